// LayerNorm and RMSNorm over the last dimension. Statistics in f32 (two-pass, no catastrophic
// cancellation); output in x's dtype. x, weight and bias share one dtype (autocast upcasts).
#pragma once
#include "keel/tensor/tensor.h"

namespace keel::ops {

// (x - mean) / sqrt(var + eps) * weight + bias   (biased variance, as torch.nn.LayerNorm)
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps = 1e-5f);
// x / sqrt(mean(x^2) + eps) * weight   (as HF LlamaRMSNorm)
Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps = 1e-6f);

}  // namespace keel::ops
