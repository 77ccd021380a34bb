// Rotary position embedding, HF Llama / GPT-NeoX "rotate half" layout: for head dim D and
// i < D/2, (x[i], x[i + D/2]) rotates by angle pos * theta^(-2i/D). Angles in f64, rotation in f32,
// output in x's dtype. x: [B, H, T, D] (split-heads layout); pos = t + pos_offset.
#pragma once
#include "keel/tensor/tensor.h"

namespace keel::ops {

Tensor rope(const Tensor& x, float theta = 10000.f, int64_t pos_offset = 0);

}  // namespace keel::ops
