// DoRA (Liu et al. 2024, "weight-decomposed low-rank adaptation") as PEFT implements it
// (tuners/lora/dora.py DoraLinearLayer, variants.py DoraLinearVariant):
//   W' = m * (W + s·B·A) / ||W + s·B·A||_row        (m [out], one magnitude per output row)
// computed without forming W':
//   y = base(x) + (m/n - 1) * base_result + (m/n) * lora_B(lora_A(x')) * s,  n = ||W + s·B·A||_row
// with n detached from the graph (paper §4.3: treated as a constant, no gradient through it), B·A
// formed under the matmul autocast rule (PEFT: lora_B(lora_A(eye)).T), base_result = base(x) - bias
// when no dropout is active (eval, or p == 0) and x'·Wᵀ with x' = dropout(x) otherwise. m is
// initialized to ||W||_row (B = 0 at start) and saved as PEFT's `lora_magnitude_vector`.
#pragma once
#include "keel/nn/adapters/lora.h"

namespace keel::nn {

class DoraAdapter : public LoraAdapter {
 public:
  DoraAdapter(Linear& base, int64_t r, double alpha, double dropout, uint64_t seed);
  const char* kind() const override { return "dora"; }
  Tensor forward(Linear& base, const Tensor& x) override;
  Tensor merged_weight(const Linear& base) const override;
  std::vector<std::pair<std::string, Tensor>> peft_tensors() const override;

  // ||W + s·lora_weight||_row [out] f32 (PEFT's get_weight_norm), outside autograd; lora_weight
  // [out, in] in any floating dtype (s·lora_weight is rounded in that dtype, as torch does).
  static Tensor weight_norm(const Tensor& w, const Tensor& lora_weight, double s);
  // The same norms through ops on w's device (weight_norm's path for a GPU weight: no copy of W
  // to the host, only the [out] sums come back): each product s·lora_weight rounded in its dtype,
  // added to W in f32, squared and summed per row in f32 by a product with a column of ones, the
  // root taken on the host in f64. Within f32 rounding of weight_norm (its order differs).
  static Tensor weight_norm_by_ops(const Tensor& w, const Tensor& lora_weight, double s);

  Tensor magnitude;  // [out] f32, "lora_magnitude_vector"
};

}  // namespace keel::nn
