// CUDA softmax and log-softmax over rows (one thread block per row), forward and backward.
// Semantics as backend/cpu (see the family header): f32 opmath, one RNE rounding on store,
// NaN/inf propagate.
#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

template <class T>
__global__ void softmax_kernel(T* y, const T* x, int64_t cols, bool log) {
  __shared__ float sh[32];
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  float mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) mx = nan_max(mx, ld(xr + c));
  mx = block_reduce(mx, sh, MaxOp{}, -INFINITY);
  if (mx == -INFINITY) {  // every entry -inf: zeros (softmax) or -inf (log_softmax), not NaN
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) st(yr + c, log ? mx : 0.f);
    return;
  }
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += expf(ld(xr + c) - mx);
  sum = block_reduce(sum, sh, SumOp{}, 0.f);
  const float lsum = logf(sum), inv = 1.f / sum;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = ld(xr + c);
    st(yr + c, log ? (v - mx) - lsum : expf(v - mx) * inv);
  }
}
template <class T>
__global__ void softmax_bwd_kernel(T* dx, const T* dy, const T* y, int64_t cols, bool log) {
  __shared__ float sh[32];
  const int64_t off = blockIdx.x * cols;
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    s += log ? ld(dy + off + c) : ld(dy + off + c) * ld(y + off + c);
  s = block_reduce(s, sh, SumOp{}, 0.f);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = ld(dy + off + c), yv = ld(y + off + c);
    st(dx + off + c, log ? d - expf(yv) * s : yv * (d - s));
  }
}
void softmax_fwd(void* y, const void* x, DType dt, int64_t rows, int64_t cols, bool log) {
  if (rows <= 0 || cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(
      dt, T,
      KEEL_LAUNCH(rows, row_threads(cols), 0, softmax_kernel<T>)((T*)y, (const T*)x, cols, log));
  KEEL_CUDA_LAUNCHED();
}
void softmax_bwd(void* dx, const void* dy, const void* y, DType dt, int64_t rows, int64_t cols,
                 bool log) {
  if (rows <= 0 || cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        KEEL_LAUNCH(rows, row_threads(cols), 0, softmax_bwd_kernel<T>)(
                            (T*)dx, (const T*)dy, (const T*)y, cols, log));
  KEEL_CUDA_LAUNCHED();
}
void sm_softmax(void* y, const void* x, DType dt, int64_t rows, int64_t cols) {
  softmax_fwd(y, x, dt, rows, cols, false);
}
void sm_log_softmax(void* y, const void* x, DType dt, int64_t rows, int64_t cols) {
  softmax_fwd(y, x, dt, rows, cols, true);
}
void sm_softmax_backward(void* dx, const void* dy, const void* y, DType dt, int64_t rows,
                         int64_t cols) {
  softmax_bwd(dx, dy, y, dt, rows, cols, false);
}
void sm_log_softmax_backward(void* dx, const void* dy, const void* y, DType dt, int64_t rows,
                             int64_t cols) {
  softmax_bwd(dx, dy, y, dt, rows, cols, true);
}
const SoftmaxKernels kSoftmax = {sm_softmax, sm_log_softmax, sm_softmax_backward,
                                 sm_log_softmax_backward};

}  // namespace

const SoftmaxKernels& softmax_table() { return kSoftmax; }

}  // namespace keel::cuda
