// Kernel interface: rotary position embedding in the "rotate half" layout (HF Llama, GPT-NeoX).
//
// For each of `rows` sequences of t positions with head dim d (even) and i < d/2, the pair
// (x[i], x[i + d/2]) at position p rotates by the angle whose cos/sin are table[p, i]:
//   out[i]       = x[i] * cos - x[i + d/2] * sin
//   out[i + d/2] = x[i + d/2] * cos + x[i] * sin
// `inverse` rotates by the opposite angle (the backward of the forward rotation). Values are
// computed in f32 and rounded once into dt; out may alias x.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct RopeKernels {
  // out, x: [rows, t, d] of dtype dt; cos, sin: [t, d/2] f32.
  void (*rotate)(void* out, const void* x, const float* cos, const float* sin, DType dt,
                 int64_t rows, int64_t t, int64_t d, bool inverse);
};

const RopeKernels& rope_kernels(Device dev);

}  // namespace keel
