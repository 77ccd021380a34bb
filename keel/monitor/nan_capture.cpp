#include "keel/monitor/nan_capture.h"

#include <omp.h>

#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "keel/io/atomic_file.h"
#include "keel/io/checkpoint.h"
#include "keel/io/safetensors.h"

namespace keel::monitor {

namespace fs = std::filesystem;

static std::string utc_now() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string write_nan_capture(Trainer& trainer, const NonfiniteEvent& ev, int rank) {
  const std::string dir = trainer.out_dir() + "/debug/nan_capture/rank" + std::to_string(rank);
  nlohmann::json meta;
  meta["format"] = "keel-nan-capture";
  meta["format_version"] = 1;
  meta["keel_version"] = KEEL_VERSION;
  meta["step"] = ev.step;
  meta["epoch"] = ev.epoch;
  meta["rank"] = rank;
  meta["utc_time"] = utc_now();
  meta["precision"] = trainer.policy().name();
  meta["attention"] = ops::attention_backend_name(trainer.model().spec().attention);
  meta["threads"] = omp_get_max_threads();
  meta["config_toml"] = config_to_toml(trainer.config());
  meta["loss"] =
      std::isfinite(ev.loss) ? nlohmann::json(ev.loss) : nlohmann::json(std::to_string(ev.loss));
  meta["loss_finite"] = ev.loss_finite;
  meta["grad_norm"] = std::isfinite(ev.grad_norm) ? nlohmann::json(ev.grad_norm)
                                                  : nlohmann::json(std::to_string(ev.grad_norm));
  meta["nonfinite_params"] = ev.nonfinite_params;
  meta["rng"] = {{"seed", trainer.config().run.seed}, {"step_seed", ev.step_seed}};
  meta["micro_batches"] = ev.window ? ev.window->size() : 0;
  if (trainer.scaler()) meta["scaler"] = trainer.scaler()->state_dict();

  std::vector<std::pair<std::string, Tensor>> batches;
  if (ev.window)
    for (size_t i = 0; i < ev.window->size(); ++i) {
      const data::Batch& b = (*ev.window)[i];
      const std::string p = "mb" + std::to_string(i) + ".";
      batches.emplace_back(p + "input_ids", b.input_ids);
      batches.emplace_back(p + "labels", b.labels);
      batches.emplace_back(p + "attention_mask", b.attention_mask);
    }
  io::write_dir_atomic(dir, [&](const std::string& tmp) {
    io::write_safetensors(tmp + "/model.safetensors", trainer.model().named_parameters());
    io::write_safetensors(tmp + "/optimizer.safetensors", trainer.optimizer().state());
    io::write_safetensors(tmp + "/microbatches.safetensors", batches);
    io::write_file_atomic(tmp + "/capture.json", meta.dump(2) + "\n");
  });
  return dir;
}

}  // namespace keel::monitor
