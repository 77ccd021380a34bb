// CPU matmul through oneDNN, primitives cached per shape (creation JITs code: ~8 ms; a cache hit
// costs microseconds). Transposes are strides; three f32 shapes of linear's backward are
// rearranged through a transposing copy (f32_plan below).
#include <dnnl.hpp>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "keel/backend/elementwise.h"
#include "keel/backend/matmul.h"
#include "keel/numerics/error.h"
#include "keel/tensor/tensor.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {
namespace {

using dt = dnnl::memory::data_type;

dt to_dnnl(DType d) {
  switch (d) {
    case DType::F32:
      return dt::f32;
    case DType::BF16:
      return dt::bf16;
    case DType::F16:
      return dt::f16;
    default:
      KEEL_CHECK(false, "matmul: floating dtype required");
  }
  return dt::undef;
}

struct Ctx {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::mutex mu;
  // (batch, m, n, k, trans_a, trans_b, in, out, accumulate, bias dtype, A's leading dimension,
  // alpha)
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, int, int, bool, int,
                         int64_t, float>;
  std::map<Key, std::shared_ptr<dnnl::matmul>> cache;
  std::map<std::pair<int, int>, bool> supported;  // (in_dt, out_dt) -> primitive creation works
  // (rows, cols, src strides, dst strides, accumulate) -> transposing copy
  using ReorderKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;
  std::map<ReorderKey, std::shared_ptr<dnnl::reorder>> reorders;
};

// Never destroyed: oneDNN's own globals (its primitive cache among them) are created after the
// context, by the first primitive, so at exit they are destroyed first, and destroying a cached
// primitive then reads freed memory. A `keel train` child of `keel serve` stopped that way died by
// SIGSEGV in ~Ctx about once in twenty exits. The process ends; the kernel frees the memory.
Ctx& ctx() {
  static Ctx& c = *new Ctx;
  return c;
}

// Logical [batch, rows, cols]; stored [batch, cols, rows] when trans. `ld` is the stored rows'
// stride when they are a piece of a wider matrix (0: packed).
dnnl::memory::desc desc(DType d, int64_t batch, int64_t rows, int64_t cols, bool trans,
                        int64_t ld = 0) {
  dnnl::memory::dims dims{batch, rows, cols};
  if (ld == 0) ld = trans ? rows : cols;
  dnnl::memory::dims strides =
      trans ? dnnl::memory::dims{rows * cols, 1, ld} : dnnl::memory::dims{rows * cols, ld, 1};
  return dnnl::memory::desc(dims, to_dnnl(d), strides);
}

// The bias row, broadcast over the batch and the M rows.
dnnl::memory::desc bias_desc(const MatmulArgs& a) {
  return dnnl::memory::desc({1, 1, a.n}, to_dnnl(a.bias_dt), dnnl::memory::dims{a.n, a.n, 1});
}

// `lda`: A's leading dimension when A is a piece of a wider matrix (0: packed).
std::shared_ptr<dnnl::matmul> primitive(const MatmulArgs& a, int64_t lda = 0) {
  Ctx& c = ctx();
  Ctx::Key key{a.batch,   a.m,          a.n,           a.k,          a.trans_a,
               a.trans_b, int(a.in_dt), int(a.out_dt), a.accumulate, a.bias ? int(a.bias_dt) : -1,
               lda,       a.alpha};
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.cache.find(key);
  if (it != c.cache.end()) return it->second;
  std::shared_ptr<dnnl::matmul> p;
  try {
    auto ad = desc(a.in_dt, a.batch, a.m, a.k, a.trans_a, lda);
    auto bd = desc(a.in_dt, a.batch, a.k, a.n, a.trans_b);
    auto cd = desc(a.out_dt, a.batch, a.m, a.n, false);
    dnnl::primitive_attr attr;
    if (a.accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    if (a.alpha != 1.f) attr.set_output_scales(0, {a.alpha});
    auto md =
        a.bias ? dnnl::matmul::desc(ad, bd, bias_desc(a), cd) : dnnl::matmul::desc(ad, bd, cd);
    p = std::make_shared<dnnl::matmul>(dnnl::matmul::primitive_desc(md, attr, c.engine));
  } catch (const dnnl::error&) {
    p = nullptr;  // this CPU has no kernel for the dtype: the caller converts to f32
  }
  c.cache[key] = p;
  return p;
}

void run(const MatmulArgs& a, const std::shared_ptr<dnnl::matmul>& p, int64_t lda = 0) {
  Ctx& c = ctx();
  auto ad = desc(a.in_dt, a.batch, a.m, a.k, a.trans_a, lda);
  auto bd = desc(a.in_dt, a.batch, a.k, a.n, a.trans_b);
  auto cd = desc(a.out_dt, a.batch, a.m, a.n, false);
  dnnl::memory am(ad, c.engine, const_cast<void*>(a.a));
  dnnl::memory bm(bd, c.engine, const_cast<void*>(a.b));
  dnnl::memory cm(cd, c.engine, a.c);
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
  if (a.bias)
    args.emplace(DNNL_ARG_BIAS, dnnl::memory(bias_desc(a), c.engine, const_cast<void*>(a.bias)));
  p->execute(c.stream, args);
  c.stream.wait();
}

// oneDNN 2.6's f32 kernels are slow for some layouts that linear's backward asks for. Four
// products are rearranged (the vocabulary head's two of a model at least 256 wide now run in
// pieces instead, vocab_pieces below); each sums the same products in another blocking
// (deterministic per shape, within rounding of the direct kernel). Times per call inside a GPT-2
// training step (2 threads, AVX-512; M x K x N):
// * mlp.c_proj's dW = dYᵀ·X reads X [tokens, 3072] as stored [K, N] (TN): 768x2048x3072 takes
//   65 ms, 48 ms with X transposed first (TT). Narrower X gained nothing, and at 256 tokens the
//   gain is within noise, so only B at least 2048 wide is copied.
// * The vocabulary head's dX = dY·W (K = vocabulary, NN): computing dXᵀ = Wᵀ·dYᵀ (TT) and
//   transposing the small [features, tokens] result back: 2048x50257x768 594 -> 522 ms, 256 rows
//   75 -> 71 ms.
// * The head's dW of a narrow model at >= 1024 tokens (TN, 132 GFLOP/s for 50257x2048x256):
//   dWᵀ = Xᵀ·dY runs at 237, and turning the [256, vocabulary] result back costs ~15 ms; the
//   4x256 model's 32-true step goes 1.17 -> 1.03 s. At 768 features the saving and the 154 MB
//   transpose cancel (825 vs 834 ms), so wider models keep the direct product.
// * mlp.c_proj's dX = dY·W (NN, B [768, 3072] wider than deep) runs at half the rate of every
//   other layout; dXᵀ = Wᵀ·dYᵀ (TT) and turning the [3072, tokens] result back: 2048x768x3072
//   61.5 -> 34.1 + 5.3 ms a call, 256 rows 9.2 -> 4.5 + 0.6 ms (bench/onednn_profile.py, steady
//   state of a 32-true step). Llama's down_proj (B [768, 2048]) gains ~7%. Measured with K = 768: a
//   thin K (a LoRA factor) keeps the direct product.
// Transposing the weight itself for dX (NN -> NT) measured no faster in a step: copying the cold
// 768x3072 weight took as long as the product it sped up. bf16 (AMX) showed no
// consistent gain from any layout and is left as given.
enum class F32Plan { kDirect, kTransposeB, kTransposedProduct };

constexpr int64_t kMaxCopiedElems = int64_t(1) << 23;  // 32 MB of f32

F32Plan f32_plan(const MatmulArgs& a) {
  if (a.in_dt != DType::F32 || a.batch != 1 || a.bias || a.trans_b || a.alpha != 1.f)
    return F32Plan::kDirect;
  const bool small_output = a.m * a.n <= kMaxCopiedElems;
  if (!a.trans_a && a.k >= 8 * std::max(a.m, a.n) && small_output)  // head dX
    return F32Plan::kTransposedProduct;
  if (!a.trans_a && a.n >= 2048 && a.n >= 2 * a.k && a.k >= 512 && small_output)  // c_proj dX
    return F32Plan::kTransposedProduct;
  if (a.trans_a && a.m >= 16 * a.n && a.k >= 1024 && a.n <= 512)  // head dW, narrow models
    return F32Plan::kTransposedProduct;
  if (a.trans_a && a.n >= 2048 && a.m >= 64 && a.k * a.n <= kMaxCopiedElems && small_output)
    return F32Plan::kTransposeB;  // mlp.c_proj's dW
  return F32Plan::kDirect;
}

// dst (+)= src over a [rows, cols] f32 matrix, each with its own strides (a transposing copy).
void reorder_f32(float* dst, const dnnl::memory::dims& dst_strides, const float* src,
                 const dnnl::memory::dims& src_strides, int64_t rows, int64_t cols,
                 bool accumulate) {
  Ctx& c = ctx();
  const dnnl::memory::desc from({rows, cols}, dt::f32, src_strides);
  const dnnl::memory::desc to({rows, cols}, dt::f32, dst_strides);
  std::shared_ptr<dnnl::reorder> r;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto& slot = c.reorders[{rows, cols, src_strides[0], src_strides[1], dst_strides[0],
                             dst_strides[1], accumulate}];
    if (!slot) {
      dnnl::primitive_attr attr;
      if (accumulate) {
        dnnl::post_ops po;
        po.append_sum(1.0f);
        attr.set_post_ops(po);
      }
      slot = std::make_shared<dnnl::reorder>(
          dnnl::reorder::primitive_desc(c.engine, from, c.engine, to, attr));
    }
    r = slot;
  }
  dnnl::memory src_m(from, c.engine, const_cast<float*>(src)), dst_m(to, c.engine, dst);
  r->execute(c.stream, src_m, dst_m);
  c.stream.wait();
}

void run_f32_plan(const MatmulArgs& a, F32Plan plan) {
  if (plan == F32Plan::kTransposeB) {       // B [K, N] -> [N, K], then C = op(A)·B with trans_b
    Tensor bt = Tensor::empty({a.n, a.k});  // the block cache's memory, like any tensor
    reorder_f32(bt.data_as<float>(), {1, a.k}, static_cast<const float*>(a.b), {a.n, 1}, a.k, a.n,
                false);
    MatmulArgs t = a;
    t.b = bt.data();
    t.trans_b = true;
    return run(t, primitive(t));
  }
  // Cᵀ[N, M] = op(B)ᵀ·op(A)ᵀ into scratch, then C (+)= its transpose.
  Tensor ct = Tensor::empty({a.n, a.m});
  MatmulArgs t = a;
  t.c = ct.data();
  t.a = a.b;
  t.trans_a = !a.trans_b;
  t.b = a.a;
  t.trans_b = !a.trans_a;
  t.m = a.n;
  t.n = a.m;
  t.accumulate = false;
  run(t, primitive(t));
  reorder_f32(static_cast<float*>(a.c), {a.n, 1}, ct.data_as<float>(), {1, a.m}, a.m, a.n,
              a.accumulate);
}

// The vocabulary head's backward products run faster in 4096-wide pieces of the vocabulary side
// (per call, 2 threads, caches flushed before each call, tokens x vocabulary x features):
// * dX = dY·W (NN, K = vocabulary): K in pieces, each piece added to the f32 result.
//   f32: 256x50257x768 78-84 -> 59-62 ms (the transposed product below: 71), 2048 tokens
//   607-618 -> 418-436 ms (transposed: 522), 64 tokens 32-35 -> 17 ms.
//   bf16 (AMX): 2048 tokens 124-135 -> 108-117 ms; 1024 tokens 281 -> 178 ms. Llama-3.2-1B's
//   head (128256 x 2048, bench/compare_pytorch's LoRA row) at 1024 tokens 2283 -> 692 ms, at 512
//   1932 -> 530 ms (2 threads, a loaded VM: the direct product slows down past ~16K of K).
//   Issue 25 item 5 moved the bf16 threshold from 2048 tokens to 512.
// * dW = dYᵀ·X (TN, M = vocabulary): M in row panels.
//   f32: 256 tokens 73-75 -> 54-59 ms, 2048 tokens 758-774 -> 426-430 ms; a 256-wide model at
//   2048 tokens 374-400 -> 195-197 ms (the transposed product: ~225); 64 tokens 22-24 -> 37-38 ms.
//   bf16: 2048 tokens 177-192 -> 153-172 ms, but 1024 tokens 78 -> 106 ms.
// The bf16 forms gain nothing at 256 features, the forward (N in pieces) nothing at 256 tokens.
// Pieces sum in another order than the direct product (deterministic per shape, within f32
// rounding of it).
constexpr int64_t kVocabPiece = 4096;

bool vocab_pieces(const MatmulArgs& a) {
  if (a.out_dt != DType::F32 || a.batch != 1 || a.bias || a.trans_b || a.alpha != 1.f) return false;
  const bool f32 = a.in_dt == DType::F32;
  if (!f32 && a.in_dt != DType::BF16) return false;
  if (!a.trans_a)  // head dX
    return a.k >= 8 * std::max(a.m, a.n) && (f32 ? a.n >= 256 : a.m >= 512 && a.n >= 512);
  return a.m >= 16 * a.n && (f32 ? a.k >= 256 && a.n >= 256 : a.k >= 2048 && a.n >= 512);
}

// C (+)= op(A)·B in pieces; false (nothing done) when this CPU has no kernel for the dtype.
bool run_vocab_pieces(const MatmulArgs& a) {
  const auto* A = static_cast<const char*>(a.a);
  const auto* B = static_cast<const char*>(a.b);
  const int64_t in_size = static_cast<int64_t>(dtype_size(a.in_dt));
  // Piece i along the vocabulary side; A keeps the whole matrix's leading dimension, lda.
  auto piece = [&](int64_t i) {
    MatmulArgs p = a;
    const int64_t v0 = i * kVocabPiece;
    if (!a.trans_a) {  // C (+)= sum over pieces of A[:, k0:k1]·B[k0:k1, :]
      p.k = std::min(kVocabPiece, a.k - v0);
      p.a = A + v0 * in_size;
      p.b = B + v0 * a.n * in_size;
      p.accumulate = a.accumulate || i > 0;
    } else {  // C[m0:m1, :] (+)= (Aᵀ)[m0:m1, :]·B
      p.m = std::min(kVocabPiece, a.m - v0);
      p.a = A + v0 * in_size;
      p.c = static_cast<float*>(a.c) + v0 * a.n;
    }
    return p;
  };
  const int64_t lda = a.trans_a ? a.m : a.k;
  const int64_t pieces = (lda + kVocabPiece - 1) / kVocabPiece;
  if (!primitive(piece(0), lda)) return false;
  for (int64_t i = 0; i < pieces; ++i) {
    const MatmulArgs p = piece(i);
    run(p, primitive(p, lda), lda);
  }
  return true;
}

void cpu_matmul(const MatmulArgs& args) {
  KEEL_CHECK(args.out_dt == DType::F32 || args.out_dt == args.in_dt,
             "matmul: out dtype must be f32 or in");
  KEEL_CHECK(!(args.bias && args.accumulate), "matmul: a bias with accumulate is not supported");
  KEEL_CHECK(!(args.alpha != 1.f && args.accumulate),
             "matmul: alpha with accumulate is not supported");
  if (args.batch == 0 || args.m == 0 || args.n == 0) return;
  const auto& ew = elementwise_kernels(Device::cpu());
  // oneDNN takes an f32 bias with every source dtype: a 16-bit one is converted (N values).
  MatmulArgs a = args;
  std::vector<float> bias32;
  if (a.bias && a.bias_dt != DType::F32) {
    bias32.resize(a.n);
    ew.convert(bias32.data(), DType::F32, a.bias, a.bias_dt, a.n);
    a.bias = bias32.data();
    a.bias_dt = DType::F32;
  }
  if (a.k == 0) {  // empty sum: C = 0 (+ bias), or unchanged when accumulating; alpha·0 = 0
    if (!a.accumulate) {
      std::vector<float> z(a.batch * a.m * a.n, 0.f);
      if (a.bias) ew.add_row(z.data(), z.data(), a.bias, DType::F32, a.batch * a.m, a.n);
      ew.convert(a.c, a.out_dt, z.data(), DType::F32, z.size());
    }
    return;
  }
  if (vocab_pieces(a) && run_vocab_pieces(a)) return;
  if (const F32Plan plan = f32_plan(a); plan != F32Plan::kDirect) return run_f32_plan(a, plan);
  if (auto p = primitive(a)) return run(a, p);
  // No native kernel (f16 on CPUs without AVX512-FP16/AMX, bf16 without AVX512): convert the
  // inputs to f32 (exact for both), multiply in f32, round the result once.
  std::vector<float> fa(a.batch * a.m * a.k), fb(a.batch * a.k * a.n);
  ew.convert(fa.data(), DType::F32, a.a, a.in_dt, fa.size());
  ew.convert(fb.data(), DType::F32, a.b, a.in_dt, fb.size());
  MatmulArgs f = a;
  f.a = fa.data();
  f.b = fb.data();
  f.in_dt = DType::F32;
  if (a.out_dt == DType::F32) {
    f.out_dt = DType::F32;
    return run(f, primitive(f));
  }
  std::vector<float> fc(a.batch * a.m * a.n);
  if (a.accumulate) ew.convert(fc.data(), DType::F32, a.c, a.out_dt, fc.size());
  f.c = fc.data();
  f.out_dt = DType::F32;
  run(f, primitive(f));
  ew.convert(a.c, a.out_dt, fc.data(), DType::F32, fc.size());
}

const char* cpu_describe() { return "oneDNN matmul (f32 accumulation)"; }

bool cpu_fuses_bias(const void*, DType, DType) { return true; }  // oneDNN's bias post-op

const MatmulKernels cpu_table{cpu_matmul, cpu_describe, cpu_fuses_bias};

}  // namespace

bool cpu_matmul_native(DType in_dt) {
  MatmulArgs a;
  a.in_dt = in_dt;
  a.out_dt = in_dt;
  a.m = a.n = a.k = 16;
  return primitive(a) != nullptr;  // built once, kept in the primitive cache
}

const MatmulKernels& matmul_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::matmul_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no matmul kernels for " + dev.str() + " in this build");
  return cpu_table;
}

}  // namespace keel
