// CUDA kernels: cross-entropy, embedding, optimizer updates, shape copies and the toolkit passes
// (fused unscale + finite check + sum of squares, tensor statistics). Semantics as the CPU
// kernels (backend/cpu/*.inc and the family headers).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "keel/backend/cuda/common.cuh"
#include "keel/backend/cuda/tables.h"
#include "keel/numerics/format_info.h"

namespace keel::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t id_at(const void* ids, bool i32, int64_t i) {
  return i32 ? static_cast<const int32_t*>(ids)[i] : static_cast<const int64_t*>(ids)[i];
}

// First index i with bad(i), or -1: the minimum is order-independent, so atomicMin is
// deterministic.
__global__ void find_invalid_kernel(unsigned long long* first, const void* ids, bool i32, int64_t n,
                                    int64_t v, int64_t ignore, bool use_ignore) {
  KEEL_CUDA_FOR(i, n) {
    const int64_t t = id_at(ids, i32, i);
    if (!(use_ignore && t == ignore) && (t < 0 || t >= v))
      atomicMin(first, static_cast<unsigned long long>(i));
  }
}
int64_t find_invalid_ids(const void* ids, DType dt, int64_t n, int64_t v, int64_t ignore,
                         bool use_ignore) {
  KEEL_CHECK(dt == DType::I32 || dt == DType::I64,
             std::string("cuda: ids/targets must be i32 or i64, got ") + dtype_name(dt));
  if (n <= 0) return -1;
  Scratch s(8);
  const unsigned long long none = ~0ull;
  KEEL_CUDA_CHECK(cudaMemsetAsync(s.as<void>(), 0xff, 8, stream()));  // = none, no host sync
  find_invalid_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
      s.as<unsigned long long>(), ids, dt == DType::I32, n, v, ignore, use_ignore);
  KEEL_CUDA_LAUNCHED();
  unsigned long long out = 0;
  read_back(&out, s.as<void>(), 8);
  return out == none ? -1 : static_cast<int64_t>(out);
}

// ---- cross-entropy --------------------------------------------------------------------------

int64_t ce_find_invalid(const void* targets, DType tdt, int64_t n, int64_t v, int64_t ignore) {
  return find_invalid_ids(targets, tdt, n, v, ignore, true);
}

__global__ void count_kernel(unsigned long long* out, const void* t, bool i32, int64_t n,
                             int64_t ignore) {
  unsigned long long c = 0;
  KEEL_CUDA_FOR(i, n) c += id_at(t, i32, i) != ignore;
  c = static_cast<unsigned long long>(warp_sum(static_cast<long long>(c)));
  if ((threadIdx.x & 31) == 0 && c) atomicAdd(out, c);  // integer sums: order-independent
}
int64_t ce_count(const void* targets, DType tdt, int64_t n, int64_t ignore) {
  if (n <= 0) return 0;
  Scratch s(8);
  KEEL_CUDA_CHECK(cudaMemsetAsync(s.as<void>(), 0, 8, stream()));
  count_kernel<<<grid_for(n), kThreads, 0, stream()>>>(s.as<unsigned long long>(), targets,
                                                       tdt == DType::I32, n, ignore);
  KEEL_CUDA_LAUNCHED();
  unsigned long long out = 0;
  read_back(&out, s.as<void>(), 8);
  return static_cast<int64_t>(out);
}

struct MaxSkipNan {
  __device__ float operator()(float a, float b) const { return b > a ? b : a; }
};

// One block per row: stats = (max, log sum exp(x - max)); row_loss = -(x[t] - max - log s).
template <class T>
__global__ void ce_fwd_kernel(float* stats, double* row_loss, const T* logits, const void* targets,
                              bool i32, int64_t v, int64_t ignore) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  const int64_t t = id_at(targets, i32, r);
  if (t == ignore) {
    if (threadIdx.x == 0) stats[2 * r] = stats[2 * r + 1] = 0.f, row_loss[r] = 0.0;
    return;
  }
  const T* row = logits + r * v;
  float mx = -INFINITY;  // as the CPU: a NaN does not win the max, it poisons the sum
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x) {
    const float x = ld(row + c);
    mx = x > mx ? x : mx;
  }
  mx = block_reduce(mx, sh, MaxSkipNan{}, -INFINITY);
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x) s += expf(ld(row + c) - mx);
  s = block_reduce(s, sh, SumOp{}, 0.f);
  if (threadIdx.x == 0) {
    const float ls = logf(s);
    stats[2 * r] = mx;
    stats[2 * r + 1] = ls;
    row_loss[r] = -static_cast<double>((ld(row + t) - mx) - ls);
  }
}
__global__ void sum_rows_in_order_kernel(double* out, const double* x, int64_t n) {
  __shared__ double sh[32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
  acc = block_reduce(acc, sh, SumOp{}, 0.0);
  if (threadIdx.x == 0) *out = acc;
}
double ce_forward(float* stats, const void* logits, DType dt, const void* targets, DType tdt,
                  int64_t n, int64_t v, int64_t ignore) {
  if (n <= 0) return 0.0;
  Scratch rl(static_cast<size_t>(n + 1) * 8);
  double* p = rl.as<double>();
  const int threads = v >= 8192 ? 1024 : 256;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        ce_fwd_kernel<<<n, threads, 0, stream()>>>(
                            stats, p + 1, (const T*)logits, targets, tdt == DType::I32, v, ignore));
  sum_rows_in_order_kernel<<<1, 1024, 0, stream()>>>(p, p + 1, n);
  KEEL_CUDA_LAUNCHED();
  double out = 0;
  read_back(&out, p, 8);
  return out;
}

template <class T>
__global__ void ce_bwd_kernel(T* dlogits, const T* logits, const float* stats, const void* targets,
                              bool i32, int64_t n, int64_t v, int64_t ignore, float scale) {
  KEEL_CUDA_FOR(e, n * v) {
    const int64_t r = e / v, c = e % v;
    const int64_t t = id_at(targets, i32, r);
    float g = 0.f;
    if (t != ignore) {
      g = expf((ld(logits + e) - stats[2 * r]) - stats[2 * r + 1]) * scale;
      if (c == t) g -= scale;
    }
    st(dlogits + e, g);
  }
}
void ce_backward(void* dlogits, const void* logits, DType dt, const float* stats,
                 const void* targets, DType tdt, int64_t n, int64_t v, int64_t ignore,
                 float scale) {
  if (n * v <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(
      dt, T,
      ce_bwd_kernel<<<grid_for(n * v), kThreads, 0, stream()>>>(
          (T*)dlogits, (const T*)logits, stats, targets, tdt == DType::I32, n, v, ignore, scale));
  KEEL_CUDA_LAUNCHED();
}
const CrossEntropyKernels kCrossEntropy = {ce_find_invalid, ce_count, ce_forward, ce_backward};

// ---- embedding ------------------------------------------------------------------------------

int64_t emb_find_invalid(const void* ids, DType id_dt, int64_t n, int64_t v) {
  return find_invalid_ids(ids, id_dt, n, v, 0, false);
}

template <class E>
__global__ void gather_kernel(E* out, const E* w, const void* ids, bool i32, int64_t n, int64_t d) {
  KEEL_CUDA_FOR(e, n * d) out[e] = w[id_at(ids, i32, e / d) * d + e % d];
}
void emb_gather(void* out, const void* weight, const void* ids, DType id_dt, DType dt, int64_t n,
                int64_t d) {
  if (n * d <= 0) return;
  const bool i32 = id_dt == DType::I32;
  if (dtype_size(dt) == 4)
    gather_kernel<<<grid_for(n * d), kThreads, 0, stream()>>>(
        (uint32_t*)out, (const uint32_t*)weight, ids, i32, n, d);
  else
    gather_kernel<<<grid_for(n * d), kThreads, 0, stream()>>>(
        (uint16_t*)out, (const uint16_t*)weight, ids, i32, n, d);
  KEEL_CUDA_LAUNCHED();
}

// One block per distinct id: its positions' gradients summed in increasing position order (f32)
// and rounded to T, then added to the row; as the CPU kernel.
template <class T>
__global__ void scatter_kernel(T* dw, const T* g, const int64_t* order, const int64_t* group,
                               const int64_t* row_of_group, int64_t d) {
  const int64_t k = blockIdx.x, first = group[k], last = group[k + 1];
  T* row = dw + row_of_group[k] * d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float acc = 0.f;
    for (int64_t p = first; p < last; ++p) acc += ld(g + order[p] * d + j);
    T sum;  // rounded to T, then added to the row as a dense add would
    st(&sum, acc);
    st(row + j, ld(row + j) + ld(&sum));
  }
}
void emb_scatter_add(void* dweight, const void* grad, const void* ids, DType id_dt, DType dt,
                     int64_t n, int64_t v, int64_t d) {
  (void)v;
  if (n <= 0 || d <= 0) return;
  // The grouping (a stable sort of the ids) on the host: ids are small next to the gradients.
  std::vector<int64_t> h(n);
  if (id_dt == DType::I32) {
    std::vector<int32_t> h32(n);
    read_back(h32.data(), ids, n * 4);
    for (int64_t i = 0; i < n; ++i) h[i] = h32[i];
  } else {
    read_back(h.data(), ids, n * 8);
  }
  std::vector<int64_t> meta(n);  // order, then group starts, then row of each group
  std::iota(meta.begin(), meta.end(), 0);
  std::stable_sort(meta.begin(), meta.end(), [&](int64_t a, int64_t b) { return h[a] < h[b]; });
  std::vector<int64_t> group, rows;
  for (int64_t p = 0; p < n; ++p)
    if (p == 0 || h[meta[p]] != h[meta[p - 1]]) group.push_back(p), rows.push_back(h[meta[p]]);
  const int64_t ng = static_cast<int64_t>(group.size());
  group.push_back(n);
  meta.insert(meta.end(), group.begin(), group.end());
  meta.insert(meta.end(), rows.begin(), rows.end());
  Scratch dev(meta.size() * 8);
  KEEL_CUDA_CHECK(cudaMemcpyAsync(dev.as<void>(), meta.data(), meta.size() * 8,
                                  cudaMemcpyHostToDevice, stream()));
  const int64_t* order = dev.as<int64_t>();
  const int threads = d >= 256 ? 256 : 128;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        scatter_kernel<<<ng, threads, 0, stream()>>>(
                            (T*)dweight, (const T*)grad, order, order + n, order + n + ng + 1, d));
  KEEL_CUDA_LAUNCHED();
  // meta must outlive the copy from pageable memory: cudaMemcpyAsync from pageable memory has
  // staged it before returning, so it may be freed here.
}
const EmbeddingKernels kEmbedding = {emb_find_invalid, emb_gather, emb_scatter_add};

// ---- optimizer updates ----------------------------------------------------------------------

struct AdamWConsts {
  float decay, b1, c1, b2, c2, bc2_sqrt, eps, neg_step;
  float grad_scale;  // clipping: g * grad_scale
};

template <class T>
__device__ __forceinline__ void store_param(T* p, float v, bool, uint64_t, int64_t) {
  st(p, v);
}
template <>
__device__ __forceinline__ void store_param(__nv_bfloat16* p, float v, bool sr, uint64_t seed,
                                            int64_t i) {
  const uint32_t u = __float_as_uint(v);
  if (!sr || (u & 0x7fffffffu) >= 0x7f800000u) {
    st(p, v);
  } else {
    const uint32_t r = static_cast<uint32_t>(splitmix64_at(seed, i) >> 48);
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>((u + r) >> 16);
  }
}

// The CPU's order of operations, one rounding per stored value; no FMA contraction (__fmul_rn /
// __fadd_rn) so the update matches the CPU kernel's f32 arithmetic.
template <class T>
__global__ void adamw_kernel(T* p, const T* g, T* m, T* v, int64_t n, AdamWConsts c, bool sr,
                             uint64_t seed) {
  KEEL_CUDA_FOR(i, n) {
    float gj = ld(g + i);
    if (c.grad_scale != 1.f) {  // clipping, rounded to T as clip_grad_norm_ would store it
      T scaled;
      st(&scaled, __fmul_rn(gj, c.grad_scale));
      gj = ld(&scaled);
    }
    const float pj = __fmul_rn(ld(p + i), c.decay);
    const float mj = __fadd_rn(__fmul_rn(ld(m + i), c.b1), __fmul_rn(c.c1, gj));
    const float vj = __fadd_rn(__fmul_rn(ld(v + i), c.b2), __fmul_rn(__fmul_rn(c.c2, gj), gj));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vj), c.bc2_sqrt), c.eps);
    store_param(p + i, __fadd_rn(pj, __fdiv_rn(__fmul_rn(c.neg_step, mj), denom)), sr, seed, i);
    st(m + i, mj);
    st(v + i, vj);
  }
}
void opt_adamw(void* p, const void* g, void* m, void* v, DType dt, int64_t n, const AdamWStep& s) {
  KEEL_CHECK(s.step >= 1, "adamw: step must be >= 1, got " + std::to_string(s.step));
  KEEL_CHECK(!s.stochastic_rounding || dt != DType::F16,
             "optimizer: stochastic rounding is implemented for bf16 parameters only");
  KEEL_CHECK(!s.p_copy, "adamw: the weight-copy write is CPU only (AdamW::writes_weight_copy)");
  if (n <= 0) return;
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  const AdamWConsts c{static_cast<float>(1.0 - s.lr * s.weight_decay),
                      static_cast<float>(s.beta1),
                      static_cast<float>(1.0 - s.beta1),
                      static_cast<float>(s.beta2),
                      static_cast<float>(1.0 - s.beta2),
                      static_cast<float>(std::sqrt(bc2)),
                      static_cast<float>(s.eps),
                      static_cast<float>(-(s.lr / bc1)),
                      s.grad_scale};
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        adamw_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
                            (T*)p, (const T*)g, (T*)m, (T*)v, n, c, s.stochastic_rounding, s.seed));
  KEEL_CUDA_LAUNCHED();
}

struct SgdConsts {
  float wd, momentum, one_minus_damp, neg_lr;
  bool use_wd, use_momentum, nesterov, first;
};
template <class T>
__global__ void sgd_kernel(T* p, const T* g, T* buf, int64_t n, SgdConsts c, bool sr,
                           uint64_t seed) {
  KEEL_CUDA_FOR(i, n) {
    const float pj = ld(p + i);
    float d = ld(g + i);
    if (c.use_wd) d = __fadd_rn(d, __fmul_rn(c.wd, pj));
    if (c.use_momentum) {
      const float b =
          c.first ? d
                  : __fadd_rn(__fmul_rn(ld(buf + i), c.momentum), __fmul_rn(c.one_minus_damp, d));
      st(buf + i, b);
      d = c.nesterov ? __fadd_rn(d, __fmul_rn(c.momentum, b)) : b;
    }
    store_param(p + i, __fadd_rn(pj, __fmul_rn(c.neg_lr, d)), sr, seed, i);
  }
}
void opt_sgd(void* p, const void* g, void* buf, DType dt, int64_t n, const SgdStep& s) {
  const SgdConsts c{static_cast<float>(s.weight_decay),
                    static_cast<float>(s.momentum),
                    static_cast<float>(1.0 - s.dampening),
                    static_cast<float>(-s.lr),
                    s.weight_decay != 0.0,
                    s.momentum != 0.0,
                    s.nesterov,
                    s.first};
  KEEL_CHECK(!c.use_momentum || buf, "sgd: momentum != 0 needs a momentum buffer");
  KEEL_CHECK(!s.stochastic_rounding || dt != DType::F16,
             "optimizer: stochastic rounding is implemented for bf16 parameters only");
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        sgd_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
                            (T*)p, (const T*)g, c.use_momentum ? (T*)buf : (T*)nullptr, n, c,
                            s.stochastic_rounding, s.seed));
  KEEL_CUDA_LAUNCHED();
}

// ---- fused unscale + finite check + sum of squares over a set of buffers --------------------

constexpr int64_t kChunk = 4096;
struct BufDesc {
  void* p;
  int64_t n;
  int64_t first_chunk;
  int dt;  // 0 f32, 1 bf16, 2 f16
};

template <class T>
__device__ void unscale_chunk(T* g, int64_t lo, int64_t hi, float inv, long long& bad, float& sq) {
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float v = ld(g + i);
    bad += !(fabsf(v) <= 3.40282347e38f);  // NaN compares false
    if (inv != 1.f) {
      T t;
      st(&t, v * inv);
      g[i] = t;
      v = ld(&t);
    }
    sq += v * v;
  }
}
// One block per chunk of kChunk values: bad count and f32 sum of squares per chunk.
__global__ void unscale_norm_kernel(long long* bad_out, double* sq_out, const BufDesc* bufs,
                                    int nbufs, float inv) {
  __shared__ float shf[32];
  __shared__ long long shi[32];
  const int64_t chunk = blockIdx.x;
  int lo = 0, hi = nbufs - 1;  // the buffer holding this chunk: last with first_chunk <= chunk
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (bufs[mid].first_chunk <= chunk)
      lo = mid;
    else
      hi = mid - 1;
  }
  const BufDesc b = bufs[lo];
  const int64_t e0 = (chunk - b.first_chunk) * kChunk, e1 = min(b.n, e0 + kChunk);
  long long bad = 0;
  float sq = 0.f;
  if (b.dt == 0)
    unscale_chunk(static_cast<float*>(b.p), e0, e1, inv, bad, sq);
  else if (b.dt == 1)
    unscale_chunk(static_cast<__nv_bfloat16*>(b.p), e0, e1, inv, bad, sq);
  else
    unscale_chunk(static_cast<__half*>(b.p), e0, e1, inv, bad, sq);
  sq = block_reduce(sq, shf, SumOp{}, 0.f);
  bad = block_reduce(bad, shi, SumOp{}, 0ll);
  if (threadIdx.x == 0) bad_out[chunk] = bad, sq_out[chunk] = static_cast<double>(sq);
}
__global__ void finish_unscale_norm_kernel(double* out, const long long* bad, const double* sq,
                                           int64_t n) {
  __shared__ double shd[32];
  __shared__ long long shi[32];
  double s = 0;
  long long c = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += sq[i], c += bad[i];
  s = block_reduce(s, shd, SumOp{}, 0.0);
  c = block_reduce(c, shi, SumOp{}, 0ll);
  if (threadIdx.x == 0) out[0] = s, reinterpret_cast<long long*>(out)[1] = c;
}
GradSetStats unscale_norm(void* const* bufs, const DType* dts, const int64_t* ns, int count,
                          float inv_scale) {
  std::vector<BufDesc> desc;
  int64_t chunks = 0;
  for (int i = 0; i < count; ++i) {
    if (ns[i] <= 0) continue;
    const int code = dts[i] == DType::F32    ? 0
                     : dts[i] == DType::BF16 ? 1
                     : dts[i] == DType::F16  ? 2
                                             : -1;
    KEEL_CHECK(code >= 0,
               std::string("unscale_norm: floating dtype required, got ") + dtype_name(dts[i]));
    desc.push_back({bufs[i], ns[i], chunks, code});
    chunks += (ns[i] + kChunk - 1) / kChunk;
  }
  GradSetStats out;
  if (chunks == 0) return out;
  const size_t desc_bytes = (desc.size() * sizeof(BufDesc) + 15) / 16 * 16;
  Scratch s(desc_bytes + static_cast<size_t>(chunks) * 16 + 16);
  char* base = s.as<char>();
  auto* d_desc = reinterpret_cast<BufDesc*>(base);
  auto* d_bad = reinterpret_cast<long long*>(base + desc_bytes);
  auto* d_sq = reinterpret_cast<double*>(base + desc_bytes + chunks * 8);
  auto* d_out = reinterpret_cast<double*>(base + desc_bytes + chunks * 16);
  KEEL_CUDA_CHECK(cudaMemcpyAsync(d_desc, desc.data(), desc.size() * sizeof(BufDesc),
                                  cudaMemcpyHostToDevice, stream()));
  unscale_norm_kernel<<<chunks, kThreads, 0, stream()>>>(d_bad, d_sq, d_desc,
                                                         static_cast<int>(desc.size()), inv_scale);
  finish_unscale_norm_kernel<<<1, 1024, 0, stream()>>>(d_out, d_bad, d_sq, chunks);
  KEEL_CUDA_LAUNCHED();
  double h[2] = {0, 0};
  read_back(h, d_out, 16);  // the one synchronization of the step's steps 4-5
  out.sum_squares = h[0];
  long long bad = 0;
  std::memcpy(&bad, &h[1], 8);
  out.nonfinite = bad;
  return out;
}

int64_t opt_unscale(void* g, DType dt, int64_t n, float inv_scale) {
  void* const bufs[1] = {g};
  return unscale_norm(bufs, &dt, &n, 1, inv_scale).nonfinite;
}
const OptimKernels kOptim = {opt_adamw, opt_sgd, opt_unscale};

// ---- tensor statistics (numerics/tensor_stats on the device) --------------------------------

struct StatsPart {
  long long nan, inf, zero, sub, near;
  double amin, amax;
};
__device__ __forceinline__ void merge(StatsPart& a, const StatsPart& b) {
  a.nan += b.nan, a.inf += b.inf, a.zero += b.zero, a.sub += b.sub, a.near += b.near;
  a.amin = b.amin < a.amin ? b.amin : a.amin;
  a.amax = b.amax > a.amax ? b.amax : a.amax;
}
template <class T>
__global__ void stats_kernel(StatsPart* parts, const T* x, int64_t n, double min_normal,
                             double near) {
  __shared__ StatsPart sh[kThreads];
  StatsPart s{0, 0, 0, 0, 0, INFINITY, 0.0};
  const int64_t lo = blockIdx.x * kChunk, hi = min(n, lo + kChunk);
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float v = ld(x + i);
    if (isnan(v)) {
      ++s.nan;
      continue;
    }
    if (isinf(v)) {
      ++s.inf;
      continue;
    }
    const double a = fabs(static_cast<double>(v));
    if (a == 0)
      ++s.zero;
    else if (a < min_normal)
      ++s.sub;
    if (a >= near) ++s.near;
    s.amin = a < s.amin ? a : s.amin;
    s.amax = a > s.amax ? a : s.amax;
  }
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) merge(sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  if (threadIdx.x == 0) parts[blockIdx.x] = sh[0];
}
__global__ void stats_finish_kernel(StatsPart* out, const StatsPart* parts, int64_t n) {
  __shared__ StatsPart sh[kThreads];
  StatsPart s{0, 0, 0, 0, 0, INFINITY, 0.0};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) merge(s, parts[i]);
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) merge(sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = sh[0];
}
TensorStats dev_stats(const void* data, DType dt, int64_t n, DType fmt) {
  const FormatInfo& fi = format_info(fmt);
  TensorStats s;
  s.count = n;
  if (n > 0) {
    const int64_t blocks = (n + kChunk - 1) / kChunk;
    Scratch parts(static_cast<size_t>(blocks + 1) * sizeof(StatsPart));
    StatsPart* p = parts.as<StatsPart>();
    KEEL_CUDA_FLOAT_TYPES(dt, T,
                          stats_kernel<<<blocks, kThreads, 0, stream()>>>(
                              p + 1, (const T*)data, n, fi.min_normal, fi.max / 2));
    stats_finish_kernel<<<1, kThreads, 0, stream()>>>(p, p + 1, blocks);
    KEEL_CUDA_LAUNCHED();
    StatsPart h{};
    read_back(&h, p, sizeof h);
    s.nan = h.nan, s.inf = h.inf, s.zero = h.zero, s.subnormal = h.sub, s.near_max = h.near;
    s.abs_min = std::isinf(h.amin) ? 0 : h.amin;
    s.abs_max = h.amax;
  }
  s.headroom_bits =
      s.abs_max > 0 ? std::log2(fi.max / s.abs_max) : std::numeric_limits<double>::infinity();
  return s;
}
const MonitorKernels kMonitor = {unscale_norm, dev_stats};

// ---- shape copies ---------------------------------------------------------------------------

// The index arithmetic in I (32 bits when the tensor allows: 64-bit division is slow), and the
// moved element E as wide as the innermost run allows (16 bytes for a 64-wide bf16 head).
template <class E, class I>
__global__ void swap_dims_kernel(E* out, const E* in, I outer, I n0, I mid, I n1, I inner) {
  // out [outer, n1, mid, n0, inner] = in [outer, n0, mid, n1, inner] with the two dims swapped
  const I n = outer * n1 * mid * n0 * inner;
  for (I e = blockIdx.x * I(blockDim.x) + threadIdx.x; e < n; e += I(gridDim.x) * blockDim.x) {
    I r = e;
    const I x = r % inner;
    r /= inner;
    const I i = r % n0;
    r /= n0;
    const I b = r % mid;
    r /= mid;
    const I j = r % n1;
    const I a = r / n1;
    out[e] = in[(((a * n0 + i) * mid + b) * n1 + j) * inner + x];
  }
}
template <class E>
void swap_dims_as(void* out, const void* in, int64_t outer, int64_t n0, int64_t mid, int64_t n1,
                  int64_t inner) {
  const int64_t n = outer * n0 * mid * n1 * inner;
  if (n < (int64_t{1} << 31))
    swap_dims_kernel<E, uint32_t><<<grid_for(n), kThreads, 0, stream()>>>(
        (E*)out, (const E*)in, uint32_t(outer), uint32_t(n0), uint32_t(mid), uint32_t(n1),
        uint32_t(inner));
  else
    swap_dims_kernel<E, int64_t>
        <<<grid_for(n), kThreads, 0, stream()>>>((E*)out, (const E*)in, outer, n0, mid, n1, inner);
}
void swap_dims(void* out, const void* in, size_t elem, int64_t outer, int64_t n0, int64_t mid,
               int64_t n1, int64_t inner) {
  if (outer * n0 * mid * n1 * inner <= 0) return;
  // Move the innermost run in the widest unit that divides it and both addresses.
  const int64_t run = inner * static_cast<int64_t>(elem);
  const auto addr = reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(in);
  int64_t w = 16;
  while (w > 1 && (run % w != 0 || addr % w != 0)) w /= 2;
  const int64_t units = run / w;
  switch (w) {
    case 16:
      swap_dims_as<uint4>(out, in, outer, n0, mid, n1, units);
      break;
    case 8:
      swap_dims_as<uint2>(out, in, outer, n0, mid, n1, units);
      break;
    case 4:
      swap_dims_as<uint32_t>(out, in, outer, n0, mid, n1, units);
      break;
    case 2:
      swap_dims_as<uint16_t>(out, in, outer, n0, mid, n1, units);
      break;
    default:
      swap_dims_as<uint8_t>(out, in, outer, n0, mid, n1, units);
  }
  KEEL_CUDA_LAUNCHED();
}
void copy_2d(void* dst, int64_t dst_ld, const void* src, int64_t src_ld, size_t elem, int64_t rows,
             int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  KEEL_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_ld * elem, src, src_ld * elem, cols * elem, rows,
                                    cudaMemcpyDeviceToDevice, stream()));
}
const ShapeKernels kShape = {swap_dims, copy_2d};

}  // namespace

const CrossEntropyKernels& cross_entropy_table() { return kCrossEntropy; }
const EmbeddingKernels& embedding_table() { return kEmbedding; }
const OptimKernels& optim_table() { return kOptim; }
const ShapeKernels& shape_table() { return kShape; }
const MonitorKernels& monitor_table() { return kMonitor; }

}  // namespace keel::cuda
