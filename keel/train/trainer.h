// Trainer: the step of DESIGN §3 and the loop around it, over a Run built by the run factory
// (train/run.h). It reports through hooks — loggers, the NaN capture and the tracer live in
// lower layers (monitor/, log/) and are wired in by the caller. Its members are defined by
// concept: the step and the loop in trainer.cpp, evaluation in evaluate.cpp, checkpoints in
// trainer_checkpoint.cpp.
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/amp/grad_pass.h"
#include "keel/amp/grad_scaler.h"
#include "keel/amp/precision.h"
#include "keel/data/data.h"
#include "keel/models/causal_lm.h"
#include "keel/optim/optimizer.h"
#include "keel/optim/schedule.h"
#include "keel/train/collective.h"
#include "keel/train/config.h"
#include "keel/train/run.h"
#include "keel/train/step_result.h"

namespace keel {

struct EvalResult {
  int64_t step = 0;
  double loss = 0;  // token mean over the held-out split
  int64_t tokens = 0;
  double accuracy = -1;  // exact-match accuracy (built-in task); -1 when not applicable
  int64_t examples = 0;
};

// What a handler of a non-finite step gets: everything is still as it was before the update.
struct NonfiniteEvent {
  int64_t step = 0;
  int64_t epoch = 0;
  double loss = 0;
  bool loss_finite = true;
  double grad_norm = 0;
  std::vector<std::string> nonfinite_params;  // parameters whose gradient holds nan/inf
  // The one of them whose gradient backward produced first (nearest the producer: every gradient
  // backward produced before it was finite), from autograd's grad_production_order.
  std::string first_nonfinite_param;
  const std::vector<data::Batch>* window = nullptr;
  uint64_t step_seed = 0;  // dropout seeds of the step derive from it
  double loss_scale = 1;   // the scale this step's backward ran with (1 without a scaler)
  // Data-parallel: what one rank's replay reproduces. The rank ran micro-batches rank, rank + W,
  // ... of the global window (their dropout seeds), each weighted by the global window's target
  // tokens; `loss` above is the global one. local_loss = this rank's loss sum / its own tokens;
  // local_grads_fingerprint = its gradients before the all-reduce (and before unscale), "" when
  // they were not recorded (the overflow arose in the sum over ranks, or the scaler was expected
  // to handle it).
  int world_size = 1, rank = 0;
  int64_t window_tokens = 0, local_tokens = 0;
  double local_loss = 0;
  std::string local_grads_fingerprint;
};

struct TrainerHooks {
  std::function<void(const StepResult&)> on_step;
  std::function<void(const EvalResult&)> on_eval;
  std::function<void(const EpochResult&)> on_epoch;
  // on_nonfinite = capture: write the capture, return its path ("" when none was written).
  std::function<std::string(const NonfiniteEvent&)> on_capture;
  std::function<void(const std::string&)> on_message;  // one-line notices (default: stderr)
  // Before a step's forward, with the number the step will have (StepResult::step): the tracer's
  // begin_batch and fault injection key on it.
  std::function<void(int64_t step)> on_step_begin;
  // After unscale and the global norm (steps 4-5), before clipping and the update: gradients are
  // pre-clip and unscaled here (per-layer grad norms). `r` is filled up to found_inf.
  std::function<void(const StepResult& r)> on_grads;
  // The trend advisor's state (monitor/advisor.h: TrendAdvisor::state), saved in each checkpoint's
  // trainer.json as "advisor" so that a resumed run's findings are the uninterrupted run's; null
  // (or a null result): none saved.
  std::function<nlohmann::json()> advisor_state;
};

// Steps 1-2 of a step without the update (zero grads are the caller's business): forward and
// backward over the window under the policy's autocast, each micro-batch's loss multiplied by
// loss_scale / (window tokens) before backward; returns the summed (unweighted) loss. Replay and
// doctor run a step's gradients through this on a Run of their own.
// Data-parallel: `window_tokens` is the global window's target-token count (summed over ranks;
// -1 = this window's own), and micro-batch i of `window` is micro-batch mb_first + i * mb_stride
// of the global window (its dropout seed), so the summed gradients are the 1-rank gradients.
double forward_backward(Run& run, const std::vector<data::Batch>& window, uint64_t step_seed,
                        double loss_scale, int64_t window_tokens = -1, int64_t mb_first = 0,
                        int64_t mb_stride = 1);
// `names` (parameters of `params`) in the order the last backward produced their gradients
// (autograd's grad_production_order), earliest first; names without one keep their order, last.
// For non-finite gradients the first names the parameter nearest the producer, where the model
// order would name the embedding.
std::vector<std::string> in_backward_order(
    const std::vector<std::pair<std::string, Tensor>>& params, std::vector<std::string> names);
// The seed every random choice of step `step` derives from (dropout masks).
uint64_t step_seed(const Config& cfg, int64_t step);
// The summed cross-entropy of a batch's target tokens (f32 scalar, with its graph when grad mode
// is on), under the autocast in force: what training and evaluation both weigh. `row_sums`: also
// each row's own sum, the cross-entropy of its slice of the same logits (keel eval --per-example).
Tensor batch_loss_sum(models::CausalLM& model, const data::Batch& batch,
                      std::vector<double>* row_sums = nullptr);
// What to do about a loss scaler whose steps keep overflowing f16: `scale` the one the last step
// overflowed at, `ever_updated` whether any update was applied (only then is optim.lr a suspect).
std::string scaler_unsettled_action(bool ever_updated, double init_scale, double scale);

// The checkpoint a resume of the run in `out_dir` continues: checkpoints/last ("" when there is
// none: the run starts from scratch). A lost `last` beside step-N checkpoints is refused (an Error
// naming the newest), as starting over would replace them.
std::string resume_checkpoint_dir(const std::string& out_dir);

// What `keel train` with run.resume = true refuses of the checkpoint in cfg.run.out_dir, read only
// (keel doctor: nothing is recovered, locked, read into memory or written): a lost or incomplete
// checkpoint, another model, precision, seed, batch or data than the checkpoint's, a moved base.
// `run` is the run built from `cfg` (its model, data files and length). Throws the Error the
// resume throws; returns what it would say instead of continuing (starting from scratch, nothing
// left to train).
std::vector<std::string> check_resume(const Run& run, const Config& cfg);
// What a resume says instead of continuing, keel train's and keel doctor's alike: no checkpoint
// in out_dir (it starts from scratch); a checkpoint at `step` with nothing left of `total` steps.
std::string resume_from_scratch_message(const std::string& out_dir);
std::string nothing_left_to_train_message(int64_t step, int64_t total);

class Trainer {
 public:
  // `collective`: the process group of a data-parallel run (dist/); null = one process. With W
  // ranks a step's global window is grad_accum * W micro-batches, rank r running micro-batches
  // r, r + W, ... of it (rank_micro_batches in collective.h); rank 0 alone evaluates and writes
  // checkpoints.
  explicit Trainer(const Config& cfg, TrainerHooks hooks = {},
                   std::shared_ptr<Collective> collective = nullptr);
  // Over a run already built (its RunOptions::world_size must be the collective's).
  Trainer(Run run, TrainerHooks hooks, std::shared_ptr<Collective> collective = nullptr);
  ~Trainer();

  // Trains to max_steps or for `epochs` epochs, evaluating and checkpointing as configured.
  // Returns the exit code of DESIGN §6: 0 done, 3 stopped on a non-finite step. Throws Error
  // (exit 1) when an epoch applied no update and some of its non-finite steps were not the
  // scaler's ("every step produced non-finite gradients"); scaler skips alone never stop it.
  int fit();
  // One optimizer step over a window of micro-batches (DESIGN §3).
  StepResult train_step(const std::vector<data::Batch>& window, int64_t epoch);
  EvalResult evaluate();
  // keel::forward_backward on this trainer's run.
  double forward_backward(const std::vector<data::Batch>& window, uint64_t step_seed,
                          double loss_scale, int64_t window_tokens = -1, int64_t mb_first = 0,
                          int64_t mb_stride = 1) {
    return keel::forward_backward(run_, window, step_seed, loss_scale, window_tokens, mb_first,
                                  mb_stride);
  }
  uint64_t step_seed(int64_t step) const { return keel::step_seed(run_.cfg, step); }

  // Weights that hold NaN or inf (an applied update overflowed them; train.on_nonfinite = skip goes
  // on past such steps) are not written to `dir`, which keeps what it holds: they go to
  // nonfinite-step-N beside it, for inspection (loaded with model.allow_nonfinite_weights or
  // --allow-nonfinite-weights), and the Error names the parameters and that folder.
  void save_checkpoint(const std::string& dir);
  void load_checkpoint(const std::string& dir);  // model, optimizer, scaler and loop position

  Run& run() { return run_; }
  models::CausalLM& model() { return *run_.model; }
  optim::Optimizer& optimizer() { return *run_.optimizer; }
  GradScaler* scaler() { return run_.scaler.get(); }
  const Config& config() const { return run_.cfg; }
  const PrecisionPolicy& policy() const { return run_.policy; }
  // Where the model, its gradients and optimizer state live (cpu when run.device = cuda found no
  // usable GPU).
  Device device() const { return run_.device; }
  const std::string& out_dir() const { return run_.out_dir; }
  const data::DataLoader& loader() const { return *run_.loader; }
  const data::Tokenizer& tokenizer() const { return *run_.data.tokenizer; }
  int64_t steps_done() const { return step_; }
  // Of those, the updates applied, the loss scaler's skips and the non-finite steps passed over
  // (train.on_nonfinite = "skip"), from the run's start (a resumed run's included).
  int64_t updates_applied() const { return sched_step_; }
  int64_t scaler_skipped_steps() const { return skipped_steps_; }
  int64_t nonfinite_steps() const { return nan_steps_; }
  // The parameters whose values hold NaN or inf (an update overflowed them), in model order; of
  // those the optimizer updates only (a frozen base was checked when it loaded, and is large).
  std::vector<std::string> nonfinite_parameters(bool trainable_only = false) const;
  // What the checkpoint this run resumed from saved of TrainerHooks::advisor_state (null: a fresh
  // run, or a checkpoint without it), and its trainer.json (for the errors of a damaged state).
  const nlohmann::json& resumed_advisor_state() const { return resumed_advisor_state_; }
  const std::string& resumed_trainer_json() const { return resumed_trainer_json_; }
  int64_t total_steps() const { return run_.total_steps; }
  // Trainable parameters (what the optimizer updates), by name.
  const std::vector<std::pair<std::string, Tensor>>& trainable() const { return run_.trainable; }
  // Set by fit() when it stops early: the reason, printed by the caller.
  const std::string& stop_message() const { return stop_message_; }
  // fit() returned 0 early because a stop was requested (SIGTERM/SIGINT); checkpoints/last holds
  // the state after steps_done() steps.
  bool stopped_by_request() const { return stopped_by_request_; }
  // bench_monitor only: false skips step 5's global grad norm and its finite check (grad_norm
  // reads 0, nothing is clipped), the baseline the always-on checks are measured against.
  void set_grad_norm_check_for_bench(bool on) { grad_norm_check_ = on; }
  // The last step's pass over the gradients (amp/grad_pass.h), aligned with trainable(): the
  // on_grads hook reads the per-layer sums of squares from it.
  const amp::GradPass& last_grad_pass() const { return last_pass_; }
  // Aligned with trainable(): per gradient, the elements in rows of an untied lookup table
  // (CausalLM::lookup_tables) that no input of the last step's window (on any rank) selected at or
  // before the last target of its sequence. Their gradient is exactly 0 because nothing reached
  // them, not because it underflowed; the per-layer underflow statistics leave them out.
  const std::vector<int64_t>& last_unselected() const { return unselected_; }
  Collective& collective() { return *coll_; }
  int rank() const { return coll_->rank(); }
  int world_size() const { return coll_->world_size(); }

 private:
  void message(const std::string& m);
  // This rank's micro-batches of the global window starting at first_batch; *global_count = the
  // global window's size (what the loop position advances by).
  std::vector<data::Batch> window_at(int64_t epoch, int64_t first_batch,
                                     int64_t* global_count = nullptr) const;
  // The rank-consistency check (dist.check_every): throws when ranks disagree.
  void check_ranks(int64_t step);
  // Ends the epoch: reports it (on_epoch), throws when it applied no update and some of its
  // non-finite steps were not the scaler's, and resets the epoch's sums.
  void end_epoch();
  void write_checkpoint(const std::string& dir);  // save_checkpoint without the weights' check
  // "65536 -> 32768 -> ... -> 0.5": the scales of the current run of consecutive skips.
  std::string scale_trace() const;
  // Whether this rank writes the NaN capture of a step the ranks in `saw_nonfinite` saw.
  bool captures_here(const std::vector<int>& saw_nonfinite) const;
  // Whether this rank takes its pre-reduce gradient fingerprint (NonfiniteEvent) this step: it
  // would write a capture of it (on_nonfinite = capture, no scaler that would skip the step).
  bool local_capture_needed(const std::vector<int>& saw_nonfinite, bool loss_finite,
                            double sum_of_norms) const;

  Run run_;
  TrainerHooks hooks_;
  std::shared_ptr<Collective> coll_;  // never null (SingleCollective without one)

  nlohmann::json resumed_advisor_state_;
  std::string resumed_trainer_json_;
  // Loop position (all of it goes into trainer.json).
  int64_t step_ = 0;        // steps attempted
  int64_t sched_step_ = 0;  // updates applied (the LR schedule's clock)
  int64_t epoch_ = 0, next_batch_ = 0;
  int64_t skipped_steps_ = 0, nan_steps_ = 0;
  double epoch_loss_sum_ = 0;  // token-weighted loss of the applied steps of the current epoch
  int64_t epoch_tokens_ = 0, epoch_updates_ = 0, epoch_steps_ = 0;
  // Non-finite steps of the epoch the scaler did not handle (scaler skips are calibration).
  int64_t epoch_unhandled_ = 0;
  // The current run of scaler skips with no update between them: the scale each ran with, and
  // the scale after the last one (kept in trainer.json: a resume continues the count).
  std::vector<double> skip_scales_;
  double skip_scale_after_ = 0;
  std::string unsettled_;  // why the scaler could not settle (the last such step), or ""
  std::string stop_message_;
  bool grad_norm_check_ = true;
  bool stopped_by_request_ = false;
  // Data-parallel: whether any rank had a stop requested (SIGTERM/SIGINT) by the last step's
  // agreement (train_step's found-inf all-reduce carries it), so that every rank stops after the
  // same step.
  bool stop_agreed_ = false;
  bool ranks_checked_ = false;       // the rank-consistency check ran at least once
  amp::GradPass last_pass_;          // the last step's gradient pass (last_grad_pass())
  std::vector<int64_t> unselected_;  // last_unselected()
  void count_unselected(const std::vector<data::Batch>& window);
};

}  // namespace keel
