// CUDA cross-entropy over rows of logits: target checks, forward (per-row stats, loss in row
// order) and backward. Semantics as backend/cpu/cross_entropy.inc.
#include <cmath>

#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

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
  KEEL_LAUNCH(grid_for(n), kThreads, 0, count_kernel)
  (s.as<unsigned long long>(), targets, tdt == DType::I32, n, ignore);
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
double ce_forward(float* stats, const void* logits, DType dt, const void* targets, DType tdt,
                  int64_t n, int64_t v, int64_t ignore) {
  if (n <= 0) return 0.0;
  Scratch rl(static_cast<size_t>(n + 1) * 8);
  double* p = rl.as<double>();
  const int threads = v >= 8192 ? 1024 : 256;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        KEEL_LAUNCH(n, threads, 0, ce_fwd_kernel<T>)(
                            stats, p + 1, (const T*)logits, targets, tdt == DType::I32, v, ignore));
  KEEL_LAUNCH(1, 1024, 0, sum_doubles_kernel<>)(p, p + 1, n);
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
      KEEL_LAUNCH(grid_for(n * v), kThreads, 0, ce_bwd_kernel<T>)(
          (T*)dlogits, (const T*)logits, stats, targets, tdt == DType::I32, n, v, ignore, scale));
  KEEL_CUDA_LAUNCHED();
}
const CrossEntropyKernels kCrossEntropy = {ce_find_invalid, ce_count, ce_forward, ce_backward};

}  // namespace

const CrossEntropyKernels& cross_entropy_table() { return kCrossEntropy; }

}  // namespace keel::cuda
