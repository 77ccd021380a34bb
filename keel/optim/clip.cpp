#include "keel/optim/clip.h"

#include <cmath>
#include <string>

#include "keel/amp/grad_pass.h"
#include "keel/backend/elementwise.h"

namespace keel::optim {

double global_grad_norm(const std::vector<Tensor>& grads) { return amp::grad_pass(grads).norm(); }

float clip_coefficient(double max_norm, double total_norm) {
  if (!(max_norm > 0.0))
    throw Error(
        "clip_grads: max_norm must be > 0 (train.max_grad_norm = 0 turns clipping off), got " +
            std::to_string(max_norm),
        Error::kUsage);
  if (!std::isfinite(total_norm))
    throw Error("clip_grads: total_norm is " + std::to_string(total_norm) +
                "; a non-finite norm means found_inf: skip the step instead of clipping");
  const double coef = max_norm / (total_norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.f;
}

void scale_grads(std::vector<Tensor>& grads, float coef) {
  for (Tensor& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    elementwise_kernels(g.device())
        .axpby(g.data(), coef, g.data(), 0.f, nullptr, g.dtype(), g.numel());
    // Gradients are not versioned (only parameters are); nothing else to invalidate.
  }
}

bool clip_grads(std::vector<Tensor>& grads, double max_norm, double total_norm) {
  const float coef = clip_coefficient(max_norm, total_norm);
  if (coef == 1.f) return false;
  scale_grads(grads, coef);
  return true;
}

}  // namespace keel::optim
