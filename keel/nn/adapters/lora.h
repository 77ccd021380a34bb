// LoRA (Hu et al. 2021) as PEFT implements it (tuners/lora/layer.py, Linear):
//   y = base(x) + lora_B(lora_A(dropout(x))) * scaling,   scaling = alpha / r
// lora_A [r, in] Kaiming-uniform(a = sqrt(5)) (nn.Linear's default), lora_B [out, r] zeros, so an
// untrained adapter leaves the model unchanged. x is cast to the adapter dtype (f32) first, and the
// sum is cast back to base(x)'s dtype.
#pragma once
#include "keel/nn/adapters/adapter.h"

namespace keel::nn {

class LoraAdapter : public LinearAdapter {
 public:
  // Registers lora_A, lora_B (and lora_dropout when dropout > 0) on `base`; `seed` initializes A.
  LoraAdapter(Linear& base, int64_t r, double alpha, double dropout, uint64_t seed);
  const char* kind() const override { return "lora"; }
  Tensor forward(Linear& base, const Tensor& x) override;
  Tensor merged_weight(const Linear& base) const override;
  std::vector<std::pair<std::string, Tensor>> peft_tensors() const override;

  // s·(B·A) [out, in] f32, PEFT's get_delta_weight (outside autograd).
  Tensor delta_weight() const;

  Linear* lora_A;                   // weight [r, in], f32
  Linear* lora_B;                   // weight [out, r], f32
  Dropout* lora_dropout = nullptr;  // null when dropout == 0 (PEFT: nn.Identity)

  // lora_dropout(adapter_input(x)); under autocast, the 16-bit copy of it that lora_A's product
  // would make, in one fused pass (ops::dropout_cast), with the same values and gradients.
  Tensor dropped_input(const Tensor& x) const;

 protected:
  // x in the adapter's dtype (PEFT's _cast_input_dtype), differentiable.
  Tensor adapter_input(const Tensor& x) const;
};

}  // namespace keel::nn
