// TensorBoard event files without TensorFlow or protobuf:
// out_dir/tb/events.out.tfevents.<time>.<host> in TFRecord framing, each record being
//   uint64 length | uint32 masked CRC-32C of the length bytes | data | uint32 masked CRC-32C of
//   data
// (little endian; mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8), where data is a serialized
// tensorflow.Event: wall_time (1, double), step (2, int64), file_version (3, string) or
// summary (5, Summary { repeated Value value = 1 }, Value { tag = 1, simple_value = 2 (float) })
// or session_log (7, SessionLog { status = 1 (START = 1) }).
// The first record is the Event {file_version: "brain.Event:2"}.
//
// A resumed run logs again the steps that the interrupted run logged after its last checkpoint.
// Its writer starts with the Event {step: S, session_log: START} at the first step S it will log:
// TensorBoard then drops the earlier files' events at steps >= S (EventAccumulator's restart
// purge), so every step has one value. PyTorch's SummaryWriter(purge_step=S) writes the same.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "keel/train/step_result.h"

namespace keel::log {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), software; crc32c("123456789") =
// 0xe3069283.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

// Serialized tensorflow.Event messages (exposed for tests).
std::string encode_file_version_event(double wall_time, const std::string& version);
std::string encode_session_start_event(double wall_time, int64_t step);
std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, float>>& values);
// One TFRecord: framing and both masked CRCs around `data`.
std::string encode_record(const std::string& data);

class TensorBoardWriter {
 public:
  // Creates out_dir/tb and a new event file in it (a numeric suffix is added if the name exists).
  // `purge_step` >= 0 (a resume): the session-start event at that step follows the version event.
  explicit TensorBoardWriter(const std::string& out_dir, int64_t purge_step = -1);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Scalars loss, grad_norm, learning_rate and loss_scale at r.step (non-finite values as they are:
  // TensorBoard shows them as gaps). Flushed, so TensorBoard sees the step at once.
  void write(const StepResult& r);
  // Any scalars (evaluation metrics, per-layer norms) at `step`; wall_time < 0 = now.
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values,
                   double wall_time = -1);
  const std::string& path() const { return path_; }

 private:
  void append(const std::string& event);
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace keel::log
