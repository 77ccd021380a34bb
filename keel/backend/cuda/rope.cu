// CUDA rotary position embedding (RoPE), forward and inverse.
// Semantics as backend/cpu (see the family header): f32 opmath, one RNE rounding on store,
// NaN/inf propagate.
#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

template <class T>
__global__ void rope_kernel(T* out, const T* x, const float* cos, const float* sin, int64_t rows,
                            int64_t t, int64_t d, int64_t rot, float sgn) {
  const int64_t h = rot / 2;
  KEEL_CUDA_FOR(e, rows * t * h) {
    const int64_t i = e % h, rp = e / h, p = rp % t;
    const float x1 = ld(x + rp * d + i), x2 = ld(x + rp * d + h + i);
    const float c = cos[p * h + i], s = sgn * sin[p * h + i];
    st(out + rp * d + i, x1 * c - x2 * s);
    st(out + rp * d + h + i, x2 * c + x1 * s);
  }
}
// The channels rot..d-1 of each position, which do not turn (partial rotary), copied as they are.
template <class T>
__global__ void rope_pass_kernel(T* out, const T* x, int64_t positions, int64_t d, int64_t rot) {
  const int64_t w = d - rot;
  KEEL_CUDA_FOR(e, positions * w) {
    const int64_t at = (e / w) * d + rot + e % w;
    out[at] = x[at];
  }
}
void rope_rotate(void* out, const void* x, const float* cos, const float* sin, DType dt,
                 int64_t rows, int64_t t, int64_t d, int64_t rot, bool inverse) {
  const int64_t n = rows * t * (rot / 2);
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        KEEL_LAUNCH(grid_for(n), kThreads, 0, rope_kernel<T>)(
                            (T*)out, (const T*)x, cos, sin, rows, t, d, rot, inverse ? -1.f : 1.f));
  KEEL_CUDA_LAUNCHED();
  if (rot < d && out != x) {
    const int64_t m = rows * t * (d - rot);
    KEEL_CUDA_FLOAT_TYPES(dt, T,
                          KEEL_LAUNCH(grid_for(m), kThreads, 0, rope_pass_kernel<T>)(
                              (T*)out, (const T*)x, rows * t, d, rot));
    KEEL_CUDA_LAUNCHED();
  }
}
const RopeKernels kRope = {rope_rotate};

}  // namespace

const RopeKernels& rope_table() { return kRope; }

}  // namespace keel::cuda
