#include "keel/optim/clip.h"

#include <cmath>
#include <string>

#include "keel/backend/elementwise.h"
#include "keel/backend/monitor.h"

namespace keel::optim {

double global_grad_norm(const std::vector<Tensor>& grads) {
  double total = 0.0;
  std::vector<void*> bufs;  // gradients on a GPU: one pass over all of them, one readback
  std::vector<DType> dts;
  std::vector<int64_t> ns;
  Device dev;
  for (const Tensor& g : grads) {
    if (!g.defined() || g.numel() == 0) continue;
    KEEL_CHECK(dtype_is_floating(g.dtype()), "global_grad_norm: floating gradient required");
    if (g.device().is_cuda() && (bufs.empty() || g.device() == dev)) {
      dev = g.device();
      bufs.push_back(g.data()), dts.push_back(g.dtype()), ns.push_back(g.numel());
      continue;
    }
    total += elementwise_kernels(g.device()).sum_squares(g.data(), g.dtype(), g.numel());
  }
  if (!bufs.empty())
    total +=
        monitor_kernels(dev)
            .unscale_norm(bufs.data(), dts.data(), ns.data(), static_cast<int>(bufs.size()), 1.f)
            .sum_squares;
  return std::sqrt(total);
}

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
