#include "keel/log/loggers.h"

namespace keel::log {

RunLoggers::RunLoggers(const LogConfig& cfg, const std::string& out_dir, int64_t total_steps,
                       bool show_scale, std::FILE* console) {
  if (cfg.console)
    console_ = std::make_unique<ConsoleLogger>(
        ConsoleLogger::Options{total_steps, cfg.every, show_scale}, console);
  if (cfg.metrics) metrics_ = std::make_unique<MetricsWriter>(out_dir);
  if (cfg.tensorboard) tensorboard_ = std::make_unique<TensorBoardWriter>(out_dir);
}

void RunLoggers::log(const StepResult& r, const nlohmann::json& extra) {
  if (console_) console_->log(r);
  if (metrics_) metrics_->write(r, extra);
  if (tensorboard_) {
    tensorboard_->write(r);
    std::vector<std::pair<std::string, double>> scalars;
    if (extra.is_object())
      for (auto& [k, v] : extra.items())
        if (v.is_number()) scalars.emplace_back(k, v.get<double>());
    if (!scalars.empty()) tensorboard_->add_scalars(r.step, scalars);
  }
}

}  // namespace keel::log
