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
//                          handled (nan_steps grew); or "diverged", from the first update on: the
//                          last 2 losses above 1.5 ln V, or above 3x + 1 the best window or the
//                          loss before any update (a pretrained start; step 1's batch is measured
//                          again under the weights, so a first batch easier than the rest is
//                          not the baseline's fault); or, once min_steps (8) finite grad norms are
//                          in the window, the median of the newer half is >= explode_ratio (10x)
//                          the median of the older half while the mean loss did not improve (or
//                          the growth is >= 10 * explode_ratio whatever the loss does).
//   vanishing              the grad norm was exactly 0 (or below vanish_abs = 1e-8) on the last
//                          zero_steps (3) applied steps: f16/bf16 gradients underflowed to zero;
//                          or, after min_steps, the newer-half median is <= vanish_ratio (1e-3) of
//                          the older half. Exact zeros after a decay already classed vanishing
//                          give a second line: their cause and fix (an underflow) differ.
//                          Not while a trainable weight is above kDivergedWeight after updates:
//                          the blown-up weights saturate the activations, and that run is
//                          exploding ("diverged"), told to lower optim.lr, never to raise it.
//   spiking                a step's grad norm >= spike_factor (10x) the median of the window
//                          before it, or its loss >= loss_spike_factor (2x) the median loss
//                          (after min_steps), while the step before it was still below half that
//                          jump (5.5x, 1.5x): a jump, not a steady growth; the class holds for
//                          spike_hold (5) steps. A first loss spike's batch is compared with the
//                          batch before it under the same weights (batch_loss): the harder batch
//                          is the data, one no harder the optimizer.
//   stable                 none of the above.
// A model whose loss before any update is already above 1.5 ln V (a wide init, a bad checkpoint)
// gets one "initialization" finding at that step (the weights, not the learning rate), and the
// diverged rule then measures against that start instead of ln V: a loss that falls from 12.9
// (model.init_std 0.5) was told "diverged ... lower optim.lr".
// A run whose loss barely moves while its updates are tiny against its weights gets one "stalled"
// finding: 50 updates at full learning rate, the median of the last 10 losses less than 2% below
// that of the first 10 (one batch's noise, ~5%, is more than 2%), and an update at most 1e-4 of the
// weights' RMS (AdamW: lr / RMS; 1e-5 for a model that starts well below ln V, a pretrained one):
// optim.lr is far too low. Both are needed: a flat loss alone may be data with little left to
// learn, and small updates alone a model that learns anyway. SGD's update is measured with the
// clipped gradient: a tiny train.max_grad_norm is then the cause named, not optim.lr. A
// scaler.init_scale below 1 (step 1), or far above 65536 and still backing off after collapse_skips
// overflows, gets one "loss scale" finding naming the key: the scale is where the setting put it,
// and neither is loss-scale collapsing. So does a scale the scaler keeps growing back into
// overflow: a quarter of a full window's steps skipped, at least one growth for every two skips,
// and no collapse_ratio fall (scaler.growth_interval too small). Grad norms of steps the scaler
// skipped (inf by design) are left out of the medians.
//
// The window holds the last `window` (20) steps. No advice is given while the class stays the
// same; the first step is "stable" without a line, so a healthy run prints nothing.
//
// Two findings beside the trend, from what the step's own passes counted (always on):
//   underflow   given the per-layer statistics (monitor/grad_norms.h): blocks none of whose
//               gradient elements was a normal number of the compute format (every one 0, or an
//               f16 subnormal) on the last layer_steps (3) steps with finite gradients, named with
//               the precision cause and the fix (16-mixed without a scaler: enable it, or
//               bf16-mixed). Said again when another block vanishes, not when every block has
//               (the global norm is then 0 or tiny, and the trend's vanishing line says it).
//   rounding    >= round_share (50%) of an update's elements had a non-zero update that left the
//               stored weight unchanged (StepResult::rounded_away: bf16 keeps 8 significant bits)
//               on round_steps (3) applied steps in a row: the share and the fix (bf16-mixed's f32
//               masters, or optim.stochastic_rounding = true). Not said when stochastic rounding
//               is on: its unchanged values are unbiased draws, and the updates land on average.
// And, for a mixture of experts, "routing" (AdvisorOptions::experts_per_token): its routers
// collapsing onto a few experts.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "keel/monitor/grad_norms.h"
#include "keel/train/step_result.h"

namespace keel::monitor {

// Once updates were applied, a trainable weight above 10^4 is the updates' doing (init 0.02; no
// sane training takes a weight past the tens): the model has diverged even when its loss has not
// (a LoRA on c_attn at optim.lr 1e4, weights of 9e7 after 3 updates, saturates the attention and
// keeps the loss at 5.8). Bisect and the trend advisor judge by it.
constexpr double kDivergedWeight = 1e4;

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
  int64_t layer_steps = 3;
  double round_share = 0.5;
  int64_t round_steps = 3;
  // optim.stochastic_rounding: bf16 updates that leave a weight unchanged are unbiased draws.
  bool stochastic_rounding = false;
  // Trainable parameters of the model (0 = unknown): below 10M, vanishing advice suggests a
  // higher learning rate, which tiny models tolerate.
  int64_t num_params = 0;
  // train.max_grad_norm (0 = no clipping, < 0 = unknown): recurring spikes are told to lower a
  // clipping threshold that is set, or to set one that is not.
  double max_grad_norm = -1;
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
  // The loss (token mean) of examples `ids` under the model's current weights, without gradients
  // or dropout; NaN when it cannot be measured; null = not asked. A loss spike's batch is then
  // compared with the batch of the step before under the same weights: much harder than its
  // neighbour (spike_batch_ratio, 1.5x), it is the data; no harder, the update before moved the
  // weights and the optimizer is the suspect, not the data.
  std::function<double(const std::vector<int64_t>&)> batch_loss;
  double spike_batch_ratio = 1.5;
  // The largest |value| of a trainable parameter now (monitor::largest_weight); null = not asked.
  // Asked only where a falling grad norm would be called vanishing (and while a divergence holds):
  // weights the updates blew up past kDivergedWeight saturate softmax, GELU and the
  // normalizations, whose gradients then fall towards 0. Such a run (a LoRA at optim.lr 1000,
  // adapter weights of 1e7) was told "vanishing: ... raise optim.lr".
  std::function<LargestWeight()> largest_weight;
  // Why a non-finite step happened when the optimizer's state shows it (AdamW's moments in 16 bits
  // flushed to 0: monitor::optimizer_state_underflow, whose text ends ": " kStateUnderflowFix);
  // "" = not so; null = not asked. Asked at a non-finite step only. Such a run (16-true at
  // optim.lr 3e-3) was told "lower optim.lr (try 0.000296)", which still ends in NaN (an update of
  // lr * m / eps blows up at any lr), while the stop's own cause line said otherwise.
  std::function<std::string()> state_underflow;
  // optim.lr, the schedule's peak (0 = unknown): steps of a warmup or of a decayed tail (their lr
  // below half of it) do not count towards "stalled", and a decayed tail (below a tenth) whose
  // updates round away is the schedule, not a learning rate to raise.
  double peak_lr = 0;
  // The schedule's warmup in steps (sched.warmup_steps, or sched.warmup_ratio resolved; -1 =
  // unknown) and the run's steps (0 = unknown): warmup is advised for a spike only where it can
  // help (none yet and a spike in the first tenth of the run, or a spike during the warmup or as
  // long again after it), not at step 151 of 160 nor to a run that warms up long enough.
  int64_t warmup_steps = -1;
  int64_t total_steps = 0;
  // RMS of the trainable matrices (>= 2-D) before the first update (0 = unknown), and whether the
  // optimizer moves each element by about lr whatever its gradient (AdamW: true) or by lr times
  // it (SGD: false): the relative size of an update, which "stalled" needs.
  double weight_rms = 0;
  bool adaptive = true;
  // model.adapter.kind ("lora", "dora", "lokr"; "" or "none": every weight trains): "stalled"
  // names the range its learning rate usually takes (adapters 1e-4 to 1e-3, full fine-tunes lower).
  std::string adapter;
  // stalled: after stall_steps (50) updates at >= half the peak lr, the median of the last 10
  // losses is less than stall_fall (2%) below the median of the first 10, and an update moves the
  // weights by less than stall_move (1e-4) of their RMS (a tenth of it for a model that starts well
  // below ln V, which may learn slowly by design): the learning rate is far too low (optim.lr =
  // 1e-7 for 1e-4).
  int64_t stall_steps = 50;
  double stall_fall = 0.02;
  double stall_move = 1e-4;
  // scaler.init_scale when a loss scaler is on (0 = none or unknown): where the scale started. A
  // scale set below 1, or far above f16's range, is the setting's doing, not f16 overflowing "at
  // any usable scale" (init_scale 1e-3 was told "the loss scale fell to 0.001 ... switch to
  // bf16-mixed").
  double init_scale = 0;
  // scaler.growth_interval when a loss scaler is on (0 = none or unknown): a scale grown back into
  // overflow every few updates skips those steps (growth_interval 1 skipped 18 of 40 without a
  // word): a "loss scale" finding names it.
  int64_t growth_interval = 0;
  // [debug.inject]: the step it corrupts (-1 = none) and what it does there ("nan into
  // transformer.h.0.mlp.c_fc's output"). A spike or non-finite step there is the injector's: it
  // was told "lower optim.lr" (a fix that fixes nothing).
  int64_t inject_step = -1;
  std::string inject_what;
  // A mixture of experts (StepResult::moe_layers): its experts a layer, the experts a token takes
  // (top_k; 0 = dense) and model.router_aux_loss_coef. routing: on routing_steps (5) steps in a
  // row, the step's load-balancing loss (moe_aux_loss, top_k when even) at >= routing_ratio (1.5)
  // times top_k, or its busiest expert (moe_max_load) at >= routing_load (0.75) of the most it can
  // take (experts / top_k: every token chose it): the routers send most tokens to a few experts.
  // Both are needed: a full fine-tune of a 6-expert Mixtral at optim.lr 1e-2 drove every token to
  // the same 2 experts a layer with its probabilities still near even (aux 2.00 -> 2.27, load
  // 3.0 of 3), and with larger router weights the aux loss rose too (2.10 -> 3.71). Neither is
  // reached by chance: a uniform router's busiest of 8 experts would need 12 of 16 tokens' choices.
  // Said with whether the updates did it (step 1 was neither) or the start had it, and the fix:
  // the load-balancing loss, or more of it. Said again only after the routing evened out.
  int64_t experts = 0, experts_per_token = 0;
  double router_aux_loss_coef = 0;
  double routing_ratio = 1.5, routing_load = 0.75;
  int64_t routing_steps = 5;
};

// One finding, as metrics.jsonl records it: {"kind": "advisor", step, trend, cause, action,
// examples (the batch of a spike), layers (the vanished blocks of an underflow), share (the
// rounded-away share of a rounding finding)}. `trend`: a trend's name, "underflow", "rounding",
// "initialization", "stalled" or "loss scale" (scaler.init_scale set below 1, or far above f16's
// range and backing off).
struct Finding {
  int64_t step = 0;
  std::string trend, cause, action;
  std::vector<std::string> examples;
  std::vector<std::string> layers;
  double share = -1;  // < 0: none
};

class TrendAdvisor {
 public:
  explicit TrendAdvisor(AdvisorOptions opt = {});
  // Adds one step to the window and classifies; `layers`: the step's per-layer statistics (the
  // underflow finding needs them). Returns the advice, one line per finding (also stored in
  // r.advice): the trend's when its class changed, then underflow, then rounding; "" if none.
  std::string observe(StepResult& r, const std::vector<BlockGradNorm>* layers = nullptr);
  Trend trend() const { return trend_; }
  // The trend's last finding (its class, when it changed to trend()); step 0: none yet.
  const Finding& trend_finding() const { return finding_; }
  // A finding named the optimizer state's underflow (AdvisorOptions::state_underflow).
  bool state_underflow_said() const { return state_underflow_said_; }
  // The findings of the last observe(), in the order of its lines.
  const std::vector<Finding>& findings() const { return findings_; }
  // The lowest loss of the best window so far (median of `best_steps` applied steps; 0 = none).
  double best_loss() const { return best_loss_; }
  // Everything later findings depend on (the window, the verdict, what was said once), as JSON
  // that holds finite numbers only: saved in each checkpoint's trainer.json ("advisor"), so that a
  // resumed run's findings are those of the run that was not interrupted. Without it the resumed
  // advisor started over: a 16-mixed run at scaler.init_scale 1e9 resumed at step 2 said its
  // "loss scale" finding at step 6 (counting 4 back-offs of its 6), not at step 4.
  nlohmann::json state() const;
  // Restores state(); `file` and `fix` name the checkpoint and its remedy in the Error a damaged
  // state gives.
  void restore(const nlohmann::json& s, const std::string& file, const std::string& fix);

 private:
  Trend classify(const StepResult& r, std::string& why) const;
  std::string action(Trend t, const StepResult& r) const;
  std::string trend_line(StepResult& r);
  // The underflow finding's state for this step (vanished blocks named), and its finding if due.
  bool observe_layers(const StepResult& r, const std::vector<BlockGradNorm>& layers, Finding* f);
  bool observe_rounding(const StepResult& r, Finding* f);
  void explain_vanished(const StepResult& r, Finding& f) const;
  std::string underflow_fix(const StepResult& r) const;
  std::string format_name() const;  // the compute format of opt_.precision: f16, bf16, f32

  AdvisorOptions opt_;
  std::deque<StepResult> window_;
  Trend trend_ = Trend::kStable;
  int64_t last_spike_ = -1;  // step of the last spike
  // What jumped at the last spike: its grad norm, its loss (or both). The line named both as
  // "far above the recent median" when only the grad norm had jumped (loss 32.4, median 33.9).
  bool spike_norm_ = false, spike_loss_ = false;
  int64_t nan_steps_ = 0;  // cumulative count seen on the previous step
  bool zeros_ = false;     // the current vanishing class is exact zeros (already advised)
  bool state_underflow_said_ = false;
  bool updated_ = false;  // some step applied an update (before that lr cannot be the cause)
  // The first finite loss, taken before any update: where the weights as initialized or loaded
  // start (0 = none yet). Above 1.5 ln V the start itself is far off, and staying up there is no
  // divergence of the learning rate's.
  double start_loss_ = 0;
  bool start_observed_ = false;
  std::vector<int64_t> start_ids_;  // step 1's batch: probed before a divergence from the start
  mutable std::pair<int64_t, double> start_probe_{-1, 0};  // (step, its loss then)
  bool observe_start(const StepResult& r, Finding* f);
  // "stalled" (AdvisorOptions::stall_steps): said once, for a run that started at step 1.
  bool observe_stall(const StepResult& r, Finding* f);
  std::string usual_lr(bool untrained) const;  // "AdamW usually trains ... at 1e-4 to 3e-3"
  int64_t full_lr_steps_ = 0;                  // applied steps at >= half the peak lr
  std::deque<double> recent_losses_;           // finite losses of the last 10 applied steps
  std::vector<double> first_losses_;  // finite losses of the first 10 applied steps (from step 1)
  bool stall_reported_ = false;
  // "loss scale" (AdvisorOptions::init_scale): said once; the scaler's back-offs seen so far.
  bool observe_scale(const StepResult& r, Finding* f);
  int64_t backoffs_ = 0;
  bool scale_reported_ = false;
  // A scale that keeps growing back into overflow (AdvisorOptions::growth_interval): said once.
  bool regrowth_reported_ = false;
  bool observe_regrowth(const StepResult& r, Finding* f);
  // Whether the scale is where scaler.init_scale put it, no overflow having moved it.
  bool scale_as_set(const StepResult& r) const;
  // The best window so far: the lowest median loss of the last 3 applied steps, and the median
  // grad norm of those steps. A divergence cannot contaminate it (it only ever goes down).
  double best_loss_ = 0, best_norm_ = 0;
  std::deque<int64_t> spikes_;  // steps of the spikes in the window
  // A loss spike's batch and the batch of the step before, under the weights after the spike
  // (AdvisorOptions::batch_loss).
  struct SpikeProbe {
    int64_t step = -1;
    double spike = 0, before = 0;  // NaN: not measured
  };
  SpikeProbe probe_;
  // The probe of spike `step` was measured: +1 its batch is the harder (the data), -1 it is no
  // harder (the weights); 0 not measured.
  int probe_verdict(int64_t step) const;
  std::string optimizer_spike_fix(const StepResult& r) const;
  std::string clip_contained() const;  // the last spike was clipped: that it is contained
  std::string lr_now(const StepResult& r) const;       // "now 0.1, 0.012 at this step of ..."
  std::string lower_lr_of(const StepResult& r) const;  // "lower optim.lr (now ...; try 0.01)"
  std::string warmup_fix(int64_t step) const;          // "add warmup (...)" where it helps, else ""
  Finding finding_;
  std::vector<Finding> findings_;
  std::vector<std::pair<std::string, int64_t>> vanished_run_;  // block -> steps in a row
  std::vector<std::string> reported_;                          // blocks named by the last finding
  bool underflow_ = false;  // some block has vanished (f16 and no scaler: the cause)
  int64_t round_run_ = 0;   // applied steps in a row at >= round_share
  bool round_reported_ = false;
  // "routing" (AdvisorOptions::experts_per_token): steps in a row collapsed, said, and step 1's
  // load-balancing loss (< 0: not seen) and whether step 1 was collapsed already.
  bool observe_routing(const StepResult& r, Finding* f);
  int64_t routing_run_ = 0;
  bool routing_reported_ = false;
  double first_aux_ = -1;
  bool first_collapsed_ = false;
  // Whether an exploding verdict's condition has cleared at `r` (back near the best window).
  bool recovered(const StepResult& r) const;
  // Whether the updates blew a trainable weight up past kDivergedWeight (asked through
  // AdvisorOptions::largest_weight); if so, `why` (a vanishing trend's cause) becomes the
  // divergence's.
  bool blown_up(std::string& why) const;
  std::string examples_of(const StepResult& s, std::vector<std::string>* list) const;
};

}  // namespace keel::monitor
