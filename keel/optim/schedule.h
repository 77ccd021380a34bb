// Learning-rate schedules: HF transformers' lr_lambda formulas, evaluated at `step` = the number of
// optimizer updates applied so far (LambdaLR sets lr = base * lambda(0) at construction and
// advances once per applied update; a step skipped by the scaler does not advance it).
//
//   warmup (all kinds):  step < W:  step / max(1, W)
//   constant:            1                                   (get_constant_schedule_with_warmup)
//   linear:              max(0, (T - step) / max(1, T - W))  (get_linear_schedule_with_warmup)
//   cosine:              max(0, 0.5 * (1 + cos(pi * 2 * 0.5 * (step - W) / max(1, T - W))))
//                                                            (get_cosine_schedule_with_warmup)
// min_lr_ratio m > 0 maps the decay factor f to f * (1 - m) + m, as HF's
// get_cosine_with_min_lr_schedule_with_warmup (min_lr_rate); keel applies the same map to linear.
#pragma once
#include <cstdint>
#include <string>

namespace keel::optim {

enum class ScheduleKind { kConstant, kLinear, kCosine };

struct LrSchedule {
  ScheduleKind kind = ScheduleKind::kConstant;
  double base_lr = 1e-3;
  int64_t warmup_steps = 0;  // W
  int64_t total_steps = 0;   // T (linear, cosine)
  double min_lr_ratio = 0.0;

  double factor(int64_t step) const;  // HF's lr_lambda(step)
  double lr(int64_t step) const { return base_lr * factor(step); }
};

// name: constant | linear | cosine. Warmup steps are warmup_steps when > 0, else
// ceil(total_steps * warmup_ratio) (HF TrainingArguments.get_warmup_steps). Bad values are usage
// Errors naming the [sched] key.
LrSchedule make_lr_schedule(const std::string& name, double lr, int64_t total_steps,
                            int64_t warmup_steps = 0, double warmup_ratio = 0.0,
                            double min_lr_ratio = 0.0);

}  // namespace keel::optim
