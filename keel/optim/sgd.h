// SGD with torch.optim.SGD's semantics: weight decay added to the gradient (d = g + wd*p), momentum
// buffer buf = momentum*buf + (1 - dampening)*d with buf = d on a parameter's first step, optional
// Nesterov, p -= lr*d. One fused pass per tensor, f32 math, state in the parameter's dtype.
#pragma once
#include "keel/optim/optimizer.h"

namespace keel::optim {

struct SGDOptions {
  double momentum = 0.0;  // 0: no momentum buffer (and no momentum_buffer state entries)
  double dampening = 0.0;
  bool nesterov = false;             // requires momentum > 0 and dampening == 0 (as PyTorch)
  bool stochastic_rounding = false;  // bf16 parameters: unbiased rounding of the new values
  uint64_t seed = 0;
};

class SGD final : public Optimizer {
 public:
  explicit SGD(std::vector<ParamGroup> groups, const SGDOptions& options = {});
  const SGDOptions& options() const { return opt_; }

 private:
  void update(Slot& slot, const Tensor& g, const Update& u) override;
  SGDOptions opt_;
};

}  // namespace keel::optim
