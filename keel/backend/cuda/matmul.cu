// Matmul on CUDA through cuBLASLt: f32 (plain FP32 compute: TF32 stays off), bf16 and f16 inputs
// with f32 accumulation (CUBLAS_COMPUTE_32F), output f32 or the input dtype, rounded once.
//
// keel's matrices are row-major; cuBLASLt's are column-major. A row-major [r, c] matrix is the
// column-major [c, r] one, so C = op(A)·op(B) (row-major, [M, N]) is computed as
// Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLASLt's first operand is our B, its second our A, m = N, n = M.
// Plans (descriptors, layouts, the heuristic's algorithm) are cached per shape, dtype, leading
// dimensions and pointer alignment.
//
// Odd sizes: cuBLASLt's fast Hopper kernels want N and K (and every leading dimension) to be
// multiples of 16 bytes. With GPT-2's 50,257-token vocabulary as N or K it picks the 2-byte-aligned
// kernels of older chips, 3-6x slower (measured on an H200: the 16384x50257x768 head product
// 13.2 ms, its dX product 8.9 ms; PyTorch's are the same). A large product with such a size runs
// padded instead: N and K rounded up to 128 bytes in zero-filled scratch copies of the operands
// (cudaMemcpy2DAsync, ~1 ms for 1.6 GB), the output's first N columns copied back. The zeros add
// 0 * 0 to each sum, so the padded product is exact; M needs no padding, only an aligned leading
// dimension when A is transposed.
//
// A bias row (ops::linear) rides in cuBLASLt's EPILOGUE_BIAS: added to the f32 accumulator before
// the one rounding, as on the CPU, instead of an f32 product, a row add and a conversion (~4 ms of
// GPT-2 124M's step on an H200). Off unless KEEL_CUDA_BIAS_EPILOGUE=1 until a GPU run has checked
// it (CudaOps.LinearWithTheBiasInCublasLtsEpilogue; docs/cuda.md).
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "keel/backend/cuda/common.cuh"
#include "keel/backend/cuda/tables.h"
#include "keel/backend/cuda_api.h"

namespace keel::cuda {
namespace {

// cuBLASLt is opened on first use, not linked: loading libcublasLt.so (540 MB on disk) makes a
// process resident ~210 MB at start (measured: a bare main() linked to it peaks at 212 MB, 3 MB
// without), which every CPU-only run of a CUDA build would pay.
struct LtApi {
  decltype(&cublasLtGetVersion) get_version;
  decltype(&cublasLtCreate) create;
  decltype(&cublasLtMatmul) matmul;
  decltype(&cublasLtMatmulAlgoGetHeuristic) algo_get_heuristic;
  decltype(&cublasLtMatmulDescCreate) desc_create;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set_attribute;
  decltype(&cublasLtMatmulPreferenceCreate) preference_create;
  decltype(&cublasLtMatmulPreferenceDestroy) preference_destroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) preference_set_attribute;
  decltype(&cublasLtMatrixLayoutCreate) layout_create;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set_attribute;
};

LtApi load_lt() {
  const std::string so = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* h = nullptr;
  std::string tried;
  // The toolkit's directory first (this build's headers match it), then the loader's search path.
  for (const std::string& path : {std::string(KEEL_CUDA_LIB_DIR) + "/" + so, so}) {
    h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) break;
    const char* e = dlerror();
    tried += "\n  " + path + ": " + (e ? e : "not found");
  }
  if (!h)
    throw Error("cuda matmul: cannot load cuBLASLt; tried:" + tried +
                "\n  fix: install the CUDA toolkit's libcublasLt or add its directory to "
                "LD_LIBRARY_PATH");
  LtApi api{};
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    if (!fn) throw Error(std::string("cuda matmul: ") + so + " has no symbol " + name);
  };
  sym(api.get_version, "cublasLtGetVersion");
  sym(api.create, "cublasLtCreate");
  sym(api.matmul, "cublasLtMatmul");
  sym(api.algo_get_heuristic, "cublasLtMatmulAlgoGetHeuristic");
  sym(api.desc_create, "cublasLtMatmulDescCreate");
  sym(api.desc_set_attribute, "cublasLtMatmulDescSetAttribute");
  sym(api.preference_create, "cublasLtMatmulPreferenceCreate");
  sym(api.preference_destroy, "cublasLtMatmulPreferenceDestroy");
  sym(api.preference_set_attribute, "cublasLtMatmulPreferenceSetAttribute");
  sym(api.layout_create, "cublasLtMatrixLayoutCreate");
  sym(api.layout_set_attribute, "cublasLtMatrixLayoutSetAttribute");
  return api;
}

const LtApi& lt() {
  static const LtApi api = load_lt();
  return api;
}

}  // namespace

size_t cublaslt_version() { return lt().get_version(); }

namespace {

void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("cuBLASLt: ") + what + " failed with status " +
                std::to_string(static_cast<int>(s)));
}

cudaDataType_t cuda_type(DType dt) {
  switch (dt) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      throw Error(std::string("cuda matmul: floating dtype required, got ") + dtype_name(dt));
  }
}

// Largest power of two (<= 256) dividing the address: cuBLASLt algorithms state what they need.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al /= 2;
  return al;
}

using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           bool, bool, uint32_t, uint32_t, uint32_t, int>;

// Leading dimensions (elements between rows of the stored row-major matrices).
struct Lds {
  int64_t a, b, c;
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

constexpr size_t kWorkspace = size_t{32} << 20;

struct DeviceCtx {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<PlanKey, Plan> plans;
};

std::mutex g_mu;
DeviceCtx g_ctx[16];

DeviceCtx& ctx() {
  const int d = current_device();
  DeviceCtx& c = g_ctx[d];
  if (!c.handle) {
    check_lt(lt().create(&c.handle), "cublasLtCreate");
    KEEL_CUDA_CHECK(cudaMalloc(&c.workspace, kWorkspace));  // lives as long as the process
  }
  return c;
}

void set_batch(cublasLtMatrixLayout_t l, int64_t batch, int64_t stride) {
  const int32_t b = static_cast<int32_t>(batch);
  check_lt(lt().layout_set_attribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof b),
           "layout batch count");
  check_lt(lt().layout_set_attribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                     sizeof stride),
           "layout batch stride");
}

Plan make_plan(DeviceCtx& c, const MatmulArgs& a, const Lds& ld, uint32_t al_a, uint32_t al_b,
               uint32_t al_c) {
  Plan p;
  const cudaDataType_t in_t = cuda_type(a.in_dt), out_t = cuda_type(a.out_dt);
  check_lt(lt().desc_create(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
  // cuBLASLt operand 1 = our B, operand 2 = our A (see the top of the file).
  const cublasOperation_t t1 = a.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t t2 = a.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(lt().desc_set_attribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &t1, sizeof t1), "transa");
  check_lt(lt().desc_set_attribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &t2, sizeof t2), "transb");
  const int64_t m = a.n, n = a.m, k = a.k;
  // Stored shapes (column-major rows, cols, ld) of each operand.
  if (a.trans_b)
    check_lt(lt().layout_create(&p.la, in_t, k, m, ld.b), "layout B");  // B stored [N, K]
  else
    check_lt(lt().layout_create(&p.la, in_t, m, k, ld.b), "layout B");  // B stored [K, N]
  if (a.trans_a)
    check_lt(lt().layout_create(&p.lb, in_t, n, k, ld.a), "layout A");  // A stored [K, M]
  else
    check_lt(lt().layout_create(&p.lb, in_t, k, n, ld.a), "layout A");  // A stored [M, K]
  check_lt(lt().layout_create(&p.lc, out_t, m, n, ld.c), "layout C");
  if (a.bias) {  // a vector of cuBLASLt's m (our N) added to every column (our row) of D
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    check_lt(
        lt().desc_set_attribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue),
        "bias epilogue");
    const cudaDataType_t bias_t = cuda_type(a.bias_dt);
    check_lt(
        lt().desc_set_attribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_t, sizeof bias_t),
        "bias dtype");
  }
  if (a.batch > 1) {
    set_batch(p.la, a.batch, a.k * a.n);
    set_batch(p.lb, a.batch, a.m * a.k);
    set_batch(p.lc, a.batch, a.m * a.n);
  }
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(lt().preference_create(&pref), "preference");
  const size_t ws = kWorkspace;
  check_lt(
      lt().preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
      "workspace preference");
  // Operand 1 is our B, operand 2 our A; C and D are the same buffer.
  check_lt(lt().preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_b,
                                         sizeof al_b),
           "alignment");
  check_lt(lt().preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_a,
                                         sizeof al_a),
           "alignment");
  check_lt(lt().preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c,
                                         sizeof al_c),
           "alignment");
  check_lt(lt().preference_set_attribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c,
                                         sizeof al_c),
           "alignment");
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  check_lt(lt().algo_get_heuristic(c.handle, p.op, p.la, p.lb, p.lc, p.lc, pref, 1, &res, &found),
           "algorithm heuristic");
  lt().preference_destroy(pref);
  if (found == 0)
    throw Error("cuBLASLt has no algorithm for a " + std::string(dtype_name(a.in_dt)) + " -> " +
                dtype_name(a.out_dt) + " matmul [" + std::to_string(a.batch) + " x " +
                std::to_string(a.m) + " x " + std::to_string(a.k) + "] x [" + std::to_string(a.k) +
                " x " + std::to_string(a.n) + "]");
  p.algo = res.algo;
  return p;
}

bool bias_epilogue_enabled() {
  const char* e = std::getenv("KEEL_CUDA_BIAS_EPILOGUE");  // read at each call: tests switch it
  return e && std::strcmp(e, "1") == 0;
}

// The bias in cuBLASLt's epilogue: its dtype is the output's (cuBLASLt's default, and what
// ops::linear passes), 16-byte aligned (a parameter's own allocation; a view into a flat buffer
// may not be).
bool cuda_fuses_bias(const void* bias, DType bias_dt, DType out_dt) {
  return bias_epilogue_enabled() && bias_dt == out_dt && aligned_to(bias, 16);
}

void cuda_matmul(const MatmulArgs& a) {
  KEEL_CHECK(
      !a.bias || (cuda_fuses_bias(a.bias, a.bias_dt, a.out_dt) && a.batch == 1 && !a.accumulate),
      "cuda matmul: a fused bias needs one batch, no accumulate, the output's dtype and "
      "KEEL_CUDA_BIAS_EPILOGUE=1 (ops::linear adds it separately otherwise)");
  KEEL_CHECK(a.alpha == 1.f, "matmul: the fused alpha is CPU only");
  KEEL_CHECK(a.out_dt == DType::F32 || a.out_dt == a.in_dt,
             "cuda matmul: out dtype must be f32 or the input dtype");
  if (a.batch <= 0 || a.m <= 0 || a.n <= 0) return;
  KEEL_CHECK(a.k > 0 || !a.bias, "cuda matmul: a fused bias with K = 0");
  if (a.k <= 0) {  // an empty sum: C = 0 (or unchanged when accumulating)
    if (!a.accumulate)
      KEEL_CUDA_CHECK(
          cudaMemsetAsync(a.c, 0, a.batch * a.m * a.n * dtype_size(a.out_dt), stream()));
    return;
  }
  // A large product whose N or K leaves rows unaligned runs padded (see the top of the file): N and
  // K rounded up to 128 bytes, zeros in the padding (exact: they add 0 * 0 to each sum).
  const size_t ei = dtype_size(a.in_dt), eo = dtype_size(a.out_dt);
  const bool large = a.batch == 1 && double(a.m) * a.n * a.k >= double(1 << 27);
  auto aligned_row = [](int64_t cols, size_t e) {
    return (cols * static_cast<int64_t>(e)) % 16 == 0;
  };
  auto round_up = [](int64_t cols, size_t e) {
    const int64_t per = static_cast<int64_t>(128 / e);
    return (cols + per - 1) / per * per;
  };
  MatmulArgs g = a;  // the product cuBLASLt runs
  if (large && !(aligned_row(a.n, ei) && aligned_row(a.n, eo)))
    g.n = round_up(a.n, std::min(ei, eo));
  if (large && !aligned_row(a.k, ei)) g.k = round_up(a.k, ei);
  // Stored [rows, cols] of each operand before and after, and its leading dimension after.
  const int64_t a_rows = a.trans_a ? a.k : a.m, a_cols = a.trans_a ? a.m : a.k;
  const int64_t b_rows = a.trans_b ? a.n : a.k, b_cols = a.trans_b ? a.k : a.n;
  const int64_t ga_rows = a.trans_a ? g.k : g.m, ga_cols = a.trans_a ? g.m : g.k;
  const int64_t gb_rows = a.trans_b ? g.n : g.k, gb_cols = a.trans_b ? g.k : g.n;
  Lds ld{ga_cols, gb_cols, g.n};
  if (large && !aligned_row(ld.a, ei)) ld.a = round_up(ld.a, ei);  // M of a transposed A
  // An input copied into zero-padded scratch [rows2, cols2] with leading dimension `lead`.
  auto padded_copy = [](std::unique_ptr<Scratch>& sp, const void* src, int64_t rows, int64_t cols,
                        int64_t rows2, int64_t cols2, int64_t lead, size_t e) {
    sp = std::make_unique<Scratch>(static_cast<size_t>(rows2 * lead) * e);
    char* d = sp->as<char>();
    if (cols2 > cols)
      KEEL_CUDA_CHECK(
          cudaMemset2DAsync(d + cols * e, lead * e, 0, (cols2 - cols) * e, rows, stream()));
    if (rows2 > rows)
      KEEL_CUDA_CHECK(cudaMemsetAsync(d + rows * lead * e, 0, (rows2 - rows) * lead * e, stream()));
    KEEL_CUDA_CHECK(cudaMemcpy2DAsync(d, lead * e, src, cols * e, cols * e, rows,
                                      cudaMemcpyDeviceToDevice, stream()));
    return static_cast<const void*>(d);
  };
  const void *pa = a.a, *pb = a.b, *pbias = a.bias;
  void* pc = a.c;
  std::unique_ptr<Scratch> sa, sb, sc, sbias;
  if (ga_rows != a_rows || ga_cols != a_cols || ld.a != a_cols)
    pa = padded_copy(sa, a.a, a_rows, a_cols, ga_rows, ga_cols, ld.a, ei);
  if (gb_rows != b_rows || gb_cols != b_cols || ld.b != b_cols)
    pb = padded_copy(sb, a.b, b_rows, b_cols, gb_rows, gb_cols, ld.b, ei);
  if (g.n != a.n) {  // C into scratch [M, N'], its first N columns copied back below
    sc = std::make_unique<Scratch>(static_cast<size_t>(a.m * g.n) * eo);
    if (a.accumulate)
      KEEL_CUDA_CHECK(cudaMemcpy2DAsync(sc->as<void>(), g.n * eo, a.c, a.n * eo, a.n * eo, a.m,
                                        cudaMemcpyDeviceToDevice, stream()));
    pc = sc->as<void>();
    if (a.bias)  // the bias as long as the padded rows, zeros past N
      pbias = padded_copy(sbias, a.bias, 1, a.n, 1, g.n, g.n, dtype_size(a.bias_dt));
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    DeviceCtx& c = ctx();
    const uint32_t al_a = alignment(pa), al_b = alignment(pb), al_c = alignment(pc);
    const PlanKey key{static_cast<int>(a.in_dt),
                      static_cast<int>(a.out_dt),
                      g.batch,
                      g.m,
                      g.n,
                      g.k,
                      ld.a,
                      ld.b,
                      ld.c,
                      a.trans_a,
                      a.trans_b,
                      al_a,
                      al_b,
                      al_c,
                      a.bias ? static_cast<int>(a.bias_dt) : -1};
    auto it = c.plans.find(key);
    if (it == c.plans.end()) it = c.plans.emplace(key, make_plan(c, g, ld, al_a, al_b, al_c)).first;
    const Plan& p = it->second;
    if (a.bias)  // the plan is cached across calls; its bias pointer is this call's
      check_lt(
          lt().desc_set_attribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &pbias, sizeof pbias),
          "bias pointer");
    const float alpha = 1.f, beta = a.accumulate ? 1.f : 0.f;
    check_lt(lt().matmul(c.handle, p.op, &alpha, pb, p.la, pa, p.lb, &beta, pc, p.lc, pc, p.lc,
                         &p.algo, c.workspace, kWorkspace, stream()),
             "cublasLtMatmul");
  }
  if (sc)
    KEEL_CUDA_CHECK(cudaMemcpy2DAsync(a.c, a.n * eo, sc->as<void>(), g.n * eo, a.n * eo, a.m,
                                      cudaMemcpyDeviceToDevice, stream()));
  if (g_profiling)
    profile_mark(std::string("matmul ") + dtype_name(a.in_dt) + "->" + dtype_name(a.out_dt) + " " +
                 (a.batch > 1 ? std::to_string(a.batch) + "x" : "") + std::to_string(a.m) + "x" +
                 std::to_string(a.n) + "x" + std::to_string(a.k) + (a.trans_a ? " T" : " N") +
                 (a.trans_b ? "T" : "N") + (a.accumulate ? " +=" : "") + (a.bias ? " +bias" : "") +
                 (sa || sb || sc ? " padded" : ""));
}

const char* cuda_describe() { return "cuBLASLt (f32 accumulation; f32 inputs without TF32)"; }

const MatmulKernels kMatmul = {cuda_matmul, cuda_describe, cuda_fuses_bias};

}  // namespace

const MatmulKernels& matmul_table() { return kMatmul; }

}  // namespace keel::cuda
