#include "keel/optim/adamw.h"

#include <cmath>
#include <string>

#include "keel/backend/optim.h"

namespace keel::optim {

uint64_t rounding_seed(uint64_t seed, size_t slot_index, int64_t step) {
  // Distinct streams per parameter and per step; the kernel mixes in the element index.
  return seed ^ (0xD1B54A32D192ED03ull * (slot_index + 1)) ^
         (0x8CB92BA72F3D8DD7ull * static_cast<uint64_t>(step));
}

void check_stochastic_rounding(const char* what, bool enabled, const std::vector<ParamGroup>& gs) {
  if (!enabled) return;
  for (const ParamGroup& g : gs)
    for (size_t i = 0; i < g.params.size(); ++i)
      if (g.params[i].defined() && g.params[i].dtype() == DType::F16)
        throw Error(std::string(what) +
                        ": stochastic rounding is implemented for bf16 parameters " +
                        "only, but '" + (g.names.empty() ? g.params[i].name() : g.names[i]) +
                        "' is f16; turn stochastic rounding off or train in bf16",
                    Error::kUsage);
}

AdamW::AdamW(std::vector<ParamGroup> groups, const AdamWOptions& o)
    : Optimizer(std::move(groups), {"exp_avg", "exp_avg_sq"}, "AdamW"), opt_(o) {
  // torch.optim.AdamW's argument checks.
  auto bad = [](const std::string& m) { throw Error("AdamW: " + m, Error::kUsage); };
  if (!(opt_.eps >= 0.0)) bad("Invalid epsilon value: " + std::to_string(opt_.eps));
  if (!(opt_.beta1 >= 0.0 && opt_.beta1 < 1.0))
    bad("Invalid beta parameter at index 0: " + std::to_string(opt_.beta1));
  if (!(opt_.beta2 >= 0.0 && opt_.beta2 < 1.0))
    bad("Invalid beta parameter at index 1: " + std::to_string(opt_.beta2));
  for (const ParamGroup& g : groups_)
    if (!(g.weight_decay >= 0.0))
      bad("Invalid weight_decay value: " + std::to_string(g.weight_decay));
  check_stochastic_rounding("AdamW", opt_.stochastic_rounding, groups_);
}

bool AdamW::writes_weight_copy(const Tensor& p) const {
  return p.device().is_cpu() && p.dtype() == DType::F32;
}

void AdamW::update(Slot& s, const Tensor& g, const Update& u) {
  AdamWStep k;
  k.lr = u.lr;
  k.beta1 = opt_.beta1;
  k.beta2 = opt_.beta2;
  k.eps = opt_.eps;
  k.weight_decay = u.weight_decay;
  k.step = s.step;
  k.stochastic_rounding = opt_.stochastic_rounding && s.param.dtype() == DType::BF16;
  k.seed = rounding_seed(opt_.seed, u.slot_index, s.step);
  k.grad_scale = u.grad_scale;
  k.rounded_away = u.rounded_away;
  if (u.weight_copy.defined()) {
    k.p_copy = u.weight_copy.data();
    k.copy_dt = u.weight_copy.dtype();
  }
  optim_kernels(s.param.device())
      .adamw(s.param.data(), g.data(), s.state[0].data(), s.state[1].data(), s.param.dtype(),
             s.param.numel(), k);
}

}  // namespace keel::optim
