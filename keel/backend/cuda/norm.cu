// CUDA LayerNorm and RMSNorm: one thread block per row; weight grads by column chunks.
// Semantics as backend/cpu (see the family header): f32 opmath, one RNE rounding on store,
// NaN/inf propagate.
#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

template <class T>
__global__ void norm_fwd_kernel(T* y, float* mean, float* rstd, const T* x, const T* w, const T* b,
                                int64_t cols, float eps, bool center) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  float mu = 0.f;
  if (center) {
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += ld(xr + c);
    mu = block_reduce(s, sh, SumOp{}, 0.f) / static_cast<float>(cols);
  }
  float v = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = ld(xr + c) - mu;
    v += d * d;
  }
  const float var = block_reduce(v, sh, SumOp{}, 0.f) / static_cast<float>(cols);
  const float rs = 1.f / sqrtf(var + eps);
  if (threadIdx.x == 0) {
    if (mean) mean[r] = mu;
    rstd[r] = rs;
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float wv = w ? ld(w + c) : 1.f, bv = b ? ld(b + c) : 0.f;
    st(y + r * cols + c, (ld(xr + c) - mu) * rs * wv + bv);
  }
}

template <class T>
__global__ void norm_dx_kernel(T* dx, const T* dy, const T* x, const T* w, const float* mean,
                               const float* rstd, int64_t cols, bool center) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x, off = r * cols;
  const float mu = center ? mean[r] : 0.f, rs = rstd[r];
  float sg = 0.f, sgx = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = w ? ld(dy + off + c) * ld(w + c) : ld(dy + off + c);
    const float xh = (ld(x + off + c) - mu) * rs;
    sg += g;
    sgx += g * xh;
  }
  const float mean_g = center ? block_reduce(sg, sh, SumOp{}, 0.f) / static_cast<float>(cols) : 0.f;
  const float mean_gx = block_reduce(sgx, sh, SumOp{}, 0.f) / static_cast<float>(cols);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = w ? ld(dy + off + c) * ld(w + c) : ld(dy + off + c);
    const float xh = (ld(x + off + c) - mu) * rs;
    st(dx + off + c, (g - mean_g - xh * mean_gx) * rs);
  }
}

// Partial column sums of dy * xhat and dy over chunks of kColChunk rows.
template <class T>
__global__ void norm_dw_partial_kernel(float* pw, float* pb, const T* dy, const T* x,
                                       const float* mean, const float* rstd, int64_t rows,
                                       int64_t cols) {
  const int64_t chunks = (rows + kColChunk - 1) / kColChunk;
  KEEL_CUDA_FOR(i, chunks * cols) {
    const int64_t c = i % cols, k = i / cols;
    const int64_t r0 = k * kColChunk, r1 = min(rows, r0 + kColChunk);
    float aw = 0.f, ab = 0.f;
    for (int64_t r = r0; r < r1; ++r) {
      const float d = ld(dy + r * cols + c);
      if (pw) aw += d * ((ld(x + r * cols + c) - (mean ? mean[r] : 0.f)) * rstd[r]);
      ab += d;
    }
    if (pw) pw[i] = aw;
    if (pb) pb[i] = ab;
  }
}

template <class T>
void norm_dw(T* dw, T* db, const T* dy, const T* x, const float* mean, const float* rstd,
             int64_t rows, int64_t cols) {
  const int64_t chunks = std::max<int64_t>(1, (rows + kColChunk - 1) / kColChunk);
  Scratch part(static_cast<size_t>(2 * chunks * cols) * 4);
  float* pw = dw ? part.as<float>() : nullptr;
  float* pb = db ? part.as<float>() + chunks * cols : nullptr;
  if (rows <= 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(part.as<float>(), 0, 2 * chunks * cols * 4, stream()));
  } else {
    KEEL_LAUNCH(grid_for(chunks * cols), kThreads, 0, norm_dw_partial_kernel<T>)
    (pw, pb, dy, x, mean, rstd, rows, cols);
  }
  if (dw) KEEL_LAUNCH(grid_for(cols), kThreads, 0, col_finish_kernel<T>)(dw, pw, chunks, cols);
  if (db) KEEL_LAUNCH(grid_for(cols), kThreads, 0, col_finish_kernel<T>)(db, pb, chunks, cols);
  KEEL_CUDA_LAUNCHED();
}

void norm_layer_norm(void* y, float* mean, float* rstd, const void* x, const void* w, const void* b,
                     DType dt, int64_t rows, int64_t cols, float eps) {
  if (rows <= 0 || cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(
      dt, T,
      KEEL_LAUNCH(rows, row_threads(cols), 0, norm_fwd_kernel<T>)(
          (T*)y, mean, rstd, (const T*)x, (const T*)w, (const T*)b, cols, eps, true));
  KEEL_CUDA_LAUNCHED();
}
void norm_layer_norm_backward(void* dx, void* dw, void* db, const void* dy, const void* x,
                              const void* w, const float* mean, const float* rstd, DType dt,
                              int64_t rows, int64_t cols) {
  if (cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (dx && rows > 0)
      KEEL_LAUNCH(rows, row_threads(cols), 0, norm_dx_kernel<T>)
      ((T*)dx, (const T*)dy, (const T*)x, (const T*)w, mean, rstd, cols, true);
    if (dw || db) norm_dw((T*)dw, (T*)db, (const T*)dy, (const T*)x, mean, rstd, rows, cols);
  });
  KEEL_CUDA_LAUNCHED();
}
void norm_rms_norm(void* y, float* rstd, const void* x, const void* w, DType dt, int64_t rows,
                   int64_t cols, float eps) {
  if (rows <= 0 || cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(
      dt, T,
      KEEL_LAUNCH(rows, row_threads(cols), 0, norm_fwd_kernel<T>)(
          (T*)y, nullptr, rstd, (const T*)x, (const T*)w, (const T*)nullptr, cols, eps, false));
  KEEL_CUDA_LAUNCHED();
}
void norm_rms_norm_backward(void* dx, void* dw, const void* dy, const void* x, const void* w,
                            const float* rstd, DType dt, int64_t rows, int64_t cols) {
  if (cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (dx && rows > 0)
      KEEL_LAUNCH(rows, row_threads(cols), 0, norm_dx_kernel<T>)
      ((T*)dx, (const T*)dy, (const T*)x, (const T*)w, nullptr, rstd, cols, false);
    if (dw) norm_dw((T*)dw, (T*)nullptr, (const T*)dy, (const T*)x, nullptr, rstd, rows, cols);
  });
  KEEL_CUDA_LAUNCHED();
}
const NormKernels kNorm = {norm_layer_norm, norm_layer_norm_backward, norm_rms_norm,
                           norm_rms_norm_backward};

}  // namespace

const NormKernels& norm_table() { return kNorm; }

}  // namespace keel::cuda
