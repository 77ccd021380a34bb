#include "keel/monitor/doctor.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>

#include "keel/amp/precision.h"
#include "keel/backend/cpu/isa.h"
#include "keel/backend/cuda_api.h"
#include "keel/data/tokenizer_base.h"
#include "keel/io/json_fields.h"
#include "keel/io/out_dir.h"
#include "keel/monitor/inject.h"
#include "keel/numerics/text.h"
#include "keel/ops/elementwise.h"
#include "keel/train/trainer.h"

namespace keel::monitor {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

DoctorCheck make(const char* sev, const char* check, std::string msg) {
  return {sev, check, std::move(msg)};
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string quoted_token(const TokenizerFacts& tok, int64_t id) {
  std::string t = tok.token_text ? tok.token_text(id) : std::string();
  return t.empty() ? std::string() : " ('" + t + "')";
}

}  // namespace

// ---- static checks

TokenizerFacts tokenizer_facts(const data::Tokenizer& tok, const std::string& name) {
  TokenizerFacts f;
  f.name = name;
  f.vocab_size = tok.vocab_size();
  f.pad_id = tok.pad_id();
  f.bos_id = tok.bos_id();
  f.eos_id = tok.eos_id();
  f.is_special = [&tok](int64_t id) { return tok.is_special(id); };
  f.token_text = [&tok](int64_t id) { return tok.id_to_token(id); };
  return f;
}

DoctorCheck check_pad_token(const TokenizerFacts& tok, const std::string& pad_mode,
                            int64_t embedding_rows, bool packed) {
  const std::string who = "tokenizer " + tok.name + ": ";
  const int64_t pad = tok.pad_id;
  const bool in_vocab = pad >= 0 && pad < tok.vocab_size;
  const bool special = in_vocab && tok.is_special && tok.is_special(pad);
  const bool hole = in_vocab && tok.token_text && tok.token_text(pad).empty();
  const bool is_bos_eos = pad >= 0 && (pad == tok.eos_id || pad == tok.bos_id);
  const bool collides = in_vocab && (is_bos_eos || (!special && !hole));
  if (pad >= 0 && !collides) {
    if (pad >= embedding_rows)
      return make("error", "pad-token",
                  who + "pad id " + std::to_string(pad) + " is outside the model's embedding (" +
                      std::to_string(embedding_rows) +
                      " rows); raise model.vocab_size to at least " + std::to_string(pad + 1) +
                      " or use the model's own tokenizer");
    return make("ok", "pad-token",
                who + "pad id " + std::to_string(pad) + quoted_token(tok, pad) +
                    " is a dedicated token, distinct from every real token");
  }
  // No usable pad: say why, then what keel does instead (data.pad).
  std::string why;
  if (pad < 0)
    why = "has no pad token (as GPT-2's and Llama-3's tokenizers)";
  else if (is_bos_eos)
    why = "declares pad id " + std::to_string(pad) + quoted_token(tok, pad) +
          ", which is also its " + (pad == tok.eos_id ? "eos" : "bos") + " token";
  else
    why = "declares pad id " + std::to_string(pad) + quoted_token(tok, pad) +
          ", an ordinary token that real text produces (as id 0 = '!' in Llama-3's vocabulary)";
  if (packed)  // as pad_fill_id: no new row for padding that no rule reads
    return make("ok", "pad-token",
                who + why +
                    "; the rows are packed from one stream (data.task = \"tokens\", or \"text\" "
                    "with data.pack): only the last "
                    "row's tail is padded, masked by position and never a label, so keel fills it "
                    "with an existing id and the embeddings keep their rows (data.pad does not "
                    "apply)");
  if (pad_mode == "eos") {
    if (tok.eos_id < 0)
      return make("error", "pad-token",
                  who + why +
                      ", and data.pad = \"eos\" but it has no eos token either; set "
                      "data.pad = \"add\"");
    return make("warning", "pad-token",
                who + why + "; data.pad = \"eos\" pads with eos " + std::to_string(tok.eos_id) +
                    quoted_token(tok, tok.eos_id) +
                    ": keel masks padding by position, so training is right, but a mask or label "
                    "rule built from ids (ids != pad, as HF collators do) also hides the real eos, "
                    "and the model never learns to stop; data.pad = \"add\" gives padding its own "
                    "id");
  }
  // A declared pad that is a real token is a defect of the tokenizer's config (any tool that
  // trusts it masks real text): a warning even though keel pads around it.
  return make(pad < 0 ? "info" : "warning", "pad-token",
              who + why + "; data.pad = \"add\" pads with the new id " +
                  std::to_string(tok.vocab_size) +
                  " (the embeddings grow by one row), so padding "
                  "never collides with a real token");
}

// JSONL examples of mixed lengths, one a row: an epoch's rows as data.padding pads them (each
// batch to its longest, or to data.seq_len), and the rows the same examples fill packed
// (data.pack: best fit decreasing, each example attending only to itself).
static std::optional<DoctorCheck> check_padding(const Config& cfg, const data::Dataset& set,
                                                const data::DataLoader& loader) {
  const DataConfig& dc = cfg.data;
  if (dc.task != "jsonl" || dc.pack || set.size() < 2 || cfg.run.device.rfind("cuda", 0) == 0)
    return std::nullopt;
  const std::vector<int64_t> order = loader.epoch_order(0);
  std::vector<size_t> lengths(order.size());
  int64_t tokens = 0, positions = 0;
  for (size_t begin = 0; begin < order.size(); begin += static_cast<size_t>(loader.batch_size())) {
    const size_t end = std::min(order.size(), begin + static_cast<size_t>(loader.batch_size()));
    int64_t longest = 0;
    for (size_t k = begin; k < end; ++k) {
      const int64_t len =
          std::min<int64_t>(static_cast<int64_t>(set.get(order[k]).size()), dc.seq_len);
      lengths[k] = static_cast<size_t>(len);
      tokens += len;
      longest = std::max(longest, len);
    }
    const int64_t row =
        dc.padding == "longest" ? data::padded_length(longest, dc.seq_len) : dc.seq_len;
    positions += static_cast<int64_t>(end - begin) * row;
  }
  if (positions == 0 || 4 * tokens > 3 * positions) return std::nullopt;  // under a quarter
  const auto rows = static_cast<int64_t>(
      data::best_fit_decreasing(lengths, static_cast<size_t>(dc.seq_len)).size());
  auto percent = [](int64_t part, int64_t whole) {
    return fmt("%.0f%%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
  };
  return make("info", "padding",
              "an epoch's rows of one example each are " + percent(positions - tokens, positions) +
                  " padding (" + std::to_string(tokens) + " tokens in " +
                  std::to_string(positions) + " positions): data.pack = true packs the " +
                  count_of(set.size(), "example") + " side by side into " + count_of(rows, "row") +
                  " of at most data.seq_len = " + std::to_string(dc.seq_len) + " tokens (at most " +
                  percent(rows * dc.seq_len - tokens, rows * dc.seq_len) +
                  " padding), each attending only to itself: the same loss in fewer rows "
                  "(CPU only)");
}

static std::optional<DoctorCheck> check_targets(const std::map<int64_t, int64_t>& count,
                                                int64_t targets, const TokenizerFacts& tok) {
  if (targets <= 0) return std::nullopt;
  int64_t top = -1, top_n = 0;
  for (auto [id, n] : count)
    if (n > top_n) top = id, top_n = n;
  // Only a dedicated pad id (as check_pad_token judges it) is never real data: Llama-3's declared
  // pad 0 is '!', which text does hold.
  const int64_t p = tok.pad_id;
  const bool in_vocab = p >= 0 && p < tok.vocab_size;
  const bool dedicated = p >= 0 && p != tok.eos_id && p != tok.bos_id &&
                         (!in_vocab || (tok.is_special && tok.is_special(p)) ||
                          (tok.token_text && tok.token_text(p).empty()));
  const auto pad = count.find(p);
  const int64_t pads = dedicated && pad != count.end() ? pad->second : 0;
  auto share = [&](int64_t n) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g%%",
                  100.0 * static_cast<double>(n) / static_cast<double>(targets));
    return std::string(buf);
  };
  const std::string of =
      " of the first micro-batch's " + std::to_string(targets) + " target tokens are ";
  if (pads > 0)
    return make("warning", "data",
                share(pads) + of + "the pad id " + std::to_string(tok.pad_id) +
                    quoted_token(tok, tok.pad_id) +
                    ": padding is in the data itself (a token file or text written with "
                    "padding), and the model is trained to predict it; remove it from the data");
  if (targets >= 16 && top_n * 10 >= targets * 9)
    return make("warning", "data",
                share(top_n) + of + "one token, id " + std::to_string(top) +
                    quoted_token(tok, top) +
                    ": the data is (almost) one repeated token, which a model predicts after a "
                    "few steps: the loss falls to ~0 and nothing is learned; check data.path");
  return std::nullopt;
}

// "; ranks 1 to 2 have no micro-batch there ...": the ranks a remainder window of `rem`
// micro-batches leaves idle (rank r runs micro-batches r, r + N, ...).
static std::string idle_ranks(int64_t rem, int64_t ranks) {
  if (ranks <= rem) return "";
  const std::string who = ranks - rem == 1 ? "rank " + std::to_string(rem) + " has"
                                           : "ranks " + std::to_string(rem) + " to " +
                                                 std::to_string(ranks - 1) + " have";
  return "; " + who + " no micro-batch there and join" + (ranks - rem == 1 ? "s" : "") +
         " the step with zero gradients";
}

std::vector<DoctorCheck> check_windows(int64_t examples, int64_t batch_size, int64_t grad_accum,
                                       int64_t ranks, const std::string& row) {
  std::vector<DoctorCheck> out;
  if (examples <= 0) {
    out.push_back(
        make("error", "windows", "the training set is empty; check data.path / data.task"));
    return out;
  }
  ranks = std::max<int64_t>(ranks, 1);
  const int64_t nb = (examples + batch_size - 1) / batch_size;  // micro-batches per epoch
  const int64_t last_rows = examples - (nb - 1) * batch_size;
  const int64_t window = grad_accum * ranks;  // micro-batches per step, all ranks together
  // "train.grad_accum = 2 x 2 ranks = 4": a step's window under mpirun is per rank times ranks.
  const std::string accum =
      "train.grad_accum = " + std::to_string(grad_accum) +
      (ranks > 1 ? " x " + std::to_string(ranks) + " ranks = " + std::to_string(window) : "");
  if (window > nb) {
    out.push_back(make("warning", "windows",
                       accum + " is larger than the epoch (" + count_of(examples, row) + " = " +
                           count_of(nb, "micro-batch", "micro-batches") + " of " +
                           std::to_string(batch_size) + "): every step is a remainder window of " +
                           count_of(nb, "micro-batch", "micro-batches") +
                           ", so the effective batch is " + count_of(examples, row) + ", not " +
                           std::to_string(window * batch_size) + "; lower train.grad_accum" +
                           (ranks > 1 ? " or the ranks so that their product is" : " to") +
                           " at most " + std::to_string(nb)));
    return out;
  }
  const int64_t steps = (nb + window - 1) / window;
  const int64_t rem = nb % window;
  if (rem != 0)
    out.push_back(make("info", "windows",
                       "each epoch ends with a remainder window of " +
                           count_of(rem, "micro-batch", "micro-batches") + " instead of " +
                           std::to_string(window) + " (step " + std::to_string(steps) + " of " +
                           std::to_string(steps) + idle_ranks(rem, ranks) +
                           "); keel weights micro-batches by target tokens, so its loss is still "
                           "the token mean (no division by the full window)"));
  if (last_rows != batch_size)
    out.push_back(make("info", "windows",
                       "the last micro-batch of each epoch has " + std::to_string(last_rows) +
                           " of " + std::to_string(batch_size) +
                           " rows (drop_last = false; token weighting keeps its loss exact)"));
  if (out.empty())
    out.push_back(make("ok", "windows",
                       count_of(steps, "step") + " per epoch of " +
                           (ranks > 1 ? std::to_string(ranks) + " ranks x " : "") +
                           std::to_string(grad_accum) + " x " + count_of(batch_size, row) +
                           ", no remainder"));
  return out;
}

std::vector<DoctorCheck> check_config(const Config& cfg) {
  std::vector<DoctorCheck> out;
  // Precision vs device.
  Device device;
  try {
    device = device_from_string(cfg.run.device);
  } catch (const Error& e) {
    out.push_back(make("error", "precision", e.what()));
    return out;
  }
  if (device.is_cuda() && !cuda::status().usable) {
    // keel train says one line and trains on the CPU: judge the rest for the CPU.
    out.push_back(make("warning", "precision",
                       "run.device = " + cfg.run.device + " but no usable CUDA device (" +
                           cuda::status().reason + "); keel train will run on the CPU"));
    device = Device::cpu();
  }
  PrecisionPolicy pol;
  try {
    pol = resolve_precision(cfg.train.precision, device, cfg.train.allow_cpu_bf16);
  } catch (const Error& e) {
    out.push_back(make("error", "precision", e.what()));
    return out;
  }
  const std::string p = pol.name();
  if (cfg.train.precision == "auto")
    out.push_back(
        make("info", "precision", "precision = auto resolves to " + p + " on " + device.str()));
  if (device.is_cpu() && pol.compute_dtype != DType::F32) {
    const bool native = pol.compute_dtype == DType::BF16 && cpu_has_avx512_bf16();
    out.push_back(make(
        "info", "precision",
        p + " on the CPU: " +
            (native ? std::string("the CPU has native bf16 dot products")
                    : std::string("no native ") + dtype_name(pol.compute_dtype) +
                          " arithmetic, so products run in f32 on rounded inputs (the rounding, "
                          "and so the numerics, are real; the speed is not)")));
  } else if (device.is_cpu()) {
    out.push_back(make("ok", "precision", p + " on the CPU"));
  }
  // f16 without a scaler, hard-cast policies.
  if (pol.kind == Precision::k16Mixed && !cfg.scaler.enabled)
    out.push_back(make("warning", "scaler",
                       "16-mixed with [scaler] enabled = false: gradients below f16's smallest "
                       "subnormal (6e-8) flush to zero and the step never learns why; enable "
                       "the scaler (scaler.enabled = true) or use bf16-mixed"));
  if (pol.kind == Precision::k16True)
    out.push_back(make("warning", "scaler",
                       "16-true keeps f16 parameters and f16 gradients with no loss scaler (a "
                       "scaler cannot unscale f16 gradients, as PyTorch refuses to): small "
                       "gradients underflow to 0 and activations above 65504 overflow; use "
                       "16-mixed (f32 masters + scaler) or bf16-mixed"));
  if (pol.kind == Precision::kBf16True)
    out.push_back(make("warning", "precision",
                       "bf16-true updates bf16 parameters without f32 masters: an update smaller "
                       "than 2^-9 of a weight rounds away (8 significant bits), so small learning "
                       "rates stall; use bf16-mixed unless memory forces it"));
  // Adapters.
  if (cfg.model.adapter.kind != "none") {
    out.push_back(make("info", "adapter",
                       cfg.model.adapter.kind + " adapter parameters are kept in f32 whatever the "
                                                "base dtype (PEFT's autocast_adapter_dtype), so "
                                                "the optimizer never updates 16-bit adapters"));
    if (cfg.model.base_dtype == "bf16" && pol.compute_dtype == DType::F16)
      out.push_back(make("warning", "adapter",
                         "a bf16 base (model.base_dtype = bf16) computing in f16 (" + p +
                             "): bf16 weights and activations beyond 65504 overflow f16; use "
                             "bf16-mixed with a bf16 base"));
  } else if (cfg.model.base_dtype != "f32") {
    out.push_back(make("info", "adapter",
                       "model.base_dtype = " + cfg.model.base_dtype +
                           " applies only to a frozen base under an adapter; ignored here"));
  }
  // Learning rate vs decoupled weight decay: AdamW multiplies decayed weights by (1 - lr*wd).
  if (cfg.optim.name == "adamw") {
    const double lr = cfg.optim.lr, wd = cfg.optim.weight_decay, lrwd = lr * wd;
    const double f = 1.0 - lrwd;
    // The fix names the key out of its usual range: lr 0.003 with weight_decay 500 was told
    // "lower optim.lr (AdamW is usually run at 1e-5 to 1e-2)", a learning rate already there.
    const bool lr_high = lr > 0.01, wd_high = wd > 1;
    const std::string lr_fix = "lower optim.lr (AdamW is usually run at 1e-5 to 1e-2)";
    const std::string wd_fix = "lower optim.weight_decay (AdamW usually takes 0 to 0.1)";
    const std::string fix = wd_high && !lr_high  ? wd_fix
                            : wd_high && lr_high ? lr_fix + " and " + wd_fix
                                                 : lr_fix;
    if (f <= 0)
      out.push_back(make("error", "optimizer",
                         "optim.lr x optim.weight_decay = " + fmt("%g", lrwd) +
                             " >= 1: AdamW's decoupled decay multiplies every decayed weight by "
                             "(1 - lr*wd) = " +
                             fmt("%g", f) +
                             " each step, so weights flip sign and grow until they overflow; " +
                             fix));
    else if (lrwd >= 0.01)
      // weight_decay 100 at lr 0.003 shrank every weight by 30% a step: the loss stuck at 4.05
      // (5.5 at the start) for 120 steps with doctor's "nothing blocks training".
      out.push_back(make(
          "warning", "optimizer",
          "optim.lr x optim.weight_decay = " + fmt("%g", lrwd) +
              ": AdamW's decoupled decay multiplies every decayed weight by " + fmt("%g", f) +
              " each step, halving it every " +
              count_of(static_cast<long long>(std::ceil(std::log(0.5) / std::log(f))), "step") +
              " whatever the gradients (the usual product is 1e-3 or "
              "less); " +
              fix));
    if (f > 0 && lr > 0.1)
      out.push_back(make("warning", "optimizer",
                         "optim.lr = " + fmt("%g", lr) +
                             " is far above AdamW's usual range (1e-5 to 1e-2): each step moves "
                             "every weight by up to lr; expect divergence"));
  }
  if (cfg.train.max_grad_norm <= 0)
    out.push_back(make("info", "optimizer",
                       "train.max_grad_norm = 0: no gradient clipping (a spike goes straight into "
                       "the update)"));
  return out;
}

DoctorCheck check_memory(const MemoryEstimate& e, int64_t available, const std::string& advice) {
  const std::string est = fmt("%.1f MB", static_cast<double>(e.total) / 1e6);
  if (available < 0)
    return make("info", "memory", "estimated peak " + est + " (/proc/meminfo unreadable)");
  std::string av = fmt("%.1f MB", static_cast<double>(available) / 1e6);
  if (ranks_on_this_machine() > 1) av += " (" + available_memory_source() + ")";
  if (e.total > available && !advice.empty()) return make("error", "memory", advice);
  if (e.total > available)
    return make("error", "memory",
                "estimated peak " + est + " exceeds the available memory " + av +
                    "; lower train.batch_size (raise train.grad_accum to keep the batch) or "
                    "data.seq_len, or use a -mixed policy");
  if (e.total > available * 8 / 10)
    return make("warning", "memory",
                "estimated peak " + est + " is over 80% of the available memory " + av);
  return make("ok", "memory", "estimated peak " + est + " of " + av + " available");
}

// ---- the sanity pass

namespace {

// 97.2M, 1.24B
std::string params_text(int64_t n) {
  char buf[32];
  if (n >= 1'000'000'000)
    std::snprintf(buf, sizeof buf, "%.2fB", static_cast<double>(n) / 1e9);
  else
    std::snprintf(buf, sizeof buf, "%.1fM", static_cast<double>(n) / 1e6);
  return buf;
}

SanityRun sanity_run(const Config& base, const std::string& label,
                     const std::vector<std::string>& sets, const std::string& out_dir) {
  SanityRun s;
  s.label = label;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    // The configured run with `sets` applied, validated as `keel train` would.
    std::vector<std::string> ov = {"run.out_dir=" + out_dir, "run.resume=false",
                                   "debug.underflow_overflow.enabled=false"};
    ov.insert(ov.end(), sets.begin(), sets.end());
    RunOptions quiet;  // its notices are the probe's, said once there
    quiet.say = [](const std::string&) {};
    Run run = build_run(load_config_text(config_to_toml(base), "the config", ov), quiet);
    s.precision = run.policy.name();
    s.attention = ops::attention_backend_name(run.model->spec().attention);
    const std::vector<data::Batch> window = {run.loader->batch(0, 0)};
    run.optimizer->zero_grad();
    run.model->train(true);
    const double scale = run.scaler ? run.scaler->get_scale() : 1.0;
    const double sum = forward_backward(run, window, step_seed(run.cfg, 1), scale);
    s.loss = window[0].n_targets > 0 ? sum / static_cast<double>(window[0].n_targets) : 0.0;
    std::vector<Tensor> grads;
    for (auto& [name, p] : run.trainable)
      if (p.grad().defined()) grads.push_back(p.grad());
    const amp::GradPass pass = run.scaler ? run.scaler->unscale_pass(grads) : amp::grad_pass(grads);
    s.grad_norm = pass.norm();
    s.finite = std::isfinite(s.loss) && std::isfinite(s.grad_norm);
    s.ran = true;
  } catch (const std::exception& e) {
    s.error = e.what();
  }
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

}  // namespace

DoctorReport run_doctor(const Config& cfg, const DoctorOptions& opt) {
  DoctorReport r;
  r.checks = check_config(cfg);
  // The out_dir as keel train will claim it (read only: nothing is locked, created or removed):
  // an out_dir holding a previous run got "nothing blocks training", and train refused it.
  if (!cfg.run.out_dir.empty()) {
    try {
      io::claim_out_dir(cfg.run.out_dir, cfg.run.resume, cfg.run.overwrite, input_paths(cfg));
    } catch (const Error& e) {
      r.checks.push_back(make("error", "out_dir", e.what()));
    }
  }
  const bool config_ok = std::none_of(r.checks.begin(), r.checks.end(), [](const DoctorCheck& c) {
    return c.severity == "error" && c.check == "precision";
  });
  std::string out_dir = opt.out_dir;
  bool remove_after = false;
  if (out_dir.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "keel-doctor-XXXXXX").string();
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) throw Error("doctor: cannot create a temporary directory");
    out_dir = buf.data();
    remove_after = true;
  }
  // Memory first: the estimate needs no model (model.path's config.json or the model.* keys,
  // the adapters' own shapes), and a run that cannot fit is not built for the probe either.
  bool estimated = false, fits = true;
  try {
    MemoryQuery q = memory_query_from_config(cfg);
    q.flags = false;  // a config's run: its keys, not keel memory's flags
    r.available_bytes = available_memory_bytes();
    // Sizes out of all reach, refused as keel train refuses them: the full estimate's arithmetic
    // would overflow on them ("no estimate"), and the probe was built until its allocation failed.
    const std::string refusal = memory_floor_refusal(q, r.available_bytes);
    if (!refusal.empty()) {
      fits = false;
      r.checks.push_back(make("error", "memory", refusal));
    } else {
      r.memory = estimate_memory(q);
      estimated = true;
      fits = r.available_bytes < 0 || r.memory.total <= r.available_bytes;
      r.checks.push_back(check_memory(r.memory, r.available_bytes,
                                      fits ? "" : memory_fit_advice(q, r.available_bytes)));
    }
  } catch (const Error& e) {
    r.checks.push_back(
        make("warning", "memory",
             std::string("no estimate (nothing is assumed in its place): ") + e.what()));
  }
  std::optional<Run> probe;
  if (config_ok && !fits)
    r.checks.push_back(make("error", "setup",
                            "the run was not built for the checks below: it would not fit in "
                            "memory (see the memory check)"));
  if (config_ok && fits) {
    try {
      Config c = cfg;
      c.run.out_dir = out_dir + "/probe";
      c.run.resume = false;  // (its checkpoint is judged below, in place)
      c.run.resume_force = false;
      // The tracer stays as configured: build_run attaches none, and turning it off here made the
      // run factory tell a user who had enabled it "the tracer is off", hiding train's notes on
      // its batch numbers.
      // Its notices go to stderr as keel train's would, but for the weights a 16-bit format
      // cannot hold: those are an error check of their own below.
      RunOptions o;
      o.say = [](const std::string& m) {
        if (m.rfind("warning: ", 0) != 0 ||
            m.find(" beyond f16's largest finite ") == std::string::npos)
          std::fprintf(stderr, "%s\n", m.c_str());
      };
      probe = build_run(c, o);
      for (const std::string& w :
           weights_beyond_compute_format(*probe->model, probe->policy, c.model.path))
        r.checks.push_back(make("error", "weights", w));
    } catch (const std::exception& e) {
      r.checks.push_back(make("error", "setup", std::string("the run cannot start: ") + e.what()));
    }
  }
  // The checkpoint a resume continues, as keel train judges it (read only): a resume train
  // refuses (another seed, batch, precision, model or data than the checkpoint's, a lost `last`
  // beside step-N checkpoints, a damaged one) got "nothing blocks training".
  if (cfg.run.resume && !cfg.run.out_dir.empty()) {
    try {
      std::vector<std::string> notes;
      if (probe)
        notes = check_resume(*probe, cfg);
      else if (resume_checkpoint_dir(cfg.run.out_dir).empty())
        notes = {resume_from_scratch_message(cfg.run.out_dir)};
      for (const std::string& n : notes) r.checks.push_back(make("warning", "resume", n));
      if (probe && notes.empty())
        r.checks.push_back(
            make("ok", "resume",
                 "the checkpoint in " + cfg.run.out_dir + "/checkpoints/last fits this config"));
    } catch (const Error& e) {
      r.checks.push_back(make("error", "resume", e.what()));
    }
  }
  // The module fault injection corrupts, looked up as keel train does once the model is built:
  // a name of no module got "nothing blocks training", and train refused it.
  if (probe && !cfg.debug.inject.module.empty()) {
    try {
      FaultInjector check(*probe->model, cfg.debug.inject);  // hooks on, and off again at once
    } catch (const Error& e) {
      r.checks.push_back(make("error", "inject", e.what()));
    }
  }
  if (probe) {
    // Tokenizer and data, as the Trainer built them for training.
    const TokenizerFacts tok = tokenizer_facts(*probe->data.tokenizer, cfg.data.tokenizer);
    const int64_t rows = probe->model->spec().vocab_size;
    r.checks.push_back(check_pad_token(tok, cfg.data.pad, std::max(rows, tok.vocab_size),
                                       rows_are_packed(cfg.data)));
    // Adapter dtypes, as built: every trainable adapter parameter must be f32 (an f16 one would
    // meet PyTorch's "Attempting to unscale FP16 gradients" pain); the frozen base as configured.
    if (cfg.model.adapter.kind != "none") {
      int64_t n = 0, not_f32 = 0, numel = 0;
      std::string bad;
      for (auto& [name, p] : probe->trainable) {
        ++n;
        numel += p.numel();
        if (p.dtype() != DType::F32 && !not_f32++) bad = name + " (" + dtype_name(p.dtype()) + ")";
      }
      DType base_dt = DType::F32;
      for (auto& [name, p] : probe->model->named_parameters())
        if (!p.requires_grad()) base_dt = p.dtype();
      if (not_f32)
        r.checks.push_back(make("error", "adapter",
                                std::to_string(not_f32) + " of " + std::to_string(n) +
                                    " adapter parameters are not f32 (first: " + bad +
                                    "); adapters must train in f32"));
      else
        r.checks.push_back(make("ok", "adapter",
                                // Tensors and their values: "160 trainable lora parameters"
                                // beside keel memory's "15.204M adapter parameters".
                                std::to_string(n) + " trainable " + cfg.model.adapter.kind +
                                    " tensors (" + std::to_string(numel) +
                                    " parameters), all f32; frozen base stored in " +
                                    dtype_name(base_dt)));
    }
    auto w = check_windows(
        probe->loader->size(), cfg.train.batch_size, cfg.train.grad_accum, opt.ranks,
        probe->data.train->examples() != probe->loader->size() ? "packed row" : "example");
    r.checks.insert(r.checks.end(), w.begin(), w.end());
    if (const std::optional<DoctorCheck> p = check_padding(cfg, *probe->data.train, *probe->loader))
      r.checks.push_back(*p);
    // A config for several ranks checked outside mpirun: the windows above are one rank's.
    if (opt.ranks == 0 && (cfg.dist.backend == "mpi" || cfg.dist.backend == "nccl"))
      r.checks.push_back(make(
          "info", "dist",
          "dist.backend = \"" + cfg.dist.backend +
              "\": train.batch_size and train.grad_accum are per rank and a step takes N x "
              "their micro-batches; the windows above are one rank's: run keel doctor under the "
              "same mpirun -np N as keel train to check N ranks' windows"));
    if (probe->loader->size() > 0) {
      // What the first micro-batch asks the model to predict: padding written into the data
      // (a token file of pad ids) or one token repeated trains to a loss of ~0 and learns
      // nothing, and every other check passes on it.
      const data::Batch b = probe->loader->batch(0, 0);
      const Tensor labels = b.labels.to(Device::cpu());
      std::map<int64_t, int64_t> count;
      int64_t targets = 0;
      const int64_t* l = labels.data_as<int64_t>();
      for (int64_t i = 0; i < labels.numel(); ++i)
        if (l[i] != data::kIgnoreLabel) ++count[l[i]], ++targets;
      if (const std::optional<DoctorCheck> d = check_targets(count, targets, tok))
        r.checks.push_back(*d);
    }
  }
  // The built model against the estimate's count: the estimate sizes the model without
  // building it (config.json or the model.* keys, the adapters' own shapes), so a difference
  // says what it missed (a pad row added to the vocabulary is one row, nothing to report).
  if (probe && estimated) {
    const int64_t built = probe->model->num_parameters();
    const int64_t trainable = probe->model->num_parameters(/*trainable_only=*/true);
    const int64_t row = probe->model->spec().n_embd * (probe->model->spec().tie_embeddings ? 1 : 2);
    if (std::llabs(built - r.memory.params) > row || trainable != r.memory.trainable)
      r.checks.push_back(make("warning", "memory",
                              "the estimate counts " + std::to_string(r.memory.params) +
                                  " parameters (" + std::to_string(r.memory.trainable) +
                                  " trainable) but the built model has " + std::to_string(built) +
                                  " (" + std::to_string(trainable) +
                                  " trainable): the estimate is off by their bytes"));
  }
  probe.reset();

  // One batch under the configured settings, 32-true, and each attention backend.
  if (opt.sanity && config_ok &&
      !std::any_of(r.checks.begin(), r.checks.end(), [](const DoctorCheck& c) {
        return c.severity == "error" && c.check == "setup";
      })) {
    const PrecisionPolicy pol =
        resolve_precision(cfg.train.precision, Device::cpu(), cfg.train.allow_cpu_bf16);
    const std::string att = cfg.model.attention;
    std::vector<std::pair<std::string, std::vector<std::string>>> passes = {{"configured", {}}};
    if (pol.name() != "32-true") passes.push_back({"32-true", {"train.precision=32-true"}});
    for (const char* b : {"eager", "math", "flash"})
      if (att != b)
        passes.push_back({std::string("attention=") + b, {std::string("model.attention=") + b}});
    const bool tell = opt.progress && r.memory.params >= opt.progress_params;
    for (size_t i = 0; i < passes.size(); ++i) {
      if (tell)
        opt.progress("sanity pass " + std::to_string(i + 1) + " of " +
                     std::to_string(passes.size()) + " (" + passes[i].first + "): builds the " +
                     params_text(r.memory.params) +
                     "-parameter run and runs one batch forward and backward; --no-sanity "
                     "skips these passes");
      r.sanity.push_back(sanity_run(cfg, passes[i].first, passes[i].second,
                                    out_dir + "/sanity-" + std::to_string(i)));
    }
    const SanityRun& conf = r.sanity.front();
    const SanityRun* ref = pol.name() != "32-true" ? &r.sanity[1] : nullptr;
    if (!conf.ran) {
      r.checks.push_back(make("error", "sanity", "one batch could not run: " + conf.error));
    } else if (!conf.finite) {
      std::string m = "the first batch is non-finite under the configured settings (" +
                      conf.precision + ", attention " + conf.attention + ")";
      const bool scaler_only = std::isfinite(conf.loss) && pol.scaler && cfg.scaler.enabled;
      if (scaler_only) {
        r.checks.push_back(make("warning", "sanity",
                                m + " only in the scaled gradients: the scaler will skip the first "
                                    "steps and back off from scaler.init_scale"));
      } else {
        if (ref && ref->ran && ref->finite)
          m += "; it is finite under 32-true: the precision is the cause (run keel train to "
               "capture it, then keel replay --bisect)";
        r.checks.push_back(make("error", "sanity", m));
      }
    } else {
      std::string m = "one batch under " + conf.precision + ": loss " + fmt("%.6g", conf.loss) +
                      ", grad norm " + fmt("%.6g", conf.grad_norm);
      const char* sev = "ok";
      if (ref && ref->ran && ref->finite) {
        const double rel = std::fabs(conf.loss - ref->loss) / std::max(1e-12, std::fabs(ref->loss));
        // A bf16 frozen base stays bf16 in the reference (an f32 copy would double the base, 32 GB
        // for 8B): its products are bf16 in both runs, and the difference measures only the rest
        // (0 at the first batch of a LoRA, whose B starts at 0), which "relative difference 0"
        // alone read as bf16 costing this model nothing.
        const bool bf16_base = cfg.model.adapter.kind != "none" && cfg.model.base_dtype == "bf16";
        m += std::string(" (32-true") +
             (bf16_base ? " with the base still bf16 (model.base_dtype), so its products are "
                          "rounded alike in both"
                        : "") +
             ": loss " + fmt("%.6g", ref->loss) + ", relative difference " + fmt("%.2g", rel) + ")";
        if (rel > 0.02) {
          sev = "warning";
          m += "; more than 2% off 32-true: low precision changes this model's loss visibly";
        }
      }
      r.checks.push_back(make(sev, "sanity", m));
    }
    for (size_t i = 1; i < r.sanity.size(); ++i) {
      const SanityRun& s = r.sanity[i];
      if (!s.ran)
        r.checks.push_back(make("warning", "sanity", s.label + " could not run: " + s.error));
      else if (!s.finite && conf.ran && conf.finite)
        r.checks.push_back(make("warning", "sanity",
                                s.label + " is non-finite on the first batch while the configured "
                                          "settings are finite: do not switch to it"));
    }
  }
  if (remove_after) {
    std::error_code ec;
    fs::remove_all(out_dir, ec);
  }
  r.blocking = std::any_of(r.checks.begin(), r.checks.end(),
                           [](const DoctorCheck& c) { return c.severity == "error"; });
  return r;
}

std::string format_doctor(const DoctorReport& r) {
  std::ostringstream o;
  o << "keel doctor\n";
  for (const DoctorCheck& c : r.checks) {
    char tag[16];
    std::snprintf(tag, sizeof tag, "%-7s", c.severity.c_str());
    o << "  [" << tag << "] " << c.check << ": " << c.message << "\n";
  }
  if (!r.sanity.empty()) {
    o << "one-batch sanity pass (first micro-batch, forward + backward, no update):\n";
    char buf[200];
    std::snprintf(buf, sizeof buf, "  %-18s %-11s %-9s %14s %14s %8s\n", "run", "precision",
                  "attention", "loss", "grad norm", "seconds");
    o << buf;
    for (const SanityRun& s : r.sanity) {
      if (!s.ran) {
        o << "  " << s.label << ": could not run (" << s.error << ")\n";
        continue;
      }
      std::snprintf(buf, sizeof buf, "  %-18s %-11s %-9s %14.7g %14.7g %8.2f\n", s.label.c_str(),
                    s.precision.c_str(), s.attention.c_str(), s.loss, s.grad_norm, s.seconds);
      o << buf;
    }
  }
  if (r.memory.total > 0) o << format_memory(r.memory);
  o << (r.blocking ? "verdict: blocked — fix the errors above before training\n"
                   : "verdict: nothing blocks training\n");
  return o.str();
}

json doctor_to_json(const DoctorReport& r) {
  json checks = json::array();
  for (const DoctorCheck& c : r.checks)
    checks.push_back({{"severity", c.severity}, {"check", c.check}, {"message", c.message}});
  json sanity = json::array();
  for (const SanityRun& s : r.sanity) {
    json e = {{"label", s.label},
              {"precision", s.precision},
              {"attention", s.attention},
              {"ran", s.ran},
              {"loss", io::json_float(s.loss)},
              {"grad_norm", io::json_float(s.grad_norm)},
              {"finite", s.finite},
              {"seconds", s.seconds}};
    if (!s.error.empty()) e["error"] = s.error;
    sanity.push_back(e);
  }
  return {{"checks", checks},
          {"sanity", sanity},
          {"memory", memory_to_json(r.memory)},
          {"available_bytes", r.available_bytes},
          {"blocking", r.blocking}};
}

}  // namespace keel::monitor
