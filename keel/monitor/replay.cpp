#include "keel/monitor/replay.h"

#include "keel/monitor/replay_step.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <tuple>
#include <utility>

#include "keel/backend/monitor.h"
#include "keel/io/json_fields.h"
#include "keel/monitor/grad_norms.h"
#include "keel/monitor/inject.h"
#include "keel/monitor/nan_capture.h"
#include "keel/monitor/tracer.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/numerics/text.h"
#include "keel/ops/elementwise.h"
#include "keel/train/checkpoint_contents.h"
#include "keel/train/trainer.h"

namespace keel::monitor {

namespace fs = std::filesystem;
using json = nlohmann::json;

Config replay_config(const Capture& c, const std::string& out_dir,
                     const std::vector<std::string>& sets) {
  // The rebuilt run writes only below out_dir, never resumes, and uses the captured thread count
  // (reductions are chunked per thread: bit-exactness needs the same count).
  std::vector<std::string> ov = {
      "run.out_dir=" + out_dir, "run.resume=false",
      "run.threads=" + std::to_string(capture_field_as<int>(c, "threads")),
      "debug.underflow_overflow.enabled=false"};
  const std::string text = capture_field_as<std::string>(c, "config_toml");
  const std::string name = c.dir + "/capture.json's config_toml";
  // The captured config alone first: its errors are the capture's (edited, or written by another
  // keel whose keys differ), and said so with the fix; they named the line and not what to do.
  // The --set overrides' own errors come after, as keel train's.
  try {
    load_config_text(text, name, {});
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + "; the capture's config does not load in this keel (" +
                    KEEL_VERSION +
                    "): it was changed after it was written, or written by another keel (" +
                    c.meta.value("keel_version", json("?")).dump() +
                    "): replay it with the keel that wrote it, or re-run the training to write "
                    "a new capture",
                Error::kUsage);
  }
  ov.insert(ov.end(), sets.begin(), sets.end());
  return load_config_text(text, name, ov);
}

namespace {

// The captured (world size, rank). A version 1 capture has no world size: it replays as one
// process (its tracer log still named after its rank).
std::pair<int, int> captured_rank(const Capture& c) {
  const bool sized = c.meta.contains("world_size");
  const int world = sized ? capture_field_as<int>(c, "world_size") : 1;
  const int rank = c.meta.contains("rank") ? capture_field_as<int>(c, "rank") : 0;
  if (world < 1 || world > (1 << 20) || rank < 0 || (sized && rank >= world))
    throw Error(c.dir + "/capture.json: \"rank\" = " + std::to_string(rank) +
                    " is not a rank of \"world_size\" = " + std::to_string(world) +
                    "; the capture is corrupt (re-run the training to write a new one)",
                Error::kUsage);
  return {world, rank};
}

const char* const kModelPathFix =
    "point model.path at the base model the run was trained on (--set model.path=DIR)";

nlohmann::json captured_base(const Capture& c) {
  return c.meta.contains("base") ? c.meta["base"] : nlohmann::json(nullptr);
}

// The model directory the captured run was built from must still be what it was, checked before
// the run is rebuilt: an adapter run's base against the capture's fingerprint of it, a full
// fine-tune's model.path (its config.json gives the model's shapes) for being there. A moved
// directory failed inside the loader with "no config.json", naming neither the capture nor the fix.
void check_model_path(const Capture& c, const Config& cfg) {
  const nlohmann::json ref = captured_base(c);
  if (!ref.is_null()) return check_saved_base(ref, c.dir, cfg, kModelPathFix, "capture");
  if (cfg.model.path.empty() || fs::is_directory(cfg.model.path)) return;
  throw Error(c.dir +
                  "/capture.json: the captured run was built from model.path = " + cfg.model.path +
                  ", which is not a directory any more (moved or removed since the capture); " +
                  kModelPathFix,
              Error::kUsage);
}

// A data file that is there but not what the captured run read: the step still replays from the
// captured micro-batches, but the example ids the capture and the report name index the old file
// (the replay said nothing, as if the file were the one trained on).
void note_changed_data(const Capture& c, const Run& run, std::vector<std::string>& notes) {
  const nlohmann::json& files = c.meta.contains("data_files") ? c.meta["data_files"] : nullptr;
  if (!files.is_object()) return;  // written before keel recorded them
  for (const auto& [key, now] : run.data.files) {
    if (!now.known() || !files.contains(key)) continue;
    const nlohmann::json& then = files[key];
    FileFingerprint was;
    if (then.is_object() && then.contains("bytes") && then["bytes"].is_number_integer() &&
        then.contains("fnv1a64") && then["fnv1a64"].is_string())
      was = {then["bytes"].get<int64_t>(), then["fnv1a64"].get<std::string>()};
    if (was == now) continue;
    notes.push_back(key + " = " +
                    (key == "data.path" ? run.cfg.data.path : run.cfg.data.eval_path) +
                    " changed since the capture (" + (was.known() ? was.text() : "unrecorded") +
                    " then, " + now.text() +
                    " now): the step replays from the captured micro-batches, and the dataset "
                    "example ids name the file as it was");
  }
}

// The captured ids against the rebuilt model's vocabulary: an id or label beyond it reached the
// embedding or the loss, whose errors named no file (exit 1).
void check_window_ids(const Capture& c, int64_t vocab) {
  for (size_t m = 0; m < c.window.size(); ++m) {
    const data::Batch& b = c.window[m];
    for (const auto& [what, t] : {std::pair<const char*, const Tensor*>{"input_ids", &b.input_ids},
                                  {"labels", &b.labels}}) {
      const int64_t* v = t->data_as<int64_t>();
      const bool labels = std::string(what) == "labels";
      for (int64_t k = 0; k < t->numel(); ++k)
        if ((v[k] < 0 || v[k] >= vocab) && !(labels && v[k] == data::kIgnoreLabel))
          throw Error(c.dir + "/microbatches.safetensors: mb" + std::to_string(m) + "." + what +
                          " holds " + std::to_string(v[k]) + " at " +
                          shape_str(shape_index(t->shape(), k)) +
                          ", outside the model's vocabulary [0, " + std::to_string(vocab) + ")" +
                          (labels ? " (nor the ignored label -100)" : "") +
                          "; the capture is corrupt: re-run the training to write a new one",
                      Error::kUsage);
    }
  }
}

// Loads the captured parameters (converted when the replay's policy stores them in another
// dtype) and, when the parameters match exactly, the optimizer and scaler state.
void load_state(Run& run, const Capture& c, std::vector<std::string>& notes) {
  bool same_dtypes = true;
  const nlohmann::json ref = captured_base(c);
  // bisect's adapter=none trains the referenced base whole: its tensors are model.path's (checked
  // by check_model_path), as the captured run's were (the trial said the capture was "written by
  // another model config").
  const bool base_trains = !ref.is_null() && run.cfg.model.adapter.kind == "none";
  // A full fine-tune over model.path: a tensor that does not fit may be the directory's doing.
  const std::string changed = run.cfg.model.path.empty() || !ref.is_null()
                                  ? std::string()
                                  : " (or model.path = " + run.cfg.model.path +
                                        " now holds another model than the "
                                        "captured run's: " +
                                        kModelPathFix + ")";
  for (auto& [name, p] : run.model->named_parameters()) {
    const Tensor* t = c.model.find(name);
    if (!t && (base_trains || from_referenced_base(ref, *run.model, p)))
      continue;  // rebuilt from model.path
    if (!t)
      throw Error(c.dir + "/model.safetensors: tensor '" + name +
                      "' is missing (the capture was written by another model config?)" + changed,
                  Error::kUsage);
    if (t->shape() != p.shape())
      throw Error(c.dir + "/model.safetensors: tensor '" + name + "' is " + shape_str(t->shape()) +
                      ", the model expects " + shape_str(p.shape()) + "; the capture is corrupt" +
                      changed,
                  Error::kUsage);
    Tensor dst = p;
    if (t->dtype() == p.dtype()) {
      dst.copy_from(*t);
    } else {
      same_dtypes = false;
      dst.copy_from(t->to_dtype(p.dtype()));
    }
    dst.bump_version();
  }
  if (same_dtypes) {
    try {
      run.optimizer->load_state(c.optimizer.tensors);
    } catch (const Error& e) {
      notes.push_back(std::string("optimizer state not loaded: ") + e.what());
    }
  } else {
    notes.push_back(
        "parameters converted from the captured dtype; optimizer state not loaded "
        "(it does not act before the update)");
  }
  if (run.scaler && c.meta.contains("scaler") && c.meta["scaler"].is_object()) {
    try {
      run.scaler->load_state_dict(c.meta["scaler"].get<std::map<std::string, double>>());
    } catch (const Error& e) {  // it said "the loss scaler's state: missing key", of no file
      throw Error(c.dir + "/capture.json: \"scaler\": " + e.what() +
                      "; the capture is corrupt (re-run the training to write a new one)",
                  Error::kUsage);
    }
  }
}

}  // namespace

StepOutcome replay_step(const Capture& c, const std::string& out_dir,
                        const std::vector<std::string>& sets, bool with_tracer, double loss_scale) {
  StepOutcome o;
  // One rank of a data-parallel run (format 2): its micro-batches are rank, rank + W, ... of the
  // global window, weighted by the global window's tokens.
  std::tie(o.world_size, o.rank) = captured_rank(c);
  fs::create_directories(out_dir);
  RunOptions ro;
  ro.data_optional = true;  // the step's micro-batches come from the capture
  // The run factory's notices are about the config this step runs: the replay's report lists
  // them; a bisect trial's config is the bisect's change (adapter=none said "this run trains
  // every parameter" of a LoRA run), and its notes are dropped.
  ro.say = [&o](const std::string& m) {
    o.notes.push_back(m.rfind("note: ", 0) == 0 ? m.substr(6) : m);  // listed as notes already
  };
  const Config cfg = replay_config(c, out_dir, sets);
  check_model_path(c, cfg);
  Run run = build_run(cfg, ro);
  for (const std::string& what : run.not_rebuilt) o.notes.push_back("not rebuilt: " + what);
  note_changed_data(c, run, o.notes);
  check_window_ids(c, run.model->spec().vocab_size);
  double sum_sq = 0;
  int64_t n = 0;
  for (const auto& [name, p] : run.trainable)
    if (p.dim() >= 2) sum_sq += ops::sum_squares(p), n += p.numel();
  if (n > 0) o.init_weight_rms = std::sqrt(sum_sq / static_cast<double>(n));
  load_state(run, c, o.notes);
  const LargestWeight w = largest_weight(run.trainable);
  o.largest_weight = w.value;
  o.largest_weight_param = w.param;
  o.precision = run.policy.name();
  o.device = run.device.str();
  o.attention = ops::attention_backend_name(run.model->spec().attention);
  o.vocab_size = run.model->spec().vocab_size;
  const int64_t step = capture_field_as<int64_t>(c, "step");
  const uint64_t step_seed = capture_field(c, "rng").at("step_seed").get<uint64_t>();
  // The captured scale when the replay has a scaler too; a scaler the capture did not have starts
  // from its configured initial scale.
  const bool captured_scaler = c.meta.contains("scaler") && c.meta["scaler"].is_object();
  if (run.scaler)
    o.loss_scale = loss_scale > 0    ? loss_scale
                   : captured_scaler ? capture_field_as<double>(c, "loss_scale")
                                     : run.scaler->get_scale();

  // The configured fault injection is part of the step; its hook goes before the tracer's so
  // the tracer sees the corrupted output (inject.h).
  std::unique_ptr<FaultInjector> injector;
  if (!run.cfg.debug.inject.module.empty()) {
    injector = std::make_unique<FaultInjector>(*run.model, run.cfg.debug.inject);
    injector->begin_step(step);
  }
  std::unique_ptr<UnderflowOverflowTracer> tracer;
  if (with_tracer) {
    TracerOptions topt{run.cfg.debug.underflow_overflow};
    topt.trace_batch_nums.clear();
    topt.abort_after_batch_num = -1;
    topt.format = run.policy.compute_dtype;
    topt.scaler_handles_backward = run.scaler != nullptr;
    tracer = std::make_unique<UnderflowOverflowTracer>(
        *run.model, topt,
        out_dir + "/debug/underflow_overflow_rank" + std::to_string(o.rank) + ".log");
    tracer->set_stop_on_finding(false);
    tracer->begin_batch(step);
  }
  run.optimizer->zero_grad();
  run.model->train(true);
  int64_t tokens = 0;
  for (auto& b : c.window) tokens += b.n_targets;
  int64_t window_tokens = -1;  // one process: the window's own
  if (o.world_size > 1) {
    window_tokens = capture_field_as<int64_t>(c, "window_tokens");
    if (window_tokens < tokens)
      throw Error(c.dir + "/capture.json: \"window_tokens\" = " + std::to_string(window_tokens) +
                      " is fewer than the captured micro-batches' " + std::to_string(tokens) +
                      " target tokens; the capture is corrupt",
                  Error::kUsage);
  }
  const double loss_sum = forward_backward(run, c.window, step_seed, o.loss_scale, window_tokens,
                                           o.world_size > 1 ? o.rank : 0, o.world_size);
  // Exactly as Trainer::train_step computes the logged loss (one rank: its local loss, its sum
  // over its own tokens).
  o.loss = tokens > 0 ? loss_sum / static_cast<double>(tokens) : 0.0;
  if (o.world_size > 1 && tokens == 0) o.loss = loss_sum;
  o.loss_bits = double_bits_hex(o.loss);
  // One rank: its gradients before the all-reduce, as the trainer fingerprinted them.
  if (o.world_size > 1) o.grads_fingerprint = gradient_fingerprint(run.trainable);
  std::vector<Tensor> grads;
  for (auto& [name, p] : run.trainable)
    if (p.grad().defined()) {
      grads.push_back(p.grad());
      const Tensor& g = p.grad();
      const TensorStats st =
          monitor_kernels(g.device()).stats(g.data(), g.dtype(), g.numel(), g.dtype());
      if (!st.all_finite()) o.nonfinite_params.push_back(name);
      if (st.abs_max > o.largest_grad) {
        o.largest_grad = st.abs_max;
        o.largest_grad_param = name;
      }
    }
  if (!o.nonfinite_params.empty())
    o.first_nonfinite_param = in_backward_order(run.trainable, o.nonfinite_params).front();
  const amp::GradPass pass = run.scaler ? run.scaler->unscale_pass(grads) : amp::grad_pass(grads);
  if (o.world_size == 1)
    o.grads_fingerprint = gradient_fingerprint(run.trainable);  // after unscale, as captured
  o.grad_norm = pass.norm();
  o.finite = std::isfinite(o.loss) && std::isfinite(o.grad_norm) && o.nonfinite_params.empty();
  if (tracer) o.finding = tracer->finding();
  return o;  // the tracer and the injector (declared after the run) detach before it goes
}

namespace {

std::string temp_out_dir() {
  std::string tmpl = (fs::temp_directory_path() / "keel-replay-XXXXXX").string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data()))
    throw Error("replay: cannot create a temporary directory under " +
                fs::temp_directory_path().string() + "; pass an output directory");
  return buf.data();
}

bool writable_dir(const std::string& d) {
  std::error_code ec;
  fs::create_directories(d, ec);
  return !ec && access(d.c_str(), W_OK) == 0;
}

ReplayResult replay_unchecked(const std::string& dir, const ReplayOptions& opt);

}  // namespace

// Every field read is checked where it is used; a type no check foresaw still names the file.
ReplayResult replay_capture(const std::string& dir, const ReplayOptions& opt) {
  try {
    return replay_unchecked(dir, opt);
  } catch (const nlohmann::json::exception& e) {
    throw Error(dir + "/capture.json: a field is missing or has the wrong type (" +
                    io::json_problem(e) +
                    "); the capture is corrupt: re-run the training to write a new one",
                Error::kUsage);
  }
}

namespace {

// capture.json's step, precision and attention are reported as what was captured; they must be
// what the captured config trained with. An edited "precision": "fp8" replayed as "bit-exact
// yes", and a config_toml edited to 32-true against a 16-true capture as "reproduced no".
void check_captured_settings(const Capture& c, const ReplayResult& r) {
  const std::string meta = c.dir + "/capture.json";
  const std::string corrupt =
      "; the capture was changed after it was written (re-run the "
      "training to write a new one)";
  if (r.step < 0 || r.step > (int64_t{1} << 53))
    throw Error(meta + ": \"step\" = " + std::to_string(r.step) + " is not a step" + corrupt,
                Error::kUsage);
  const Config cfg = replay_config(c, c.dir, {});
  std::string precision;
  try {
    precision = resolve_precision(r.captured_precision, Device::cpu(), true).name();
  } catch (const Error&) {
  }
  if (precision != r.captured_precision)
    throw Error(meta + ": \"precision\" = \"" + r.captured_precision +
                    "\" is not a precision policy's name" + corrupt,
                Error::kUsage);
  // "auto" resolves per device: the capture's own device may differ from this one.
  if (cfg.train.precision != "auto" &&
      resolve_precision(cfg.train.precision, Device::cpu(), true).name() != precision)
    throw Error(meta + ": \"precision\" = \"" + precision + "\" but its config_toml trains in " +
                    cfg.train.precision + corrupt,
                Error::kUsage);
  std::string attention;
  try {
    attention = ops::attention_backend_name(ops::attention_backend_from_name(r.captured_attention));
  } catch (const Error&) {
  }
  if (attention != r.captured_attention ||
      attention !=
          ops::attention_backend_name(ops::attention_backend_from_name(cfg.model.attention)))
    throw Error(meta + ": \"attention\" = \"" + r.captured_attention +
                    "\" is not the attention backend its config_toml names (" +
                    cfg.model.attention + ")" + corrupt,
                Error::kUsage);
}

ReplayResult replay_unchecked(const std::string& dir, const ReplayOptions& opt) {
  const Capture c = read_nan_capture(dir);
  ReplayResult r;
  r.dir = dir;
  r.step = capture_field_as<int64_t>(c, "step");
  r.captured_precision = capture_field_as<std::string>(c, "precision");
  r.captured_attention = capture_field_as<std::string>(c, "attention");
  r.threads = capture_field_as<int>(c, "threads");
  std::tie(r.world_size, r.rank) = captured_rank(c);
  check_captured_settings(c, r);
  // One rank of several: its own loss and pre-reduce gradients are what a replay of it reproduces.
  const bool local = r.world_size > 1;
  r.recorded_loss_bits = capture_field_as<std::string>(c, local ? "local_loss_bits" : "loss_bits");
  if (c.meta.contains("nonfinite_param_values"))
    r.nonfinite_param_values = c.meta["nonfinite_param_values"].get<std::vector<std::string>>();
  r.out_dir = opt.out_dir;
  // The replay writes debug/underflow_overflow_rank{R}.log (and bisect/) below --out: a keel
  // run's out_dir (the captured run's own, typically) had its tracer log replaced without a word.
  for (const char* f : {"config.toml", "metrics.jsonl", ".keel.lock", "checkpoints"})
    if (!r.out_dir.empty() && fs::exists(fs::path(r.out_dir) / f))
      throw Error("replay --out " + r.out_dir + ": a keel run's out_dir (it holds " + f +
                      "); the replay writes its tracer log below it, over the run's own: pass "
                      "another directory (by default the replay writes to " +
                      dir + "/replay)",
                  Error::kUsage);
  if (r.out_dir.empty())
    r.out_dir = writable_dir(dir + "/replay") ? dir + "/replay" : temp_out_dir();

  std::vector<std::string> sets = opt.sets;
  if (!opt.precision.empty()) sets.push_back("train.precision=" + opt.precision);
  if (!opt.attention.empty()) sets.push_back("model.attention=" + opt.attention);
  const StepOutcome main = replay_step(c, r.out_dir, sets, opt.tracer);
  r.precision = main.precision;
  r.attention = main.attention;
  r.loss = main.loss;
  r.loss_bits = main.loss_bits;
  r.grad_norm = main.grad_norm;
  r.loss_scale = main.loss_scale;
  r.nonfinite_params = main.nonfinite_params;
  r.largest_grad_param = main.largest_grad_param;
  r.largest_grad = main.largest_grad;
  r.largest_weight_param = main.largest_weight_param;
  r.largest_weight = main.largest_weight;
  r.init_weight_rms = main.init_weight_rms;
  r.reproduced = !main.finite;
  r.grads_fingerprint = main.grads_fingerprint;
  r.recorded_grads_fingerprint = local ? capture_field_as<std::string>(c, "local_grads_fingerprint")
                                       : c.meta.value("grads_fingerprint", std::string());
  if (c.meta.contains("first_nonfinite_param"))
    r.recorded_first_nonfinite_param = capture_field_as<std::string>(c, "first_nonfinite_param");
  r.loss_bit_exact = main.loss_bits == r.recorded_loss_bits;
  r.grads_bit_exact = r.grads_fingerprint == r.recorded_grads_fingerprint;
  r.first_nonfinite_param = main.first_nonfinite_param;
  r.bit_exact = r.loss_bit_exact && r.grads_bit_exact;
  r.notes = main.notes;
  // Another keel's kernels may round differently: a capture it wrote that replays under its own
  // settings but not bit-exactly says why (the report said only "bit-exact no").
  if (const std::string by = c.meta.value("keel_version", std::string());
      !r.bit_exact && by != KEEL_VERSION && r.precision == r.captured_precision &&
      r.attention == r.captured_attention)
    r.notes.push_back("the capture was written by keel " + (by.empty() ? "(unknown)" : by) +
                      ", this is keel " + KEEL_VERSION +
                      ": its kernels may round differently (replay it with the keel that wrote it "
                      "for bit-exactness)");
  // A capture of a GPU run replayed on the CPU (or the reverse) runs other kernels: its bits
  // differ, and the report said only "bit-exact no".
  if (const std::string dev = c.meta.value("device", std::string());
      !r.bit_exact && !dev.empty() && (dev == "cpu") != (main.device == "cpu"))
    r.notes.push_back(
        "the capture was written on " + dev + ", this replay ran on " + main.device +
        ": the other device's kernels round differently (replay it on " +
        (dev == "cpu" ? std::string("the CPU, run.device = \"cpu\"") : std::string("a GPU")) +
        ", for bit-exactness)");
  if (!main.finite)
    if (std::string why = optimizer_state_underflow(c, replay_config(c, r.out_dir, sets));
        !why.empty())
      r.notes.push_back(why);
  if (main.finding.found) {
    r.first_module = main.finding.module;
    r.first_module_type = main.finding.module_type;
    r.first_phase = main.finding.phase;
    r.first_tensor = main.finding.tensor;
    r.tracer_message = main.finding.message;
    r.tracer_log = main.finding.log_path;
  }

  if (opt.bisect) bisect_step(c, sets, r);
  return r;
}

}  // namespace

json replay_to_json(const ReplayResult& r) {
  json j = {{"capture", r.dir},
            {"step", r.step},
            {"precision", r.precision},
            {"attention", r.attention},
            {"captured_precision", r.captured_precision},
            {"captured_attention", r.captured_attention},
            {"threads", r.threads},
            {"reproduced", r.reproduced},
            {"bit_exact", r.bit_exact},
            {"loss", io::json_float(r.loss)},
            {"loss_bits", r.loss_bits},
            {"recorded_loss_bits", r.recorded_loss_bits},
            {"loss_bit_exact", r.loss_bit_exact},
            {"grads_fingerprint", r.grads_fingerprint},
            {"recorded_grads_fingerprint", r.recorded_grads_fingerprint},
            {"grads_bit_exact", r.grads_bit_exact},
            {"grad_norm", io::json_float(r.grad_norm)},
            {"loss_scale", r.loss_scale},
            {"nonfinite_params", r.nonfinite_params},
            {"first_nonfinite_param", r.first_nonfinite_param},
            {"recorded_first_nonfinite_param", r.recorded_first_nonfinite_param},
            {"world_size", r.world_size},
            {"rank", r.rank},
            {"compared", r.world_size > 1 ? "local" : "global"},
            {"nonfinite_param_values", r.nonfinite_param_values},
            {"largest_grad_param", r.largest_grad_param},
            {"largest_grad", io::json_float(r.largest_grad)},
            {"largest_weight_param", r.largest_weight_param},
            {"largest_weight", io::json_float(r.largest_weight)},
            {"nonfinite_rows", r.nonfinite_rows},
            {"nonfinite_token_examples", r.nonfinite_token_examples},
            {"first_module", r.first_module},
            {"first_module_type", r.first_module_type},
            {"first_phase", r.first_phase},
            {"first_tensor", r.first_tensor},
            {"tracer_message", r.tracer_message},
            {"tracer_log", r.tracer_log},
            {"out_dir", r.out_dir},
            {"notes", r.notes}};
  if (r.bisected) {
    json b = json::array();
    for (const BisectTrial& t : r.bisect) {
      json e = {{"change", t.change},
                {"finite", t.finite},
                {"marginal", t.marginal},
                {"diverged", t.diverged},
                {"loss", io::json_float(t.loss)},
                {"grad_norm", io::json_float(t.grad_norm)}};
      if (!t.error.empty()) e["error"] = t.error;
      b.push_back(e);
    }
    j["bisect"] = b;
    j["cause"] = r.cause;
    j["explanation"] = r.explanation;
  }
  return j;
}

std::string format_replay(const ReplayResult& r) {
  std::ostringstream o;
  char buf[256];
  o << "replay of step " << r.step << " from " << r.dir << "\n";
  o << "  settings     " << r.precision << ", attention " << r.attention << ", " << r.threads
    << (r.threads == 1 ? " thread" : " threads");
  if (r.precision != r.captured_precision || r.attention != r.captured_attention)
    o << " (captured: " << r.captured_precision << ", attention " << r.captured_attention << ")";
  o << "\n";
  // A cross-entropy and a norm are >= 0: |.| drops a NaN's sign bit, which printf shows as "-nan"
  // (it says nothing to the user; the loss bits keep it).
  std::snprintf(buf, sizeof buf, "  loss         %.9g (bits %s, recorded %s)\n", std::fabs(r.loss),
                r.loss_bits.c_str(), r.recorded_loss_bits.c_str());
  o << buf;
  std::snprintf(buf, sizeof buf, "  grad norm    %.6g (unscaled; loss scale %g)\n",
                std::fabs(r.grad_norm), r.loss_scale);
  o << buf;
  o << "  reproduced   " << (r.reproduced ? "yes: the step is non-finite again" : "no: finite")
    << "\n";
  const bool local = r.world_size > 1;
  if (local)
    o << "  rank         " << r.rank << " of " << r.world_size
      << " (replayed alone: its micro-batches, its loss and its gradients before the "
         "all-reduce)\n";
  o << "  bit-exact    " << (r.bit_exact ? "yes" : "no") << " ("
    << (local ? "local loss " : "loss ") << (r.loss_bit_exact ? "same bits" : "differs") << ", "
    << (local ? "pre-reduce gradients " : "gradients ")
    << (r.grads_bit_exact                      ? "same bits"
        : r.recorded_grads_fingerprint.empty() ? "not recorded"
                                               : "differ")
    << ")\n";
  // From a non-finite loss, backward carries it into every gradient: the first of them is no
  // producer (it named transformer.ln_f.weight beside a first module found in the forward).
  if (!r.nonfinite_params.empty() && !std::isfinite(r.loss))
    o << "  non-finite gradients in "
      << count_of(static_cast<long long>(r.nonfinite_params.size()), "parameter")
      << ", carried back from the loss's own " << (std::isnan(r.loss) ? "nan" : "inf")
      << ": the forward produced it, not backward\n";
  else if (!r.nonfinite_params.empty())
    o << "  non-finite gradients in "
      << count_of(static_cast<long long>(r.nonfinite_params.size()), "parameter")
      << ", first produced by backward: " << r.first_nonfinite_param << "\n";
  if (!r.nonfinite_param_values.empty())
    o << "  non-finite VALUES before the step in "
      << count_of(static_cast<long long>(r.nonfinite_param_values.size()), "parameter")
      << ", first: " << r.nonfinite_param_values.front() << "\n";
  if (!r.first_module.empty() || !r.first_phase.empty())
    o << "  first module " << (r.first_module.empty() ? "(root)" : r.first_module) << " ("
      << r.first_module_type << ", " << r.first_phase << ", " << r.first_tensor << ")\n"
      << "  tracer log   " << r.tracer_log << "\n";
  if (r.reproduced && r.nonfinite_params.empty() && std::isfinite(r.loss)) {
    std::snprintf(buf, sizeof buf,
                  "  every gradient element is finite: the norm overflowed f32; largest |g| = %.3g "
                  "in %s\n",
                  r.largest_grad, r.largest_grad_param.c_str());
    o << buf;
  }
  for (const std::string& n : r.notes) o << "  note         " << n << "\n";
  if (r.bisected) {
    o << "bisect:\n";
    for (const BisectTrial& t : r.bisect) {
      std::snprintf(buf, sizeof buf, "  %-22s %s", t.change.c_str(),
                    !t.error.empty()         ? "error"
                    : t.finite && t.marginal ? "finite only at the edge"
                    : t.finite && t.diverged ? "finite, but the model has diverged"
                    : t.finite               ? "finite"
                                             : "non-finite");
      o << buf;
      if (!t.error.empty()) o << " (" << t.error << ")";
      o << "\n";
    }
    o << "cause: " << r.cause << "\n  " << r.explanation << "\n";
  }
  return o.str();
}

}  // namespace keel::monitor
