// Kernel interface: element-wise arithmetic, conversions and reductions.
//
// Buffers are raw pointers of one floating dtype `dt` (f32, bf16 or f16) unless stated; values are
// computed in f32 and rounded once on store (PyTorch's "opmath" rule). Output may alias an input.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct ElementwiseKernels {
  void (*add)(void* out, const void* a, const void* b, DType dt, int64_t n);  // a + b
  void (*mul)(void* out, const void* a, const void* b, DType dt, int64_t n);  // a * b
  // alpha * a + beta * b (b may be null when beta == 0)
  void (*axpby)(void* out, float alpha, const void* a, float beta, const void* b, DType dt,
                int64_t n);
  // a + round(s * b): the sum of `a` and the output of scaling `b` (s * b rounded into dt), in
  // one pass with the bits of the two (LoRA's base output plus its scaled update).
  void (*add_scaled)(void* out, const void* a, float s, const void* b, DType dt, int64_t n);
  // out[r, c] = a[r, c] (+|*) row[c]  (row broadcast over `rows` rows of `cols`)
  void (*add_row)(void* out, const void* a, const void* row, DType dt, int64_t rows, int64_t cols);
  void (*mul_row)(void* out, const void* a, const void* row, DType dt, int64_t rows, int64_t cols);
  // out[c] = sum_r a[r, c] (f32 accumulation in row order; out has dtype dt)
  void (*sum_rows)(void* out, const void* a, DType dt, int64_t rows, int64_t cols);
  // out[c] = sum_r a[r, c] * b[r, c]
  void (*sum_rows_mul)(void* out, const void* a, const void* b, DType dt, int64_t rows,
                       int64_t cols);
  // Conversion between any two floating dtypes (exact RNE).
  void (*convert)(void* out, DType out_dt, const void* in, DType in_dt, int64_t n);
  // Reductions over fixed 4096-element blocks: f32 lanes within a block, f64 across blocks.
  // Non-finite values propagate (a NaN anywhere gives NaN).
  double (*sum)(const void* a, DType dt, int64_t n);
  double (*sum_squares)(const void* a, DType dt, int64_t n);
};

const ElementwiseKernels& elementwise_kernels(Device dev);

}  // namespace keel
