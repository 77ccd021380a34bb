// bf16 for the host emulator: keel's own round-to-nearest-even conversion (numerics/convert.h).
#pragma once
#include "emulator.h"
#include "keel/numerics/convert.h"

struct __nv_bfloat16 {
  uint16_t x;
};
inline float __bfloat162float(__nv_bfloat16 b) { return keel::bf16_bits_to_f32(b.x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {keel::f32_to_bf16_bits(f)}; }
