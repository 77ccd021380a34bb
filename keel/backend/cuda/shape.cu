// CUDA shape copies: swapping two dims of a contiguous tensor, strided 2-D copies.
#include <cstring>

#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

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
    KEEL_LAUNCH(grid_for(n), kThreads, 0, swap_dims_kernel<E, uint32_t>)
    ((E*)out, (const E*)in, uint32_t(outer), uint32_t(n0), uint32_t(mid), uint32_t(n1),
     uint32_t(inner));
  else
    KEEL_LAUNCH(grid_for(n), kThreads, 0, swap_dims_kernel<E, int64_t>)
    ((E*)out, (const E*)in, outer, n0, mid, n1, inner);
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

const ShapeKernels& shape_table() { return kShape; }

}  // namespace keel::cuda
