// keel replay --bisect (DESIGN §4): re-runs a captured step under one numerics change at a time,
// from the smallest to the largest, and names the first that makes it finite with headroom; when
// none does, the state the step started from is the cause (non-finite or diverged parameters).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "keel/monitor/advisor.h"
#include "keel/monitor/replay_step.h"

namespace keel::monitor {

namespace {

struct Alternative {
  std::string change;
  std::vector<std::string> sets;
  double loss_scale = 0;  // > 0: the backward's loss scale instead of the captured one
};

// PyTorch's initial loss scale: f16 gradients of ordinary size times it stay in f16's range.
constexpr double kDefaultLossScale = 65536.0;

// The trainer's f32 sum of squares overflows at a gradient norm of ~1.8e19; within 2^10 of that a
// step is finite only by luck.
constexpr double kMarginalNorm = 1.8446744073709552e19 / 1024.0;
// A cross-entropy of 10^4 nats needs logit gaps of 10^4: the uniform guess over the largest
// vocabularies is 12 nats, and even an untrained model at init_std 10 (CliNan's f16 overflow)
// starts near 250; only weights an update blew up get there (optim.lr 1e4: 9e8).
constexpr double kDivergedLoss = 1e4;
// Once updates were applied, a loss above 1.5 x ln V (the uniform guess over the model's logits;
// the trend advisor's "diverged" line uses the same bound) is a model the updates destroyed: a run
// at optim.lr 1 in 16-mixed was captured at step 7 with a loss of 25 under attention=math (ln V =
// 5.56) and bisect named attention=math its cause. Not before any update: an untrained model with
// a wide init (init_std 10: ~250) is no divergence, and there the precision change is the fix.
constexpr double kDivergedUniform = 1.5;
// A trainable weight above kDivergedWeight (monitor/advisor.h) after updates: the model has
// diverged even when its loss has not, and a change that leaves the step finite runs those
// weights, or, as adapter=none, drops them. Bisect named attention=math and "check its
// rank/alpha".

// Updates the optimizer applied (its state's "step" count); -1: unknown.
int64_t updates_in(const std::vector<std::pair<std::string, Tensor>>& optimizer_state) {
  for (const auto& [name, t] : optimizer_state)
    if (name == "step" && t.numel() == 1 && !dtype_is_floating(t.dtype()))
      return t.to(Device::cpu()).to_ints()[0];
  return -1;
}
// Before the captured step.
int64_t updates_before(const Capture& c) { return updates_in(c.optimizer.tensors); }

std::vector<Alternative> alternatives(const Config& cfg, const std::string& precision,
                                      const std::string& attention, double loss_scale) {
  std::vector<Alternative> a;
  // A scale far above the default (scaler.init_scale = 1e30, a scaler that could not settle) is
  // the smallest change: it alone multiplies the f16 gradients past 65504 (bisect named
  // bf16-mixed, whose lack of a scaler was what fixed it).
  if (precision == "16-mixed" && loss_scale > kDefaultLossScale)
    a.push_back({"loss_scale=65536", {}, kDefaultLossScale});
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

std::string explain_change(const std::string& change, const std::string& precision,
                           const Config& cfg, double loss_scale) {
  if (change == "loss_scale=65536") {
    char buf[160];
    std::snprintf(buf, sizeof buf, "the loss scale %.8g multiplies the f16 gradients past 65504",
                  loss_scale);
    std::string why = buf;
    // What held the scale up: a floor above the default, or a start far above it.
    const bool floor = cfg.scaler.min_scale > kDefaultLossScale;
    std::snprintf(buf, sizeof buf, "%.8g", floor ? cfg.scaler.min_scale : cfg.scaler.init_scale);
    return why + "; at 65536 the step is finite: " +
           (floor ? "lower scaler.min_scale (now " + std::string(buf) + ")"
            : cfg.scaler.init_scale > kDefaultLossScale
                ? "lower scaler.init_scale (now " + std::string(buf) + "; PyTorch's default 65536)"
                : std::string("set scaler.max_scale = 65536 (the scale grew to it)"));
  }
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
  const bool embedding = name.find("embed_tokens") != std::string::npos ||
                         name.find("wte") != std::string::npos ||
                         name.find("embed_in") != std::string::npos;  // (GPT-NeoX's)
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
                 (ex < 0                     ? std::string()
                  : b.position_ids.defined() ? " (dataset row " + std::to_string(ex) + ", packed)"
                                             : " (dataset example " + std::to_string(ex) + ")");
          pos = T;  // one mention per row
        }
      }
  }
  return out;
}

}  // namespace

std::string optimizer_state_underflow(const std::vector<std::pair<std::string, Tensor>>& state,
                                      const std::vector<std::pair<std::string, Tensor>>& parameters,
                                      const Config& cfg) {
  const std::string suffix = ".exp_avg_sq";
  std::map<std::string, const Tensor*> by_name;
  for (auto& [name, t] : state) by_name[name] = &t;
  auto host_floats = [](const Tensor& t) {
    return t.to(Device::cpu()).to_dtype(DType::F32).to_floats();
  };
  int64_t lost = 0, total = 0, worst_lost = 0, worst_total = 0;
  std::string worst, state_dtype;
  for (auto& [name, v] : state) {
    if (name.size() <= suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0 ||
        v.dtype() == DType::F32)
      continue;
    const std::string param = name.substr(0, name.size() - suffix.size());
    auto it = by_name.find(param + ".exp_avg");
    if (it == by_name.end() || it->second->numel() != v.numel()) continue;
    const std::vector<float> vs = host_floats(v), ms = host_floats(*it->second);
    int64_t n = 0;
    for (size_t i = 0; i < vs.size(); ++i) n += vs[i] == 0.0f && ms[i] != 0.0f;
    lost += n;
    total += v.numel();
    state_dtype = dtype_name(v.dtype());
    if (n > worst_lost) worst_lost = n, worst_total = v.numel(), worst = param;
  }
  if (lost == 0) return "";
  double max_abs = 0;
  for (const auto& [name, w] : parameters)
    if (name == worst)
      for (float x : host_floats(w)) max_abs = std::max<double>(max_abs, std::fabs(x));
  const int64_t updates = updates_in(state);
  // AdamW moves an element by about lr per update (|m / sqrt(v)| <= ~3); weights within that
  // reach of their init (|w| <= 1) owe their size to the learning rate, not to the flushed
  // moment (optim.lr 1e4 makes 1e4 weights in one update whatever v holds).
  if (max_abs <= 10 * cfg.optim.lr * static_cast<double>(std::max<int64_t>(updates, 1)) + 1)
    return "";
  char buf[256];
  std::snprintf(buf, sizeof buf, "%.3g", max_abs);
  const std::string largest = buf;
  std::snprintf(buf, sizeof buf, "%g", cfg.optim.adamw.eps);
  return "AdamW's second moment (exp_avg_sq, stored in " + state_dtype + ") underflowed to 0 for " +
         std::to_string(lost) + " of " + std::to_string(total) +
         " elements whose first moment is not 0 (most in " + worst + ": " +
         std::to_string(worst_lost) + " of " + std::to_string(worst_total) +
         "): a squared gradient below " + state_dtype +
         "'s smallest subnormal is stored as 0, and those elements are updated by lr * m / eps "
         "(optim.eps = " +
         buf + "), so " + worst + " grew to a largest |value| of " + largest +
         (updates > 0 ? " in " + std::to_string(updates) + (updates == 1 ? " update" : " updates")
                      : std::string()) +
         ": " + kStateUnderflowFix;
}

std::string optimizer_state_underflow(const Capture& c, const Config& cfg) {
  return optimizer_state_underflow(c.optimizer.tensors, c.model.tensors, cfg);
}

void bisect_step(const Capture& c, const std::vector<std::string>& sets, ReplayResult& r) {
  r.bisected = true;
  // The base of the bisection is the replay's own settings (the capture's, or --precision /
  // --attention); each alternative changes one thing.
  const Config base = replay_config(c, r.out_dir, sets);
  if (!r.reproduced) {
    r.cause = "not-reproduced";
    r.explanation = "the step is finite under " + r.precision + " / attention " + r.attention +
                    ": nothing to bisect (replay without --precision/--attention to reproduce "
                    "the captured failure)";
  } else {
    const int64_t updates = updates_before(c);
    double uniform = 0;  // ln V once a trial has built the model
    // AdamW moves every weight by about lr per update: at an optim.lr of 10x the initial weights'
    // RMS the updates wreck the model in any format (the trend advisor's rule), and a wider one
    // only keeps the wreck finite. A LoRA at optim.lr 300 in 16-mixed (weights of 300 after one
    // update) was bisected to precision=bf16-mixed while the run's advice said "lower optim.lr".
    // Judged only once the weights did move that far (a warmup may not have got there).
    const double wreck = 10 * r.init_weight_rms;
    const bool lr_wrecks = base.optim.name != "sgd" && wreck > 0 && base.optim.lr >= wreck &&
                           r.largest_weight >= wreck;
    const bool grown = updates > 0 && (r.largest_weight > kDivergedWeight || lr_wrecks);
    for (const Alternative& a : alternatives(base, r.precision, r.attention, r.loss_scale)) {
      BisectTrial t;
      t.change = a.change;
      std::vector<std::string> s = sets;
      s.insert(s.end(), a.sets.begin(), a.sets.end());
      try {
        const StepOutcome o = replay_step(c, r.out_dir + "/bisect", s, false, a.loss_scale);
        t.finite = o.finite;
        t.marginal = o.finite && o.grad_norm > kMarginalNorm;
        if (o.vocab_size > 1) uniform = std::log(static_cast<double>(o.vocab_size));
        t.diverged =
            o.finite && (grown || o.loss > kDivergedLoss ||
                         (updates > 0 && uniform > 0 && o.loss > kDivergedUniform * uniform));
        t.loss = o.loss;
        t.grad_norm = o.grad_norm;
      } catch (const Error& e) {
        t.error = e.what();
      }
      r.bisect.push_back(t);
    }
    for (const BisectTrial& t : r.bisect)
      if (t.finite && !t.marginal && !t.diverged) {
        r.cause = t.change;
        r.explanation = explain_change(t.change, r.precision, base, r.loss_scale);
        break;
      }
    if (r.cause.empty()) {
      if (!r.nonfinite_param_values.empty()) {
        r.cause = "nonfinite-parameters";
        // Where it came from, when the capture knows: a frozen base tensor is not in the capture
        // (the run referenced model.path), and before any update a non-finite value was loaded
        // (the explanation blamed "an earlier update" of a run that had applied none).
        const std::string& first = r.nonfinite_param_values.front();
        const bool in_base = !c.model.find(first) && c.meta.contains("base") &&
                             !c.meta["base"].is_null() && !base.model.path.empty();
        std::string origin =
            "the model state came in broken (a corrupt checkpoint or initialization, or an "
            "earlier update)";
        if (in_base)
          origin = first + " is a frozen tensor of the base model.path = " + base.model.path +
                   ", whose file holds it (loaded under model.allow_nonfinite_weights = true): "
                   "correct the base's weights";
        else if (updates == 0 && !base.model.path.empty())
          origin = "no update was applied yet, so it came with model.path = " + base.model.path +
                   " (loaded under model.allow_nonfinite_weights = true): correct its weights";
        r.explanation = "the parameters were already non-finite before the step (first: " + first +
                        describe_rows(c, r) + "): no numerics change helps; " + origin;
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
        // Finite but diverged under some change: the weights do not overflow it, they are wrong.
        const bool some_finite = std::any_of(r.bisect.begin(), r.bisect.end(),
                                             [](const BisectTrial& t) { return t.finite; });
        r.explanation = (some_finite ? "no numerics change makes this step sound: the parameters "
                                       "themselves have diverged (largest |value| "
                                     : "no numerics change makes this step finite: the parameters "
                                       "themselves overflow every precision (largest |value| ") +
                        std::string(buf) + " in " + where + "); the run diverged before this step" +
                        (updates == 1  ? " (1 update was applied)"
                         : updates > 1 ? " (" + std::to_string(updates) + " updates were applied)"
                                       : std::string()) +
                        ": lower optim.lr";
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
          } else if (t.diverged && grown && t.change == "adapter=none") {
            r.explanation +=
                "; adapter=none leaves this step finite by dropping the adapter, "
                "whose weights diverged";
          } else if (t.diverged) {
            std::snprintf(buf, sizeof buf, "%.3g", t.loss);
            r.explanation += "; " + t.change + " leaves this step finite with a loss of " + buf;
            if (t.loss <= kDivergedLoss) {
              const bool by_loss =
                  updates > 0 && uniform > 0 && t.loss > kDivergedUniform * uniform;
              std::snprintf(buf, sizeof buf, "%.3g", by_loss ? uniform : r.largest_weight);
              r.explanation += std::string(by_loss ? ", above 1.5 x the uniform guess ln V = "
                                                   : ", but on weights of up to ") +
                               buf;
            }
            r.explanation += ": the model it runs has diverged";
          }
      }
    }
  }
  // The weights this step overflows on were blown up by updates with a flushed second moment:
  // that is the cause, the precision or backend change only the symptom's fix.
  if (r.reproduced) {
    const std::string why = optimizer_state_underflow(c, base);
    if (!why.empty()) {
      // The divergence is those updates' doing: its "lower optim.lr" would not fix it (an update
      // of lr * m / eps blows up at any lr), and read as a second, contradicting fix.
      const std::string lr_fix = ": lower optim.lr";
      if (const size_t at = r.explanation.find(lr_fix); at != std::string::npos)
        r.explanation.replace(at, lr_fix.size(), ", by the updates of the flushed second moment");
      r.explanation = why + ". This step: " + r.explanation;
    }
  }
}

}  // namespace keel::monitor
