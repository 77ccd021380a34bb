// GradScaler: dynamic loss scaling for 16-mixed, reproducing torch.amp.GradScaler exactly by
// default (reference/amp-anchors.md §1.2-§1.4), with DeepSpeed/Megatron's optional min_scale,
// max_scale and hysteresis (§2.1, §2.3), all off by default.
//
// One step:  backward(scaler.scale(loss));  found_inf = scaler.unscale(grads);
//            [clip, optimizer step unless found_inf];  r = scaler.update(found_inf);
//
// The scale is an f32 value and the growth tracker an int, as PyTorch's device tensors; factors
// are doubles and every new scale is computed in double and rounded to f32 (AmpKernels.cu).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "keel/amp/grad_pass.h"
#include "keel/tensor/tensor.h"

namespace keel {

struct GradScalerOptions {
  double init_scale = 65536.0;     // 2^16
  double growth_factor = 2.0;      // must be > 1
  double backoff_factor = 0.5;     // must be in (0, 1)
  int64_t growth_interval = 2000;  // consecutive clean updates before growing (>= 1)
  bool enabled = true;             // false: scale 1, every call a no-op
  // DeepSpeed/Megatron extensions (0 / 1 = off = PyTorch behaviour):
  double min_scale = 0.0;  // back-off never goes below it (clamped, as Megatron does)
  double max_scale = 0.0;  // growth never goes above it (clamped, as Apex does)
  // Overflows tolerated before backing off: each overflow spends one, and the scale backs off
  // once they are spent (then on every further overflow) until they are refilled. Refill at each
  // growth (Megatron, DeepSpeed's default) or, with consecutive_hysteresis, on any clean update
  // (DeepSpeed's consecutive_hysteresis=True).
  int64_t hysteresis = 1;
  bool consecutive_hysteresis = false;
  // Read by the trainer, not by the scaler (PyTorch backs off forever): this many overflows in a
  // row without one applied update mean the scaler cannot settle, and the step that reaches it is
  // a non-finite step the scaler did not handle (train.on_nonfinite acts). 0 = never.
  int64_t max_consecutive_skips = 32;
};

// What update() decided, for StepResult and the logs.
struct ScalerUpdate {
  double scale_before = 1;  // the scale this step's loss was multiplied by
  double scale_after = 1;   // the scale for the next step
  bool found_inf = false;   // a non-finite gradient was found (the step is skipped)
  bool applied = true;      // the optimizer step is applied (== !found_inf)
  // found_inf while the scale was already at min_scale: backing off is no longer possible, so the
  // trainer acts on on_nonfinite (DESIGN §3 step 6; DeepSpeed raises here).
  bool at_min_scale = false;
};

// Whether `v` can be a loss scale: held in f32, it must be finite and at least f32's smallest
// normal (1e-300 rounded to 0 and made every step a skip, the run ending with exit 0).
bool is_f32_scale(double v);

class GradScaler {
 public:
  explicit GradScaler(const GradScalerOptions& options = {});

  bool enabled() const { return opt_.enabled; }
  // The current scale (1 when disabled).
  double get_scale() const { return opt_.enabled ? static_cast<double>(scale_) : 1.0; }
  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t hysteresis_tracker() const { return hysteresis_tracker_; }
  const GradScalerOptions& options() const { return opt_; }

  // loss * scale (differentiable; the loss itself when disabled).
  Tensor scale(const Tensor& loss) const;

  // Multiplies every defined gradient in place by inv_scale = (float)(1.0 / (double)scale) and
  // returns whether any value was non-finite (checked in the same pass). Gradients are unscaled
  // even when found_inf, as PyTorch does. f16 gradients are rejected (masters must be f32), and so
  // is a second call before update(), with PyTorch's messages. Disabled: returns false, no-op.
  // (The pass's finite(), not its count: at a scale of exactly 1 nothing is written and the CPU
  // reads each value once, for the sum, which then carries a non-finite value.)
  bool unscale(std::vector<Tensor>& grads) {
    const amp::GradPass p = unscale_pass(grads);
    return opt_.enabled && !p.finite();
  }
  // The same, returning the whole pass (amp/grad_pass.h): the non-finite count and the sums of
  // squares of the unscaled gradients, from the one pass. Disabled: the pass without unscaling.
  // Its zero/subnormal counts judge each value as f16 carried it (before unscaling).
  amp::GradPass unscale_pass(std::vector<Tensor>& grads, DType format = DType::F16);
  // True between unscale() and update().
  bool unscaled() const { return unscaled_; }

  // Backs off on found_inf, grows after growth_interval consecutive clean updates (never to inf),
  // and resets the unscale state. Disabled: {1, 1, found_inf, !found_inf}.
  ScalerUpdate update(bool found_inf);
  // Ends a step the trainer did not apply for a cause of its own, not an overflow of the scale (a
  // non-finite loss, which train.on_nonfinite handles): no back-off, the scale stays; the clean
  // updates in a row start over, and the next step may unscale. Without it a 16-mixed run with
  // on_nonfinite = skip failed at the step after a NaN loss: "unscale_() has already been called".
  void discard_step();

  // PyTorch's state_dict keys: scale, growth_factor, backoff_factor, growth_interval,
  // _growth_tracker (plus _hysteresis_tracker when hysteresis > 1). Empty when disabled; loading
  // an empty state into an enabled scaler is an error (as PyTorch).
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  GradScalerOptions opt_;
  float scale_;  // PyTorch's _scale: a float32 tensor
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_ = 1;
  bool unscaled_ = false;
};

}  // namespace keel
