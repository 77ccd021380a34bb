// Kernel interface: rotary position embedding in the "rotate half" layout (HF Llama, GPT-NeoX).
//
// For each of `rows` sequences of t positions with head dim d, the first `rot` channels (even,
// <= d) rotate: for i < rot/2 the pair (x[i], x[i + rot/2]) at position p turns by the angle whose
// cos/sin are table[p, i]:
//   out[i]         = x[i] * cos - x[i + rot/2] * sin
//   out[i + rot/2] = x[i + rot/2] * cos + x[i] * sin
// and channels rot..d-1 pass unchanged (HF's partial_rotary_factor: Phi-4-mini turns 96 of 128).
// `inverse` rotates by the opposite angle (the backward of the forward rotation). Values are
// computed in f32 and rounded once into dt; out may alias x.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct RopeKernels {
  // out, x: [rows, t, d] of dtype dt; cos, sin: [t, rot/2] f32.
  void (*rotate)(void* out, const void* x, const float* cos, const float* sin, DType dt,
                 int64_t rows, int64_t t, int64_t d, int64_t rot, bool inverse);
};

const RopeKernels& rope_kernels(Device dev);

}  // namespace keel
