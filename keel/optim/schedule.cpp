#include "keel/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "keel/numerics/error.h"

namespace keel::optim {

double LrSchedule::factor(int64_t step) const {
  const int64_t w = warmup_steps, t = total_steps;
  if (step < w) return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, w));
  double f = 1.0;
  if (kind == ScheduleKind::kLinear) {
    f = std::max(0.0,
                 static_cast<double>(t - step) / static_cast<double>(std::max<int64_t>(1, t - w)));
  } else if (kind == ScheduleKind::kCosine) {
    const double num_cycles = 0.5;
    const double progress =
        static_cast<double>(step - w) / static_cast<double>(std::max<int64_t>(1, t - w));
    f = 0.5 * (1.0 + std::cos(std::numbers::pi * num_cycles * 2.0 * progress));
  } else {
    return 1.0;
  }
  if (min_lr_ratio > 0.0) f = f * (1.0 - min_lr_ratio) + min_lr_ratio;
  return std::max(0.0, f);
}

LrSchedule make_lr_schedule(const std::string& name, double lr, int64_t total_steps,
                            int64_t warmup_steps, double warmup_ratio, double min_lr_ratio) {
  auto bad = [](const std::string& m) { throw Error("lr schedule: " + m, Error::kUsage); };
  LrSchedule s;
  if (name == "constant")
    s.kind = ScheduleKind::kConstant;
  else if (name == "linear")
    s.kind = ScheduleKind::kLinear;
  else if (name == "cosine")
    s.kind = ScheduleKind::kCosine;
  else
    bad("unknown sched.name '" + name + "'; valid: constant, linear, cosine");
  if (!(lr > 0.0) || !std::isfinite(lr)) bad("optim.lr must be > 0, got " + std::to_string(lr));
  if (warmup_steps < 0) bad("sched.warmup_steps must be >= 0, got " + std::to_string(warmup_steps));
  if (!(warmup_ratio >= 0.0 && warmup_ratio <= 1.0))
    bad("sched.warmup_ratio must be in [0, 1], got " + std::to_string(warmup_ratio));
  if (!(min_lr_ratio >= 0.0 && min_lr_ratio <= 1.0))
    bad("sched.min_lr_ratio must be in [0, 1], got " + std::to_string(min_lr_ratio));
  if (s.kind != ScheduleKind::kConstant && total_steps < 1)
    bad("a " + name + " schedule needs the total number of steps (>= 1), got " +
        std::to_string(total_steps) + "; set train.max_steps or train.epochs");
  s.base_lr = lr;
  s.total_steps = total_steps;
  s.warmup_steps =
      warmup_steps > 0
          ? warmup_steps
          : static_cast<int64_t>(std::ceil(static_cast<double>(total_steps) * warmup_ratio));
  s.min_lr_ratio = min_lr_ratio;
  return s;
}

}  // namespace keel::optim
