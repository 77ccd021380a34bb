// Trend advisor (DESIGN §4): classifies the grad-norm, loss and loss-scale trends over a sliding
// window of steps and, when the class changes, puts one line with the class and the next action in
// StepResult::advice (the console logger prints it, metrics.jsonl records it).
//
// Classes and thresholds (AdvisorOptions defaults), checked in this order each step:
//   loss-scale collapsing  a scaler is on and either its scale fell below 1 (PyTorch warns there),
//                          or >= collapse_skips (4) steps of the window were skipped by it AND the
//                          scale fell >= collapse_ratio (256x, eight back-offs) across the window.
//                          A normal 16-mixed start backs off a few times (65536 -> 8192): not this.
//   exploding              a step with a non-finite loss, or non-finite gradients no scaler
//                          handled (nan_steps grew); or, once min_steps (8) finite grad norms are
//                          in the window, the median of the newer half is >= explode_ratio (10x)
//                          the median of the older half while the mean loss did not improve (or
//                          the growth is >= 10 * explode_ratio whatever the loss does).
//   vanishing              the grad norm was exactly 0 (or below vanish_abs = 1e-8) on the last
//                          zero_steps (3) applied steps: f16/bf16 gradients underflowed to zero;
//                          or, after min_steps, the newer-half median is <= vanish_ratio (1e-3) of
//                          the older half. Exact zeros after a decay already classed vanishing
//                          give a second line: their cause and fix (an underflow) differ.
//   spiking                a step's grad norm >= spike_factor (10x) the median of the window
//                          before it, or its loss >= loss_spike_factor (2x) the median loss
//                          (after min_steps), while the step before it was still below half that
//                          jump (5.5x, 1.5x): a jump, not a steady growth; the class holds for
//                          spike_hold (5) steps.
//   stable                 none of the above.
// Grad norms of steps the scaler skipped (inf by design) are left out of the medians.
//
// The window holds the last `window` (20) steps. No advice is given while the class stays the
// same; the first step is "stable" without a line, so a healthy run prints nothing.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "keel/train/step_result.h"

namespace keel::monitor {

enum class Trend { kStable, kExploding, kVanishing, kSpiking, kScaleCollapsing };
const char* trend_name(Trend t);  // "stable", "exploding", "vanishing", "spiking",
                                  // "loss-scale collapsing"

struct AdvisorOptions {
  int64_t window = 20;
  int64_t min_steps = 8;
  double explode_ratio = 10;
  double vanish_ratio = 1e-3;
  double vanish_abs = 1e-8;
  int64_t zero_steps = 3;
  double spike_factor = 10;
  double loss_spike_factor = 2;
  int64_t spike_hold = 5;
  int64_t collapse_skips = 4;
  double collapse_ratio = 256;
  // Trainable parameters of the model (0 = unknown): below 10M, vanishing advice suggests a
  // higher learning rate, which tiny models tolerate.
  int64_t num_params = 0;
  // The run's precision policy ("32-true", "bf16-mixed", "16-mixed", ...; "" = unknown): the
  // advice names the policy to switch to only where lower precision is a suspect.
  std::string precision;
  // debug.underflow_overflow.enabled: the tracer is already on, so the advice points at its log
  // (`tracer_log`) instead of asking to enable it.
  bool tracer_on = false;
  std::string tracer_log;
  // ln V, the loss of a uniform guess over the vocabulary (0 = unknown): an absolute reference a
  // divergence cannot move. A loss above it is worse than knowing nothing.
  double uniform_loss = 0;
  // Where a dataset example comes from ("corpus.txt:17"); null = "example 17".
  std::function<std::string(int64_t)> describe_example;
};

// One finding, as metrics.jsonl records it: {"kind": "advisor", step, trend, cause, action,
// examples (the batch of a spike)}.
struct Finding {
  int64_t step = 0;
  std::string trend, cause, action;
  std::vector<std::string> examples;
};

class TrendAdvisor {
 public:
  explicit TrendAdvisor(AdvisorOptions opt = {});
  // Adds one step to the window and classifies. Returns the advice line when the class changed
  // (also stored in r.advice), "" otherwise.
  std::string observe(StepResult& r);
  Trend trend() const { return trend_; }
  // The finding of the last observe() that returned a line.
  const Finding& last_finding() const { return finding_; }
  // The lowest loss of the best window so far (median of `best_steps` applied steps; 0 = none).
  double best_loss() const { return best_loss_; }

 private:
  Trend classify(const StepResult& r, std::string& why) const;
  std::string action(Trend t, const StepResult& r) const;

  AdvisorOptions opt_;
  std::deque<StepResult> window_;
  Trend trend_ = Trend::kStable;
  int64_t last_spike_ = -1;  // step of the last spike
  int64_t nan_steps_ = 0;    // cumulative count seen on the previous step
  bool zeros_ = false;       // the current vanishing class is exact zeros (already advised)
  bool updated_ = false;     // some step applied an update (before that lr cannot be the cause)
  // The best window so far: the lowest median loss of the last 3 applied steps, and the median
  // grad norm of those steps. A divergence cannot contaminate it (it only ever goes down).
  double best_loss_ = 0, best_norm_ = 0;
  std::deque<int64_t> spikes_;  // steps of the spikes in the window
  Finding finding_;
  // Whether an exploding verdict's condition has cleared at `r` (back near the best window).
  bool recovered(const StepResult& r) const;
  std::string examples_of(const StepResult& s, std::vector<std::string>* list) const;
};

}  // namespace keel::monitor
