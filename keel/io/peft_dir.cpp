#include "keel/io/peft_dir.h"

#include <filesystem>
#include <set>
#include <utility>
#include <vector>

#include "keel/amp/precision.h"
#include "keel/io/atomic_file.h"
#include "keel/io/checkpoint.h"
#include "keel/io/hf_config.h"
#include "keel/io/hf_json.h"
#include "keel/io/hf_weights.h"
#include "keel/io/safetensors.h"
#include "keel/models/resize.h"
#include "keel/numerics/input_file.h"

namespace keel::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

json peft_config_json(const models::CausalLM& model, const nn::AdapterOptions& opt,
                      const std::string& base_model_name_or_path) {
  json c;
  c["task_type"] = "CAUSAL_LM";
  c["base_model_name_or_path"] =
      base_model_name_or_path.empty() ? json(nullptr) : json(base_model_name_or_path);
  c["target_modules"] = opt.target_modules;
  c["r"] = opt.r;
  c["inference_mode"] = true;
  c["modules_to_save"] = nullptr;
  c["layers_to_transform"] = nullptr;
  c["layers_pattern"] = nullptr;
  c["rank_pattern"] = json::object();
  c["alpha_pattern"] = json::object();
  c["revision"] = nullptr;
  if (opt.kind == "lokr") {
    c["peft_type"] = "LOKR";
    c["alpha"] = opt.alpha;
    c["rank_dropout"] = 0.0;
    c["module_dropout"] = 0.0;
    c["use_effective_conv2d"] = false;
    c["decompose_both"] = false;
    c["decompose_factor"] = -1;
    c["init_weights"] = true;
  } else {
    c["peft_type"] = "LORA";
    c["lora_alpha"] = opt.alpha;
    c["lora_dropout"] = opt.dropout;
    c["use_dora"] = opt.kind == "dora";
    c["use_rslora"] = false;
    c["bias"] = "none";
    c["init_lora_weights"] = true;
    // PEFT's flag for weights stored [in, out]: GPT-2's Conv1D layers in HF.
    c["fan_in_fan_out"] = model.spec().conv1d_weights();
  }
  return c;
}

namespace {

// The token embedding and an untied lm_head, under their HF names: the rows of the vocabulary.
std::vector<std::pair<std::string, Tensor>> vocab_parameters(models::CausalLM& model) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, p] : model.named_parameters())
    if (models::is_vocabulary_parameter(name)) out.emplace_back(name, p);
  return out;
}

constexpr const char* kPrecisionKey = "keel.precision";
constexpr const char* kBaseDtypeKey = "keel.base_dtype";
constexpr const char* kTokenizerKey = "keel.tokenizer";

}  // namespace

void save_peft_adapter(models::CausalLM& model, const nn::AdapterOptions& opt,
                       const std::string& dir, const std::string& base_model_name_or_path,
                       const AdapterRunRecord& record) {
  auto tensors = nn::peft_state_dict(model);
  if (tensors.empty())
    throw Error("save_peft_adapter: the model has no adapter (set model.adapter.kind)");
  // A vocabulary grown past the base's (data.pad = "add"'s pad row) travels as PEFT's
  // save_embedding_layers does: the whole embedding (and an untied lm_head) in the adapter file,
  // for a base resized to it. Without it the adapter on its base computed logits one row short.
  if (!base_model_name_or_path.empty() && path_exists(base_model_name_or_path + "/config.json") &&
      read_hf_config(base_model_name_or_path).spec.vocab_size < model.spec().vocab_size)
    for (auto& [name, p] : vocab_parameters(model))
      tensors.emplace_back("base_model.model." + name, p);
  const std::string text = peft_config_json(model, opt, base_model_name_or_path).dump(2) + "\n";
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (!record.precision.empty()) metadata[kPrecisionKey] = record.precision;
  if (record.base_dtype) metadata[kBaseDtypeKey] = dtype_name(*record.base_dtype);
  if (!record.tokenizer.empty()) metadata[kTokenizerKey] = record.tokenizer;
  write_dir_atomic(dir, [&](const std::string& tmp) {
    write_file_atomic(tmp + "/adapter_config.json", text);
    write_safetensors(tmp + "/adapter_model.safetensors", tensors, metadata);
  });
}

AdapterRunRecord read_adapter_run_record(const std::string& dir) {
  AdapterRunRecord rec;
  const std::string file = dir + "/adapter_model.safetensors";
  if (!path_exists(file)) return rec;
  std::map<std::string, std::string> metadata;
  try {
    metadata = read_safetensors_header(file).metadata;
  } catch (const Error&) {
    return rec;
  }
  // A value keel cannot use is named with its file: it surfaced as "unknown precision 'x'", as
  // if --precision had been given.
  auto damaged = [&](const char* key, const std::string& value, const char* valid,
                     const char* fix) {
    return Error(file + ": its __metadata__ " + key + " is \"" + value + "\", not " + valid +
                     " (the file was changed after keel wrote it); " + fix,
                 Error::kUsage);
  };
  if (auto it = metadata.find(kPrecisionKey); it != metadata.end()) {
    try {
      rec.precision = resolve_precision(it->second, Device::cpu(), /*allow_cpu_bf16=*/true).name();
    } catch (const Error&) {
      throw damaged(kPrecisionKey, it->second,
                    "a precision (32-true, bf16-mixed, 16-mixed, bf16-true, 16-true)",
                    "give --precision");
    }
  }
  if (auto it = metadata.find(kTokenizerKey); it != metadata.end()) rec.tokenizer = it->second;
  if (auto it = metadata.find(kBaseDtypeKey); it != metadata.end()) {
    rec.base_dtype = dtype_from_name(it->second);
    if (!rec.base_dtype || !dtype_is_floating(*rec.base_dtype))
      throw damaged(kBaseDtypeKey, it->second, "a dtype (f32, bf16, f16)",
                    "copy the adapter again from its run's OUT_DIR/adapter");
  }
  return rec;
}

nn::AdapterOptions read_peft_config(const std::string& dir) {
  const std::string cfg_path = dir + "/adapter_config.json";
  if (!path_exists(cfg_path))
    throw Error(dir +
                    ": no adapter_config.json (expected a PEFT adapter directory, e.g. a run's "
                    "out_dir/adapter)",
                Error::kUsage);
  const json c = read_json(cfg_path);
  ConfigReader r{c, cfg_path};
  nn::AdapterOptions opt;
  const std::string type = r.string("peft_type", "");
  opt.r = r.integer({"r"});
  if (type == "LORA") {
    opt.kind = r.boolean("use_dora", false) ? "dora" : "lora";
    opt.alpha = r.number({"lora_alpha"}, 8);
    opt.dropout = r.number({"lora_dropout"}, 0);
    if (r.boolean("use_rslora", false))
      throw Error(cfg_path + ": use_rslora = true is not supported (scaling alpha / sqrt(r))");
  } else if (type == "LOKR") {
    opt.kind = "lokr";
    opt.alpha = r.number({"alpha"}, 8);
    if (r.number({"rank_dropout"}, 0) != 0 || r.number({"module_dropout"}, 0) != 0)
      throw Error(cfg_path + ": LoKr rank_dropout/module_dropout are not supported");
    if (r.boolean("decompose_both", false) || r.number({"decompose_factor"}, -1) > 0)
      throw Error(cfg_path + ": LoKr decompose_both/decompose_factor are not supported");
  } else {
    throw Error(cfg_path +
                (type.empty() ? std::string(": has no peft_type")
                              : ": peft_type '" + type + "' is not supported") +
                "; keel reads PEFT's LORA (with or without use_dora) and LOKR adapters");
  }
  // PEFT fields keel does not apply, when set: an adapter loaded without them computes another
  // function (alpha_pattern was ignored: the loss of a PEFT run with other alphas per module came
  // out as if it had none), or is refused naming a tensor (rank_pattern, layers_to_transform).
  auto set = [&](const char* field) {
    if (!c.contains(field)) return false;
    const json& v = c[field];
    return !(v.is_null() || (v.is_object() && v.empty()) || (v.is_array() && v.empty()) ||
             (v.is_boolean() && !v.get<bool>()) || (v.is_string() && v == "none"));
  };
  for (const auto& [field, what] : std::vector<std::pair<const char*, const char*>>{
           {"alpha_pattern", "alphas per module"},
           {"rank_pattern", "ranks per module"},
           {"layers_to_transform", "adapters on some layers only"},
           {"modules_to_save", "whole modules trained beside the adapter"},
           {"exclude_modules", "modules excluded from target_modules"},
           // PEFT builds a model of other layers (copies, another order, fewer) from it: the
           // adapter's tensors may still name the base's layers, and loaded on the base's own
           // layers they computed another model without a word.
           {"layer_replication", "layers copied or reordered into another stack"},
           {"trainable_token_indices", "token embeddings trained beside the adapter"},
           {"target_parameters", "adapters on parameters rather than linear layers"},
           {"bias", "trained biases"},
           {"lora_bias", "trained biases"}})
    if (set(field))
      throw Error(cfg_path + ": " + field + " = " + c[field].dump() + " (" + what +
                      ") is not supported by keel, which would load the adapter without it and "
                      "compute another model; merge the adapter into its base with PEFT "
                      "(merge_and_unload) and use the merged model instead",
                  Error::kUsage);
  // Checked here with the file's own field names: apply_adapters would name model.adapter, a key
  // of the user's config that this directory did not come from.
  if (opt.r < 1 || opt.r > nn::kMaxAdapterRank)
    throw Error(cfg_path + ": field 'r' must be in [1, " + std::to_string(nn::kMaxAdapterRank) +
                "], got " + std::to_string(opt.r));
  const char* alpha_field = opt.kind == "lokr" ? "alpha" : "lora_alpha";
  if (!(opt.alpha > 0))
    throw Error(cfg_path + ": field '" + alpha_field + "' must be > 0, got " +
                c.at(alpha_field).dump());
  if (!(opt.dropout >= 0 && opt.dropout < 1))
    throw Error(cfg_path + ": field 'lora_dropout' must be in [0, 1), got " +
                c.at("lora_dropout").dump());
  if (!c.contains("target_modules") || !c["target_modules"].is_array())
    throw Error(cfg_path + ": target_modules must be a list of module names");
  opt.target_modules.clear();
  for (auto& t : c["target_modules"]) {
    if (!t.is_string()) throw Error(cfg_path + ": target_modules must hold strings");
    opt.target_modules.push_back(t.get<std::string>());
  }
  if (opt.target_modules.empty())
    throw Error(cfg_path +
                ": target_modules is empty (PEFT writes the adapted module names, e.g. "
                "[\"q_proj\", \"v_proj\"])");
  return opt;
}

nn::AdapterOptions load_peft_adapter(models::CausalLM& model, const std::string& dir,
                                     const WeightCheck& check) {
  const std::string st_path = dir + "/adapter_model.safetensors";
  const nn::AdapterOptions opt = read_peft_config(dir);
  Safetensors st = read_safetensors(st_path);
  std::set<std::string> used;
  // Embeddings saved beside the adapter (a vocabulary grown past the base's): the base takes
  // their rows first (PEFT's user resizes the base before loading), then their values.
  for (auto& [name, p] : vocab_parameters(model)) {
    const Tensor* t = st.find("base_model.model." + name);
    if (!t) continue;
    if (t->dim() != 2 || t->size(1) != p.size(1) || t->size(0) < 1)
      throw Error(st_path + ": tensor 'base_model.model." + name + "' has shape " +
                  shape_str(t->shape()) + ", the base's " + name + " is " + shape_str(p.shape()) +
                  " (another base model's embeddings)");
    if (t->size(0) != model.spec().vocab_size) models::resize_token_embeddings(model, t->size(0));
  }
  for (auto& [name, p] : vocab_parameters(model)) {
    const Tensor* t = st.find("base_model.model." + name);
    if (!t) continue;
    check_weights_finite(check, *t, name, st_path);
    Tensor dst = p;
    dst.copy_from(*t);
    dst.bump_version();
    used.insert("base_model.model." + name);
  }
  nn::apply_adapters(model, opt, dir + "/adapter_config.json");
  // An adapter PEFT saved on a Gemma3ForConditionalGeneration names the language model's modules
  // under language_model. (or model.language_model.), and may adapt its vision tower too, which
  // text alone never runs: read the former, leave the latter (io/hf_weights.cpp reads such a
  // base the same way).
  const bool multimodal = model.spec().hf_model_type == "gemma3_text";
  const std::string peft = "base_model.model.";  // before every module's name
  auto find = [&](const std::string& name) {
    const Tensor* t = st.find(name);
    if (t || !multimodal) return std::pair{t, name};
    for (const std::string& k : multimodal_file_names(name.substr(peft.size())))
      if ((t = st.find(peft + k))) return std::pair{t, peft + k};
    return std::pair{t, name};
  };
  for (auto& [name, p] : nn::peft_state_dict(model)) {
    // adapter_config.json says which tensors the file holds; one it lacks is a mismatch between
    // the two files or with the base (Safetensors::at asked "written for another model?").
    const auto [found, key] = find(name);
    if (!found)
      throw Error(st_path + ": tensor '" + name + "' is missing (the file has " +
                  std::to_string(st.tensors.size()) + " tensors), though " + dir +
                  "/adapter_config.json adapts that module of this base model: the adapter was "
                  "saved for another base model (other layers or modules) or with another "
                  "adapter_config.json; load it on the base it was trained on, or give the "
                  "adapter_config.json saved with these weights");
    const Tensor& t = *found;
    if (t.shape() != p.shape())
      throw Error(st_path + ": tensor '" + name + "' has shape " + shape_str(t.shape()) +
                  ", the adapter expects " + shape_str(p.shape()) +
                  " (r = " + std::to_string(opt.r) + ")");
    if (!dtype_is_floating(t.dtype()))
      throw Error(st_path + ": tensor '" + name + "' has non-floating dtype " +
                  dtype_name(t.dtype()));
    check_weights_finite(check, t, name, st_path);
    Tensor dst = p;
    dst.copy_from(t);
    dst.bump_version();
    used.insert(key);
  }
  for (auto& [name, t] : st.tensors)
    if (!used.count(name) && !(multimodal && multimodal_vision_tensor(name)))
      throw Error(st_path + ": unexpected tensor '" + name + "' (no adapted module has it)");
  return opt;
}

}  // namespace keel::io
