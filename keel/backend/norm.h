// Kernel interface: LayerNorm and RMSNorm over the last dimension of a [rows, cols] buffer.
//
// x, weight, bias, outputs and gradients share one floating dtype `dt`; statistics are f32
// buffers of `rows` entries. Per row the statistics are computed in f32 in two passes (mean, then
// the mean of squared deviations: no cancellation), each pass in 16 f32 lanes combined in a fixed
// order. Weight and bias gradients are reduced over rows in f32, in row order, per column (the
// same bits for any thread count), then rounded into dt. Backward kernels write (not accumulate).
// weight and bias may be null (no affine transform); so may any gradient that is not wanted.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct NormKernels {
  // y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var + eps) (biased variance)
  // y, x [rows, cols]; w, b [cols]; mean, rstd [rows] (f32, written)
  void (*layer_norm)(void* y, float* mean, float* rstd, const void* x, const void* w, const void* b,
                     DType dt, int64_t rows, int64_t cols, float eps);
  // With xhat = (x - mean) * rstd and g = dy * w:
  //   dx = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)),  dw = sum_r dy * xhat,  db = sum_r dy
  void (*layer_norm_backward)(void* dx, void* dw, void* db, const void* dy, const void* x,
                              const void* w, const float* mean, const float* rstd, DType dt,
                              int64_t rows, int64_t cols);
  // y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)        rstd [rows] (f32, written)
  void (*rms_norm)(void* y, float* rstd, const void* x, const void* w, DType dt, int64_t rows,
                   int64_t cols, float eps);
  // With xhat = x * rstd and g = dy * w:
  //   dx = rstd * (g - xhat * mean_c(g * xhat)),  dw = sum_r dy * xhat
  void (*rms_norm_backward)(void* dx, void* dw, const void* dy, const void* x, const void* w,
                            const float* rstd, DType dt, int64_t rows, int64_t cols);
};

const NormKernels& norm_kernels(Device dev);

}  // namespace keel
