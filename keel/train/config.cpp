// Config loading: one table of every key (section, name, the Config field it fills, its checks),
// used for reading the TOML file, applying --set overrides, validating, writing the effective
// config back, and listing the keys for docs/config.md's test. Adding a key means adding one line
// to `key_table()` and one row to docs/config.md.
#include "keel/train/config.h"

#include <toml++/toml.h>
#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <tuple>
#include <variant>

#include "keel/data/chat_template.h"
#include "keel/io/hf_config.h"
#include "keel/models/causal_lm.h"
#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"
#include "keel/numerics/text.h"

namespace keel {
namespace {

using Field = std::variant<bool*, int*, int64_t*, uint64_t*, double*, std::string*,
                           std::vector<std::string>*, std::vector<int64_t>*>;

constexpr double kInf = std::numeric_limits<double>::infinity();

// One key: where it lives, which field it fills, and the checks on its value.
struct KeySpec {
  KeySpec(std::string s, std::string n, Field (*f)(Config&))
      : section(std::move(s)), name(std::move(n)), field(f) {}
  std::string section;  // "train", "model.adapter"
  std::string name;     // "batch_size"
  Field (*field)(Config&);
  std::vector<std::string> choices;  // strings: the valid values (empty = any)
  double lo = -kInf, hi = kInf;      // numbers (and each element of int[]): the valid range
  bool lo_open = false, hi_open = false;
  std::optional<double> also;  // a value outside the range with a meaning of its own (-1 = never)

  std::string full() const { return section + "." + name; }
  KeySpec& at_least(double v) { return lo = v, lo_open = false, *this; }
  KeySpec& above(double v) { return lo = v, lo_open = true, *this; }
  KeySpec& below(double v) { return hi = v, hi_open = true, *this; }
  KeySpec& at_most(double v) { return hi = v, hi_open = false, *this; }
  KeySpec& one_of(std::vector<std::string> c) { return choices = std::move(c), *this; }
  KeySpec& or_value(double v) { return also = v, *this; }
};

#define KEEL_KEY(section, path, member)                                 \
  KeySpec {                                                             \
    section, #member, [](Config& c) -> Field { return &c.path.member; } \
  }

const std::vector<KeySpec>& key_table() {
  static const std::vector<KeySpec> keys = [] {
    std::vector<KeySpec> k;
    // [run]
    k.push_back(KEEL_KEY("run", run, out_dir));
    k.push_back(KEEL_KEY("run", run, seed));
    k.push_back(KEEL_KEY("run", run, resume));
    k.push_back(KEEL_KEY("run", run, resume_force));
    k.push_back(KEEL_KEY("run", run, overwrite));
    k.push_back(KEEL_KEY("run", run, device));  // checked by check_device()
    // Sizes have upper bounds (docs/config.md): products of sizes stay far inside int64, and an
    // absurd value is a config error, not a segfault or an allocation of exabytes.
    k.push_back(KEEL_KEY("run", run, threads).at_least(0).at_most(4096));
    // [model]
    k.push_back(KEEL_KEY("model", model, family).one_of({"gpt2", "llama"}));
    k.push_back(KEEL_KEY("model", model, path));
    k.push_back(KEEL_KEY("model", model, n_layer).at_least(1).at_most(1024));
    k.push_back(KEEL_KEY("model", model, n_embd).at_least(1).at_most(65536));
    k.push_back(KEEL_KEY("model", model, n_head).at_least(1).at_most(1024));
    k.push_back(KEEL_KEY("model", model, n_kv_head).at_least(0).at_most(1024));
    k.push_back(
        KEEL_KEY("model", model, head_dim).at_least(0).at_most(models::ModelSpec::kMaxHeadWidth));
    k.push_back(KEEL_KEY("model", model, intermediate_size).at_least(0).at_most(1048576));
    k.push_back(KEEL_KEY("model", model, vocab_size).at_least(0).at_most(16777216));
    k.push_back(KEEL_KEY("model", model, max_seq_len).at_least(2).at_most(1048576));
    k.push_back(KEEL_KEY("model", model, tie_embeddings));
    k.push_back(KEEL_KEY("model", model, rope_theta).above(0));
    k.push_back(KEEL_KEY("model", model, norm_eps).above(0));
    k.push_back(KEEL_KEY("model", model, init_std).at_least(0));
    k.push_back(KEEL_KEY("model", model, dropout).at_least(0).below(1));
    k.push_back(KEEL_KEY("model", model, attention_dropout).at_least(0).below(1));
    k.push_back(KEEL_KEY("model", model, attention).one_of({"eager", "math", "flash"}));
    k.push_back(KEEL_KEY("model", model, base_dtype).one_of({"f32", "bf16"}));
    k.push_back(KEEL_KEY("model", model, allow_nonfinite_weights));
    k.push_back(KEEL_KEY("model", model, router_aux_loss_coef).at_least(0).at_most(100));
    // [model.adapter]
    k.push_back(
        KEEL_KEY("model.adapter", model.adapter, kind).one_of({"none", "lora", "dora", "lokr"}));
    k.push_back(
        KEEL_KEY("model.adapter", model.adapter, r).at_least(1).at_most(nn::kMaxAdapterRank));
    k.push_back(KEEL_KEY("model.adapter", model.adapter, alpha).above(0));
    k.push_back(KEEL_KEY("model.adapter", model.adapter, dropout).at_least(0).below(1));
    k.push_back(KEEL_KEY("model.adapter", model.adapter, target_modules));
    // [data]
    k.push_back(KEEL_KEY("data", data, task).one_of({"arith", "text", "jsonl", "tokens"}));
    k.push_back(KEEL_KEY("data", data, path));
    k.push_back(KEEL_KEY("data", data, tokenizer));
    k.push_back(KEEL_KEY("data", data, pad).one_of({"add", "eos"}));
    k.push_back(KEEL_KEY("data", data, seq_len).at_least(2).at_most(1048576));
    k.push_back(KEEL_KEY("data", data, pack));
    k.push_back(KEEL_KEY("data", data, padding).one_of({"longest", "max_length"}));
    k.push_back(KEEL_KEY("data", data, shuffle));
    k.push_back(KEEL_KEY("data", data, num_examples).at_least(1).at_most(100000000));
    k.push_back(KEEL_KEY("data", data, eval_examples).at_least(0).at_most(100000000));
    k.push_back(KEEL_KEY("data", data, eval_path));
    k.push_back(KEEL_KEY("data", data, eval_fraction).at_least(0).below(1));
    k.push_back(KEEL_KEY("data", data, chat_date));  // checked in validate()
    // 18 digits keep operands and their sums within int64.
    k.push_back(KEEL_KEY("data", data, digits).at_least(1).at_most(18));
    k.push_back(KEEL_KEY("data", data, arith_reverse));
    // [train]
    k.push_back(KEEL_KEY("train", train, precision)
                    .one_of({"32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "32",
                             "bf16", "16", "auto"}));
    k.push_back(KEEL_KEY("train", train, batch_size).at_least(1).at_most(65536));
    k.push_back(KEEL_KEY("train", train, grad_accum).at_least(1).at_most(65536));
    k.push_back(KEEL_KEY("train", train, max_steps).at_least(0).at_most(1e12));
    k.push_back(KEEL_KEY("train", train, epochs).at_least(1).at_most(1000000));
    k.push_back(KEEL_KEY("train", train, max_grad_norm).at_least(0));
    k.push_back(KEEL_KEY("train", train, on_nonfinite).one_of({"capture", "skip", "abort"}));
    k.push_back(KEEL_KEY("train", train, eval_every).at_least(0));
    k.push_back(KEEL_KEY("train", train, allow_cpu_bf16));
    k.push_back(KEEL_KEY("train", train, activation_checkpointing));  // checked in validate()
    // [optim]
    k.push_back(KEEL_KEY("optim", optim, name).one_of({"adamw", "sgd"}));
    k.push_back(KEEL_KEY("optim", optim, lr).above(0));
    k.push_back(KEEL_KEY("optim", optim.adamw, beta1).at_least(0).below(1));
    k.push_back(KEEL_KEY("optim", optim.adamw, beta2).at_least(0).below(1));
    k.push_back(KEEL_KEY("optim", optim.adamw, eps).at_least(0));
    k.push_back(KEEL_KEY("optim", optim, weight_decay).at_least(0));
    k.push_back(KEEL_KEY("optim", optim.sgd, momentum).at_least(0));
    k.push_back(KEEL_KEY("optim", optim.sgd, dampening).at_least(0).at_most(1));
    k.push_back(KEEL_KEY("optim", optim.sgd, nesterov));
    k.push_back(KEEL_KEY("optim", optim, stochastic_rounding));
    // [sched]
    k.push_back(KEEL_KEY("sched", sched, name).one_of({"constant", "linear", "cosine"}));
    k.push_back(KEEL_KEY("sched", sched, warmup_steps).at_least(0));
    k.push_back(KEEL_KEY("sched", sched, warmup_ratio).at_least(0).below(1));
    k.push_back(KEEL_KEY("sched", sched, min_lr_ratio).at_least(0).at_most(1));
    // [scaler] (PyTorch's GradScaler rejects growth_factor <= 1 and backoff_factor >= 1 too)
    k.push_back(KEEL_KEY("scaler", scaler, enabled));
    k.push_back(KEEL_KEY("scaler", scaler, init_scale).above(0));
    k.push_back(KEEL_KEY("scaler", scaler, growth_factor).above(1));
    k.push_back(KEEL_KEY("scaler", scaler, backoff_factor).above(0).below(1));
    k.push_back(KEEL_KEY("scaler", scaler, growth_interval).at_least(1));
    k.push_back(KEEL_KEY("scaler", scaler, min_scale).at_least(0));
    k.push_back(KEEL_KEY("scaler", scaler, max_scale).at_least(0));
    k.push_back(KEEL_KEY("scaler", scaler, hysteresis).at_least(1));
    k.push_back(KEEL_KEY("scaler", scaler, consecutive_hysteresis));
    k.push_back(KEEL_KEY("scaler", scaler, max_consecutive_skips).at_least(0));
    // [log]
    k.push_back(KEEL_KEY("log", log, every).at_least(1));
    k.push_back(KEEL_KEY("log", log, console));
    k.push_back(KEEL_KEY("log", log, metrics));
    k.push_back(KEEL_KEY("log", log, tensorboard));
    k.push_back(KEEL_KEY("log", log, per_layer_grad_norm));
    k.push_back(KEEL_KEY("log", log, checkpoint_every).at_least(0));
    k.push_back(KEEL_KEY("log", log, keep_checkpoints).at_least(0));
    // [debug]
    k.push_back(KEEL_KEY("debug", debug, nan_capture));
    // [debug.underflow_overflow]
    k.push_back(KEEL_KEY("debug.underflow_overflow", debug.underflow_overflow, enabled));
    k.push_back(KEEL_KEY("debug.underflow_overflow", debug.underflow_overflow, max_frames_to_save)
                    .at_least(1)
                    .at_most(100000));
    // Batch numbers are steps, 1-based as the console counts them: a 0 (HF counts from 0) named
    // no batch, and trace_batch_nums = [0] traced nothing while abort_after_batch_num = 0 stopped
    // before the first step, both without a word.
    k.push_back(KEEL_KEY("debug.underflow_overflow", debug.underflow_overflow, trace_batch_nums)
                    .at_least(1));
    k.push_back(
        KEEL_KEY("debug.underflow_overflow", debug.underflow_overflow, abort_after_batch_num)
            .at_least(1)
            .or_value(-1));
    // [debug.inject]
    k.push_back(KEEL_KEY("debug.inject", debug.inject, module));
    // Steps count from 1: step 0 injected nothing, without a word.
    k.push_back(KEEL_KEY("debug.inject", debug.inject, step).at_least(1).or_value(-1));
    k.push_back(KEEL_KEY("debug.inject", debug.inject, kind).one_of({"nan", "inf", "scale"}));
    k.push_back(KEEL_KEY("debug.inject", debug.inject, factor));
    k.push_back(KEEL_KEY("debug.inject", debug.inject, only_rank).at_least(-1));
    // [dist]
    k.push_back(KEEL_KEY("dist", dist, backend).one_of({"auto", "single", "mpi", "nccl"}));
    k.push_back(KEEL_KEY("dist", dist, bucket_mb).above(0).at_most(4096));
    k.push_back(KEEL_KEY("dist", dist, check_every).at_least(0));
    k.push_back(KEEL_KEY("dist", dist, rank_weights));
    k.push_back(KEEL_KEY("dist", dist, timeout_s).above(0).at_most(604800));
    return k;
  }();
  return keys;
}

#undef KEEL_KEY

// Sections in file order ("model" before "model.adapter").
std::vector<std::string> section_names() {
  std::vector<std::string> out;
  for (const KeySpec& k : key_table())
    if (std::find(out.begin(), out.end(), k.section) == out.end()) out.push_back(k.section);
  return out;
}

const KeySpec* find_key(const std::string& full) {
  for (const KeySpec& k : key_table())
    if (k.full() == full) return &k;
  return nullptr;
}

bool is_section(const std::string& name) {
  for (const KeySpec& k : key_table())
    if (k.section == name) return true;
  return false;
}

// Edit distance, except that a prefix counts as one edit: `rank` is nearest to `r`,
// `[debug.underflow]` to `[debug.underflow_overflow]`.
size_t name_distance(const std::string& a, const std::string& b) {
  const size_t d = edit_distance(a, b);
  if (!a.empty() && !b.empty() && (a.rfind(b, 0) == 0 || b.rfind(a, 0) == 0))
    return std::min<size_t>(d, 1);
  return d;
}

// The valid key nearest to `full` ("train.lr" -> "optim.lr"): the closest key name across all
// sections, ties broken by the closest section, then by plain edit distance (so `model.adaptor`
// prefers `model.adapter` to its prefix `model`). A key put in the wrong section is found.
std::string nearest_key(const std::string& full) {
  const size_t dot = full.rfind('.');
  const std::string sec = dot == std::string::npos ? "" : full.substr(0, dot);
  const std::string name = dot == std::string::npos ? full : full.substr(dot + 1);
  std::string best;
  std::array<size_t, 4> best_d{SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX};
  for (const KeySpec& k : key_table()) {
    std::array<size_t, 4> d{name_distance(name, k.name), name_distance(sec, k.section),
                            edit_distance(name, k.name), edit_distance(sec, k.section)};
    if (d < best_d) best_d = d, best = k.full();
  }
  return best;
}

std::string nearest_section(const std::string& name) {
  std::string best;
  std::pair<size_t, size_t> best_d{SIZE_MAX, SIZE_MAX};
  for (const std::string& s : section_names()) {
    std::pair<size_t, size_t> d{name_distance(name, s), edit_distance(name, s)};
    if (d < best_d) best_d = d, best = s;
  }
  return best;
}

// Whether `guess` is worth offering for what the user typed: at most half of the longer name
// edited, or a prefix (`rank` for `r`; an abbreviation of 3 letters or more, `[debug.underflow]`).
// The nearest of ~100 keys to a one-letter name is always one edit or a prefix away (`x` -> `r`,
// model.adapter.r; `a` -> data.arith_reverse), and offering it says nothing.
bool close_enough(const std::string& typed, const std::string& guess) {
  if (2 * edit_distance(typed, guess) <= std::max(typed.size(), guess.size())) return true;
  return guess.size() < typed.size() ? typed.rfind(guess, 0) == 0
                                     : typed.size() >= 3 && guess.rfind(typed, 0) == 0;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// What follows "unknown key FULL (where); ": the key another system's name means, the nearest
// valid key when it is close, else what the place it was put in holds.
std::string unknown_key_hint(const std::string& full) {
  const size_t dot = full.rfind('.');
  const std::string sec = dot == std::string::npos ? "" : full.substr(0, dot);
  const std::string name = dot == std::string::npos ? full : full.substr(dot + 1);
  const auto& peers = peer_key_names();
  for (const std::string& typed : {full, name})
    if (auto it = peers.find(typed); it != peers.end()) return "did you mean " + it->second + "?";
  const std::string guess = nearest_key(full);
  if (close_enough(name, guess.substr(guess.rfind('.') + 1))) return "did you mean " + guess + "?";
  if (sec.empty() && close_enough(full, nearest_section(full)))
    return "did you mean the section [" + nearest_section(full) + "]?";
  if (is_section(sec)) {
    std::vector<std::string> keys;
    for (const KeySpec& k : key_table())
      if (k.section == sec) keys.push_back(k.name);
    return "the keys of [" + sec + "] are " + joined(keys);
  }
  std::vector<std::string> top;
  for (const std::string& s : section_names())
    if (s.find('.') == std::string::npos) top.push_back(s);
  return "every key belongs to a section (e.g. train.max_steps); the sections are " + joined(top);
}

// The same for an unknown section.
std::string unknown_section_hint(const std::string& full) {
  const std::string guess = nearest_section(full);
  if (close_enough(full, guess)) return "did you mean [" + guess + "]?";
  return "the sections are " + joined(section_names());
}

// Shortest text that reads back as the same double; TOML floats need a '.' or an exponent.
std::string format_double(double v, bool toml) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);
  std::string s(buf, res.ptr);
  if (toml && s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (ch < 0x20 || ch == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04X", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

// The value of a field as TOML.
std::string field_toml(const Field& f) {
  struct Visitor {
    std::string operator()(bool* v) const { return *v ? "true" : "false"; }
    std::string operator()(int* v) const { return std::to_string(*v); }
    std::string operator()(int64_t* v) const { return std::to_string(*v); }
    std::string operator()(uint64_t* v) const { return std::to_string(*v); }
    std::string operator()(double* v) const { return format_double(*v, true); }
    std::string operator()(std::string* v) const { return toml_string(*v); }
    std::string operator()(std::vector<std::string>* v) const {
      std::string s = "[";
      for (size_t i = 0; i < v->size(); ++i) s += (i ? ", " : "") + toml_string((*v)[i]);
      return s + "]";
    }
    std::string operator()(std::vector<int64_t>* v) const {
      std::string s = "[";
      for (size_t i = 0; i < v->size(); ++i) s += (i ? ", " : "") + std::to_string((*v)[i]);
      return s + "]";
    }
  };
  return std::visit(Visitor{}, f);
}

const char* field_type(const Field& f) {
  struct Visitor {
    const char* operator()(bool*) const { return "bool"; }
    const char* operator()(int*) const { return "int"; }
    const char* operator()(int64_t*) const { return "int"; }
    const char* operator()(uint64_t*) const { return "int"; }
    const char* operator()(double*) const { return "float"; }
    const char* operator()(std::string*) const { return "string"; }
    const char* operator()(std::vector<std::string>*) const { return "string[]"; }
    const char* operator()(std::vector<int64_t>*) const { return "int[]"; }
  };
  return std::visit(Visitor{}, f);
}

// "string \"big\"", "integer 8", ... for type errors.
std::string describe(const toml::node& v) {
  if (auto s = v.as_string()) return "string " + toml_string(s->get());
  if (auto i = v.as_integer()) return "integer " + std::to_string(i->get());
  if (auto d = v.as_floating_point()) return "float " + format_double(d->get(), true);
  if (auto b = v.as_boolean()) return std::string("boolean ") + (b->get() ? "true" : "false");
  if (auto a = v.as_array()) {
    std::string s = "array [";
    for (size_t i = 0; i < a->size(); ++i) {
      if (i == 4) {
        s += ", ...";
        break;
      }
      s += (i ? ", " : "") + describe((*a)[i]);
    }
    return s + "]";
  }
  if (v.is_table()) return "table";
  std::ostringstream os;
  if (auto d = v.as_date()) os << "date " << *d;
  if (auto t = v.as_time()) os << "time " << *t;
  if (auto dt = v.as_date_time()) os << "date-time " << *dt;
  return os.str();
}

// Where a value came from, for messages: "config.toml:12" or "--set train.batch_size=0".
using Origins = std::map<std::string, std::string>;

// String keys that also take a TOML integer: precision = 16 (as Lightning), and
// activation_checkpointing = 2 (blocks per segment).
bool takes_integer(const KeySpec& k) {
  return k.full() == "train.precision" || k.full() == "train.activation_checkpointing";
}

Error usage(const std::string& msg) { return Error(msg, Error::kUsage); }

// Stores TOML value `v` into the field of `k`; a wrong type is an Error naming `where` and the key.
void assign(Config& c, const KeySpec& k, const toml::node& v, const std::string& where) {
  const Field f = k.field(c);
  auto type_error = [&](const std::string& expected) {
    return usage(where + ": " + k.full() + " must be " + expected + ", got " + describe(v));
  };
  auto integer = [&](int64_t lo, int64_t hi, const std::string& expected) -> int64_t {
    auto i = v.as_integer();
    if (!i) throw type_error(expected);
    if (i->get() < lo || i->get() > hi)
      throw usage(where + ": " + k.full() + " = " + std::to_string(i->get()) +
                  " is out of range for " + expected);
    return i->get();
  };
  if (auto p = std::get_if<bool*>(&f)) {
    auto b = v.as_boolean();
    if (!b) throw type_error("a boolean (true or false)");
    **p = b->get();
  } else if (auto p = std::get_if<int*>(&f)) {
    **p = static_cast<int>(
        integer(std::numeric_limits<int>::min(), std::numeric_limits<int>::max(), "an integer"));
  } else if (auto p = std::get_if<int64_t*>(&f)) {
    **p = integer(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
                  "an integer");
  } else if (auto p = std::get_if<uint64_t*>(&f)) {
    **p = static_cast<uint64_t>(
        integer(0, std::numeric_limits<int64_t>::max(), "an integer from 0 to 2^63-1"));
  } else if (auto p = std::get_if<double*>(&f)) {
    // An integer is a fine number: `lr = 1` means 1.0.
    if (auto d = v.as_floating_point())
      **p = d->get();
    else if (auto i = v.as_integer())
      **p = static_cast<double>(i->get());
    else
      throw type_error("a number");
  } else if (auto p = std::get_if<std::string*>(&f)) {
    if (auto s = v.as_string()) **p = s->get();
    // Lightning accepts precision=16 / 32 as integers; so do we.
    else if (auto i = v.as_integer(); i && takes_integer(k))
      **p = std::to_string(i->get());
    else
      throw type_error("a string");
  } else if (auto p = std::get_if<std::vector<std::string>*>(&f)) {
    auto a = v.as_array();
    if (!a) throw type_error("an array of strings");
    std::vector<std::string> out;
    for (const toml::node& e : *a) {
      if (!e.is_string()) throw type_error("an array of strings");
      out.push_back(e.as_string()->get());
    }
    **p = std::move(out);
  } else if (auto p = std::get_if<std::vector<int64_t>*>(&f)) {
    auto a = v.as_array();
    if (!a) throw type_error("an array of integers");
    std::vector<int64_t> out;
    for (const toml::node& e : *a) {
      if (!e.is_integer()) throw type_error("an array of integers");
      out.push_back(e.as_integer()->get());
    }
    **p = std::move(out);
  }
}

std::string line_of(const toml::source_region& r) {
  return r.begin.line ? ":" + std::to_string(r.begin.line) : "";
}

// Walks a parsed table: known keys are assigned, known sections recursed into, anything else is an
// Error naming it and the nearest valid key or section.
void walk(Config& c, const toml::table& t, const std::string& prefix, const std::string& path,
          Origins& origins) {
  for (auto&& [key, node] : t) {
    const std::string full =
        prefix.empty() ? std::string(key.str()) : prefix + "." + std::string(key.str());
    const std::string where =
        path + line_of(key.source().begin.line ? key.source() : node.source());
    if (const KeySpec* k = find_key(full)) {
      assign(c, *k, node, where);
      origins[full] = where;
    } else if (is_section(full)) {
      if (!node.is_table())
        throw usage(where + ": [" + full + "] must be a table (a section), got " + describe(node));
      walk(c, *node.as_table(), full, path, origins);
    } else if (node.is_table()) {
      throw usage("unknown section [" + visible(full) + "] (" + where + "); " +
                  unknown_section_hint(full));
    } else {
      throw usage("unknown key " + visible(full) + " (" + where + "); " + unknown_key_hint(full));
    }
  }
}

std::string describe_range(const KeySpec& k) {
  // Integral bounds as integers: "in [1, 100000000]", not "[1, 1e+08]", for an integer key.
  auto num = [](double v) {
    return std::abs(v) < 0x1p53 && v == std::floor(v) ? std::to_string(static_cast<int64_t>(v))
                                                      : format_double(v, false);
  };
  if (k.hi == kInf) return std::string(k.lo_open ? "> " : ">= ") + num(k.lo);
  if (k.lo == -kInf) return std::string(k.hi_open ? "< " : "<= ") + num(k.hi);
  return std::string("in ") + (k.lo_open ? "(" : "[") + num(k.lo) + ", " + num(k.hi) +
         (k.hi_open ? ")" : "]");
}

bool in_range(const KeySpec& k, double v) {
  if (std::isnan(v)) return false;
  if (k.also && v == *k.also) return true;
  if (k.lo_open ? !(v > k.lo) : !(v >= k.lo)) return false;
  if (k.hi_open ? !(v < k.hi) : !(v <= k.hi)) return false;
  return true;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

// A number of key `k` is finite and in its range; `pre` names where it came from ("FILE:3:7: ").
void check_number(const KeySpec& k, double v, const std::string& shown, const std::string& pre) {
  // With the range: "must be a finite number" alone left the valid values to a guess.
  if (!std::isfinite(v))
    throw usage(pre + k.full() + " must be a finite number, got " + shown +
                (k.lo == -kInf && k.hi == kInf ? "" : " (valid: " + describe_range(k) + ")"));
  if (!in_range(k, v))
    throw usage(pre + k.full() + " must be " + describe_range(k) +
                (k.also ? " (or " + format_double(*k.also, false) + ")" : std::string()) +
                ", got " + shown);
}

// Checks every key's value (enumerations, ranges, finiteness) and the few rules that tie keys
// together; normalizes precision aliases. Errors name where the offending value came from.
void validate(Config& c, const Origins& origins) {
  auto from = [&](const std::string& key) {
    auto it = origins.find(key);
    return it == origins.end() ? std::string("default") : it->second;
  };
  auto prefix = [&](const std::string& key) {
    auto it = origins.find(key);
    return it == origins.end() ? std::string() : it->second + ": ";
  };
  // A NUL byte (TOML's "\u0000") ends a path at the C library: data.path = "a.txt\u0000b"
  // trained on a.txt, and run.out_dir = "out\u0000x" created out/. No path or name holds one.
  auto check_no_nul = [&](const KeySpec& k, const std::string& s, const std::string& pre) {
    if (s.find('\0') != std::string::npos)
      throw usage(pre + k.full() + " = " + toml_string(s) +
                  " holds a NUL byte (\\u0000), which no path or name can hold; remove it");
  };
  for (const KeySpec& k : key_table()) {
    const Field f = k.field(c);
    const std::string pre = prefix(k.full());
    if (auto p = std::get_if<std::string*>(&f)) check_no_nul(k, **p, pre);
    if (auto p = std::get_if<std::vector<std::string>*>(&f))
      for (const std::string& s : **p) check_no_nul(k, s, pre);
    if (auto p = std::get_if<std::string*>(&f); p && !k.choices.empty()) {
      if (std::find(k.choices.begin(), k.choices.end(), **p) == k.choices.end())
        throw usage(pre + k.full() + " must be one of " + join(k.choices, ", ") + "; got " +
                    toml_string(**p));
    }
    if (auto p = std::get_if<int*>(&f)) check_number(k, **p, std::to_string(**p), pre);
    if (auto p = std::get_if<int64_t*>(&f))
      check_number(k, static_cast<double>(**p), std::to_string(**p), pre);
    if (auto p = std::get_if<double*>(&f)) check_number(k, **p, format_double(**p, false), pre);
    if (auto p = std::get_if<std::vector<int64_t>*>(&f))
      for (int64_t v : **p)
        check_number(k, static_cast<double>(v), std::to_string(v) + " in the list", pre);
  }
  // Device: cpu | cuda | cuda:N.
  const std::string& dev = c.run.device;
  bool dev_ok = dev == "cpu" || dev == "cuda";
  if (dev.rfind("cuda:", 0) == 0 && dev.size() > 5 && dev.size() < 12)
    dev_ok =
        std::all_of(dev.begin() + 5, dev.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  if (!dev_ok)
    throw usage(prefix("run.device") +
                "run.device must be cpu, cuda or cuda:N (N = GPU index); got " + toml_string(dev));
  // Lightning's aliases; the rest of keel sees canonical names only.
  std::string& prec = c.train.precision;
  if (prec == "32") prec = "32-true";
  if (prec == "16") prec = "16-mixed";
  if (prec == "bf16") prec = "bf16-mixed";
  // none | blocks | a positive integer, stored without sign or leading zeros.
  std::string& ckpt = c.train.activation_checkpointing;
  if (ckpt != "none" && ckpt != "blocks") {
    int64_t n = 0;
    const char* end = ckpt.data() + ckpt.size();
    auto [ptr, ec] = std::from_chars(ckpt.data(), end, n);
    if (ckpt.empty() || ec != std::errc() || ptr != end || n < 1 || n > 1024)
      throw usage(prefix("train.activation_checkpointing") +
                  "train.activation_checkpointing must be none, blocks, or an integer N in "
                  "[1, 1024] (checkpointed segments of N consecutive blocks); got " +
                  toml_string(ckpt));
    ckpt = std::to_string(n);
  }
  // Rules across keys.
  auto at = [&](const std::string& key) { return " (" + from(key) + ")"; };
  const ModelConfig& m = c.model;
  if (m.path.empty() && m.head_dim == 0 && m.n_embd % m.n_head != 0)
    throw usage("model.n_embd = " + std::to_string(m.n_embd) + at("model.n_embd") +
                " must be divisible by model.n_head = " + std::to_string(m.n_head) +
                at("model.n_head") +
                "; each head gets n_embd / n_head channels (or llama's model.head_dim)");
  // (the model's own check said "model: llama needs an even head dim for RoPE, got 9", naming
  // no key)
  if (m.path.empty() && m.family == "llama" && m.head_dim > 0 && m.head_dim % 2 != 0)
    throw usage("model.head_dim = " + std::to_string(m.head_dim) + at("model.head_dim") +
                " is odd; llama's rotary embedding (RoPE) turns pairs of channels, so a head "
                "needs an even number");
  if (m.path.empty() && m.family == "llama" && m.head_dim == 0 && m.n_embd % m.n_head == 0 &&
      (m.n_embd / m.n_head) % 2 != 0)
    throw usage("model.n_embd = " + std::to_string(m.n_embd) + at("model.n_embd") +
                " / model.n_head = " + std::to_string(m.n_head) + at("model.n_head") +
                " gives heads of " + std::to_string(m.n_embd / m.n_head) +
                " channels; llama's rotary embedding (RoPE) turns pairs of channels, so a head "
                "needs an even number: change model.n_embd or model.n_head");
  if (m.path.empty() && m.n_kv_head > 0 && m.n_head % m.n_kv_head != 0)
    throw usage("model.n_head = " + std::to_string(m.n_head) + at("model.n_head") +
                " must be divisible by model.n_kv_head = " + std::to_string(m.n_kv_head) +
                at("model.n_kv_head") + " (each key/value head serves a group of query heads)");
  if (m.adapter.kind != "none") {
    if (m.adapter.target_modules.empty())
      throw usage("model.adapter.target_modules" + at("model.adapter.target_modules") +
                  " is empty but model.adapter.kind = \"" + m.adapter.kind +
                  "\"; name the modules to adapt, e.g. [\"q_proj\", \"v_proj\"]");
    for (const std::string& t : m.adapter.target_modules)
      if (t.empty())
        throw usage("model.adapter.target_modules" + at("model.adapter.target_modules") +
                    " contains an empty module name");
  }
  // (SGD's own check said "SGD: Nesterov momentum requires a momentum and zero dampening",
  // naming no key)
  const optim::SGDOptions& sgd = c.optim.sgd;
  if (c.optim.name == "sgd" && sgd.nesterov && (sgd.momentum <= 0 || sgd.dampening != 0))
    throw usage("optim.nesterov = true" + at("optim.nesterov") +
                " needs optim.momentum > 0 and optim.dampening = 0 (as PyTorch's SGD); got "
                "optim.momentum = " +
                format_double(sgd.momentum, false) + at("optim.momentum") + ", optim.dampening = " +
                format_double(sgd.dampening, false) + at("optim.dampening"));
  if (c.data.task != "arith" && c.data.path.empty())
    throw usage("data.task = \"" + c.data.task + "\"" + at("data.task") + " needs data.path (the " +
                (c.data.task == "tokens" ? std::string("llm.c token") : c.data.task) +
                " file to train on)");
  // data.pack = true with another task was ignored without a word (keel eval --pack refuses it).
  if (c.data.pack && c.data.task != "text" && c.data.task != "jsonl")
    throw usage("data.pack = true" + at("data.pack") +
                " packs a text or JSONL file into rows; data.task = \"" + c.data.task + "\"" +
                at("data.task") +
                (c.data.task == "tokens" ? std::string(" is trained packed already")
                                         : std::string(" makes one problem a row")) +
                "; remove data.pack (or set it to false)");
  // Packed JSONL rows keep their examples apart in attention by position, which only the CPU
  // kernels read yet: the run would stop at its first step.
  if (c.data.pack && c.data.task == "jsonl" && c.run.device.rfind("cuda", 0) == 0)
    throw usage("data.pack = true" + at("data.pack") +
                " with data.task = \"jsonl\" and run.device = \"" + c.run.device + "\"" +
                at("run.device") +
                ": packed examples attend only to themselves through their positions, which keel's "
                "CUDA attention does not read yet; set run.device = \"cpu\", or data.pack = false "
                "(one example a row)");
  // The same for dropout on the attention probabilities.
  if (c.model.attention_dropout > 0 && c.run.device.rfind("cuda", 0) == 0)
    throw usage("model.attention_dropout = " + format_double(c.model.attention_dropout, false) +
                at("model.attention_dropout") + " with run.device = \"" + c.run.device + "\"" +
                at("run.device") +
                ": keel's CUDA attention does not drop probabilities yet; set run.device = "
                "\"cpu\", or remove model.attention_dropout");
  if (!c.data.eval_path.empty() && c.data.eval_fraction > 0)
    throw usage(prefix("data.eval_path") +
                "data.eval_path and data.eval_fraction both give a validation split; set one");
  if (!c.data.chat_date.empty() && !data::is_calendar_date(c.data.chat_date))
    throw usage(prefix("data.chat_date") + "data.chat_date = \"" + c.data.chat_date +
                "\" is not a day written YYYY-MM-DD (such as \"2024-12-04\"); give one, or leave "
                "it out");
  if (c.data.task == "arith" && (!c.data.eval_path.empty() || c.data.eval_fraction > 0))
    throw usage(
        prefix("data.task") +
        "data.eval_path / data.eval_fraction apply to text, jsonl and tokens; the arith task "
        "holds out data.eval_examples problems of its own");
  if (c.data.tokenizer.empty())
    throw usage(prefix("data.tokenizer") +
                "data.tokenizer must not be empty (\"byte\", \"gpt2:DIR\" or \"hf:PATH\")");
  // "hf:" alone reached the loader as "HF tokenizer file  does not exist", naming no key (keel
  // serve's requests are answered by this check too: it runs before serve's own path checks).
  if (c.data.tokenizer == "hf:" || c.data.tokenizer == "gpt2:")
    throw usage(prefix("data.tokenizer") + "data.tokenizer = \"" + c.data.tokenizer +
                "\": give the path after " + c.data.tokenizer + " (e.g. " + c.data.tokenizer +
                (c.data.tokenizer == "hf:" ? "tokenizer.json, or its directory"
                                           : "gpt2-tokenizer-dir, GPT-2's vocabulary directory") +
                ")");
  GradScalerOptions& s = c.scaler;
  // The scale is an f32 (docs/config.md): 1e39 loaded, then the GradScaler refused it at the
  // first 16-mixed run naming no file or line (and doctor's static checks passed it).
  for (const auto& [key, v, zero_ok] : {std::tuple{"scaler.init_scale", s.init_scale, false},
                                        std::tuple{"scaler.min_scale", s.min_scale, true},
                                        std::tuple{"scaler.max_scale", s.max_scale, true}})
    if (!(zero_ok && v == 0) &&
        (v < std::numeric_limits<float>::min() || v > std::numeric_limits<float>::max()))
      throw usage(std::string(key) + " = " + format_double(v, false) + at(key) +
                  " is outside f32's range: a loss scale is an f32 value from 1.2e-38 (f32's "
                  "smallest normal) to 3.4e38" +
                  (zero_ok ? std::string(", or 0 for no bound") : std::string()));
  if (s.max_scale > 0 && s.min_scale > s.max_scale)
    throw usage("scaler.min_scale = " + format_double(s.min_scale, false) + at("scaler.min_scale") +
                " is above scaler.max_scale = " + format_double(s.max_scale, false) +
                at("scaler.max_scale") + " (0 = no limit)");
  // A start outside the bounds was taken as it was: init_scale 1e10 under min_scale 1e20 stopped
  // at its first overflow as "the gradients overflowed f16 at scaler.min_scale = 1e+20, the lowest
  // scale allowed; scale 1e+10 -> 1e+20" (a back-off that raised the scale), and a start above
  // max_scale stayed above it.
  // Left at its default (65536), the start follows the bound that was set: scaler.max_scale =
  // 4096 alone means a start at 4096, not an error asking for scaler.init_scale too.
  if (!origins.count("scaler.init_scale")) {
    if (s.max_scale > 0) s.init_scale = std::min(s.init_scale, s.max_scale);
    if (s.min_scale > 0) s.init_scale = std::max(s.init_scale, s.min_scale);
  }
  if (s.min_scale > 0 && s.init_scale < s.min_scale)
    throw usage("scaler.init_scale = " + format_double(s.init_scale, false) +
                at("scaler.init_scale") + " is below scaler.min_scale = " +
                format_double(s.min_scale, false) + at("scaler.min_scale") +
                ": the scale would start under its own floor; set scaler.init_scale to at least "
                "scaler.min_scale, or lower scaler.min_scale (0 = no limit)");
  if (s.max_scale > 0 && s.init_scale > s.max_scale)
    throw usage("scaler.init_scale = " + format_double(s.init_scale, false) +
                at("scaler.init_scale") + " is above scaler.max_scale = " +
                format_double(s.max_scale, false) + at("scaler.max_scale") +
                ": the scale would start over its own ceiling; set scaler.init_scale to at most "
                "scaler.max_scale, or raise scaler.max_scale (0 = no limit)");
}

// Parses the value of one --set override: a TOML value, or the raw text as a bare string.
void apply_override(Config& c, const std::string& ov, Origins& origins) {
  const std::string where = "--set " + ov;
  const size_t eq = ov.find('=');
  if (eq == std::string::npos)
    throw usage(where + ": expected section.key=value (e.g. --set train.batch_size=8)");
  auto trim = [](std::string s) {
    const char* ws = " \t";
    s.erase(0, s.find_first_not_of(ws));
    s.erase(s.find_last_not_of(ws) + 1);
    return s;
  };
  const std::string key = trim(ov.substr(0, eq));
  const std::string text = trim(ov.substr(eq + 1));
  if (key.empty())  // "--set =5" named no key ("unknown key ; did you mean ...")
    throw usage(where +
                ": no key before '='; expected section.key=value (e.g. --set "
                "train.batch_size=8)");
  const KeySpec* k = find_key(key);
  if (!k) {
    if (is_section(key))
      throw usage(where + ": " + key + " is a section, not a key; set one of its keys (" + key +
                  ".<key>=value)");
    throw usage(where + ": unknown key " + key + "; " + unknown_key_hint(key));
  }
  toml::table parsed;
  bool is_value = false;
  try {
    parsed = toml::parse("v = " + text);
    is_value = parsed.size() == 1 && parsed.contains("v");
  } catch (const toml::parse_error& e) {
    // A number TOML cannot hold (1e400, an integer beyond int64) would otherwise be read as a
    // bare string and reported as "must be a number, got string".
    const std::string type = field_type(k->field(c));
    if ((type == "int" || type == "float") && !text.empty() &&
        text.find_first_not_of("+-0123456789.eE_") == std::string::npos)
      throw usage(where + ": " + key + " = " + text + " is not a number TOML can hold (" +
                  std::string(e.description()) + ")");
  }
  // `--set model.adapter.target_modules=["q_proj"]` typed without single quotes reaches keel as
  // [q_proj] (the shell removes the double quotes): it was "must be an array of strings, got
  // string "[q_proj]"", which did not say what to type.
  if (!is_value && std::holds_alternative<std::vector<std::string>*>(k->field(c)) &&
      !text.empty() && text.front() == '[')
    throw usage(where + ": " + key + " = " + text +
                " is not a TOML array of strings: quote each entry, in single quotes that keep "
                "the shell from removing the double ones (--set '" +
                key + "=[\"q_proj\", \"v_proj\"]')");
  // A list key given one bare value (`--set model.adapter.target_modules=q_proj`, `...
  // trace_batch_nums=3`) was "must be an array of strings, got string", without the way to write
  // one: the message now shows it.
  const bool strings = std::holds_alternative<std::vector<std::string>*>(k->field(c));
  const bool ints = std::holds_alternative<std::vector<int64_t>*>(k->field(c));
  if ((strings || ints) && !text.empty() && text.front() != '[' &&
      !(is_value && parsed.get("v")->is_array()))
    throw usage(where + ": " + key + " takes a list; write it in brackets" +
                (strings ? ", each entry quoted, in single quotes that keep the shell from "
                           "removing the double ones (--set '" +
                               key + "=[\"" +
                               (is_value && parsed.get("v")->is_string()
                                    ? parsed.get("v")->as_string()->get()
                                    : text) +
                               "\"]')"
                         : " (--set '" + key + "=[" + text + "]')"));
  toml::value<std::string> bare(text);
  const toml::node* v = is_value ? parsed.get("v") : &bare;
  // Bare strings: `train.precision=bf16-mixed`, and `run.out_dir=out/2024-01-01`, which TOML would
  // read as something else; a quoted string is used as written.
  if (std::holds_alternative<std::string*>(k->field(c)) && !v->is_string() &&
      !(takes_integer(*k) && v->is_integer()))
    v = &bare;
  assign(c, *k, *v, where);
  origins[key] = where;
}

}  // namespace

int64_t activation_checkpointing_blocks(const TrainConfig& t) {
  if (t.activation_checkpointing == "none") return 0;
  if (t.activation_checkpointing == "blocks") return 1;
  return std::stoll(t.activation_checkpointing);  // validated: an integer in [1, 1024]
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) return load_config_text("", "", overrides);
  const std::string problem = input_file_problem(path);
  std::ifstream in(path, std::ios::binary);
  if (!problem.empty() || !in)
    throw usage("cannot read config file " + path + ": it " +
                (problem.empty() ? std::string(std::strerror(errno)) : problem) +
                " (check the path; pass \"\" for defaults)");
  std::stringstream ss;
  ss << in.rdbuf();
  return load_config_text(ss.str(), path, overrides);
}

Config load_config_text(const std::string& text, const std::string& source,
                        const std::vector<std::string>& overrides) {
  Config c;
  Origins origins;
  if (!source.empty() || !text.empty()) {
    toml::table root;
    try {
      root = toml::parse(text, source);
    } catch (const toml::parse_error& e) {
      throw usage(source + ":" + std::to_string(e.source().begin.line) + ":" +
                  std::to_string(e.source().begin.column) +
                  ": TOML syntax error: " + std::string(e.description()));
    }
    walk(c, root, "", source, origins);
    c.source = source;
  }
  for (const std::string& ov : overrides) apply_override(c, ov, origins);
  validate(c, origins);
  return c;
}

namespace {
// A JSON value as the TOML node a file would have given (no source positions: messages say
// `source` alone). JSON has no dates; null has no TOML counterpart and is an error.
std::unique_ptr<toml::node> toml_of_json(const nlohmann::json& j, const std::string& key,
                                         const std::string& source, int depth = 0) {
  using nlohmann::json;
  // The deepest section is [model.adapter]; anything deeper is no config (and must not recurse
  // without bound: a request body may be a million nested objects).
  if (depth > 4)
    throw usage(source + ": " + key + " is nested " + std::to_string(depth) +
                " levels deep; no config key is (see docs/config.md)");
  switch (j.type()) {
    case json::value_t::boolean:
      return std::make_unique<toml::value<bool>>(j.get<bool>());
    case json::value_t::number_integer:
      return std::make_unique<toml::value<int64_t>>(j.get<int64_t>());
    case json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        throw usage(source + ": " + key + " = " + std::to_string(u) + " is out of range for an " +
                    "integer (at most 2^63 - 1)");
      return std::make_unique<toml::value<int64_t>>(static_cast<int64_t>(u));
    }
    case json::value_t::number_float:
      return std::make_unique<toml::value<double>>(j.get<double>());
    case json::value_t::string:
      return std::make_unique<toml::value<std::string>>(j.get<std::string>());
    case json::value_t::array: {
      auto a = std::make_unique<toml::array>();
      for (const json& e : j) {
        if (e.is_object() || e.is_array() || e.is_null())
          throw usage(source + ": " + key + " holds " + std::string(e.type_name()) +
                      " elements; its values are strings or numbers");
        toml_of_json(e, key, source)->visit([&](auto&& n) { a->push_back(std::move(n)); });
      }
      return a;
    }
    case json::value_t::object: {
      auto t = std::make_unique<toml::table>();
      for (const auto& item : j.items()) {  // (clang 14 lambdas cannot capture structured bindings)
        const std::string& k = item.key();
        toml_of_json(item.value(), key.empty() ? k : key + "." + k, source, depth + 1)
            ->visit([&](auto&& n) { t->insert(k, std::move(n)); });
      }
      return t;
    }
    default:
      throw usage(source + ": " + key + " is " + std::string(j.type_name()) +
                  "; give a value or leave the key out for its default (docs/config.md)");
  }
}
}  // namespace

Config load_config_json(const nlohmann::json& root, const std::string& source) {
  if (!root.is_object())
    throw usage(source + ": expected a JSON object with the sections of docs/config.md (e.g. " +
                "{\"train\": {\"max_steps\": 100}}), got " + std::string(root.type_name()));
  const std::unique_ptr<toml::node> table = toml_of_json(root, "", source);
  Config c;
  Origins origins;
  walk(c, *table->as_table(), "", source, origins);
  c.source = source;
  validate(c, origins);
  return c;
}

std::string config_to_toml(const Config& config) {
  Config c = config;  // fields are reached through non-const pointers; only read here
  std::string out = "# keel config: every key with its effective value (docs/config.md)\n";
  if (!c.source.empty()) out += "# read from " + c.source + "\n";
  std::string section;
  for (const KeySpec& k : key_table()) {
    if (k.section != section) {
      section = k.section;
      out += "\n[" + section + "]\n";
    }
    out += k.name + " = " + field_toml(k.field(c)) + "\n";
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> config_values(const Config& config) {
  Config c = config;  // fields are reached through non-const pointers; only read here
  std::vector<std::pair<std::string, std::string>> out;
  for (const KeySpec& k : key_table()) out.emplace_back(k.full(), field_toml(k.field(c)));
  return out;
}

void check_config_number(const std::string& key, double value, const std::string& shown,
                         const std::string& origin) {
  const KeySpec* k = find_key(key);
  KEEL_CHECK(k, "check_config_number: no key " + key);
  check_number(*k, value, shown, origin + ": ");
}

void check_keys_take_effect(const Config& cfg) {
  // Without run.out_dir every run writes to a new out/<UTC time>/: such a resume found no
  // checkpoint there and trained from scratch (`keel train CONFIG --set run.resume=true` with a
  // CONFIG that names no out_dir did just that).
  if (cfg.run.resume && cfg.run.out_dir.empty())
    throw Error(
        "run.resume = true but run.out_dir is not set: a run without it writes to a new "
        "out/<UTC time>/ directory, where there is nothing to resume; set run.out_dir to the "
        "directory of the run to continue (e.g. --set run.out_dir=out/20260101-120000)",
        Error::kUsage);
  // train.eval_every with nothing to evaluate was accepted and no evaluation ever ran.
  if (cfg.train.eval_every > 0) {
    const bool arith = cfg.data.task == "arith";
    if (arith ? cfg.data.eval_examples == 0
              : cfg.data.eval_path.empty() && cfg.data.eval_fraction == 0)
      throw Error("train.eval_every = " + std::to_string(cfg.train.eval_every) +
                      " evaluates the run's validation split, but it has none (" +
                      (arith ? std::string("data.eval_examples = 0")
                             : "data.task = \"" + cfg.data.task +
                                   "\" without data.eval_path or data.eval_fraction") +
                      "); " +
                      (arith ? "raise data.eval_examples"
                             : "set data.eval_path to a validation file, or data.eval_fraction "
                               "to hold out a share of data.path") +
                      ", or remove train.eval_every",
                  Error::kUsage);
  }
  // Two keys for one setting: the one documented to lose was ignored without a word.
  const SchedConfig& sc = cfg.sched;
  if (sc.warmup_steps > 0 && sc.warmup_ratio > 0)
    throw Error("sched.warmup_steps = " + std::to_string(sc.warmup_steps) +
                    " and sched.warmup_ratio = " + format_double(sc.warmup_ratio, false) +
                    " both set the warmup, and warmup_ratio is ignored when warmup_steps is set; "
                    "remove one of them",
                Error::kUsage);
  if (sc.min_lr_ratio > 0 && sc.name == "constant")
    throw Error("sched.min_lr_ratio = " + format_double(sc.min_lr_ratio, false) +
                    " floors the decay of a linear or cosine schedule, but sched.name = "
                    "\"constant\" does not decay; remove sched.min_lr_ratio, or set sched.name "
                    "to linear or cosine",
                Error::kUsage);
  // The options of the optimizer not chosen: optim.momentum = 0.9 under AdamW (whose momentum is
  // beta1) and optim.beta2 = 0.95 under SGD trained without them, without a word.
  const bool adamw = cfg.optim.name == "adamw";
  const std::vector<std::string> other = keys_off_default(
      cfg, adamw ? std::vector<std::string>{"optim.momentum", "optim.dampening", "optim.nesterov"}
                 : std::vector<std::string>{"optim.beta1", "optim.beta2", "optim.eps"});
  if (!other.empty())
    throw Error(join(other, " and ") + (other.size() > 1 ? " are options" : " is an option") +
                    " of " + (adamw ? "SGD" : "AdamW") + ", but optim.name = \"" + cfg.optim.name +
                    "\" does not read " + (other.size() > 1 ? "them" : "it") +
                    (adamw ? " (AdamW's momentum is optim.beta1)" : "") + "; remove " +
                    (other.size() > 1 ? "them" : "it") + ", or set optim.name = \"" +
                    (adamw ? "sgd" : "adamw") + "\"",
                Error::kUsage);
  // SGD's dampening scales what enters the momentum buffer; without momentum there is none.
  if (!adamw && cfg.optim.sgd.dampening > 0 && cfg.optim.sgd.momentum == 0)
    throw Error("optim.dampening = " + format_double(cfg.optim.sgd.dampening, false) +
                    " damps SGD's momentum, but optim.momentum = 0 keeps none; set "
                    "optim.momentum, or remove optim.dampening",
                Error::kUsage);
  // model.dropout drops GPT-2's residual streams and embedding (HF's resid_pdrop, embd_pdrop), and
  // Phi's, GPT-NeoX's and StableLM's sublayer outputs. Another Llama-family model has no such
  // layers (HF's has none: its only dropout is attention_dropout, on the attention probabilities:
  // model.attention_dropout), and trained as without the key.
  if (cfg.model.dropout > 0) {
    const bool from_dir = !cfg.model.path.empty();
    const models::ModelSpec file_spec =
        from_dir ? io::read_hf_config(cfg.model.path).spec : models::ModelSpec{};
    // (Phi, GPT-NeoX and StableLM drop their sublayers' outputs: ModelSpec::branch_dropout.)
    if (from_dir ? file_spec.family == "llama" && !file_spec.branch_dropout()
                 : cfg.model.family == "llama")
      throw Error(
          "model.dropout = " + format_double(cfg.model.dropout, false) + " with " +
              (from_dir ? "model.path = " + cfg.model.path + " (" + file_spec.architecture() + ")"
                        : std::string("model.family = \"llama\"")) +
              ": keel's Llama-family models have no such dropout layers but Phi's, GPT-NeoX's "
              "and StableLM's (HF's "
              "LlamaForCausalLM drops nothing but, where config.json's attention_dropout "
              "says so, attention probabilities: model.attention_dropout); remove "
              "model.dropout (model.adapter.dropout is an adapter's input dropout)",
          Error::kUsage);
  }
  // Stochastic rounding acts on bf16 parameters only: under 32-true and the -mixed policies (f32
  // masters), and for adapters (f32 under every policy), a run with it rounded as without it;
  // under 16-true the optimizer refused it naming no key.
  const std::string& prec = cfg.train.precision;
  if (cfg.optim.stochastic_rounding && (prec != "bf16-true" || cfg.model.adapter.kind != "none"))
    throw Error(
        "optim.stochastic_rounding = true rounds the updates of bf16 parameters, but " +
            (prec != "bf16-true"
                 ? "train.precision = \"" + prec + "\" trains " +
                       (prec == "16-true" ? std::string("f16 parameters, which it cannot round")
                                          : std::string("f32 parameters (no rounding to do)")) +
                       "; set train.precision = \"bf16-true\", or remove "
                       "optim.stochastic_rounding"
                 : "model.adapter.kind = \"" + cfg.model.adapter.kind +
                       "\" trains f32 adapters (under every precision); remove "
                       "optim.stochastic_rounding"),
        Error::kUsage);
}

std::vector<std::pair<std::string, std::string>> input_paths(const Config& c) {
  return {{"model.path", c.model.path},
          {"data.path", c.data.path},
          {"data.eval_path", c.data.eval_path}};
}

std::vector<std::string> keys_off_default(const Config& config,
                                          const std::vector<std::string>& keys) {
  Config c = config, d;  // fields are reached through non-const pointers; only read here
  std::vector<std::string> out;
  for (const std::string& key : keys) {
    const KeySpec* k = find_key(key);
    KEEL_CHECK(k, "keys_off_default: no key " + key);
    const std::string v = field_toml(k->field(c));
    if (v != field_toml(k->field(d))) out.push_back(key + " = " + v);
  }
  return out;
}

std::vector<ConfigKeyInfo> config_keys() {
  Config c;
  std::vector<ConfigKeyInfo> out;
  for (const KeySpec& k : key_table()) {
    const Field f = k.field(c);
    out.push_back({k.full(), field_type(f), field_toml(f), k.choices});
  }
  return out;
}

std::string InjectConfig::what() const {
  char factor_text[32];
  std::snprintf(factor_text, sizeof factor_text, "%.6g", factor);
  return (kind == "scale" ? "a factor of " + std::string(factor_text) : kind) + " into " + module +
         "'s output";
}

// By spelling alone `steps` was nearest to debug.inject.step and `data.kind` to
// model.adapter.kind. Looked up by the whole name typed, then by its last part in any section.
const std::map<std::string, std::string>& peer_key_names() {
  static const std::map<std::string, std::string> names = {
      {"steps", "train.max_steps"},
      {"num_steps", "train.max_steps"},
      {"total_steps", "train.max_steps"},
      {"max_iters", "train.max_steps"},
      {"num_iterations", "train.max_steps"},
      {"num_train_epochs", "train.epochs"},
      {"max_epochs", "train.epochs"},
      {"num_epochs", "train.epochs"},
      {"learning_rate", "optim.lr"},
      {"per_device_train_batch_size", "train.batch_size"},
      {"train_batch_size", "train.batch_size"},
      {"micro_batch_size", "train.batch_size"},
      {"gradient_accumulation_steps", "train.grad_accum"},
      {"accumulate_grad_batches", "train.grad_accum"},
      {"gradient_clip_val", "train.max_grad_norm"},
      {"grad_clip", "train.max_grad_norm"},
      {"gradient_checkpointing", "train.activation_checkpointing"},
      {"bf16", "train.precision = \"bf16-mixed\""},
      {"fp16", "train.precision = \"16-mixed\""},
      {"mixed_precision", "train.precision"},
      {"eval_steps", "train.eval_every"},
      {"eval_interval", "train.eval_every"},
      {"val_check_interval", "train.eval_every"},
      {"lr_scheduler_type", "sched.name"},
      {"lr_scheduler", "sched.name"},
      {"scheduler", "sched.name"},
      {"warmup_iters", "sched.warmup_steps"},
      {"adam_beta1", "optim.beta1"},
      {"adam_beta2", "optim.beta2"},
      {"adam_epsilon", "optim.eps"},
      {"optimizer", "optim.name"},
      {"output_dir", "run.out_dir"},
      {"default_root_dir", "run.out_dir"},
      {"overwrite_output_dir", "run.overwrite"},
      {"resume_from_checkpoint", "run.resume"},
      {"ckpt_path", "run.resume"},
      {"accelerator", "run.device"},
      {"num_threads", "run.threads"},
      {"model_name_or_path", "model.path"},
      {"pretrained_model_name_or_path", "model.path"},
      {"torch_dtype", "model.base_dtype"},
      {"lora_r", "model.adapter.r"},
      {"lora_alpha", "model.adapter.alpha"},
      {"lora_dropout", "model.adapter.dropout"},
      {"use_dora", "model.adapter.kind = \"dora\""},
      {"peft_type", "model.adapter.kind"},
      {"dataset", "data.path"},
      {"dataset_path", "data.path"},
      {"train_file", "data.path"},
      {"data_path", "data.path"},
      {"input_bin", "data.path"},
      {"validation_file", "data.eval_path"},
      {"eval_file", "data.eval_path"},
      {"input_val_bin", "data.eval_path"},
      {"max_seq_length", "data.seq_len"},
      {"max_length", "data.seq_len"},
      {"block_size", "data.seq_len"},
      {"seq_length", "data.seq_len"},
      {"packing", "data.pack"},
      {"padding_free", "data.pack"},
      {"data.kind", "data.task"},
      {"data.type", "data.task"},
      {"data.format", "data.task"},
      {"logging_steps", "log.every"},
      {"log_every_n_steps", "log.every"},
      {"save_steps", "log.checkpoint_every"},
      {"every_n_train_steps", "log.checkpoint_every"},
      {"save_total_limit", "log.keep_checkpoints"},
  };
  return names;
}

}  // namespace keel
