// Kernel interface: the copies behind the shape ops (transpose, split/merge heads, split_last).
// Elements are opaque `elem`-byte values: copies are bitwise and work for every dtype.
#pragma once
#include <cstddef>
#include <cstdint>

#include "keel/tensor/device.h"

namespace keel {

struct ShapeKernels {
  // Swaps two dims of a contiguous tensor viewed as in [outer, n0, mid, n1, inner]:
  //   out [outer, n1, mid, n0, inner],  out[a, j, b, i, :] = in[a, i, b, j, :]
  void (*swap_dims)(void* out, const void* in, size_t elem, int64_t outer, int64_t n0, int64_t mid,
                    int64_t n1, int64_t inner);
  // dst[r, 0:cols] = src[r, 0:cols] for r < rows; leading dims dst_ld, src_ld in elements.
  void (*copy_2d)(void* dst, int64_t dst_ld, const void* src, int64_t src_ld, size_t elem,
                  int64_t rows, int64_t cols);
};

const ShapeKernels& shape_kernels(Device dev);

}  // namespace keel
