#include "keel/io/trained_model.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>
#include <vector>

#include "keel/io/atomic_file.h"
#include "keel/io/base_reference.h"
#include "keel/io/checkpoint.h"
#include "keel/io/hf_model.h"
#include "keel/io/safetensors.h"
#include "keel/models/resize.h"
#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"
#include "keel/tensor/convert_mapped.h"

namespace keel::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The tokenizer files an HF directory holds, as a load_tokenizer spec ("" when none).
std::string tokenizer_of(const std::string& dir) {
  if (path_exists(dir + "/tokenizer.json")) return "hf:" + dir;
  if (path_exists(dir + "/vocab.bpe") || path_exists(dir + "/merges.txt")) return "gpt2:" + dir;
  return "";
}

json keel_block(const std::string& dir) {
  const std::string file = dir + "/config.json";
  if (!path_exists(file) || !path_exists(dir + "/trainer.json")) return nullptr;
  try {
    const json j = json::parse(read_file(file));
    if (j.is_object() && j.contains("keel_checkpoint") && j["keel_checkpoint"].is_object())
      return j["keel_checkpoint"];
  } catch (const json::exception&) {
  }
  return nullptr;
}

// A field of a checkpoint's keel_checkpoint block, `def` when absent: json::value() threw
// nlohmann's raw "[json.exception.type_error.302] type must be string, but is number" for a
// hand-edited field of another type.
template <class T>
T keel_field(const json& keel, const char* key, T def, const std::string& dir) {
  const auto it = keel.find(key);
  if (it == keel.end() || it->is_null()) return def;
  const bool ok = std::is_same_v<T, bool> ? it->is_boolean() : it->is_string();
  if (!ok)
    throw Error(dir + "/config.json: keel_checkpoint." + key + " must be " +
                    (std::is_same_v<T, bool> ? "true or false" : "a string") + ", got " +
                    it->dump() + " (" + kDamagedCheckpointUseFix + ")",
                Error::kUsage);
  return it->get<T>();
}

// The PEFT directory's adapter_config.json base_model_name_or_path ("" when unreadable or
// absent: the adapter's own load names the problem).
std::string peft_base_of(const std::string& adapter_dir) {
  json cfg;
  try {
    cfg = json::parse(read_file(adapter_dir + "/adapter_config.json"));
  } catch (const std::exception&) {
    return "";
  }
  const auto it = cfg.is_object() ? cfg.find("base_model_name_or_path") : cfg.end();
  return it != cfg.end() && it->is_string() ? it->get<std::string>() : "";
}

// Whether the PEFT directory's adapter_config.json names one of `dirs` as its base
// (base_model_name_or_path, as the run's model.path was given). A relative name is relative to
// where that run ran: from any other directory it named nothing, and the checkpoint it was
// trained on was refused as "already carrying adapters". It names a directory whose path ends
// with it.
bool peft_base_is(const std::string& adapter_dir, const std::vector<std::string>& dirs) {
  const std::string named = peft_base_of(adapter_dir);
  if (named.empty()) return false;
  std::error_code ec;
  const fs::path base = fs::weakly_canonical(named, ec);
  if (ec) return false;
  fs::path tail = fs::path(named).lexically_normal();
  if (tail.filename().empty()) tail = tail.parent_path();  // "A/checkpoints/last/"
  const bool relative =
      tail.is_relative() && std::none_of(tail.begin(), tail.end(),
                                         [](const fs::path& c) { return c == "." || c == ".."; });
  for (const std::string& d : dirs) {
    const fs::path full = fs::weakly_canonical(d, ec);
    if (ec) continue;
    if (full == base) return true;
    if (!relative) continue;
    auto f = full.end(), t = tail.end();
    while (t != tail.begin() && f != full.begin() && *std::prev(t) == *std::prev(f)) --t, --f;
    if (t == tail.begin()) return true;
  }
  return false;
}

// The OUT_DIR of the run whose OUT_DIR/adapter (Trainer::fit) `adapter_dir` is: beside its
// config.toml and its checkpoint of the same adapters. "" for any other PEFT directory.
std::string adapter_run_dir(const std::string& adapter_dir) {
  std::error_code ec;
  const fs::path a = fs::weakly_canonical(adapter_dir, ec);
  if (ec || a.filename() != "adapter") return "";
  fs::path given = fs::path(adapter_dir).lexically_normal();
  if (given.filename().empty()) given = given.parent_path();  // "OUT_DIR/adapter/"
  const std::string run = given.has_parent_path() ? given.parent_path().string() : ".";
  const json keel = keel_block(run + "/checkpoints/last");
  const auto adapters = keel.find("adapter");
  if (!path_exists(run + "/config.toml") || adapters == keel.end() || *adapters != true) return "";
  return run;
}

// The dtype an adapter run held its frozen base in when its parameters are f32
// (model.base_dtype = bf16): config.json's torch_dtype, `stored` here, is the base's.
std::optional<DType> run_base_dtype(const std::string& dir, DType stored) {
  if (stored == DType::F32) return std::nullopt;
  const std::string precision = run_precision(dir);
  if (precision == "32-true" || precision == "bf16-mixed" || precision == "16-mixed") return stored;
  return std::nullopt;
}

// t.model built from `spec` with the weights of the checkpoint t.dir: its referenced base's
// (`ref`), then its own model.safetensors, adapters included (attached unmerged).
void load_checkpoint_weights(TrainedModel& t, const models::ModelSpec& spec, const json& ref,
                             bool adapters, const WeightCheck& check, const std::string& base_dir) {
  const std::string& dir = t.dir;
  // The names (and shapes) of the parameters the referenced base supplies: the checkpoint of
  // an adapter run over an HF directory holds only the others.
  std::map<std::string, Shape> from_base;
  if (!ref.is_null()) {
    const std::string base = find_referenced_base(ref, dir, base_dir);
    models::ModelSpec base_spec = spec;
    base_spec.vocab_size = read_hf_config(base).spec.vocab_size;  // before data.pad = "add"'s rows
    t.model = attach_hf_model(base_spec, base, check);
    // The run held its base in `dtype` (model.base_dtype): the same rounding of the files, into
    // it and back into the parameters' dtype. Steps exact in f32 are skipped, so that a bf16
    // file held in bf16 stays a view of its mapping.
    const std::optional<DType> held = dtype_from_name(ref.value("dtype", std::string("f32")));
    if (!held)
      throw Error(dir + "/config.json: keel_checkpoint.base.dtype is not a dtype name (" +
                  kDamagedCheckpointUseFix + ")");
    const DType param = spec.param_dtype;
    for (auto& [name, p] : t.model->named_parameters()) {
      if (*held != DType::F32 && *held != param && p.dtype() != *held) {
        Tensor(p).attach_storage(convert_mapped(p, *held));
        if (param != DType::F32) Tensor(p).attach_storage(convert_mapped(p, param));
      }
      from_base[name] = p.shape();
    }
    if (base_spec.vocab_size != spec.vocab_size) {
      // Resized in the parameters' dtype; the checkpoint holds the grown tensors' values.
      for (auto& [name, p] : t.model->named_parameters())
        if (models::is_vocabulary_parameter(name) && p.dtype() != param)
          Tensor(p).attach_storage(convert_mapped(p, param));
      models::resize_token_embeddings(*t.model, spec.vocab_size);
    }
  } else {
    t.model = models::make_causal_lm(spec, 0);
  }
  if (adapters) {
    // Its adapters' shapes come from adapter_config.json: one missing was "no
    // adapter_config.json (expected a PEFT adapter directory, e.g. a run's out_dir/adapter)",
    // as if the checkpoint had been given as --adapter.
    if (!path_exists(dir + "/adapter_config.json"))
      throw Error(dir + "/adapter_config.json is missing, though " + dir +
                  "/config.json says the checkpoint holds adapters (" + kDamagedCheckpointUseFix +
                  ")");
    t.adapter = read_peft_config(dir);
    nn::apply_adapters(*t.model, *t.adapter, dir + "/adapter_config.json");
  }
  const std::string file = dir + "/model.safetensors";
  if (!path_exists(file))
    throw Error(dir + ": the checkpoint is incomplete: model.safetensors is missing");
  Safetensors st = read_safetensors(file);
  std::set<std::string> used;
  for (auto& [name, p] : t.model->named_parameters()) {
    const Tensor* src = st.find(name);
    auto base_it = from_base.find(name);
    if (!src && base_it != from_base.end() && base_it->second == p.shape()) continue;
    if (!src)
      throw Error(file + ": tensor '" + name + "' is missing (" + dir +
                  "/config.json describes a model that has it)");
    // An adapter's shape is adapter_config.json's (r), not config.json's.
    if (src->shape() != p.shape())
      throw Error(
          file + ": tensor '" + name + "' is " + shape_str(src->shape()) + ", " + dir +
          (nn::is_adapter_parameter(*t.model, p) ? "/adapter_config.json" : "/config.json") +
          " implies " + shape_str(p.shape()) + " (" + kDamagedCheckpointUseFix + ")");
    check_weights_finite(check, *src, name, file);
    Tensor dst = p;
    dst.copy_from(*src);
    dst.bump_version();
    used.insert(name);
  }
  for (auto& [name, x] : st.tensors)
    if (!used.count(name))
      throw Error(file + ": unexpected tensor '" + name + "' (" + dir +
                  "/config.json describes a model without it)");
}

// Each parameter not yet in the dtype it is used in, with that dtype: the parameters' dtype, or a
// frozen base held as its run held it (hold_base; a bf16 file then stays a view of its mapping).
// An 8B base was built whole in f32 and cast afterwards: 32 GB, more than the 24 GB machine its
// adapter trained on.
template <class F>
void for_each_parameter_to_hold(TrainedModel& t, DType param_dtype, bool hold_base, F&& use) {
  const bool held = hold_base && t.base_dtype && param_dtype == DType::F32;
  for (auto& [name, p] : t.model->named_parameters()) {
    if (nn::is_adapter_parameter(*t.model, p)) continue;
    const DType want = held && !p.requires_grad() ? *t.base_dtype : param_dtype;
    if (p.dtype() != want) use(p, want);
  }
}

}  // namespace

void write_checkpoint_model_files(const models::CausalLM& model,
                                  const std::optional<nn::AdapterOptions>& adapter,
                                  const std::string& tokenizer, const std::string& base_model,
                                  const std::string& dir, const json& base) {
  json j = hf_config_json(model.spec(), stored_base_dtype(model));
  j["keel_checkpoint"] = {{"layout", "keel"},
                          {"tokenizer", absolute_tokenizer_spec(tokenizer)},
                          {"adapter", adapter.has_value()},
                          {"base_model", base_model}};
  if (!base.is_null()) j["keel_checkpoint"]["base"] = base;
  write_file_atomic(dir + "/config.json", j.dump(2) + "\n");
  if (adapter)
    write_file_atomic(dir + "/adapter_config.json",
                      peft_config_json(model, *adapter, base_model).dump(2) + "\n");
}

DType stored_base_dtype(const models::CausalLM& model) {
  auto& m = const_cast<models::CausalLM&>(model);
  for (auto& [name, p] : m.named_parameters())
    if (!nn::is_adapter_parameter(m, p)) return p.dtype();
  return DType::F32;
}

bool is_keel_checkpoint(const std::string& dir) { return !keel_block(dir).is_null(); }

std::string absolute_tokenizer_spec(const std::string& spec) {
  if (spec.empty() || spec == "byte") return spec;
  for (const char* prefix : {"gpt2:", "hf:"})
    if (spec.rfind(prefix, 0) == 0)
      return prefix + fs::absolute(spec.substr(std::strlen(prefix))).lexically_normal().string();
  return fs::absolute(spec).lexically_normal().string();
}

TrainedModel attach_trained_model(const std::string& path, const std::string& adapter_dir,
                                  DType param_dtype, ops::AttentionBackend attention,
                                  const WeightCheck& check, const std::string& base_dir) {
  const char* kinds =
      "give a Hugging Face model directory (config.json + model.safetensors), a run's checkpoint "
      "(OUT_DIR/checkpoints/last) or the run's OUT_DIR";
  if (!directory_exists(path)) throw Error(path + ": no such directory; " + kinds, Error::kUsage);
  TrainedModel t;
  t.dir = path;
  if (!path_exists(path + "/config.json") && !path_exists(path + "/trainer.json") &&
      directory_exists(path + "/checkpoints/last"))
    t.dir = path + "/checkpoints/last";
  const std::string& dir = t.dir;
  if (path_exists(dir + "/trainer.json")) {
    const json keel = keel_block(dir);
    if (keel.is_null())
      throw Error(dir +
                      ": this checkpoint has no config.json describing its model (it was "
                      "written by an older keel); resume the run (run.resume = true) for one "
                      "more step to write one",
                  Error::kUsage);
    HfConfig hf = read_hf_config(dir);
    if (!base_dir.empty() && checkpoint_base_reference(dir).is_null())
      throw Error("--base " + base_dir + ": " + dir +
                      " holds every parameter of its model (its run did not reference a base "
                      "from files); drop --base",
                  Error::kUsage);
    hf.spec.param_dtype = param_dtype;
    hf.spec.attention = attention;
    t.checkpoint = true;
    t.tokenizer = keel_field<std::string>(keel, "tokenizer", "", dir);
    const json ref = checkpoint_base_reference(dir);
    t.base_model = base_dir.empty() || ref.is_null()
                       ? keel_field<std::string>(keel, "base_model", "", dir)
                       : base_dir;
    const bool adapters = keel_field<bool>(keel, "adapter", false, dir);
    if (adapters && !adapter_dir.empty() && peft_base_is(adapter_dir, {path, dir})) {
      // An adapter trained with model.path = this checkpoint: its run loaded the checkpoint with
      // its adapters merged (hf_weights.h) into a model of its own, then attached the new ones.
      // The same here, so that the PEFT export of such a run gives its logits bit for bit. Read
      // once: loading the checkpoint with its adapters first, then again to merge, read an 8B
      // base twice.
      t.model = models::make_causal_lm_for_loading(hf.spec);
      attach_checkpoint_weights(*t.model, dir, check, /*hold_base=*/false, base_dir);
      t.merged_base = true;  // the dtype its base was held in is the adapter run's, below
    } else {
      load_checkpoint_weights(t, hf.spec, ref, adapters, check, base_dir);
      if (adapters) t.base_dtype = run_base_dtype(dir, hf.dtype);
    }
  } else if (path_exists(dir + "/config.json")) {
    if (!base_dir.empty())
      throw Error("--base " + base_dir + ": " + dir +
                      " is a model directory, not a checkpoint of an adapter run; drop --base "
                      "(a PEFT adapter goes on a base with --adapter)",
                  Error::kUsage);
    HfConfig hf = read_hf_config(dir);
    hf.spec.param_dtype = param_dtype;
    hf.spec.attention = attention;
    t.model = attach_hf_model(hf.spec, dir, check);
    t.tokenizer = tokenizer_of(dir);
  } else {
    throw Error(path +
                    ": neither a model directory (no config.json) nor a checkpoint (no "
                    "trainer.json) nor a run's out_dir (no checkpoints/last); " +
                    std::string(kinds),
                Error::kUsage);
  }
  if (!adapter_dir.empty()) {
    if (t.adapter)
      throw Error("--adapter " + adapter_dir + ": " + dir + " already carries the " +
                      t.adapter->kind +
                      " adapters it was trained with; give --adapter with a base model only",
                  Error::kUsage);
    if (!directory_exists(adapter_dir))
      throw Error("--adapter " + adapter_dir +
                      ": no such directory (a PEFT adapter directory, e.g. OUT_DIR/adapter)",
                  Error::kUsage);
    try {
      t.adapter = load_peft_adapter(*t.model, adapter_dir, check);
    } catch (const Error& e) {
      // An adapter on another base than its own fails on a shape or a module name, and the
      // message alone ("the adapter expects [12, 8] (r = 8)", "fix target_modules") pointed at
      // the adapter's files rather than at MODEL.
      const std::string named = peft_base_of(adapter_dir);
      if (named.empty() || peft_base_is(adapter_dir, {path, dir})) throw;
      throw Error(std::string(e.what()) + "; note: " + adapter_dir +
                      "/adapter_config.json names base_model_name_or_path \"" + named + "\", not " +
                      path + ": an adapter loads on the model it was trained on",
                  e.kind);
    }
    // A run's own PEFT directory: use the model as that run did (its tokenizer, its base's
    // dtype), not as the base directory alone suggests.
    t.adapter_run = adapter_run_dir(adapter_dir);
    if (!t.adapter_run.empty()) {
      const std::string ck = t.adapter_run + "/checkpoints/last";
      const std::string tok = keel_field<std::string>(keel_block(ck), "tokenizer", "", ck);
      if (!tok.empty()) {
        t.tokenizer = tok;
        t.tokenizer_of_adapter_run = true;
      }
      t.base_dtype = run_base_dtype(ck, read_hf_config(ck).dtype);
    } else {  // copied out of its run: as the run recorded it
      const AdapterRunRecord rec = read_adapter_run_record(adapter_dir);
      if (rec.base_dtype && *rec.base_dtype != DType::F32) t.base_dtype = rec.base_dtype;
      // The base's own tokenizer files, where it has them, are what PEFT's users take; else the
      // run's (keel's byte tokenizer needs none: a copied adapter then named none at all).
      if (t.tokenizer.empty() && !rec.tokenizer.empty()) {
        t.tokenizer = rec.tokenizer;
        t.tokenizer_recorded_in = adapter_dir + "/adapter_model.safetensors";
      }
    }
  }
  return t;
}

std::string run_precision(const std::string& path, const std::string& adapter_dir,
                          std::string* recorded_in) {
  std::string ck;
  if (path_exists(path + "/trainer.json"))
    ck = path;
  else if (!path_exists(path + "/config.json") &&
           path_exists(path + "/checkpoints/last/trainer.json"))
    ck = path + "/checkpoints/last";
  else if (!adapter_dir.empty()) {
    const std::string run = adapter_run_dir(adapter_dir);
    if (run.empty()) {
      std::string precision = read_adapter_run_record(adapter_dir).precision;
      if (recorded_in && !precision.empty())
        *recorded_in = adapter_dir + "/adapter_model.safetensors";
      return precision;
    }
    ck = run + "/checkpoints/last";
  }
  if (ck.empty()) return "";
  try {
    return json::parse(read_file(ck + "/trainer.json")).value("precision", "");
  } catch (const std::exception&) {  // loading names a damaged trainer.json
    return "";
  }
}

size_t bytes_to_hold(TrainedModel& t, DType param_dtype, bool hold_base) {
  size_t bytes = 0;
  for_each_parameter_to_hold(t, param_dtype, hold_base, [&](Tensor& p, DType want) {
    bytes += static_cast<size_t>(p.numel()) * dtype_size(want);
  });
  return bytes;
}

void hold_parameters(TrainedModel& t, DType param_dtype, bool hold_base) {
  for_each_parameter_to_hold(t, param_dtype, hold_base, [](Tensor& p, DType want) {
    Tensor(p).attach_storage(convert_mapped(p, want));
  });
}

TrainedModel load_trained_model(const std::string& path, const std::string& adapter_dir,
                                DType param_dtype, ops::AttentionBackend attention,
                                const WeightCheck& check, const std::string& base_dir,
                                bool hold_base) {
  TrainedModel t = attach_trained_model(path, adapter_dir, param_dtype, attention, check, base_dir);
  hold_parameters(t, param_dtype, hold_base);
  return t;
}

}  // namespace keel::io
