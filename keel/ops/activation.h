// Differentiable activations. Computed in f32, stored in the input's dtype (PyTorch's opmath rule);
// gradients have the input's dtype.
#pragma once
#include "keel/tensor/tensor.h"

namespace keel::ops {

enum class GeluApprox { None, Tanh };  // None = exact erf form; Tanh = GPT-2's "gelu_new"

Tensor gelu(const Tensor& x, GeluApprox approx = GeluApprox::Tanh);
Tensor silu(const Tensor& x);                         // x * sigmoid(x)
Tensor swiglu(const Tensor& gate, const Tensor& up);  // silu(gate) * up (Llama MLP), same shapes
// cap * tanh(x / cap), cap > 0: Gemma-2's final_logit_softcapping (and its attention's, inside the
// attention kernels), smooth below cap and bounded by it.
Tensor softcap(const Tensor& x, float cap);
// min(max(x, -bound), bound), bound > 0 (torch.clamp: OLMo's clip_qkv on its q/k/v projections);
// the gradient passes where -bound <= x <= bound. A NaN stays a NaN (and takes no gradient).
Tensor clamp(const Tensor& x, float bound);

}  // namespace keel::ops
