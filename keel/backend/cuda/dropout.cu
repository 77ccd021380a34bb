// CUDA inverted dropout with the counter-based mask of backend/dropout.h (numerics/hash.h).
// Semantics as backend/cpu (see the family header): f32 opmath, one RNE rounding on store,
// NaN/inf propagate.
#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

template <class TO, class TI>
__global__ void dropout_kernel(TO* out, const TI* x, int64_t n, uint64_t key, uint32_t threshold,
                               float scale) {
  KEEL_CUDA_FOR(i, n) {
    const uint32_t bits = static_cast<uint32_t>(splitmix64_at(key, static_cast<uint64_t>(i)) >> 32);
    st(out + i, ld(x + i) * (bits >= threshold ? 1.f : 0.f) * scale);
  }
}
void dropout_apply(void* out, const void* x, DType dt, int64_t n, uint64_t seed, uint32_t threshold,
                   float scale) {
  if (n <= 0) return;
  const uint64_t key = splitmix64_at(seed, 0);
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        KEEL_LAUNCH(grid_for(n), kThreads, 0, dropout_kernel<T, T>)(
                            (T*)out, (const T*)x, n, key, threshold, scale));
  KEEL_CUDA_LAUNCHED();
}
// The same, a thread per 8 elements, writing their keep bits as one byte (bit l: element 8q + l).
template <class TO, class TI>
__global__ void dropout_keep_kernel(TO* out, const TI* x, int64_t n, uint64_t key,
                                    uint32_t threshold, float scale, uint8_t* keep) {
  KEEL_CUDA_FOR(q, (n + 7) / 8) {
    uint32_t byte = 0;
    for (int l = 0; l < 8 && q * 8 + l < n; ++l) {
      const int64_t i = q * 8 + l;
      const uint32_t bits =
          static_cast<uint32_t>(splitmix64_at(key, static_cast<uint64_t>(i)) >> 32);
      st(out + i, ld(x + i) * (bits >= threshold ? 1.f : 0.f) * scale);
      byte |= static_cast<uint32_t>(bits >= threshold) << l;
    }
    keep[q] = static_cast<uint8_t>(byte);
  }
}
template <class TO, class TI>
__global__ void dropout_kept_kernel(TO* out, const TI* x, int64_t n, const uint8_t* keep,
                                    float scale) {
  KEEL_CUDA_FOR(i, n) {
    const bool kept = (keep[i >> 3] >> (i & 7)) & 1;
    st(out + i, ld(x + i) * (kept ? 1.f : 0.f) * scale);
  }
}
void dropout_apply_cast(void* out, DType out_dt, const void* x, DType x_dt, int64_t n,
                        uint64_t seed, uint32_t threshold, float scale, uint8_t* keep) {
  if (n <= 0) return;
  const uint64_t key = splitmix64_at(seed, 0);
  KEEL_CUDA_FLOAT_TYPES(out_dt, TO, KEEL_CUDA_FLOAT_TYPES(x_dt, TI, {
                          if (keep)
                            KEEL_LAUNCH(grid_for((n + 7) / 8), kThreads, 0,
                                        dropout_keep_kernel<TO, TI>)
                          ((TO*)out, (const TI*)x, n, key, threshold, scale, keep);
                          else KEEL_LAUNCH(grid_for(n), kThreads, 0, dropout_kernel<TO, TI>)(
                              (TO*)out, (const TI*)x, n, key, threshold, scale);
                        }));
  KEEL_CUDA_LAUNCHED();
}
void dropout_apply_kept(void* out, DType out_dt, const void* x, DType x_dt, int64_t n,
                        const uint8_t* keep, float scale) {
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(
      out_dt, TO,
      KEEL_CUDA_FLOAT_TYPES(x_dt, TI,
                            KEEL_LAUNCH(grid_for(n), kThreads, 0, dropout_kept_kernel<TO, TI>)(
                                (TO*)out, (const TI*)x, n, keep, scale)));
  KEEL_CUDA_LAUNCHED();
}
const DropoutKernels kDropout = {dropout_apply, dropout_apply_cast, dropout_apply_kept};

}  // namespace

const DropoutKernels& dropout_table() { return kDropout; }

}  // namespace keel::cuda
