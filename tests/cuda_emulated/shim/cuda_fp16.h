// f16 for the host emulator: keel's own round-to-nearest-even conversion (numerics/convert.h).
#pragma once
#include "emulator.h"
#include "keel/numerics/convert.h"

struct __half {
  uint16_t x;
};
inline float __half2float(__half h) { return keel::f16_bits_to_f32(h.x); }
inline __half __float2half_rn(float f) { return {keel::f32_to_f16_bits(f)}; }
