#include "keel/amp/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "keel/backend/elementwise.h"
#include "keel/backend/monitor.h"
#include "keel/backend/optim.h"
#include "keel/ops/elementwise.h"

namespace keel {

namespace {
std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
}  // namespace

bool is_f32_scale(double v) {
  const float f = static_cast<float>(v);
  return std::isfinite(f) && f >= std::numeric_limits<float>::min();
}

GradScaler::GradScaler(const GradScalerOptions& o)
    : opt_(o), scale_(static_cast<float>(o.init_scale)) {
  if (!opt_.enabled) return;  // PyTorch validates only an enabled scaler
  // PyTorch's assertion texts, then where to change the value.
  if (!(opt_.growth_factor > 1.0))
    throw Error("GradScaler: The growth factor must be > 1.0. (scaler.growth_factor = " +
                    num(opt_.growth_factor) + ")",
                Error::kUsage);
  if (!(opt_.backoff_factor < 1.0) || !(opt_.backoff_factor > 0.0))
    throw Error("GradScaler: The backoff factor must be < 1.0. (scaler.backoff_factor = " +
                    num(opt_.backoff_factor) + "; it must also be > 0)",
                Error::kUsage);
  if (!is_f32_scale(opt_.init_scale))
    throw Error(
        "GradScaler: scaler.init_scale must be a positive finite f32 value (from 1.2e-38 "
        "to 3.4e38), got " +
            num(opt_.init_scale),
        Error::kUsage);
  if (opt_.growth_interval < 1)
    throw Error("GradScaler: scaler.growth_interval must be >= 1, got " +
                    std::to_string(opt_.growth_interval),
                Error::kUsage);
  if (opt_.hysteresis < 1)
    throw Error("GradScaler: scaler.hysteresis must be >= 1 (1 = PyTorch behaviour), got " +
                    std::to_string(opt_.hysteresis),
                Error::kUsage);
  if (opt_.min_scale < 0.0 || opt_.max_scale < 0.0 ||
      (opt_.min_scale > 0.0 && !is_f32_scale(opt_.min_scale)) ||
      (opt_.max_scale > 0.0 && !is_f32_scale(opt_.max_scale)) ||
      (opt_.min_scale > 0.0 && opt_.max_scale > 0.0 && opt_.min_scale > opt_.max_scale))
    throw Error(
        "GradScaler: scaler.min_scale (" + num(opt_.min_scale) + ") and max_scale (" +
            num(opt_.max_scale) +
            ") must be 0 (none) or f32 values from 1.2e-38 to 3.4e38, with min_scale <= max_scale",
        Error::kUsage);
  hysteresis_tracker_ = opt_.hysteresis;
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!opt_.enabled) return loss;
  return ops::scale(loss, scale_);
}

amp::GradPass GradScaler::unscale_pass(std::vector<Tensor>& grads, DType format) {
  if (!opt_.enabled) return amp::grad_pass(grads, 1.f, format);
  if (unscaled_)
    throw Error(
        "unscale_() has already been called on this optimizer since the last update(). "
        "(GradScaler: call update() once per step before unscaling the next step's gradients)");
  for (const Tensor& g : grads)
    if (g.defined() && g.dtype() == DType::F16)
      throw Error(
          "Attempting to unscale FP16 gradients. (GradScaler: gradient '" + g.name() +
          "' is f16; keep f32 master parameters under 16-mixed, or use bf16 without a scaler)");
  // "FP32 division can be imprecise for certain compile options, so we carry out the reciprocal
  // in FP64" (torch/amp/grad_scaler.py).
  const float inv = static_cast<float>(1.0 / static_cast<double>(scale_));
  amp::GradPass pass = amp::grad_pass(grads, inv, format);
  unscaled_ = true;
  return pass;
}

void GradScaler::discard_step() {
  unscaled_ = false;
  growth_tracker_ = 0;
}

ScalerUpdate GradScaler::update(bool found_inf) {
  ScalerUpdate r;
  r.found_inf = found_inf;
  r.applied = !found_inf;
  unscaled_ = false;
  if (!opt_.enabled) return r;
  r.scale_before = scale_;
  if (found_inf) {
    growth_tracker_ = 0;
    // With hysteresis 1 (PyTorch) the tracker reaches 0 at once and every overflow backs off.
    hysteresis_tracker_ -= 1;
    if (hysteresis_tracker_ <= 0) {
      double next = static_cast<double>(scale_) * opt_.backoff_factor;
      if (opt_.min_scale > 0.0) {
        r.at_min_scale = static_cast<double>(scale_) <= opt_.min_scale;
        next = std::max(next, opt_.min_scale);
      }
      scale_ = static_cast<float>(next);
    }
  } else {
    if (opt_.consecutive_hysteresis) hysteresis_tracker_ = opt_.hysteresis;
    const int64_t successful = growth_tracker_ + 1;
    if (successful == opt_.growth_interval) {
      double grown = static_cast<double>(scale_) * opt_.growth_factor;
      if (opt_.max_scale > 0.0) grown = std::min(grown, opt_.max_scale);
      const float next = static_cast<float>(grown);
      if (std::isfinite(next)) scale_ = next;  // never grow to inf
      growth_tracker_ = 0;
      hysteresis_tracker_ = opt_.hysteresis;
    } else {
      growth_tracker_ = successful;
    }
  }
  r.scale_after = scale_;
  return r;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!opt_.enabled) return {};
  std::map<std::string, double> s{{"scale", static_cast<double>(scale_)},
                                  {"growth_factor", opt_.growth_factor},
                                  {"backoff_factor", opt_.backoff_factor},
                                  {"growth_interval", static_cast<double>(opt_.growth_interval)},
                                  {"_growth_tracker", static_cast<double>(growth_tracker_)}};
  if (opt_.hysteresis > 1) s["_hysteresis_tracker"] = static_cast<double>(hysteresis_tracker_);
  return s;
}

void GradScaler::load_state_dict(const std::map<std::string, double>& s) {
  if (!opt_.enabled) return;
  if (s.empty())
    throw Error(
        "The source state dict is empty, possibly because it was saved from a disabled instance "
        "of GradScaler.");
  auto get = [&](const char* key) {
    auto it = s.find(key);
    if (it == s.end())
      throw Error(std::string("the loss scaler's state: missing key '") + key +
                  "' (expected scale, growth_factor, backoff_factor, growth_interval, "
                  "_growth_tracker)");
    return it->second;
  };
  const float scale = static_cast<float>(get("scale"));
  const double interval = get("growth_interval"), tracker = get("_growth_tracker");
  if (!(scale > 0.f) || !std::isfinite(scale) || interval < 1 || tracker < 0)
    throw Error("the loss scaler's state is invalid (scale " + num(scale) + ", growth_interval " +
                num(interval) + ", _growth_tracker " + num(tracker) + ")");
  scale_ = scale;
  opt_.growth_factor = get("growth_factor");
  opt_.backoff_factor = get("backoff_factor");
  opt_.growth_interval = static_cast<int64_t>(interval);
  growth_tracker_ = static_cast<int64_t>(tracker);
  auto h = s.find("_hysteresis_tracker");
  hysteresis_tracker_ = h != s.end() ? static_cast<int64_t>(h->second) : opt_.hysteresis;
  unscaled_ = false;
}

}  // namespace keel
