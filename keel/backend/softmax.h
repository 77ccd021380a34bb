// Kernel interface: softmax and log-softmax over the last dimension of a [rows, cols] buffer.
//
// One floating dtype `dt` for every buffer; per row the max, the sum of exp(x - max) (16 f32
// lanes combined in a fixed order: the same bits for any thread count) and the outputs are
// computed in f32, outputs rounded once into dt. A row whose entries are all -inf gives zeros
// (softmax) or -inf (log_softmax), never NaN; a NaN or +inf anywhere in a row makes the row NaN.
// Backward kernels write (not accumulate) dx in dt.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct SoftmaxKernels {
  // y = exp(x - max) / sum exp(x - max)            x, y [rows, cols]
  void (*softmax)(void* y, const void* x, DType dt, int64_t rows, int64_t cols);
  // y = x - max - log(sum exp(x - max))
  void (*log_softmax)(void* y, const void* x, DType dt, int64_t rows, int64_t cols);
  // dx = y * (dy - sum_j dy_j y_j)   from the forward output y
  void (*softmax_backward)(void* dx, const void* dy, const void* y, DType dt, int64_t rows,
                           int64_t cols);
  // dx = dy - exp(y) * sum_j dy_j    from the forward output y
  void (*log_softmax_backward)(void* dx, const void* dy, const void* y, DType dt, int64_t rows,
                               int64_t cols);
};

const SoftmaxKernels& softmax_kernels(Device dev);

}  // namespace keel
