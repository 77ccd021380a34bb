#include "keel/nn/adapters/adapter.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "keel/nn/adapters/dora.h"
#include "keel/nn/adapters/lokr.h"
#include "keel/nn/adapters/lora.h"
#include "keel/tensor/convert_mapped.h"
#include "keel/tensor/random.h"

namespace keel::nn {

namespace {

// PEFT's target rule for a list of names: the key equals the target or ends with "." + target.
bool targets(const std::string& path, const std::string& target) {
  if (path == target) return true;
  return path.size() > target.size() &&
         path.compare(path.size() - target.size(), target.size(), target) == 0 &&
         path[path.size() - target.size() - 1] == '.';
}

std::string last_component(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

// An Error about `source`'s options, and how to name one of its fields in a fix.
struct SourceErrors {
  std::string source;
  Error operator()(const std::string& m) const { return Error(source + ": " + m, Error::kUsage); }
  std::string field(const std::string& f) const {
    return source == "model.adapter" ? source + "." + f : f + " in " + source;
  }
};

}  // namespace

void init_kaiming_uniform(Tensor& w, uint64_t seed) {
  KEEL_CHECK(w.dim() == 2, "init_kaiming_uniform: 2-D weight expected");
  // gain = sqrt(2 / (1 + a^2)) with a = sqrt(5); bound = sqrt(3) * gain / sqrt(fan_in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(w.size(1)));
  Rng rng(seed);
  fill_uniform(w, rng, -bound, bound);
}

std::pair<int64_t, int64_t> lokr_factorization(int64_t dimension, int64_t factor) {
  // A transcription of LyCORIS' factorization (PEFT copies it), `length` never updated included.
  if (factor > 0 && dimension % factor == 0) return {factor, dimension / factor};
  if (factor == -1) factor = dimension;
  int64_t m = 1, n = dimension;
  const int64_t length = m + n;
  while (m < n) {
    int64_t new_m = m + 1;
    while (dimension % new_m != 0) ++new_m;
    const int64_t new_n = dimension / new_m;
    if (new_m + new_n > length || new_m > factor) break;
    m = new_m;
    n = new_n;
  }
  if (m > n) std::swap(m, n);
  return {m, n};
}

int64_t AdapterParamShape::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<AdapterParamShape> adapter_parameter_shapes(const std::string& kind, int64_t r,
                                                        int64_t in, int64_t out) {
  if (kind == "lora") return {{"lora_A.weight", {r, in}}, {"lora_B.weight", {out, r}}};
  if (kind == "dora")
    return {
        {"lora_magnitude_vector", {out}}, {"lora_A.weight", {r, in}}, {"lora_B.weight", {out, r}}};
  if (kind == "lokr") {
    auto [in_m, in_n] = lokr_factorization(in);
    auto [out_l, out_k] = lokr_factorization(out);
    // PEFT: use_w2 = not (r < max(out_k, in_n) / 2), a float comparison.
    if (!(static_cast<double>(r) < static_cast<double>(std::max(out_k, in_n)) / 2))
      return {{"lokr_w1", {out_l, in_m}}, {"lokr_w2", {out_k, in_n}}};
    return {{"lokr_w1", {out_l, in_m}}, {"lokr_w2_a", {out_k, r}}, {"lokr_w2_b", {r, in_n}}};
  }
  return {};
}

bool adapter_targets(const std::string& module_path, const std::vector<std::string>& targets_) {
  return std::any_of(targets_.begin(), targets_.end(),
                     [&](const std::string& t) { return targets(module_path, t); });
}

std::vector<Linear*> adapted_linears(Module& root) {
  std::vector<Linear*> out;
  for (Module* m : root.modules())
    if (auto* lin = dynamic_cast<Linear*>(m); lin && lin->adapter) out.push_back(lin);
  return out;
}

void check_adapter_options(const AdapterOptions& opt, const std::string& source) {
  const SourceErrors usage{source};
  if (opt.kind == "none") return;
  if (opt.kind != "lora" && opt.kind != "dora" && opt.kind != "lokr")
    throw usage("unknown kind '" + opt.kind + "': use none, lora, dora or lokr");
  if (opt.r < 1 || opt.r > kMaxAdapterRank)
    throw usage("r = " + std::to_string(opt.r) + " must be in [1, " +
                std::to_string(kMaxAdapterRank) + "]");
  if (!(opt.alpha > 0)) throw usage("alpha must be > 0");
  if (!(opt.dropout >= 0 && opt.dropout < 1)) throw usage("dropout must be in [0, 1)");
  if (opt.kind == "lokr" && opt.dropout > 0) {
    char dropout[32];
    std::snprintf(dropout, sizeof dropout, "%g", opt.dropout);  // 0.1, not 0.100000
    throw usage(std::string("dropout = ") + dropout +
                " with kind = \"lokr\": LoKr has no input dropout (PEFT's rank/module dropout are "
                "not implemented); set " +
                usage.field("dropout") + " = 0");
  }
  if (opt.target_modules.empty())
    throw usage(
        "target_modules is empty; name the modules to adapt, e.g. [\"q_proj\", \"v_proj\"]");
}

std::vector<std::string> apply_adapters(Module& root, const AdapterOptions& opt,
                                        const std::string& source) {
  const SourceErrors usage{source};
  if (opt.kind == "none") return {};
  check_adapter_options(opt, source);

  // Candidate Linears: every Linear except those an adapter already owns (lora_A, lora_B).
  std::set<const Module*> internal;
  for (Linear* lin : adapted_linears(root))
    for (Module* m : lin->modules())
      if (m != lin) internal.insert(m);
  std::vector<Linear*> linears;
  for (Module* m : root.modules())
    if (auto* lin = dynamic_cast<Linear*>(m); lin && !internal.count(lin)) linears.push_back(lin);

  std::vector<Linear*> chosen;
  for (const std::string& t : opt.target_modules) {
    bool found = false;
    for (Linear* lin : linears)
      if (targets(lin->path(), t)) {
        found = true;
        if (std::find(chosen.begin(), chosen.end(), lin) == chosen.end()) chosen.push_back(lin);
      }
    if (!found) {
      std::vector<std::string> names;
      for (Linear* lin : linears) {
        const std::string n = last_component(lin->path());
        if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
      }
      std::string list;
      for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
      throw usage("target module '" + t + "' matches no linear layer of this " + root.type() +
                  "; its linear layers are named: " + list + " (fix " +
                  usage.field("target_modules") + ")");
    }
  }
  // Tree order, whatever the order of the targets.
  std::vector<Linear*> ordered;
  for (Linear* lin : linears)
    if (std::find(chosen.begin(), chosen.end(), lin) != chosen.end()) ordered.push_back(lin);

  std::vector<std::string> paths;
  for (Linear* lin : ordered) {
    if (lin->adapter)
      throw usage("'" + lin->path() + "' already has a " + lin->adapter->kind() +
                  " adapter; apply adapters once");
    const uint64_t seed = mix_seed(opt.seed, name_seed(lin->path()));
    if (opt.kind == "lora")
      lin->adapter = std::make_shared<LoraAdapter>(*lin, opt.r, opt.alpha, opt.dropout, seed);
    else if (opt.kind == "dora")
      lin->adapter = std::make_shared<DoraAdapter>(*lin, opt.r, opt.alpha, opt.dropout, seed);
    else
      lin->adapter = std::make_shared<LokrAdapter>(*lin, opt.r, opt.alpha, seed);
    paths.push_back(lin->path());
  }
  root.assign_paths(root.path());
  // Freeze the base: only adapter parameters train.
  for (auto& [name, p] : root.named_parameters()) {
    Tensor t = p;
    if (!is_adapter_parameter(root, t)) t.set_requires_grad(false);
  }
  return paths;
}

int64_t merge_adapters(Module& root) {
  int64_t n = 0;
  for (Linear* lin : adapted_linears(root)) {
    if (lin->adapter->merged) continue;
    Tensor merged = lin->adapter->merged_weight(*lin);  // [out, in] f32
    Tensor w = lin->weight;
    if (w.is_external()) {
      // A view of a read-only file mapping (a base held as stored): the merged weight becomes
      // its own tensor, and the file's pages it no longer needs leave memory.
      drop_mapped_pages(w);
      w.attach_storage(merged.dtype() == w.dtype() ? merged : merged.to_dtype(w.dtype()));
    } else {
      w.copy_from(merged);  // rounds into the base dtype
    }
    w.bump_version();
    lin->adapter->merged = true;
    ++n;
  }
  return n;
}

std::vector<std::pair<std::string, Tensor>> peft_state_dict(Module& root) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (Linear* lin : adapted_linears(root))
    for (auto& [name, t] : lin->adapter->peft_tensors())
      out.emplace_back("base_model.model." + lin->path() + "." + name, t);
  return out;
}

bool is_adapter_parameter(Module& root, const Tensor& t) {
  for (Linear* lin : adapted_linears(root))
    for (auto& [name, a] : lin->adapter->peft_tensors())
      if (a.impl() == t.impl()) return true;
  return false;
}

void cast_frozen_parameters(Module& root, DType dt) {
  for (auto& [name, p] : root.named_parameters()) {
    if (p.requires_grad() || !dtype_is_floating(p.dtype()) || p.dtype() == dt) continue;
    // Rewrite the shared impl: every handle to this parameter (module members, the registry)
    // sees the new dtype and storage.
    // One tensor at a time, and a view of a file mapping a chunk at a time (its pages dropped as
    // they are converted: an f32 file's tensor is never resident whole beside its cast).
    Tensor(p).attach_storage(convert_mapped(p, dt));
  }
}

}  // namespace keel::nn
