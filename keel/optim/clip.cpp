#include "keel/optim/clip.h"

#include <cmath>
#include <string>

#include "keel/backend/elementwise.h"

namespace keel::optim {

double global_grad_norm(const std::vector<Tensor>& grads) {
  double total = 0.0;
  for (const Tensor& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    KEEL_CHECK(dtype_is_floating(g.dtype()), "global_grad_norm: floating gradient required");
    total += elementwise_kernels(g.device()).sum_squares(g.data(), g.dtype(), g.numel());
  }
  return std::sqrt(total);
}

bool clip_grads(std::vector<Tensor>& grads, double max_norm, double total_norm) {
  if (!(max_norm > 0.0))
    throw Error(
        "clip_grads: max_norm must be > 0 (train.max_grad_norm = 0 turns clipping off), got " +
            std::to_string(max_norm),
        Error::kUsage);
  if (!std::isfinite(total_norm))
    throw Error("clip_grads: total_norm is " + std::to_string(total_norm) +
                "; a non-finite norm means found_inf: skip the step instead of clipping");
  const double coef = max_norm / (total_norm + 1e-6);
  if (!(coef < 1.0)) return false;
  const float c = static_cast<float>(coef);
  for (Tensor& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    elementwise_kernels(g.device())
        .axpby(g.data(), c, g.data(), 0.f, nullptr, g.dtype(), g.numel());
    // Gradients are not versioned (only parameters are); nothing else to invalidate.
  }
  return true;
}

}  // namespace keel::optim
