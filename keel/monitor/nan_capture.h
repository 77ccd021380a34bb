// NaN capture (DESIGN §4): when a step decides to stop on a non-finite value, everything needed to
// replay that step is written atomically to out_dir/debug/nan_capture/rank{R}/:
//   capture.json            step, epoch, rank, UTC time, keel version, precision (and the
//                           parameter / compute dtypes), attention backend, OpenMP thread count
//                           (part of bit-exactness: reductions are chunked per thread), the
//                           device it ran on ("cpu", "cuda:0": replay names another one), the
//                           effective config as TOML, the scaler state after the step's decision
//                           and the loss scale its backward ran with, the RNG state (run seed and
//                           step seed; dropout masks of micro-batch i derive from
//                           mix_seed(step_seed, i) and the module path), the loss (and its exact
//                           IEEE-754 bits, "loss_bits", which replay compares), grad norm,
//                           parameters with non-finite gradients (and the one backward produced
//                           first, "first_nonfinite_param") and with non-finite values, and per
//                           micro-batch its target-token count, dataset example ids and index in
//                           the global window, and a fingerprint of every gradient's bits
//                           ("grads_fingerprint"). Data-parallel: "world_size", the global
//                           window's "window_tokens" (every rank's loss weights divide by it), and
//                           what replaying this rank alone reproduces: "local_loss(_bits)" (its
//                           loss sum over its own tokens) and "local_grads_fingerprint" (its
//                           gradients before the all-reduce, still scaled); "base" (an adapter
//                           run's reference to its model.path) and "data_files" (size and hash
//                           of data.path / data.eval_path as read: replay names a changed file)
//   model.safetensors       the parameters as they were before the step, in their stored dtype:
//                           the f32 masters under the -mixed policies (the low-precision copies
//                           autocast uses are a deterministic rounding of them, recomputed on
//                           replay), the bf16/f16 parameters themselves under the -true policies
//   optimizer.safetensors   optimizer state (moments and step counts)
//   microbatches.safetensors  mb{i}.input_ids / mb{i}.labels / mb{i}.attention_mask, and
//                           mb{i}.position_ids where the rows are packed (data.pack with JSONL)
// The capture runs after unscale and before any update, so it reads state that is still intact:
// nothing is cloned per step, and a step the scaler handles (a finite loss whose scaled gradients
// overflowed) never reaches it.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/io/safetensors.h"
#include "keel/train/grad_fingerprint.h"  // gradient_fingerprint: replay compares it
#include "keel/train/trainer.h"

namespace keel::monitor {

inline constexpr const char* kCaptureFormat = "keel-nan-capture";
// 2: world_size, window_tokens, first_nonfinite_param; with several ranks local_tokens,
// local_loss(_bits), local_grads_fingerprint and each micro-batch's global_index (its dropout seed
// was mix_seed(step_seed, index) before, wrong on ranks > 0). A version 1 capture reads as 1 rank.
inline constexpr int kCaptureFormatVersion = 2;

// Writes the capture and returns its directory.
std::string write_nan_capture(Trainer& trainer, const NonfiniteEvent& ev, int rank = 0);

// A capture read back (replay; the fuzz harness): capture.json checked for every key replay needs,
// the three safetensors files, and the step's window of micro-batches. Errors (kUsage) name the
// file, the key and what to do.
struct Capture {
  std::string dir;
  nlohmann::json meta;  // capture.json
  io::Safetensors model, optimizer, batches;
  std::vector<data::Batch> window;
};
Capture read_nan_capture(const std::string& dir);

// capture.json's `key`, or an Error naming the file and the key.
const nlohmann::json& capture_field(const Capture& c, const char* key);
Error capture_field_type_error(const Capture& c, const char* key);
template <class T>
T capture_field_as(const Capture& c, const char* key) {
  try {
    return capture_field(c, key).get<T>();
  } catch (const nlohmann::json::exception&) {
    throw capture_field_type_error(c, key);
  }
}

// "0x7ff8000000000000": the exact bits of a double, as the capture records the loss.
std::string double_bits_hex(double v);

}  // namespace keel::monitor
