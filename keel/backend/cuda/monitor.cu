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

}  // namespace

const MonitorKernels& monitor_table() { return kMonitor; }

}  // namespace keel::cuda
