// CUDA toolkit passes (backend/monitor.h): the fused unscale + finite check + sum of squares over
// a set of buffers, and tensor statistics (numerics/tensor_stats on the device). Fixed launch
// shapes: deterministic.
#include <cstring>
#include <limits>
#include <vector>

#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"
#include "keel/numerics/format_info.h"

namespace keel::cuda {
namespace {

// ---- fused unscale + finite check + sum of squares over a set of buffers --------------------

constexpr int64_t kChunk = 4096;
struct BufDesc {
  void* p;
  int64_t n;
  int64_t first_chunk;
  int dt;  // 0 f32, 1 bf16, 2 f16
};

template <class T>
__device__ void unscale_chunk(T* g, int64_t lo, int64_t hi, float inv, float normal_min,
                              long long& bad, float& sq, long long& zero, long long& below) {
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
    zero += v == 0.f;
    below += v != 0.f && fabsf(v) < normal_min;
  }
}
// One block per chunk of kChunk values: bad count, f32 sum of squares, zeros and values below
// normal_min per chunk.
__global__ void unscale_norm_kernel(long long* bad_out, double* sq_out, long long* zero_out,
                                    long long* below_out, const BufDesc* bufs, int nbufs, float inv,
                                    float normal_min) {
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
  long long bad = 0, zero = 0, below = 0;
  float sq = 0.f;
  if (b.dt == 0)
    unscale_chunk(static_cast<float*>(b.p), e0, e1, inv, normal_min, bad, sq, zero, below);
  else if (b.dt == 1)
    unscale_chunk(static_cast<__nv_bfloat16*>(b.p), e0, e1, inv, normal_min, bad, sq, zero, below);
  else
    unscale_chunk(static_cast<__half*>(b.p), e0, e1, inv, normal_min, bad, sq, zero, below);
  sq = block_reduce(sq, shf, SumOp{}, 0.f);
  bad = block_reduce(bad, shi, SumOp{}, 0ll);
  zero = block_reduce(zero, shi, SumOp{}, 0ll);
  below = block_reduce(below, shi, SumOp{}, 0ll);
  if (threadIdx.x == 0) {
    bad_out[chunk] = bad, sq_out[chunk] = static_cast<double>(sq);
    zero_out[chunk] = zero, below_out[chunk] = below;
  }
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
// Per buffer (one block each): its chunks' sums and counts, in a fixed order. out[3 b + 0..2]:
// sum of squares, zeros, values below normal_min (the counts as long long bits).
__global__ void finish_per_buffer_kernel(double* out, const BufDesc* bufs, const double* sq,
                                         const long long* zero, const long long* below,
                                         int64_t chunks) {
  __shared__ double shd[32];
  __shared__ long long shi[32];
  const BufDesc b = bufs[blockIdx.x];
  const int64_t c1 = min(chunks, b.first_chunk + (b.n + kChunk - 1) / kChunk);
  double s = 0;
  long long z = 0, w = 0;
  for (int64_t i = b.first_chunk + threadIdx.x; i < c1; i += blockDim.x)
    s += sq[i], z += zero[i], w += below[i];
  s = block_reduce(s, shd, SumOp{}, 0.0);
  z = block_reduce(z, shi, SumOp{}, 0ll);
  w = block_reduce(w, shi, SumOp{}, 0ll);
  if (threadIdx.x == 0) {
    out[3 * blockIdx.x] = s;
    reinterpret_cast<long long*>(out)[3 * blockIdx.x + 1] = z;
    reinterpret_cast<long long*>(out)[3 * blockIdx.x + 2] = w;
  }
}
GradSetStats unscale_norm(void* const* bufs, const DType* dts, const int64_t* ns, int count,
                          float inv_scale, float normal_min, GradBufStats* per) {
  std::vector<BufDesc> desc;
  std::vector<int> index_of;  // desc entry -> buffer index
  int64_t chunks = 0;
  for (int i = 0; i < count; ++i) {
    if (per) per[i] = GradBufStats{};
    if (ns[i] <= 0) continue;
    const int code = dts[i] == DType::F32    ? 0
                     : dts[i] == DType::BF16 ? 1
                     : dts[i] == DType::F16  ? 2
                                             : -1;
    KEEL_CHECK(code >= 0,
               std::string("unscale_norm: floating dtype required, got ") + dtype_name(dts[i]));
    desc.push_back({bufs[i], ns[i], chunks, code});
    index_of.push_back(i);
    chunks += (ns[i] + kChunk - 1) / kChunk;
  }
  GradSetStats out;
  if (chunks == 0) return out;
  const size_t nd = desc.size();
  const size_t desc_bytes = (nd * sizeof(BufDesc) + 15) / 16 * 16;
  const size_t out_bytes = 16 + (per ? nd * 24 : 0);  // total, then per buffer
  Scratch s(desc_bytes + static_cast<size_t>(chunks) * 32 + out_bytes);
  char* base = s.as<char>();
  auto* d_desc = reinterpret_cast<BufDesc*>(base);
  auto* d_bad = reinterpret_cast<long long*>(base + desc_bytes);
  auto* d_sq = reinterpret_cast<double*>(base + desc_bytes + chunks * 8);
  auto* d_zero = reinterpret_cast<long long*>(base + desc_bytes + chunks * 16);
  auto* d_below = reinterpret_cast<long long*>(base + desc_bytes + chunks * 24);
  auto* d_out = reinterpret_cast<double*>(base + desc_bytes + chunks * 32);
  KEEL_CUDA_CHECK(
      cudaMemcpyAsync(d_desc, desc.data(), nd * sizeof(BufDesc), cudaMemcpyHostToDevice, stream()));
  KEEL_LAUNCH(chunks, kThreads, 0, unscale_norm_kernel)
  (d_bad, d_sq, d_zero, d_below, d_desc, static_cast<int>(nd), inv_scale, normal_min);
  KEEL_LAUNCH(1, 1024, 0, finish_unscale_norm_kernel)(d_out, d_bad, d_sq, chunks);
  if (per) KEEL_LAUNCH(static_cast<unsigned>(nd), kThreads, 0, finish_per_buffer_kernel)
  (d_out + 2, d_desc, d_sq, d_zero, d_below, chunks);
  KEEL_CUDA_LAUNCHED();
  std::vector<double> h(out_bytes / 8, 0.0);
  read_back(h.data(), d_out, out_bytes);  // the one synchronization of the step's steps 4-5
  out.sum_squares = h[0];
  long long bad = 0;
  std::memcpy(&bad, &h[1], 8);
  out.nonfinite = bad;
  if (per)
    for (size_t k = 0; k < nd; ++k) {
      GradBufStats& b = per[index_of[k]];
      b.sum_squares = h[2 + 3 * k];
      long long z = 0, w = 0;
      std::memcpy(&z, &h[3 + 3 * k], 8);
      std::memcpy(&w, &h[4 + 3 * k], 8);
      b.zero = z, b.below_normal = w;
    }
  return out;
}

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
                          KEEL_LAUNCH(blocks, kThreads, 0, stats_kernel<T>)(
                              p + 1, (const T*)data, n, fi.min_normal, fi.max / 2));
    KEEL_LAUNCH(1, kThreads, 0, stats_finish_kernel)(p, p + 1, blocks);
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

}  // namespace

const MonitorKernels& monitor_table() { return kMonitor; }

}  // namespace keel::cuda
