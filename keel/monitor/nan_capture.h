// NaN capture (DESIGN §4): when a step decides to stop on a non-finite value, everything needed to
// replay that step is written atomically to out_dir/debug/nan_capture/rank{R}/:
//   capture.json            step, epoch, rank, UTC time, keel version, precision (and the
//                           parameter / compute dtypes), attention backend, OpenMP thread count
//                           (part of bit-exactness: reductions are chunked per thread), the
//                           effective config as TOML, the scaler state after the step's decision
//                           and the loss scale its backward ran with, the RNG state (run seed and
//                           step seed; dropout masks of micro-batch i derive from
//                           mix_seed(step_seed, i) and the module path), the loss (and its exact
//                           IEEE-754 bits, "loss_bits", which replay compares), grad norm,
//                           parameters with non-finite gradients and with non-finite values, and
//                           per micro-batch its target-token count and dataset example ids, and a
//                           fingerprint of every gradient's bits ("grads_fingerprint")
//   model.safetensors       the parameters as they were before the step, in their stored dtype:
//                           the f32 masters under the -mixed policies (the low-precision copies
//                           autocast uses are a deterministic rounding of them, recomputed on
//                           replay), the bf16/f16 parameters themselves under the -true policies
//   optimizer.safetensors   optimizer state (moments and step counts)
//   microbatches.safetensors  mb{i}.input_ids / mb{i}.labels / mb{i}.attention_mask
// The capture runs after unscale and before any update, so it reads state that is still intact:
// nothing is cloned per step, and a step the scaler handles (a finite loss whose scaled gradients
// overflowed) never reaches it.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "keel/train/trainer.h"

namespace keel::monitor {

inline constexpr const char* kCaptureFormat = "keel-nan-capture";
inline constexpr int kCaptureFormatVersion = 1;

// Writes the capture and returns its directory.
std::string write_nan_capture(Trainer& trainer, const NonfiniteEvent& ev, int rank = 0);

// "0x7ff8000000000000": the exact bits of a double, as the capture records the loss.
std::string double_bits_hex(double v);

// FNV-1a (64 bits, hex) over the names and raw bytes of every defined gradient, in order: replay
// compares it with the capture's "grads_fingerprint", so bit-exactness covers the whole backward,
// not only a loss that may be NaN.
std::string gradient_fingerprint(const std::vector<std::pair<std::string, Tensor>>& params);

}  // namespace keel::monitor
