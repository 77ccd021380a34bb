// AdamW with torch.optim.AdamW's exact semantics (amsgrad = false): decoupled weight decay applied
// first (p *= 1 - lr*wd), bias corrections from each parameter's own step count, and
// denom = sqrt(v) / sqrt(1 - beta2^t) + eps. Math in f32 (one fused pass per tensor); bf16 or f16
// parameters (the -true policies) keep their state in their own dtype, as PyTorch does, and are
// rounded once per update (optionally stochastically for bf16).
#pragma once
#include "keel/optim/optimizer.h"

namespace keel::optim {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool stochastic_rounding = false;  // bf16 parameters: unbiased rounding of the new values
  uint64_t seed = 0;                 // of the stochastic rounding (with step and parameter index)
};

class AdamW final : public Optimizer {
 public:
  explicit AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options = {});
  const AdamWOptions& options() const { return opt_; }

 private:
  void update(Slot& slot, const Tensor& g, const Update& u) override;
  bool fuses_grad_scale() const override { return true; }   // one pass: clip + update
  bool writes_weight_copy(const Tensor& p) const override;  // f32 weights on the CPU
  AdamWOptions opt_;
};

// The per-(parameter, step) seed of stochastic rounding (shared by AdamW and SGD).
uint64_t rounding_seed(uint64_t seed, size_t slot_index, int64_t step);
// Rejects options no kernel implements (stochastic rounding of f16), naming the parameter.
void check_stochastic_rounding(const char* what, bool enabled, const std::vector<ParamGroup>& g);

}  // namespace keel::optim
