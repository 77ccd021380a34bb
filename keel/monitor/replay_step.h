// One re-run of a captured step, shared by replay and bisect (monitor/replay.cpp, bisect.cpp).
#pragma once
#include <string>
#include <vector>

#include "keel/monitor/nan_capture.h"
#include "keel/monitor/replay.h"
#include "keel/monitor/tracer.h"
#include "keel/train/config.h"

namespace keel::monitor {

struct StepOutcome {
  double loss = 0, grad_norm = 0, loss_scale = 1;
  std::string loss_bits, grads_fingerprint;
  bool finite = true;
  std::vector<std::string> nonfinite_params;
  std::string first_nonfinite_param;  // of those, the one backward produced first
  int world_size = 1, rank = 0;       // the captured rank (a replay runs it alone)
  std::string largest_grad_param;     // the largest finite |gradient| element, and where
  double largest_grad = 0;
  // The largest |value| of a trainable parameter as the step starts, and where: weights the
  // updates blew up (bisect.cpp).
  std::string largest_weight_param;
  double largest_weight = 0;
  // RMS of the trainable matrices (>= 2-D) as the run factory initializes them, before the
  // captured state is loaded: what the trend advisor measures AdamW's lr against (advisor.h).
  double init_weight_rms = 0;
  TracerFinding finding;
  std::string precision, attention;
  std::string device;      // where the replay ran ("cpu", "cuda:0")
  int64_t vocab_size = 0;  // the model's logits: ln V is the loss of a uniform guess
  std::vector<std::string> notes;
};

// The capture's config with `sets` applied, as the replay runs it (below out_dir, no resume, the
// captured thread count).
Config replay_config(const Capture& c, const std::string& out_dir,
                     const std::vector<std::string>& sets);

// Rebuilds the run from the capture's config (in memory; a training file that is gone is named
// in the notes, the captured micro-batches feed the step), loads the captured state and runs the
// step's forward and backward, stopping before the update. `loss_scale` > 0 runs the backward
// under that scale instead of the captured one (bisect's loss-scale trial).
StepOutcome replay_step(const Capture& c, const std::string& out_dir,
                        const std::vector<std::string>& sets, bool with_tracer,
                        double loss_scale = 0);

// AdamW's second moment held in a 16-bit format (16-true's f16 state): elements whose exp_avg is
// not 0 but whose exp_avg_sq is (a squared gradient flushed to 0) are updated by lr * m / eps,
// which blows the weights up in a few updates. What it did, naming the tensor and the fix; "" when
// no element is so (bisect.cpp).
std::string optimizer_state_underflow(const Capture& c, const Config& cfg);
// What optimizer_state_underflow's text ends with, after ": ": its fix (the trend advisor gives it
// as the action of its finding).
inline constexpr const char* kStateUnderflowFix =
    "train in 16-mixed or bf16-mixed (f32 master weights and optimizer state), or raise optim.eps "
    "(to about 1e-4)";
// The same from a live run (keel train, stopping at a non-finite step): the optimizer's state()
// entries (its "step" counts the updates applied) and the model's named parameters.
std::string optimizer_state_underflow(const std::vector<std::pair<std::string, Tensor>>& state,
                                      const std::vector<std::pair<std::string, Tensor>>& parameters,
                                      const Config& cfg);

// --bisect (bisect.cpp): one numerics change at a time from the replay's own settings `sets`;
// fills r.bisect, r.cause and r.explanation.
void bisect_step(const Capture& c, const std::vector<std::string>& sets, ReplayResult& r);

}  // namespace keel::monitor
