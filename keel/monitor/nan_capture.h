// NaN capture (DESIGN §4): when a step decides to stop on a non-finite value, everything needed to
// replay that step is written atomically to out_dir/debug/nan_capture/rank{R}/:
//   capture.json            step, rank, UTC time, precision, attention backend, thread count, the
//                           effective config, scaler state, RNG state, non-finite parameters, keel
//                           version, the loss and grad norm seen
//   model.safetensors       parameters (the f32 masters under the mixed policies) as they were
//                           before the step: the capture runs before any update, so nothing is
//                           cloned per step
//   optimizer.safetensors   optimizer state
//   microbatches.safetensors  input_ids / labels / attention_mask of every micro-batch
#pragma once
#include <string>

#include "keel/train/trainer.h"

namespace keel::monitor {

// Writes the capture and returns its directory.
std::string write_nan_capture(Trainer& trainer, const NonfiniteEvent& ev, int rank = 0);

}  // namespace keel::monitor
