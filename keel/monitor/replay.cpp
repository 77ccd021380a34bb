#include "keel/monitor/replay.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>

#include "keel/backend/monitor.h"
#include "keel/io/atomic_file.h"
#include "keel/io/json_fields.h"
#include "keel/io/safetensors.h"
#include "keel/monitor/inject.h"
#include "keel/monitor/nan_capture.h"
#include "keel/monitor/tracer.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/optim/clip.h"
#include "keel/train/trainer.h"

namespace keel::monitor {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// ---- the capture on disk

struct Capture {
  std::string dir;
  json meta;
  io::Safetensors model, optimizer, batches;
  std::vector<data::Batch> window;
};

std::string capture_hint() {
  return "keel train writes a capture to out_dir/debug/nan_capture/rank0 when a step is "
         "non-finite; pass that directory";
}

const json& need(const Capture& c, const char* key) {
  if (!c.meta.contains(key))
    throw Error(c.dir + "/capture.json: missing \"" + key +
                    "\"; the file is incomplete or was written by another tool (write a new "
                    "capture by re-running the training)",
                Error::kUsage);
  return c.meta.at(key);
}

template <class T>
T need_as(const Capture& c, const char* key) {
  try {
    return need(c, key).get<T>();
  } catch (const json::exception&) {
    throw Error(c.dir + "/capture.json: \"" + key + "\" has the wrong type (" +
                    need(c, key).dump() +
                    "); the file is corrupt (re-run the training to write a "
                    "new capture)",
                Error::kUsage);
  }
}

Capture read_capture(const std::string& dir) {
  Capture c;
  c.dir = dir;
  if (!fs::is_directory(dir))
    throw Error("replay: " + dir + " is not a directory; " + capture_hint(), Error::kUsage);
  const std::string meta_path = dir + "/capture.json";
  if (!fs::exists(meta_path))
    throw Error(meta_path + ": missing; " + dir + " is not a NaN capture (" + capture_hint() + ")",
                Error::kUsage);
  try {
    c.meta = json::parse(io::read_file(meta_path));
  } catch (const json::parse_error& e) {
    throw Error(meta_path + ": not valid JSON (" + e.what() +
                    "); the capture is corrupt: re-run the training to write a new one",
                Error::kUsage);
  }
  if (!c.meta.is_object() || !c.meta.contains("format") || c.meta["format"] != kCaptureFormat)
    throw Error(meta_path + ": not a keel NaN capture (\"format\" is not \"" +
                    std::string(kCaptureFormat) + "\"); " + capture_hint(),
                Error::kUsage);
  const int version = need_as<int>(c, "format_version");
  if (version > kCaptureFormatVersion)
    throw Error(meta_path + ": format_version " + std::to_string(version) +
                    " is newer than this keel reads (" + std::to_string(kCaptureFormatVersion) +
                    "); replay it with the keel that wrote it (" +
                    c.meta.value("keel_version", json("?")).dump() + ")",
                Error::kUsage);
  for (const char* key : {"step", "config_toml", "threads", "loss_bits", "grads_fingerprint",
                          "loss_scale", "rng", "micro_batches", "precision", "attention"})
    need(c, key);
  // Replay uses the captured thread count (capped at the cores by the trainer, with a warning).
  const int64_t threads = need(c, "threads").is_number_integer() ? need(c, "threads").get<int64_t>() : -1;
  if (threads < 1 || threads > 4096)
    throw Error(meta_path + ": \"threads\" = " + need(c, "threads").dump() +
                    " is not a thread count in [1, 4096]; the capture is corrupt (re-run the "
                    "training to write a new one)",
                Error::kUsage);
  if (!need(c, "rng").is_object() || !need(c, "rng").contains("step_seed"))
    throw Error(meta_path +
                    ": \"rng\" lacks \"step_seed\"; the capture is incomplete (re-run the "
                    "training to write a new one)",
                Error::kUsage);
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "microbatches.safetensors"})
    if (!fs::exists(dir + "/" + f))
      throw Error(dir + "/" + f +
                      ": missing; the capture is incomplete (it is written atomically, "
                      "so the directory was changed afterwards): re-run the training",
                  Error::kUsage);
  c.model = io::read_safetensors(dir + "/model.safetensors");
  c.optimizer = io::read_safetensors(dir + "/optimizer.safetensors");
  c.batches = io::read_safetensors(dir + "/microbatches.safetensors");
  const json& mbs = need(c, "micro_batches");
  if (!mbs.is_array() || mbs.empty())
    throw Error(meta_path + ": \"micro_batches\" must be a non-empty list; the capture is corrupt",
                Error::kUsage);
  for (size_t i = 0; i < mbs.size(); ++i) {
    const std::string p = "mb" + std::to_string(i) + ".";
    data::Batch b;
    b.input_ids = c.batches.at(p + "input_ids");
    b.labels = c.batches.at(p + "labels");
    if (const Tensor* m = c.batches.find(p + "attention_mask")) b.attention_mask = *m;
    if (b.input_ids.dtype() != DType::I64 || b.labels.dtype() != DType::I64 ||
        b.input_ids.dim() != 2 || b.labels.shape() != b.input_ids.shape())
      throw Error(dir + "/microbatches.safetensors: " + p +
                      "input_ids / labels must be i64 [B, T] of the same shape; the capture is "
                      "corrupt",
                  Error::kUsage);
    const int64_t* lab = b.labels.data_as<int64_t>();
    for (int64_t k = 0; k < b.labels.numel(); ++k) b.n_targets += lab[k] != data::kIgnoreLabel;
    if (mbs[i].is_object() && mbs[i].contains("example_ids"))
      b.example_ids = mbs[i]["example_ids"].get<std::vector<int64_t>>();
    c.window.push_back(std::move(b));
  }
  return c;
}

// ---- one run of the captured step

struct StepOutcome {
  double loss = 0, grad_norm = 0, loss_scale = 1;
  std::string loss_bits, grads_fingerprint;
  bool finite = true;
  std::vector<std::string> nonfinite_params;
  std::string largest_grad_param;  // the largest finite |gradient| element, and where
  double largest_grad = 0;
  TracerFinding finding;
  std::string precision, attention;
  std::vector<std::string> notes;
};

std::unique_ptr<Trainer> build_trainer(const Capture& c, const std::string& out_dir,
                                       const std::vector<std::string>& sets,
                                       std::vector<std::string>& notes) {
  fs::create_directories(out_dir);
  const std::string cfg_path = out_dir + "/captured_config.toml";
  io::write_file_atomic(cfg_path, need_as<std::string>(c, "config_toml"));
  // The rebuilt run writes only below out_dir, never resumes, and uses the captured thread count
  // (reductions are chunked per thread: bit-exactness needs the same count).
  std::vector<std::string> ov = {"run.out_dir=" + out_dir, "run.resume=false",
                                 "run.threads=" + std::to_string(need_as<int>(c, "threads")),
                                 "debug.underflow_overflow.enabled=false"};
  ov.insert(ov.end(), sets.begin(), sets.end());
  Config cfg = load_config(cfg_path, ov);
  try {
    return std::make_unique<Trainer>(cfg);
  } catch (const Error& e) {
    // The dataset only feeds the loader; the step's micro-batches come from the capture. When the
    // original data is gone (another machine, a moved file), a stand-in keeps the replay possible:
    // the model's shape does not depend on the dataset.
    if (cfg.data.task == "arith") throw;
    notes.push_back("the config's dataset could not be loaded (" + std::string(e.what()) +
                    "); the captured micro-batches are used with a stand-in dataset");
    ov.push_back("data.task=arith");
    ov.push_back("data.num_examples=64");
    ov.push_back("data.eval_examples=0");
    return std::make_unique<Trainer>(load_config(cfg_path, ov));
  }
}

// Loads the captured parameters (converted when the replay's policy stores them in another
// dtype) and, when the parameters match exactly, the optimizer and scaler state.
void load_state(Trainer& tr, const Capture& c, std::vector<std::string>& notes) {
  bool same_dtypes = true;
  for (auto& [name, p] : tr.model().named_parameters()) {
    const Tensor* t = c.model.find(name);
    if (!t)
      throw Error(c.dir + "/model.safetensors: tensor '" + name +
                      "' is missing (the capture was written by another model config?)",
                  Error::kUsage);
    if (t->shape() != p.shape())
      throw Error(c.dir + "/model.safetensors: tensor '" + name + "' is " + shape_str(t->shape()) +
                      ", the model expects " + shape_str(p.shape()) + "; the capture is corrupt",
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
      tr.optimizer().load_state(c.optimizer.tensors);
    } catch (const Error& e) {
      notes.push_back(std::string("optimizer state not loaded: ") + e.what());
    }
  } else if (!same_dtypes) {
    notes.push_back(
        "parameters converted from the captured dtype; optimizer state not loaded "
        "(it does not act before the update)");
  }
  if (tr.scaler() && c.meta.contains("scaler") && c.meta["scaler"].is_object())
    tr.scaler()->load_state_dict(c.meta["scaler"].get<std::map<std::string, double>>());
}

StepOutcome run_step(const Capture& c, const std::string& out_dir,
                     const std::vector<std::string>& sets, bool with_tracer) {
  StepOutcome o;
  std::unique_ptr<Trainer> tr = build_trainer(c, out_dir, sets, o.notes);
  load_state(*tr, c, o.notes);
  o.precision = tr->policy().name();
  o.attention = ops::attention_backend_name(tr->model().spec().attention);
  const int64_t step = need_as<int64_t>(c, "step");
  const uint64_t step_seed = need(c, "rng").at("step_seed").get<uint64_t>();
  // The captured scale when the replay has a scaler too; a scaler the capture did not have starts
  // from its configured initial scale.
  const bool captured_scaler = c.meta.contains("scaler") && c.meta["scaler"].is_object();
  if (tr->scaler())
    o.loss_scale = captured_scaler ? need_as<double>(c, "loss_scale") : tr->scaler()->get_scale();

  // The configured fault injection is part of the step; its hook goes before the tracer's so
  // the tracer sees the corrupted output (inject.h).
  std::unique_ptr<FaultInjector> injector;
  const InjectConfig& inj = tr->config().debug.inject;
  if (!inj.module.empty()) {
    injector = std::make_unique<FaultInjector>(
        tr->model(), InjectOptions{inj.module, inj.step, inj.kind, inj.factor});
    injector->begin_step(step);
  }
  std::unique_ptr<UnderflowOverflowTracer> tracer;
  if (with_tracer) {
    TracerOptions topt;
    topt.max_frames_to_save = tr->config().debug.underflow_overflow.max_frames_to_save;
    topt.format = tr->policy().compute_dtype;
    topt.scaler_handles_backward = tr->scaler() != nullptr;
    tracer = std::make_unique<UnderflowOverflowTracer>(
        tr->model(), topt, out_dir + "/debug/underflow_overflow_rank0.log");
    tracer->set_stop_on_finding(false);
    tracer->begin_batch(step);
  }
  tr->optimizer().zero_grad();
  tr->model().train(true);
  int64_t tokens = 0;
  for (auto& b : c.window) tokens += b.n_targets;
  const double loss_sum = tr->forward_backward(c.window, step_seed, o.loss_scale);
  // Exactly as Trainer::train_step computes the logged loss.
  o.loss = tokens > 0 ? loss_sum / static_cast<double>(tokens) : 0.0;
  o.loss_bits = double_bits_hex(o.loss);
  std::vector<Tensor> grads;
  for (auto& [name, p] : tr->trainable())
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
  if (tr->scaler()) tr->scaler()->unscale(grads);
  o.grads_fingerprint = gradient_fingerprint(tr->trainable());  // after unscale, as captured
  o.grad_norm = optim::global_grad_norm(grads);
  o.finite = std::isfinite(o.loss) && std::isfinite(o.grad_norm) && o.nonfinite_params.empty();
  if (tracer) o.finding = tracer->finding();
  return o;
}

// ---- bisect

struct Alternative {
  std::string change;
  std::vector<std::string> sets;
};

// The trainer's f32 sum of squares overflows at a gradient norm of ~1.8e19; within 2^10 of that a
// step is finite only by luck.
constexpr double kMarginalNorm = 1.8446744073709552e19 / 1024.0;

std::vector<Alternative> alternatives(const Config& cfg, const std::string& precision,
                                      const std::string& attention) {
  std::vector<Alternative> a;
  if (attention != "math") a.push_back({"attention=math", {"model.attention=math"}});
  if (attention == "flash") a.push_back({"attention=eager", {"model.attention=eager"}});
  if (precision == "16-true") a.push_back({"precision=16-mixed", {"train.precision=16-mixed"}});
  if (precision == "bf16-true")
    a.push_back({"precision=bf16-mixed", {"train.precision=bf16-mixed"}});
  if (precision == "16-true" || precision == "16-mixed")
    a.push_back({"precision=bf16-mixed", {"train.precision=bf16-mixed"}});
  if (precision != "32-true") a.push_back({"precision=32-true", {"train.precision=32-true"}});
  if (cfg.model.adapter.kind != "none") a.push_back({"adapter=none", {"model.adapter.kind=none"}});
  if (!cfg.debug.inject.module.empty()) a.push_back({"inject=off", {"debug.inject.module="}});
  return a;
}

std::string explain_change(const std::string& change, const std::string& precision) {
  if (change == "attention=math")
    return "the attention scores overflow or lose their range in the compute dtype; "
           "model.attention = \"math\" keeps scores and softmax in f32";
  if (change == "attention=eager")
    return "the flash backend's tiled softmax produces it; model.attention = \"eager\" "
           "materializes the scores instead";
  if (change == "precision=16-mixed" || change == "precision=bf16-mixed") {
    if (precision.rfind("16", 0) == 0 && change == "precision=bf16-mixed")
      return "a value exceeds f16's range (max 65504) under " + precision +
             "; bf16 has f32's range (train.precision = \"bf16-mixed\")";
    return "hard-cast " + precision +
           " parameters and activations lose it; the -mixed policy keeps f32 masters and f32 "
           "softmax/norms (train.precision = \"" +
           change.substr(10) + "\")";
  }
  if (change == "precision=32-true")
    return "low-precision compute under " + precision +
           " produces it and f32 does not; train in 32-true, or find the overflowing module in "
           "the tracer's log and rescale it";
  if (change == "adapter=none") return "the adapter's update produces it (check its rank/alpha)";
  if (change == "inject=off")
    return "the fault injected by [debug.inject] produces it (remove debug.inject.module)";
  return change;
}

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

// For a non-finite 2-D parameter: which rows, and for an embedding table (rows are token ids)
// where those tokens occur in the step's micro-batches — a NaN row breaks only the steps whose data
// reaches it.
std::string describe_rows(const Capture& c, ReplayResult& r) {
  const std::string& name = r.nonfinite_param_values.front();
  const Tensor* t = c.model.find(name);
  if (!t || t->dim() != 2) return "";
  const int64_t rows = t->size(0), cols = t->size(1);
  const std::vector<float> v = t->to_dtype(DType::F32).to_floats();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      if (!std::isfinite(v[i * cols + j])) {
        r.nonfinite_rows.push_back(i);
        break;
      }
  if (r.nonfinite_rows.empty()) return "";
  std::string out = ", rows";
  for (size_t k = 0; k < r.nonfinite_rows.size() && k < 5; ++k)
    out += " " + std::to_string(r.nonfinite_rows[k]);
  if (r.nonfinite_rows.size() > 5) out += " ...";
  const bool embedding =
      name.find("embed_tokens") != std::string::npos || name.find("wte") != std::string::npos;
  if (!embedding) return out;
  for (size_t m = 0; m < c.window.size(); ++m) {
    const data::Batch& b = c.window[m];
    const int64_t B = b.input_ids.size(0), T = b.input_ids.size(1);
    const int64_t* ids = b.input_ids.data_as<int64_t>();
    for (int64_t row = 0; row < B; ++row)
      for (int64_t pos = 0; pos < T; ++pos) {
        const int64_t id = ids[row * T + pos];
        const bool hit = std::find(r.nonfinite_rows.begin(), r.nonfinite_rows.end(), id) !=
                         r.nonfinite_rows.end();
        const bool real =
            !b.attention_mask.defined() || b.attention_mask.data_as<uint8_t>()[row * T + pos] != 0;
        if (hit && real) {
          const int64_t ex =
              row < static_cast<int64_t>(b.example_ids.size()) ? b.example_ids[row] : -1;
          r.nonfinite_token_examples.push_back(ex);
          out += "; token " + std::to_string(id) + " occurs in micro-batch " + std::to_string(m) +
                 " row " + std::to_string(row) + " position " + std::to_string(pos) +
                 (ex >= 0 ? " (dataset example " + std::to_string(ex) + ")" : "");
          pos = T;  // one mention per row
        }
      }
  }
  return out;
}

ReplayResult replay_unchecked(const std::string& dir, const ReplayOptions& opt);

}  // namespace

// Every field read is checked where it is used; a type no check foresaw still names the file.
ReplayResult replay_capture(const std::string& dir, const ReplayOptions& opt) {
  try {
    return replay_unchecked(dir, opt);
  } catch (const json::exception& e) {
    throw Error(dir + "/capture.json: a field is missing or has the wrong type (" +
                    io::json_problem(e) +
                    "); the capture is corrupt: re-run the training to write a new one",
                Error::kUsage);
  }
}

namespace {

ReplayResult replay_unchecked(const std::string& dir, const ReplayOptions& opt) {
  const Capture c = read_capture(dir);
  ReplayResult r;
  r.dir = dir;
  r.step = need_as<int64_t>(c, "step");
  r.captured_precision = need_as<std::string>(c, "precision");
  r.captured_attention = need_as<std::string>(c, "attention");
  r.threads = need_as<int>(c, "threads");
  r.recorded_loss_bits = need_as<std::string>(c, "loss_bits");
  if (c.meta.contains("nonfinite_param_values"))
    r.nonfinite_param_values = c.meta["nonfinite_param_values"].get<std::vector<std::string>>();
  r.out_dir = opt.out_dir;
  if (r.out_dir.empty())
    r.out_dir = writable_dir(dir + "/replay") ? dir + "/replay" : temp_out_dir();

  std::vector<std::string> sets = opt.sets;
  if (!opt.precision.empty()) sets.push_back("train.precision=" + opt.precision);
  if (!opt.attention.empty()) sets.push_back("model.attention=" + opt.attention);
  const StepOutcome main = run_step(c, r.out_dir, sets, opt.tracer);
  r.precision = main.precision;
  r.attention = main.attention;
  r.loss = main.loss;
  r.loss_bits = main.loss_bits;
  r.grad_norm = main.grad_norm;
  r.loss_scale = main.loss_scale;
  r.nonfinite_params = main.nonfinite_params;
  r.largest_grad_param = main.largest_grad_param;
  r.largest_grad = main.largest_grad;
  r.reproduced = !main.finite;
  r.grads_fingerprint = main.grads_fingerprint;
  r.recorded_grads_fingerprint = c.meta.value("grads_fingerprint", std::string());
  r.loss_bit_exact = main.loss_bits == r.recorded_loss_bits;
  r.grads_bit_exact = r.grads_fingerprint == r.recorded_grads_fingerprint;
  r.bit_exact = r.loss_bit_exact && r.grads_bit_exact;
  r.notes = main.notes;
  if (main.finding.found) {
    r.first_module = main.finding.module;
    r.first_module_type = main.finding.module_type;
    r.first_phase = main.finding.phase;
    r.first_tensor = main.finding.tensor;
    r.tracer_message = main.finding.message;
    r.tracer_log = main.finding.log_path;
  }

  if (opt.bisect) {
    r.bisected = true;
    // The base of the bisection is the replay's own settings (the capture's, or --precision /
    // --attention); each alternative changes one thing.
    std::vector<std::string> notes;
    const Config base = [&] {
      const std::string p = r.out_dir + "/captured_config.toml";
      return load_config(p, sets);
    }();
    if (!r.reproduced) {
      r.cause = "not-reproduced";
      r.explanation = "the step is finite under " + r.precision + " / attention " + r.attention +
                      ": nothing to bisect (replay without --precision/--attention to reproduce "
                      "the captured failure)";
    } else {
      for (const Alternative& a : alternatives(base, r.precision, r.attention)) {
        BisectTrial t;
        t.change = a.change;
        std::vector<std::string> s = sets;
        s.insert(s.end(), a.sets.begin(), a.sets.end());
        try {
          const StepOutcome o = run_step(c, r.out_dir + "/bisect", s, false);
          t.finite = o.finite;
          t.marginal = o.finite && o.grad_norm > kMarginalNorm;
          t.loss = o.loss;
          t.grad_norm = o.grad_norm;
        } catch (const Error& e) {
          t.error = e.what();
        }
        r.bisect.push_back(t);
      }
      for (const BisectTrial& t : r.bisect)
        if (t.finite && !t.marginal) {
          r.cause = t.change;
          r.explanation = explain_change(t.change, r.precision);
          break;
        }
      if (r.cause.empty()) {
        if (!r.nonfinite_param_values.empty()) {
          r.cause = "nonfinite-parameters";
          r.explanation = "the parameters were already non-finite before the step (first: " +
                          r.nonfinite_param_values.front() + describe_rows(c, r) +
                          "): no numerics change helps; the model state came in broken (a corrupt "
                          "checkpoint or initialization, or an earlier update)";
        } else {
          // Finite parameters that overflow under every precision: the largest one names where.
          double max_abs = 0;
          std::string where;
          for (auto& [name, t] : c.model.tensors) {
            const Tensor f = t.to_dtype(DType::F32);
            for (float v : f.to_floats())
              if (std::fabs(v) > max_abs) {
                max_abs = std::fabs(v);
                where = name;
              }
          }
          char buf[64];
          std::snprintf(buf, sizeof buf, "%.3g", max_abs);
          r.cause = "diverged-parameters";
          r.explanation =
              "no numerics change makes this step finite: the parameters themselves "
              "overflow every precision (largest |value| " +
              std::string(buf) + " in " + where +
              "); the run diverged before this step: lower optim.lr";
          const double decay = 1.0 - base.optim.lr * base.optim.weight_decay;
          if (base.optim.name == "adamw" && decay <= 0) {
            std::snprintf(buf, sizeof buf, "%g", decay);
            r.explanation += " (AdamW's decoupled decay multiplies the weights by 1 - lr*wd = " +
                             std::string(buf) + " every step)";
          }
          if (base.train.max_grad_norm <= 0)
            r.explanation += ", and enable gradient clipping (train.max_grad_norm)";
          for (const BisectTrial& t : r.bisect)
            if (t.marginal) {
              std::snprintf(buf, sizeof buf, "%.3g", t.grad_norm);
              r.explanation += "; " + t.change +
                               " leaves this step finite only at the edge (grad norm " + buf +
                               ", within 2^10 of the f32 overflow)";
            }
        }
      }
    }
  }
  return r;
}

}  // namespace

json replay_to_json(const ReplayResult& r) {
  auto num = [](double v) -> json {
    if (std::isfinite(v)) return v;
    return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  };
  json j = {{"capture", r.dir},
            {"step", r.step},
            {"precision", r.precision},
            {"attention", r.attention},
            {"captured_precision", r.captured_precision},
            {"captured_attention", r.captured_attention},
            {"threads", r.threads},
            {"reproduced", r.reproduced},
            {"bit_exact", r.bit_exact},
            {"loss", num(r.loss)},
            {"loss_bits", r.loss_bits},
            {"recorded_loss_bits", r.recorded_loss_bits},
            {"loss_bit_exact", r.loss_bit_exact},
            {"grads_fingerprint", r.grads_fingerprint},
            {"recorded_grads_fingerprint", r.recorded_grads_fingerprint},
            {"grads_bit_exact", r.grads_bit_exact},
            {"grad_norm", num(r.grad_norm)},
            {"loss_scale", r.loss_scale},
            {"nonfinite_params", r.nonfinite_params},
            {"nonfinite_param_values", r.nonfinite_param_values},
            {"largest_grad_param", r.largest_grad_param},
            {"largest_grad", num(r.largest_grad)},
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
                {"loss", num(t.loss)},
                {"grad_norm", num(t.grad_norm)}};
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
    << " threads";
  if (r.precision != r.captured_precision || r.attention != r.captured_attention)
    o << " (captured: " << r.captured_precision << ", attention " << r.captured_attention << ")";
  o << "\n";
  std::snprintf(buf, sizeof buf, "  loss         %.9g (bits %s, recorded %s)\n", r.loss,
                r.loss_bits.c_str(), r.recorded_loss_bits.c_str());
  o << buf;
  std::snprintf(buf, sizeof buf, "  grad norm    %.6g (unscaled; loss scale %g)\n", r.grad_norm,
                r.loss_scale);
  o << buf;
  o << "  reproduced   " << (r.reproduced ? "yes: the step is non-finite again" : "no: finite")
    << "\n";
  o << "  bit-exact    " << (r.bit_exact ? "yes" : "no") << " (loss "
    << (r.loss_bit_exact ? "same bits" : "differs") << ", gradients "
    << (r.grads_bit_exact ? "same bits" : "differ") << ")\n";
  if (!r.nonfinite_params.empty()) {
    o << "  non-finite gradients in " << r.nonfinite_params.size()
      << " parameters, first: " << r.nonfinite_params.front() << "\n";
  }
  if (!r.nonfinite_param_values.empty())
    o << "  non-finite VALUES before the step in " << r.nonfinite_param_values.size()
      << " parameters, first: " << r.nonfinite_param_values.front() << "\n";
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
