// `keel train [CONFIG.toml] [--set section.key=value ...]`: trains a model. With no config it
// trains the built-in arithmetic task, which visibly learns in about a minute on two cores.
#include <cstdio>
#include <filesystem>

#include "apps/keel/commands.h"
#include "keel/io/atomic_file.h"
#include "keel/log/loggers.h"
#include "keel/monitor/nan_capture.h"
#include "keel/train/trainer.h"

namespace keel::cli {

namespace {
struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
};

int run_train(const TrainArgs& a) {
  Config cfg = load_config(a.config, a.sets);
  std::unique_ptr<log::RunLoggers> loggers;
  Trainer* trainer_ptr = nullptr;
  TrainerHooks hooks;
  hooks.on_step = [&](const StepResult& r) { loggers->log(r); };
  hooks.on_eval = [&](const EvalResult& e) {
    std::printf("eval step %lld | loss %.4f", static_cast<long long>(e.step), e.loss);
    if (e.accuracy >= 0)
      std::printf(" | exact-match %.1f%% of %lld held-out problems", 100 * e.accuracy,
                  static_cast<long long>(e.examples));
    std::printf("\n");
    std::fflush(stdout);
    nlohmann::json rec = {{"step", e.step}, {"eval_loss", e.loss}, {"eval_tokens", e.tokens}};
    if (e.accuracy >= 0) rec["eval_accuracy"] = e.accuracy;
    if (loggers->metrics()) loggers->metrics()->write_record(rec);
  };
  hooks.on_capture = [&](const NonfiniteEvent& ev) {
    return monitor::write_nan_capture(*trainer_ptr, ev);
  };
  Trainer trainer(cfg, hooks);
  trainer_ptr = &trainer;
  std::filesystem::create_directories(trainer.out_dir());
  io::write_file_atomic(trainer.out_dir() + "/config.toml", config_to_toml(trainer.config()));
  loggers = std::make_unique<log::RunLoggers>(cfg.log, trainer.out_dir(), trainer.total_steps(),
                                              trainer.scaler() != nullptr);
  const auto& spec = trainer.model().spec();
  std::printf(
      "keel train | %s %lldL %lld-wide %lld heads | %.2fM params | %s | attention %s | "
      "%lld steps | out %s\n",
      spec.family.c_str(), static_cast<long long>(spec.n_layer),
      static_cast<long long>(spec.n_embd), static_cast<long long>(spec.n_head),
      trainer.model().num_parameters() / 1e6, trainer.policy().name().c_str(),
      ops::attention_backend_name(spec.attention), static_cast<long long>(trainer.total_steps()),
      trainer.out_dir().c_str());
  std::fflush(stdout);
  const int code = trainer.fit();
  if (code != 0) {
    std::fprintf(stderr, "stopped: %s\n", trainer.stop_message().c_str());
    return code;
  }
  std::printf("done: %lld steps, checkpoint in %s/checkpoints/last\n",
              static_cast<long long>(trainer.steps_done()), trainer.out_dir().c_str());
  return 0;
}
}  // namespace

Command add_train(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* sub =
      app.add_subcommand("train", "Train a model (no CONFIG: the built-in arithmetic task)");
  sub->add_option("CONFIG", args->config, "TOML config (every key: docs/config.md)");
  sub->add_option("--set", args->sets, "override a key: section.key=value (repeatable)")
      ->allow_extra_args(false);
  return {sub, [args] { return run_train(*args); }};
}

}  // namespace keel::cli
