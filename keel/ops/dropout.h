// Inverted dropout: zero with probability p, scale survivors by 1/(1-p). The mask is a pure
// function of (seed, element index) — a counter-based hash, independent of threads — so replaying a
// step with the same seed regenerates it bit for bit. p == 0 returns x itself.
#pragma once
#include <cstdint>

#include "keel/tensor/tensor.h"

namespace keel::ops {

// The mask's parameters for a probability p in [0, 1) (an Error outside it): an element survives
// when its 32 hash bits are >= threshold (backend/dropout.h), survivors are multiplied by scale.
// What dropout applies, and what the attention's probability dropout (ops/attention.h) applies.
struct DropoutMask {
  uint32_t threshold = 0;
  float scale = 1.f;
};
DropoutMask dropout_mask(float p);

Tensor dropout(const Tensor& x, float p, uint64_t seed);

// cast(dropout(cast(x, f32), p, seed), out) in one pass, bit for bit, for x in f32 or 16 bits
// and a 16-bit `out`: the dropout's f32 product is rounded once into `out`. Its gradient is asked
// for in f32 (grad_dtype_for), as the narrowing cast's was; the backward applies the mask in f32
// and rounds once into x's dtype, as dropout's backward and the widening cast's backward did.
// This is LoRA's input path under autocast (PEFT: x cast to the adapter's f32, dropout, then
// autocast's 16-bit copy for lora_A): one pass each way instead of two or three, without the f32
// intermediates. p == 0 keeps every element (x's values, rounded into out).
Tensor dropout_cast(const Tensor& x, float p, uint64_t seed, DType out);

}  // namespace keel::ops
