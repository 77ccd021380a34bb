// metrics.jsonl: one JSON object per optimizer step, appended to out_dir/metrics.jsonl and flushed
// line by line (a crash loses at most the line being written; a resumed run appends).
//
// Keys: step, epoch, loss, grad_norm, learning_rate, loss_scale, skipped_steps, nan_steps,
// tokens_per_s; `rounded_away` (the share of the update's elements whose non-zero update left the
// stored bf16/f16 weight unchanged) when any did; `advice` when the trend advisor printed a line
// (one finding per line); then any extra fields given.
// JSON has no NaN or infinity: a non-finite number (in the fixed keys or in the extras) is written
// as the string "nan", "inf" or "-inf", so `"grad_norm": "inf"` is a step whose gradients
// overflowed. Readers must accept a string wherever a number is expected (docs/config.md, [log]).
#pragma once
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "keel/train/step_result.h"

namespace keel::log {

// `j` with every non-finite float replaced by its string (recursively; io::json_float).
nlohmann::json json_finite(const nlohmann::json& j);

// The record of one step, keys in the order above. `extra` must be an object (or null) whose keys
// differ from the fixed ones.
nlohmann::ordered_json metrics_record(const StepResult& r,
                                      const nlohmann::json& extra = nlohmann::json::object());

// Resume: rewrites OUT_DIR/metrics.jsonl (atomically) without the records of steps after `step`
// (the interrupted run logged them after its last checkpoint; the resumed run logs them again) and
// without a last line a crash cut short. Nothing to do when the file does not exist.
void drop_metrics_after(const std::string& out_dir, int64_t step);

class MetricsWriter {
 public:
  // Creates out_dir if needed and opens out_dir/metrics.jsonl for appending.
  explicit MetricsWriter(const std::string& out_dir);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const StepResult& r, const nlohmann::json& extra = nlohmann::json::object());
  // A record that is not a training step (an evaluation: {"step", "eval_loss", ...}), as HF's
  // log_history interleaves them. Non-finite numbers become strings, as above.
  void write_record(const nlohmann::json& record);
  const std::string& path() const { return path_; }

 private:
  void write_line(const std::string& text);
  std::string path_;
  std::FILE* f_ = nullptr;
  long whole_ = 0;  // the file's bytes up to its last whole line
};

}  // namespace keel::log
