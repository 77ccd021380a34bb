#include "keel/monitor/nan_capture.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "keel/backend/monitor.h"
#include "keel/io/atomic_file.h"
#include "keel/io/checkpoint.h"
#include "keel/io/safetensors.h"
#include "keel/numerics/hash.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/numerics/utc_time.h"
#include "keel/tensor/random.h"

namespace keel::monitor {

namespace {

// JSON has no NaN/inf: non-finite numbers are written as strings ("nan", "inf", "-inf").
nlohmann::json number(double v) {
  if (std::isfinite(v)) return v;
  return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
}

}  // namespace

std::string double_bits_hex(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(bits));
  return buf;
}

std::string gradient_fingerprint(const std::vector<std::pair<std::string, Tensor>>& params) {
  uint64_t h = kNameHashStart;
  for (const auto& [name, p] : params) {
    if (!p.grad().defined()) continue;
    const Tensor g = p.grad().device().is_cpu() ? p.grad() : p.grad().to(Device::cpu());
    h = fnv1a(name.data(), name.size(), h);
    h = fnv1a(g.data(), g.numel() * dtype_size(g.dtype()), h);
  }
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string write_nan_capture(Trainer& trainer, const NonfiniteEvent& ev, int rank) {
  const std::string dir = trainer.out_dir() + "/debug/nan_capture/rank" + std::to_string(rank);
  const PrecisionPolicy& pol = trainer.policy();
  nlohmann::json meta;
  meta["format"] = kCaptureFormat;
  meta["format_version"] = kCaptureFormatVersion;
  meta["keel_version"] = KEEL_VERSION;
  meta["step"] = ev.step;
  meta["epoch"] = ev.epoch;
  meta["rank"] = rank;
  meta["utc_time"] = utc_time(kUtcIso8601);
  meta["precision"] = pol.name();
  meta["param_dtype"] = dtype_name(pol.param_dtype);
  meta["compute_dtype"] = dtype_name(pol.compute_dtype);
  meta["masters"] = pol.autocast;  // model.safetensors holds f32 masters of low-precision compute
  meta["attention"] = ops::attention_backend_name(trainer.model().spec().attention);
  meta["threads"] = omp_get_max_threads();
  meta["config_toml"] = config_to_toml(trainer.config());
  meta["loss"] = number(ev.loss);
  meta["loss_bits"] = double_bits_hex(ev.loss);
  meta["loss_finite"] = ev.loss_finite;
  meta["grad_norm"] = number(ev.grad_norm);
  meta["grads_fingerprint"] = gradient_fingerprint(trainer.trainable());
  meta["loss_scale"] = ev.loss_scale;
  meta["nonfinite_params"] = ev.nonfinite_params;
  // Parameters whose values (not only gradients) are already non-finite: the step cannot be
  // fixed by any numerics change, the state came in broken (a corrupt checkpoint, an earlier
  // update that overflowed).
  std::vector<std::string> bad_values;
  for (auto& [name, p] : trainer.model().named_parameters())
    if (!monitor_kernels(p.device()).stats(p.data(), p.dtype(), p.numel(), p.dtype()).all_finite())
      bad_values.push_back(name);
  meta["nonfinite_param_values"] = bad_values;
  meta["rng"] = {{"seed", trainer.config().run.seed},
                 {"step_seed", ev.step_seed},
                 {"dropout", "micro-batch i: mix_seed(step_seed, i), mixed with the module path"}};
  meta["scaler"] =
      trainer.scaler() ? nlohmann::json(trainer.scaler()->state_dict()) : nlohmann::json(nullptr);

  std::vector<std::pair<std::string, Tensor>> batches;
  nlohmann::json mbs = nlohmann::json::array();
  if (ev.window)
    for (size_t i = 0; i < ev.window->size(); ++i) {
      const data::Batch& b = (*ev.window)[i];
      const std::string p = "mb" + std::to_string(i) + ".";
      batches.emplace_back(p + "input_ids", b.input_ids);
      batches.emplace_back(p + "labels", b.labels);
      batches.emplace_back(p + "attention_mask", b.attention_mask);
      mbs.push_back({{"index", i},
                     {"rows", b.input_ids.size(0)},
                     {"n_targets", b.n_targets},
                     {"dropout_seed", mix_seed(ev.step_seed, i)},
                     {"example_ids", b.example_ids}});
    }
  meta["micro_batches"] = mbs;
  io::write_dir_atomic(dir, [&](const std::string& tmp) {
    io::write_safetensors(tmp + "/model.safetensors", trainer.model().named_parameters());
    io::write_safetensors(tmp + "/optimizer.safetensors", trainer.optimizer().state());
    io::write_safetensors(tmp + "/microbatches.safetensors", batches);
    io::write_file_atomic(tmp + "/capture.json", meta.dump(2) + "\n");
  });
  return dir;
}

}  // namespace keel::monitor
