// The loggers of a run, as [log] configures them: console line every `log.every` steps,
// metrics.jsonl and TensorBoard every step. The trainer calls log() once per optimizer step.
#pragma once
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "keel/log/console.h"
#include "keel/log/metrics.h"
#include "keel/log/tensorboard.h"
#include "keel/train/config.h"

namespace keel::log {

class RunLoggers {
 public:
  // `total_steps` <= 0: unknown. `show_scale`: a loss scaler is on (16-mixed). `resumed_at` >= 0:
  // the run resumed after that step, so TensorBoard hides what an earlier writer logged beyond it.
  RunLoggers(const LogConfig& cfg, const std::string& out_dir, int64_t total_steps, bool show_scale,
             std::FILE* console = stdout, int64_t resumed_at = -1);

  // `extra`: more fields for metrics.jsonl (e.g. eval_loss); its top-level numbers also go to
  // TensorBoard under their key.
  void log(const StepResult& r, const nlohmann::json& extra = nlohmann::json::object());

  // The end of an epoch: a console line, a metrics.jsonl record {step, epoch, epoch_loss,
  // epoch_tokens, epoch_updates} and the TensorBoard scalar epoch_loss at its last step. An epoch
  // that applied no update (only scaler skips) has no epoch_loss and says so.
  void log_epoch(const EpochResult& e);
  // A record that is not a training step ({"step", "eval_loss", ...}, an advisor finding): into
  // metrics.jsonl, and its numbers other than "step" to TensorBoard at that step under
  // `tb_prefix` + key (nothing when `to_tensorboard` is false).
  void log_record(const nlohmann::json& record, bool to_tensorboard = true,
                  const std::string& tb_prefix = "");

  ConsoleLogger* console() { return console_.get(); }
  MetricsWriter* metrics() { return metrics_.get(); }
  TensorBoardWriter* tensorboard() { return tensorboard_.get(); }

 private:
  std::FILE* console_out_ = nullptr;
  std::unique_ptr<ConsoleLogger> console_;
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace keel::log
