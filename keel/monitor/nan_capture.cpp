#include "keel/monitor/nan_capture.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "keel/backend/monitor.h"
#include "keel/io/atomic_file.h"
#include "keel/io/checkpoint.h"
#include "keel/io/json_fields.h"
#include "keel/io/safetensors.h"
#include "keel/numerics/hash.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/numerics/text.h"
#include "keel/numerics/utc_time.h"
#include "keel/ops/attention.h"
#include "keel/tensor/random.h"
#include "keel/train/checkpoint_contents.h"

namespace keel::monitor {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string double_bits_hex(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(bits));
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
  meta["device"] = trainer.run().device.str();  // where it ran (run.device = "cuda" may fall back)
  meta["config_toml"] = config_to_toml(trainer.config());
  meta["loss"] = io::json_float(ev.loss);
  meta["loss_bits"] = double_bits_hex(ev.loss);
  meta["loss_finite"] = ev.loss_finite;
  meta["grad_norm"] = io::json_float(ev.grad_norm);
  meta["grads_fingerprint"] = gradient_fingerprint(trainer.trainable());
  meta["loss_scale"] = ev.loss_scale;
  meta["nonfinite_params"] = ev.nonfinite_params;
  meta["first_nonfinite_param"] = ev.first_nonfinite_param;  // in the order backward produced them
  // One rank of a data-parallel run: what replaying this rank alone reproduces (its loss and its
  // gradients before the all-reduce; "loss" and "grads_fingerprint" are the reduced ones).
  meta["world_size"] = ev.world_size;
  meta["window_tokens"] = ev.window_tokens;
  if (ev.world_size > 1) {
    meta["local_tokens"] = ev.local_tokens;
    meta["local_loss"] = io::json_float(ev.local_loss);
    meta["local_loss_bits"] = double_bits_hex(ev.local_loss);
    meta["local_grads_fingerprint"] = ev.local_grads_fingerprint;
  }
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

  KEEL_CHECK(ev.rank == rank, "write_nan_capture: the event's rank is the capture's");
  std::vector<std::pair<std::string, Tensor>> batches;
  nlohmann::json mbs = nlohmann::json::array();
  if (ev.window)
    for (size_t i = 0; i < ev.window->size(); ++i) {
      const data::Batch& b = (*ev.window)[i];
      const std::string p = "mb" + std::to_string(i) + ".";
      batches.emplace_back(p + "input_ids", b.input_ids);
      batches.emplace_back(p + "labels", b.labels);
      batches.emplace_back(p + "attention_mask", b.attention_mask);
      if (b.position_ids.defined()) batches.emplace_back(p + "position_ids", b.position_ids);
      // Micro-batch i of rank r is micro-batch r + i * W of the global window (its dropout seed).
      const uint64_t global =
          static_cast<uint64_t>(ev.rank) + i * static_cast<uint64_t>(ev.world_size);
      mbs.push_back({{"index", i},
                     {"global_index", global},
                     {"rows", b.input_ids.size(0)},
                     {"n_targets", b.n_targets},
                     {"dropout_seed", mix_seed(ev.step_seed, global)},
                     {"example_ids", b.example_ids}});
    }
  meta["micro_batches"] = mbs;
  // An adapter run over an HF directory captures its trained tensors only, with the reference to
  // the base that its checkpoints carry (train/checkpoint_contents.h); replay rebuilds the base.
  meta["base"] = trainer.run().base_ref;
  // The data files as the run read them: a replay names a file changed since (the step replays
  // from the captured micro-batches, but their example ids index the file as it was).
  nlohmann::json files = nlohmann::json::object();
  for (const auto& [key, f] : trainer.run().data.files)
    if (f.known()) files[key] = {{"bytes", f.bytes}, {"fnv1a64", f.fnv1a64}};
  meta["data_files"] = files;
  io::write_dir_atomic(dir, [&](const std::string& tmp) {
    io::write_safetensors(tmp + "/model.safetensors",
                          saved_parameters(trainer.model(), trainer.config()));
    io::write_safetensors(tmp + "/optimizer.safetensors", trainer.optimizer().state());
    io::write_safetensors(tmp + "/microbatches.safetensors", batches);
    io::write_file_atomic(tmp + "/capture.json", meta.dump(2) + "\n");
  });
  return dir;
}

// ---- reading a capture back

namespace {

// Names the captures below `dir` when it is a run's out_dir or its debug/nan_capture (the
// error said only where keel writes them, to a user who had passed the run).
std::string capture_hint(const std::string& dir = "") {
  std::string found;
  std::error_code ec;
  for (const std::string& d : {dir + "/debug/nan_capture", dir})
    if (!dir.empty() && fs::is_directory(d, ec))
      for (const auto& e : fs::directory_iterator(d, ec))
        if (e.path().filename().string().rfind("rank", 0) == 0 &&
            fs::exists(e.path() / "capture.json", ec))
          found += (found.empty() ? "" : ", ") + e.path().string();
  if (!found.empty()) return "it holds the capture " + found + ": pass that directory";
  return "keel train writes a capture to out_dir/debug/nan_capture/rank0 when a step is "
         "non-finite; pass that directory";
}

}  // namespace

const json& capture_field(const Capture& c, const char* key) {
  if (!c.meta.contains(key))
    throw Error(c.dir + "/capture.json: missing \"" + key +
                    "\"; the file is incomplete or was written by another tool (write a new "
                    "capture by re-running the training)",
                Error::kUsage);
  return c.meta.at(key);
}

Error capture_field_type_error(const Capture& c, const char* key) {
  return Error(c.dir + "/capture.json: \"" + key + "\" has the wrong type (" +
                   capture_field(c, key).dump() +
                   "); the file is corrupt (re-run the training to write a new capture)",
               Error::kUsage);
}

Capture read_nan_capture(const std::string& dir) {
  Capture c;
  c.dir = dir;
  if (!fs::is_directory(dir))
    throw Error("replay: " + dir + " is not a directory; " + capture_hint(), Error::kUsage);
  const std::string meta_path = dir + "/capture.json";
  if (!fs::exists(meta_path))
    throw Error(
        meta_path + ": missing; " + dir + " is not a NaN capture (" + capture_hint(dir) + ")",
        Error::kUsage);
  try {
    c.meta = json::parse(io::read_file(meta_path));
  } catch (const json::exception& e) {
    throw Error(meta_path + ": not valid JSON (" + json_error_detail(e.what()) +
                    "); the capture is corrupt: re-run the training to write a new one",
                Error::kUsage);
  }
  if (!c.meta.is_object() || !c.meta.contains("format") || c.meta["format"] != kCaptureFormat)
    throw Error(meta_path + ": not a keel NaN capture (\"format\" is not \"" +
                    std::string(kCaptureFormat) + "\"); " + capture_hint(),
                Error::kUsage);
  const int version = capture_field_as<int>(c, "format_version");
  if (version > kCaptureFormatVersion)
    throw Error(meta_path + ": format_version " + std::to_string(version) +
                    " is newer than this keel reads (" + std::to_string(kCaptureFormatVersion) +
                    "); replay it with the keel that wrote it (" +
                    c.meta.value("keel_version", json("?")).dump() + ")",
                Error::kUsage);
  for (const char* key : {"step", "config_toml", "threads", "loss_bits", "grads_fingerprint",
                          "loss_scale", "rng", "micro_batches", "precision", "attention"})
    capture_field(c, key);
  // Replay uses the captured thread count (capped at the cores by the trainer, with a warning).
  const json& threads = capture_field(c, "threads");
  if (!threads.is_number_integer() || threads.get<int64_t>() < 1 || threads.get<int64_t>() > 4096)
    throw Error(meta_path + ": \"threads\" = " + threads.dump() +
                    " is not a thread count in [1, 4096]; the capture is corrupt (re-run the "
                    "training to write a new one)",
                Error::kUsage);
  if (!capture_field(c, "rng").is_object() || !capture_field(c, "rng").contains("step_seed"))
    throw Error(meta_path +
                    ": \"rng\" lacks \"step_seed\"; the capture is incomplete (re-run the "
                    "training to write a new one)",
                Error::kUsage);
  // Edited values replayed as "bit-exact yes": a loss scale of -5, a step seed of -1 (read as
  // 2^64 - 1). Each is held to what the writer writes: a scale is positive and finite, a seed a
  // non-negative integer (run.seed at most 2^63 - 1, as the config bounds it; a step seed any 64
  // bits), a count a non-negative integer.
  auto corrupt = [&](const std::string& field, const json& v, const std::string& what) {
    return Error(meta_path + ": \"" + field + "\" = " + v.dump() + " is not " + what +
                     "; the capture is corrupt (re-run the training to write a new one)",
                 Error::kUsage);
  };
  const json& scale = capture_field(c, "loss_scale");
  if (!scale.is_number()) throw capture_field_type_error(c, "loss_scale");
  if (!std::isfinite(scale.get<double>()) || !(scale.get<double>() > 0))
    throw corrupt("loss_scale", scale, "a loss scale (a positive finite number)");
  const json& rng = capture_field(c, "rng");
  if (!rng["step_seed"].is_number_unsigned())
    throw corrupt("rng.step_seed", rng["step_seed"], "a seed (an integer in [0, 2^64))");
  if (rng.contains("seed") && !(rng["seed"].is_number_unsigned() &&
                                rng["seed"].get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)))
    throw corrupt("rng.seed", rng["seed"], "a seed (an integer in [0, 2^63), as run.seed)");
  auto is_count = [](const json& v) { return v.is_number_unsigned(); };
  for (const char* key : {"epoch", "window_tokens", "local_tokens"}) {
    if (!c.meta.contains(key)) continue;
    if (!c.meta[key].is_number_integer()) throw capture_field_type_error(c, key);
    if (!is_count(c.meta[key])) throw corrupt(key, c.meta[key], "a count (a non-negative integer)");
  }
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "microbatches.safetensors"})
    if (!fs::exists(dir + "/" + f))
      throw Error(dir + "/" + f +
                      ": missing; the capture is incomplete (it is written atomically, "
                      "so the directory was changed afterwards): re-run the training",
                  Error::kUsage);
  // A file cut short or overwritten: the reader names the file and the problem (it said nothing of
  // the fix, and exited 1 where every other problem of a capture exits 2).
  auto read_part = [&](const char* f) {
    try {
      return io::read_safetensors(dir + "/" + f);
    } catch (const Error& e) {
      throw Error(std::string(e.what()) +
                      "; the capture is corrupt: re-run the training to write a new one",
                  Error::kUsage);
    }
  };
  c.model = read_part("model.safetensors");
  c.optimizer = read_part("optimizer.safetensors");
  c.batches = read_part("microbatches.safetensors");
  const json& mbs = capture_field(c, "micro_batches");
  if (!mbs.is_array() || mbs.empty())
    throw Error(meta_path + ": \"micro_batches\" must be a non-empty list; the capture is corrupt",
                Error::kUsage);
  for (size_t i = 0; i < mbs.size(); ++i) {
    const std::string p = "mb" + std::to_string(i) + ".";
    data::Batch b;
    // Looked up first, so that the error says the capture is corrupt and how to get a new one
    // (Safetensors::at's would name the tensor alone).
    for (const char* t : {"input_ids", "labels"})
      if (!c.batches.find(p + t))
        throw Error(
            dir + "/microbatches.safetensors: " + p + t + " is missing, but " + meta_path +
                " lists " + std::to_string(mbs.size()) +
                " micro-batches; the capture is corrupt: re-run the training to write a new one",
            Error::kUsage);
    b.input_ids = c.batches.at(p + "input_ids");
    b.labels = c.batches.at(p + "labels");
    if (const Tensor* m = c.batches.find(p + "attention_mask")) b.attention_mask = *m;
    // The mask reached attention unchecked: its error named no file ("key_padding_mask must be
    // u8 [B, T]", exit 1).
    if (b.attention_mask.defined() &&
        (b.attention_mask.dtype() != DType::U8 || b.attention_mask.shape() != b.input_ids.shape()))
      throw Error(dir + "/microbatches.safetensors: " + p + "attention_mask is " +
                      dtype_name(b.attention_mask.dtype()) + " " +
                      shape_str(b.attention_mask.shape()) + ", not u8 " +
                      shape_str(b.input_ids.shape()) +
                      " as its input_ids; the capture is corrupt: re-run the training to write a "
                      "new one",
                  Error::kUsage);
    // A packed run's rows: which tokens start an example (ops::attention checks the rest).
    if (const Tensor* pos = c.batches.find(p + "position_ids")) {
      if (pos->dtype() != DType::I64 || pos->shape() != b.input_ids.shape())
        throw Error(dir + "/microbatches.safetensors: " + p + "position_ids is " +
                        dtype_name(pos->dtype()) + " " + shape_str(pos->shape()) + ", not i64 " +
                        shape_str(b.input_ids.shape()) +
                        " as its input_ids; the capture is corrupt: re-run the training to write "
                        "a new one",
                    Error::kUsage);
      if (const int64_t k = ops::first_bad_position(*pos); k >= 0)
        throw Error(dir + "/microbatches.safetensors: " + p + "position_ids holds " +
                        std::to_string(pos->data_as<int64_t>()[k]) + " at " +
                        shape_str(shape_index(pos->shape(), k)) +
                        ", where a packed row's position is 0 (an example's first token) or "
                        "the one before it plus 1; the capture is corrupt: re-run the training "
                        "to write a new one",
                    Error::kUsage);
      b.position_ids = *pos;
    }
    if (b.input_ids.dtype() != DType::I64 || b.labels.dtype() != DType::I64 ||
        b.input_ids.dim() != 2 || b.labels.shape() != b.input_ids.shape())
      throw Error(dir + "/microbatches.safetensors: " + p +
                      "input_ids / labels must be i64 [B, T] of the same shape; the capture is "
                      "corrupt",
                  Error::kUsage);
    const int64_t* lab = b.labels.data_as<int64_t>();
    for (int64_t k = 0; k < b.labels.numel(); ++k) b.n_targets += lab[k] != data::kIgnoreLabel;
    const std::string field = "micro_batches[" + std::to_string(i) + "]";
    if (mbs[i].is_object()) {
      for (const char* key : {"index", "global_index", "rows", "n_targets"})
        if (mbs[i].contains(key) && !is_count(mbs[i][key]))
          throw corrupt(field + "." + key, mbs[i][key], "a count (a non-negative integer)");
      if (mbs[i].contains("example_ids")) {
        const json& ids = mbs[i]["example_ids"];
        if (!ids.is_array() || !std::all_of(ids.begin(), ids.end(), is_count))
          throw corrupt(field + ".example_ids", ids,
                        "a list of example indices (non-negative integers)");
        b.example_ids = ids.get<std::vector<int64_t>>();
      }
    }
    c.window.push_back(std::move(b));
  }
  return c;
}

}  // namespace keel::monitor
