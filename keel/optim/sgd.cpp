#include "keel/optim/sgd.h"

#include <string>

#include "keel/backend/optim.h"
#include "keel/optim/adamw.h"

namespace keel::optim {

namespace {
std::vector<std::string> sgd_kinds(const SGDOptions& o) {
  if (o.momentum != 0.0) return {"momentum_buffer"};
  return {};
}
}  // namespace

SGD::SGD(std::vector<ParamGroup> groups, const SGDOptions& o)
    : Optimizer(std::move(groups), sgd_kinds(o), "SGD"), opt_(o) {
  auto bad = [](const std::string& m) { throw Error("SGD: " + m, Error::kUsage); };
  if (!(opt_.momentum >= 0.0)) bad("Invalid momentum value: " + std::to_string(opt_.momentum));
  if (opt_.nesterov && (opt_.momentum <= 0.0 || opt_.dampening != 0.0))
    bad("Nesterov momentum requires a momentum and zero dampening");
  for (const ParamGroup& g : groups_)
    if (!(g.weight_decay >= 0.0))
      bad("Invalid weight_decay value: " + std::to_string(g.weight_decay));
  check_stochastic_rounding("SGD", opt_.stochastic_rounding, groups_);
}

void SGD::update(Slot& s, const Tensor& g, const Update& u) {
  SgdStep k;
  k.lr = u.lr;
  k.momentum = opt_.momentum;
  k.dampening = opt_.dampening;
  k.weight_decay = u.weight_decay;
  k.nesterov = opt_.nesterov;
  k.first = s.step == 1;  // PyTorch: buf = clone(d_p) when the buffer does not exist yet
  k.stochastic_rounding = opt_.stochastic_rounding && s.param.dtype() == DType::BF16;
  k.seed = rounding_seed(opt_.seed, u.slot_index, s.step);
  k.rounded_away = u.rounded_away;
  optim_kernels(s.param.device())
      .sgd(s.param.data(), g.data(), s.state.empty() ? nullptr : s.state[0].data(), s.param.dtype(),
           s.param.numel(), k);
}

}  // namespace keel::optim
