// WMMA for the host emulator: every lane's fragment holds the whole 16 x 16 tile; a product sums
// its 16 terms in order in f32 (16-bit inputs multiply exactly); a store writes each lane's share
// of the elements (every 32nd), so lanes never write the same byte.
#pragma once
#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "emulator.h"

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  float v[16][16];
};

inline float emu_load(const float* p) { return *p; }
inline float emu_load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
inline float emu_load(const __half* p) { return __half2float(*p); }

template <class Use, class T, class L>
void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, float x) {
  for (auto& row : f.v)
    for (float& e : row) e = x;
}
template <class Use, class T, class L, class S>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const S* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load names its layout");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.v[r][c] = emu_load(std::is_same_v<L, col_major> ? p + c * ldm + r : p + r * ldm + c);
}
template <class T>
void load_matrix_sync(fragment<accumulator, 16, 16, 16, T>& f, const float* p, unsigned ldm,
                      layout_t layout) {
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.v[r][c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}
template <class TA, class LA, class TB, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, TA, LA>& a,
              const fragment<matrix_b, 16, 16, 16, TB, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  float out[16][16];
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 16; ++n) {
      float s = c.v[r][n];
      for (int k = 0; k < 16; ++k) s += a.v[r][k] * b.v[k][n];
      out[r][n] = s;
    }
  std::memcpy(d.v, out, sizeof out);
}
template <class T>
void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, T>& f, unsigned ldm,
                       layout_t layout) {
  const unsigned lane = threadIdx.x % 32;
  for (unsigned e = lane; e < 256; e += 32) {
    const unsigned r = e / 16, c = e % 16;
    (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.v[r][c];
  }
}

}  // namespace nvcuda::wmma
