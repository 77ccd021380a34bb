// LoKr (LyCORIS; Yeh et al. 2023) as PEFT implements it for nn.Linear (tuners/lokr/layer.py),
// with PEFT's defaults decompose_both = false, decompose_factor = -1, rank_dropout = 0,
// module_dropout = 0, init_weights = true:
//   ΔW = scaling · kron(w1, w2),   scaling = alpha / r,   y = base(x) + x·ΔWᵀ
// with (out_l, out_k) = factorization(out), (in_m, in_n) = factorization(in) (lokr_factorization),
//   w1 = lokr_w1 [out_l, in_m]                                   (always full: decompose_both off)
//   w2 = lokr_w2 [out_k, in_n]            when r >= max(out_k, in_n) / 2,
//      = lokr_w2_a [out_k, r] · lokr_w2_b [r, in_n]   otherwise (low-rank).
// Init: w1 = 0 (the update starts at 0), w2 / w2_a / w2_b Kaiming-uniform(a = sqrt(5)).
// Dtypes as PEFT: x is cast to ΔW's dtype, x·ΔWᵀ follows the linear autocast rule, and the sum is
// cast back to x's dtype (LoKr's forward returns result.to(previous_dtype)). PEFT's rank/module
// dropout are not implemented: apply_adapters rejects dropout > 0 for LoKr.
#pragma once
#include "keel/nn/adapters/adapter.h"

namespace keel::nn {

class LokrAdapter : public LinearAdapter {
 public:
  LokrAdapter(Linear& base, int64_t r, double alpha, uint64_t seed);
  const char* kind() const override { return "lokr"; }
  Tensor forward(Linear& base, const Tensor& x) override;
  Tensor merged_weight(const Linear& base) const override;
  std::vector<std::pair<std::string, Tensor>> peft_tensors() const override;

  // scaling · kron(w1, w2) [out, in], differentiable (w2 = w2_a·w2_b under the matmul autocast
  // rule when low-rank; kron in the wider of the two dtypes, as torch promotes).
  Tensor delta_weight() const;

  Tensor w1;          // [out_l, in_m] f32, "lokr_w1"
  Tensor w2;          // [out_k, in_n] f32, "lokr_w2" (undefined when low-rank)
  Tensor w2_a, w2_b;  // [out_k, r], [r, in_n] f32, "lokr_w2_a", "lokr_w2_b" (when low-rank)
};

// kron(a, b) for 2-D a [A, B], b [P, Q] -> [A·P, B·Q], differentiable in both (built from
// matmul, reshape and transpose, so it has their gradients).
Tensor kron(const Tensor& a, const Tensor& b);

}  // namespace keel::nn
