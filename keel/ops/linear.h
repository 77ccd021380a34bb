// Differentiable matrix products. Inputs share one floating dtype; products accumulate in f32 and
// the output is rounded once to the input dtype (bias included before the rounding).
#pragma once
#include "keel/tensor/tensor.h"

namespace keel::ops {

// x [..., in] · w[out, in]ᵀ + b[out]  ->  [..., out]   (nn.Linear layout; b may be undefined)
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = Tensor());

// a [..., M, K] · b [..., K, N]  ->  [..., M, N]. b is either 2-D (shared by every batch) or has
// a's batch dims. trans_a / trans_b read a as [..., K, M] / b as [..., N, K].
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

}  // namespace keel::ops
