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
  // `total_steps` <= 0: unknown. `show_scale`: a loss scaler is on (16-mixed).
  RunLoggers(const LogConfig& cfg, const std::string& out_dir, int64_t total_steps, bool show_scale,
             std::FILE* console = stdout);

  // `extra`: more fields for metrics.jsonl (e.g. eval_loss); its top-level numbers also go to
  // TensorBoard under their key.
  void log(const StepResult& r, const nlohmann::json& extra = nlohmann::json::object());

  ConsoleLogger* console() { return console_.get(); }
  MetricsWriter* metrics() { return metrics_.get(); }
  TensorBoardWriter* tensorboard() { return tensorboard_.get(); }

 private:
  std::unique_ptr<ConsoleLogger> console_;
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace keel::log
