// Exact conversions between f32 and the 16-bit floating formats.
//
// f32 -> bf16/f16 round to nearest, ties to even; NaN stays NaN (quiet bit set, payload truncated,
// as the x86 F16C and AVX512-BF16 instructions do); values past the format's max become +-inf;
// f16 subnormals are produced and read exactly. bf16/f16 -> f32 is exact.
// These scalar versions are the reference every vectorized conversion is tested against.
#pragma once
#include <cstdint>
#include <cstring>

#include "keel/numerics/dtype.h"

namespace keel {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // ties to even; overflow carries into the exponent -> inf
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_bits_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_f16_bits(float f) {
  uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u)  // inf, or NaN with the quiet bit set and the payload's top bits kept
    return static_cast<uint16_t>(sign | 0x7c00u | (u > 0x7f800000u ? 0x200u | ((u >> 13) & 0x3ffu) : 0u));
  if (u >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (u < 0x38800000u) {
    // Below f16's min normal (2^-14): let the FPU round |f| * 2^24 to an integer by adding 0.5,
    // whose ulp is exactly f16's min subnormal (2^-24). The low bits are the subnormal mantissa.
    const float magic = 0.5f;
    const uint32_t r = f32_bits(f32_from_bits(u) + magic) - f32_bits(magic);
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t mant_odd = (u >> 13) & 1u;
  u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd;
  return static_cast<uint16_t>(sign | (u >> 13));
}

inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f)  // inf, or NaN made quiet (as F16C does)
    return f32_from_bits(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in f32
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return f32_from_bits(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

// f32 -> dtype -> f32: the value a floating dtype actually stores for f.
inline float round_to(DType dt, float f) {
  switch (dt) {
    case DType::BF16: return bf16_bits_to_f32(f32_to_bf16_bits(f));
    case DType::F16: return f16_bits_to_f32(f32_to_f16_bits(f));
    default: return f;
  }
}

// Element read/write for kernels written once for every floating storage type.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
inline float load_f32(const float* p) { return *p; }
inline float load_f32(const bf16_t* p) { return bf16_bits_to_f32(p->bits); }
inline float load_f32(const f16_t* p) { return f16_bits_to_f32(p->bits); }
inline void store_f32(float* p, float v) { *p = v; }
inline void store_f32(bf16_t* p, float v) { p->bits = f32_to_bf16_bits(v); }
inline void store_f32(f16_t* p, float v) { p->bits = f32_to_f16_bits(v); }

}  // namespace keel
