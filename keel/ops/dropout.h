// Inverted dropout: zero with probability p, scale survivors by 1/(1-p). The mask is a pure
// function of (seed, element index) — a counter-based hash, independent of threads — so replaying a
// step with the same seed regenerates it bit for bit. p == 0 returns x itself.
#pragma once
#include <cstdint>

#include "keel/tensor/tensor.h"

namespace keel::ops {

Tensor dropout(const Tensor& x, float p, uint64_t seed);

}  // namespace keel::ops
