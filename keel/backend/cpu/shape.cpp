// Shape copies on the CPU: bitwise moves of fixed-size elements, memory-bound, so one plain
// implementation (no per-ISA variants). Parallel over output rows: every element is written once.
#include "keel/backend/shape.h"

#include <algorithm>
#include <cstring>

#include "keel/backend/parallel.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

namespace {

// Copies `count` elements of E bytes (E a compile-time constant for the common sizes, so that a
// one-element copy is a single move).
template <size_t E>
inline void copy_elems(char* dst, const char* src, int64_t count, size_t) {
  std::memcpy(dst, src, E * static_cast<size_t>(count));
}
template <>
inline void copy_elems<0>(char* dst, const char* src, int64_t count, size_t elem) {
  std::memcpy(dst, src, elem * static_cast<size_t>(count));
}

template <size_t E>
void swap_dims_t(char* out, const char* in, size_t elem, int64_t outer, int64_t n0, int64_t mid,
                 int64_t n1, int64_t inner) {
  const int64_t step = inner * static_cast<int64_t>(elem);  // bytes of one [inner] run
  // One task per output row block out[a, j, b, :, :] (n0 runs of `inner` elements).
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n0 * inner, 1));
  parallel_for(outer * n1 * mid, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t b = r % mid, j = (r / mid) % n1, a = r / (mid * n1);
      char* dst = out + r * n0 * step;
      const char* src = in + ((a * n0 * mid + b) * n1 + j) * step;  // in[a, 0, b, j, :]
      for (int64_t i = 0; i < n0; ++i)
        copy_elems<E>(dst + i * step, src + i * mid * n1 * step, inner, elem);
    }
  });
}

void swap_dims(void* out, const void* in, size_t elem, int64_t outer, int64_t n0, int64_t mid,
               int64_t n1, int64_t inner) {
  auto* o = static_cast<char*>(out);
  auto* s = static_cast<const char*>(in);
  switch (elem) {
    case 2:
      return swap_dims_t<2>(o, s, elem, outer, n0, mid, n1, inner);
    case 4:
      return swap_dims_t<4>(o, s, elem, outer, n0, mid, n1, inner);
    case 8:
      return swap_dims_t<8>(o, s, elem, outer, n0, mid, n1, inner);
    default:
      return swap_dims_t<0>(o, s, elem, outer, n0, mid, n1, inner);
  }
}

void copy_2d(void* dst, int64_t dst_ld, const void* src, int64_t src_ld, size_t elem, int64_t rows,
             int64_t cols) {
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  const int64_t e = static_cast<int64_t>(elem);
  parallel_for(rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t r = lo; r < hi; ++r)
                   std::memcpy(d + r * dst_ld * e, s + r * src_ld * e, cols * e);
               });
}

const ShapeKernels kCpuShape = {swap_dims, copy_2d};

}  // namespace

const ShapeKernels& shape_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::shape_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no shape kernels for " + dev.str() + " in this build");
  return kCpuShape;
}

}  // namespace keel
