#include "keel/log/loggers.h"

#include <fmt/format.h>

namespace keel::log {

RunLoggers::RunLoggers(const LogConfig& cfg, const std::string& out_dir, int64_t total_steps,
                       bool show_scale, std::FILE* console, int64_t resumed_at) {
  if (cfg.console) console_out_ = console;
  if (cfg.console)
    console_ = std::make_unique<ConsoleLogger>(
        ConsoleLogger::Options{total_steps, cfg.every, show_scale}, console);
  if (cfg.metrics) metrics_ = std::make_unique<MetricsWriter>(out_dir);
  if (cfg.tensorboard)
    tensorboard_ =
        std::make_unique<TensorBoardWriter>(out_dir, resumed_at >= 0 ? resumed_at + 1 : -1);
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

void RunLoggers::log_epoch(const EpochResult& e) {
  if (console_out_) {
    const std::string line =
        e.updates > 0
            ? fmt::format(
                  "epoch {} | loss {} (token mean of {} applied step{}, {} tokens) | step {}\n",
                  e.epoch, format_number(e.loss, 4), e.updates, e.updates == 1 ? "" : "s", e.tokens,
                  e.step)
            : fmt::format(
                  "epoch {} | no update applied: its steps were the loss scaler's "
                  "calibration skips | step {}\n",
                  e.epoch, e.step);
    std::fputs(line.c_str(), console_out_);
    std::fflush(console_out_);
  }
  nlohmann::json rec = {{"step", e.step}, {"epoch", e.epoch}};
  if (e.updates > 0) rec["epoch_loss"] = e.loss;
  rec["epoch_tokens"] = e.tokens;
  rec["epoch_updates"] = e.updates;
  log_record(rec, false);
  if (tensorboard_ && e.updates > 0) tensorboard_->add_scalars(e.step, {{"epoch_loss", e.loss}});
}

void RunLoggers::log_record(const nlohmann::json& record, bool to_tensorboard,
                            const std::string& tb_prefix) {
  if (metrics_) metrics_->write_record(record);
  if (!tensorboard_ || !to_tensorboard || !record.contains("step")) return;
  std::vector<std::pair<std::string, double>> scalars;
  for (auto& [k, v] : record.items())
    if (k != "step" && v.is_number()) scalars.emplace_back(tb_prefix + k, v.get<double>());
  if (!scalars.empty()) tensorboard_->add_scalars(record.at("step").get<int64_t>(), scalars);
}

}  // namespace keel::log
