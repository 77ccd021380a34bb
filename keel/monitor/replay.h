// Replay of a NaN capture (DESIGN §4, `keel replay DIR`): rebuilds the Trainer from the capture's
// config, loads the captured parameters, optimizer state, scaler state and micro-batches, and
// re-runs the step's forward and backward (Trainer::forward_backward with the captured step seed
// and loss scale, on the captured thread count) with the underflow/overflow tracer on, stopping
// before any update. It reports whether the step is non-finite again (`reproduced`), whether the
// loss has the same bits as recorded (`bit_exact`), the parameters with non-finite gradients, and
// the module that produced the first non-finite value. A capture of one rank of a data-parallel
// run replays that rank alone (its micro-batches, their global indices and the global window's
// token count) and compares its local loss and pre-reduce gradients; the tracer's log is
// underflow_overflow_rank{R}.log after the captured rank R.
//
// Bisect re-runs the step under one numerics change at a time, ordered from the smallest change
// to the largest — under 16-mixed a loss scale above 65536 brought to it, attention backend (math:
// f32 scores; eager), the -mixed variant of a -true policy, bf16-mixed for an f16 policy, 32-true,
// no adapter, no fault injection — and names the first change that makes the step finite with
// headroom (a step that a change leaves finite only marginally, its gradient norm within 2^10 of
// the f32 overflow, or with a diverged loss, counts as not fixed). A learning rate does not act
// within a step, so when no change helps the cause is the state the step started from: non-finite
// parameter values (a corrupt checkpoint, a broken update), or finite parameters so large that
// every precision overflows (a run that diverged: lower optim.lr).
//
// Nothing of the original run is touched: the rebuilt trainer's out_dir is `out_dir` (default
// DIR/replay, or a fresh temporary directory when DIR is not writable), where the tracer's log
// goes.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace keel::monitor {

struct ReplayOptions {
  std::string precision;          // "" = as captured
  std::string attention;          // "" = as captured
  std::vector<std::string> sets;  // further config overrides (section.key=value)
  bool bisect = false;
  bool tracer = true;   // run the underflow/overflow tracer on the main replay
  std::string out_dir;  // "" = DIR/replay (or a temporary directory)
};

struct BisectTrial {
  std::string change;  // "attention=math", "precision=bf16-mixed", "inject=off", ...
  bool finite = false;
  // Finite, but the gradient norm is within 2^10 of where its f32 sum of squares overflows
  // (~1.8e19): the change only nudged a diverged step under the edge, it fixes nothing.
  bool marginal = false;
  // Finite, but with a loss only blown-up weights give (above 10^4 nats, or, once an update was
  // applied, above 1.5 x the uniform guess ln V): the change ran a diverged model's step in
  // another format, it fixes nothing (a run at optim.lr 1e4 in 16-true was blamed on its
  // precision: 32-true gave a loss of 9e8; one at optim.lr 1 in 16-mixed on attention=math:
  // 25 nats after 4 updates, ln V = 5.56), or, once an update was applied, on trainable weights
  // above 10^4 whatever the loss (a LoRA at optim.lr 1e4 saturates the attention at a loss of 5.8).
  bool diverged = false;
  double loss = 0;
  double grad_norm = 0;
  std::string error;  // the trial could not run (e.g. an invalid combination), with why
};

struct ReplayResult {
  std::string dir;
  int64_t step = 0;
  std::string precision, attention;  // what the replay ran under
  std::string captured_precision, captured_attention;
  int threads = 0;
  bool reproduced = false;  // non-finite loss or gradients again
  bool bit_exact = false;   // the loss has exactly the recorded bits, and so has every gradient
  bool loss_bit_exact = false, grads_bit_exact = false;
  double loss = 0;
  std::string loss_bits, recorded_loss_bits;
  std::string grads_fingerprint, recorded_grads_fingerprint;
  double grad_norm = 0;  // unscaled
  double loss_scale = 1;
  std::vector<std::string> nonfinite_params;  // non-finite gradients, in parameter order
  // Of those, the one backward produced first (nearest the producer), and the capture's.
  std::string first_nonfinite_param, recorded_first_nonfinite_param;
  // The captured rank of a data-parallel run and its world size. With several ranks a replay runs
  // that rank's micro-batches alone: the loss compared is the rank's own (its loss sum over its
  // target tokens, "local_loss_bits") and the gradients its own before the all-reduce, still
  // scaled ("local_grads_fingerprint"); the reduced loss and gradients need every rank's data.
  int world_size = 1, rank = 0;
  std::string largest_grad_param;  // where the largest |gradient| element is (finite ones)
  double largest_grad = 0;
  std::string largest_weight_param;  // the largest |value| of a trainable parameter (before)
  double largest_weight = 0;
  double init_weight_rms = 0;  // the trainable matrices' RMS as initialized (StepOutcome's)
  std::vector<std::string> nonfinite_param_values;  // non-finite values before the step
  // --bisect, non-finite values: the first such parameter's non-finite rows and, for an embedding,
  // the dataset examples of the step whose tokens hit them.
  std::vector<int64_t> nonfinite_rows, nonfinite_token_examples;
  // The tracer's finding: the module that produced the first non-finite value.
  std::string first_module, first_module_type, first_phase, first_tensor, tracer_message;
  std::string tracer_log;
  std::string out_dir;
  std::vector<std::string> notes;  // what was adapted (e.g. optimizer state not loaded)
  // --bisect
  bool bisected = false;
  std::vector<BisectTrial> bisect;
  std::string cause;        // the smallest change that makes the step finite, or the state class
  std::string explanation;  // one or two sentences for the user
};

// Errors (keel::Error) name the capture file at fault and the fix: a missing directory or file, a
// capture.json that is not JSON or lacks a key, a safetensors file that does not match the model.
ReplayResult replay_capture(const std::string& dir, const ReplayOptions& opt = {});

nlohmann::json replay_to_json(const ReplayResult& r);
std::string format_replay(const ReplayResult& r);

}  // namespace keel::monitor
