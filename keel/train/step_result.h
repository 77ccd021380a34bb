// StepResult: everything one optimizer step decided, as DESIGN §3 step 8 lists it. Loggers,
// the trend advisor and tests read it; nothing else carries step outcomes around.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace keel {

struct StepResult {
  int64_t step = 0;       // 1-based count of optimizer steps attempted (applied or skipped)
  int64_t epoch = 0;      // 0-based
  double loss = 0;        // token-mean loss of the window (f32 math, reported as double)
  double grad_norm = 0;   // global, pre-clip, unscaled; inf/nan when found_inf
  bool clipped = false;   // clipping changed the gradients
  double lr = 0;          // learning rate used by this step
  double loss_scale = 1;  // scale in effect for this step (1 without a scaler)
  double loss_scale_after = 1;
  bool stepped = false;       // the optimizer applied an update
  bool found_inf = false;     // a non-finite gradient (or loss) was found
  int64_t skipped_steps = 0;  // cumulative: steps skipped by the scaler
  int64_t nan_steps = 0;      // cumulative: non-finite steps not handled by the scaler
  int64_t tokens = 0;         // non-padding target tokens in the window
  double tokens_per_s = 0;
  double seconds = 0;         // wall time of the step
  int64_t micro_batches = 0;  // K, or the remainder r < K at the end of an epoch
  // The update's counts (optim::UpdateCounts, 0 when no update was applied): elements of the
  // updated parameters, and those whose non-zero update left the stored value unchanged.
  int64_t update_elements = 0, rounded_away = 0;
  // A mixture of experts' routing over the step's tokens on this rank (models::expert_load): the
  // load-balancing loss (the experts a token takes when even), the (layer, expert) pairs no token
  // reached, the busiest expert's tokens over its layer's mean. moe_layers 0: a dense model.
  int64_t moe_layers = 0, moe_unused_experts = 0;
  double moe_aux_loss = 0, moe_max_load = 0;
  // The advisor's lines when it found something (or empty): the trend's line when its class
  // changed, then any per-layer underflow or rounded-away finding, one per line ('\n').
  std::string advice;
  std::vector<int64_t> example_ids;  // dataset indices of the global window's rows
};

// The end of an epoch (DESIGN §3): its loss is the token mean over the steps that applied an
// update, remainder windows included; `loss` is meaningless when `updates` is 0.
struct EpochResult {
  int64_t epoch = 0;  // 0-based
  int64_t step = 0;   // the last step of the epoch
  double loss = 0;
  int64_t tokens = 0;                        // target tokens of the applied steps
  int64_t updates = 0;                       // steps that applied an update
  int64_t skipped_steps = 0, nan_steps = 0;  // cumulative, as in StepResult
};

}  // namespace keel
