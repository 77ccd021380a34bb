#include "keel/io/hf_model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "keel/io/atomic_file.h"
#include "keel/io/checkpoint.h"
#include "keel/io/safetensors.h"
#include "keel/io/trained_model.h"

namespace keel::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kSingle = "model.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

json read_json(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(path + ": invalid JSON: " + e.what());
  }
}

// config.json fields, with errors naming the file and the field.
struct ConfigReader {
  const json& j;
  std::string file;

  const json* find(std::initializer_list<const char*> names) const {
    for (const char* n : names)
      if (j.contains(n) && !j[n].is_null()) return &j[n];
    return nullptr;
  }
  int64_t integer(std::initializer_list<const char*> names, std::optional<int64_t> def = {}) const {
    const json* v = find(names);
    if (!v) {
      if (def) return *def;
      throw Error(file + ": missing field '" + *names.begin() + "'");
    }
    if (!v->is_number_integer() || v->get<int64_t>() < 0)
      throw Error(file + ": field '" + *names.begin() + "' must be a non-negative integer, got " +
                  v->dump());
    return v->get<int64_t>();
  }
  double number(std::initializer_list<const char*> names, double def) const {
    const json* v = find(names);
    if (!v) return def;
    if (!v->is_number())
      throw Error(file + ": field '" + *names.begin() + "' must be a number, got " + v->dump());
    return v->get<double>();
  }
  std::string string(const char* name, const std::string& def) const {
    const json* v = find({name});
    if (!v) return def;
    if (!v->is_string())
      throw Error(file + ": field '" + name + "' must be a string, got " + v->dump());
    return v->get<std::string>();
  }
  bool boolean(const char* name, bool def) const {
    const json* v = find({name});
    if (!v) return def;
    if (!v->is_boolean())
      throw Error(file + ": field '" + name + "' must be true or false, got " + v->dump());
    return v->get<bool>();
  }
};

// HF's `rope_scaling` object. "rope_type" (transformers >= 4.45) or "type" (older) names it.
ops::RopeScaling read_rope_scaling(const json& rs, const std::string& file) {
  using Kind = ops::RopeScaling::Kind;
  const std::string where = file + ": rope_scaling";
  if (!rs.is_object()) throw Error(where + " must be an object or null, got " + rs.dump());
  ConfigReader c{rs, file};
  const json* type = c.find({"rope_type", "type"});
  if (!type || !type->is_string())
    throw Error(where + " has no string field 'rope_type' (or 'type'): " + rs.dump());
  const std::string t = type->get<std::string>();
  ops::RopeScaling s;
  auto required = [&](const char* name) {
    const json* v = c.find({name});
    if (!v || !v->is_number() || !(v->get<double>() > 0))
      throw Error(where + " (" + t + ") needs a positive number '" + name + "', got " +
                  (v ? v->dump() : std::string("nothing")));
    return v->get<double>();
  };
  if (t == "default") return s;
  if (t == "linear") {
    s.kind = Kind::kLinear;
    s.factor = required("factor");
  } else if (t == "llama3") {
    s.kind = Kind::kLlama3;
    s.factor = required("factor");
    s.low_freq_factor = required("low_freq_factor");
    s.high_freq_factor = required("high_freq_factor");
    s.original_max_position = static_cast<int64_t>(required("original_max_position_embeddings"));
    if (!(s.high_freq_factor > s.low_freq_factor))
      throw Error(where + " (llama3): high_freq_factor (" + std::to_string(s.high_freq_factor) +
                  ") must exceed low_freq_factor (" + std::to_string(s.low_freq_factor) + ")");
  } else {
    throw Error(where + " type '" + t +
                "' is not supported by keel's llama model (it runs 'default', 'linear' and "
                "'llama3'; Llama 3.1/3.2 checkpoints use 'llama3')");
  }
  return s;
}

json rope_scaling_json(const ops::RopeScaling& s) {
  switch (s.kind) {
    case ops::RopeScaling::Kind::kNone:
      return nullptr;
    case ops::RopeScaling::Kind::kLinear:
      return {{"rope_type", "linear"}, {"factor", s.factor}};
    case ops::RopeScaling::Kind::kLlama3:
      return {{"rope_type", "llama3"},
              {"factor", s.factor},
              {"low_freq_factor", s.low_freq_factor},
              {"high_freq_factor", s.high_freq_factor},
              {"original_max_position_embeddings", s.original_max_position}};
  }
  return nullptr;
}

std::string family_of(const json& j, const std::string& file) {
  std::string mt;
  if (j.contains("model_type") && !j["model_type"].is_null()) {
    if (!j["model_type"].is_string())
      throw Error(file +
                  ": field 'model_type' must be a string such as \"gpt2\" or \"llama\", got " +
                  j["model_type"].dump());
    mt = j["model_type"].get<std::string>();
  }
  std::string arch;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    arch = j["architectures"][0].get<std::string>();
  if (mt == "gpt2" || arch == "GPT2LMHeadModel" || arch == "GPT2Model") return "gpt2";
  if (mt == "llama" || arch == "LlamaForCausalLM" || arch == "LlamaModel") return "llama";
  throw Error(file + ": unsupported model (model_type '" + mt + "', architecture '" + arch +
              "'); keel reads GPT2LMHeadModel (gpt2) and LlamaForCausalLM (llama)");
}

// GPT-2's Conv1D layers: stored [in, out] by HF.
bool is_conv1d(const std::string& family, const std::string& name) {
  return family == "gpt2" &&
         (ends_with(name, ".attn.c_attn.weight") || ends_with(name, ".attn.c_proj.weight") ||
          ends_with(name, ".mlp.c_fc.weight") || ends_with(name, ".mlp.c_proj.weight"));
}

// Tensors HF files may hold that keel has no parameter for and may skip: GPT-2's causal-mask
// buffers, Llama's rotary inverse frequencies, a tied lm_head.
bool ignorable(const models::ModelSpec& spec, const std::string& name) {
  if (spec.family == "gpt2")
    return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||
           name == "lm_head.weight";
  return ends_with(name, ".rotary_emb.inv_freq") ||
         (spec.tie_embeddings && name == "lm_head.weight");
}

// [R, C] -> [C, R], any element size.
Tensor transpose2d(const Tensor& t) {
  const int64_t R = t.size(0), C = t.size(1);
  Tensor out = Tensor::empty({C, R}, t.dtype());
  const size_t es = dtype_size(t.dtype());
  const char* src = static_cast<const char*>(t.data());
  char* dst = static_cast<char*>(out.data());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) std::memcpy(dst + (c * R + r) * es, src + (r * C + c) * es, es);
  return out;
}

// Every tensor of a model directory with the file it came from.
struct WeightSource {
  std::map<std::string, std::pair<std::string, Tensor>> tensors;  // name -> (file, tensor)
  std::string describe;  // "DIR/model.safetensors" or "DIR/model.safetensors.index.json"
};

WeightSource read_weights(const std::string& dir) {
  WeightSource src;
  const std::string single = dir + "/" + kSingle, index = dir + "/" + kIndex;
  if (fs::exists(single)) {
    src.describe = single;
    for (auto& [name, t] : read_safetensors(single).tensors) src.tensors[name] = {single, t};
    return src;
  }
  if (!fs::exists(index)) {
    std::string hint;
    if (fs::exists(dir + "/pytorch_model.bin"))
      hint = " (pytorch_model.bin is not read: convert it to safetensors first)";
    throw Error(dir + ": no " + kSingle + " or " + kIndex + " found" + hint);
  }
  src.describe = index;
  const json j = read_json(index);
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    throw Error(index + ": missing the \"weight_map\" object {tensor: shard file}");
  std::map<std::string, std::vector<std::string>> by_shard;
  for (auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw Error(index + ": weight_map['" + name + "'] is not a file name");
    by_shard[file.get<std::string>()].push_back(name);
  }
  for (auto& [file, names] : by_shard) {
    if (file.find('/') != std::string::npos || file.find("..") != std::string::npos)
      throw Error(index + ": shard name '" + file + "' must be a plain file name in " + dir);
    const std::string path = dir + "/" + file;
    if (!fs::exists(path))
      throw Error(index + ": shard '" + file + "' (holding '" + names.front() +
                  "') does not exist in " + dir);
    Safetensors st = read_safetensors(path);
    for (const std::string& n : names) {
      const Tensor* t = st.find(n);
      if (!t)
        throw Error(path + ": tensor '" + n + "' is missing (" + kIndex +
                    " places it in this shard)");
      src.tensors[n] = {path, *t};
    }
  }
  return src;
}

// The shapes the weight files' headers declare (nothing else is read), name -> shape; empty when
// the directory holds no weights.
std::map<std::string, Shape> weight_shapes(const std::string& dir) {
  std::map<std::string, Shape> out;
  const std::string single = dir + "/" + kSingle, index = dir + "/" + kIndex;
  std::set<std::string> files;
  if (fs::exists(single)) {
    files.insert(single);
  } else if (fs::exists(index)) {
    const json j = read_json(index);
    if (j.is_object() && j.contains("weight_map") && j["weight_map"].is_object())
      for (auto& [name, file] : j["weight_map"].items())
        if (file.is_string() && file.get<std::string>().find('/') == std::string::npos &&
            fs::exists(dir + "/" + file.get<std::string>()))
          files.insert(dir + "/" + file.get<std::string>());
  }
  for (const std::string& f : files)
    for (TensorInfo& t : read_safetensors_header(f).tensors) out[t.name] = std::move(t.shape);
  return out;
}

// config.json's sizes against the weights' headers, before any parameter is allocated: a layer
// count, width, vocabulary or context that the files do not hold is an error naming the field
// (the full per-tensor check follows in load_hf_weights).
void check_sizes_against_weights(const std::string& dir, const models::ModelSpec& s) {
  const std::map<std::string, Shape> shapes = weight_shapes(dir);
  if (shapes.empty()) return;
  const std::string file = dir + "/config.json";
  const bool gpt2 = s.family == "gpt2";
  auto shape_of = [&](std::initializer_list<const char*> names) -> const Shape* {
    for (const char* n : names)
      if (auto it = shapes.find(n); it != shapes.end()) return &it->second;
    return nullptr;
  };
  auto disagree = [&](const char* field, int64_t v, const std::string& held) {
    return Error(file + ": " + field + " = " + std::to_string(v) + " but the weights in " + dir +
                     " hold " + held + "; config.json does not describe these weights (fix " +
                     field + " or use the config.json written with them)",
                 Error::kUsage);
  };
  int64_t layers = 0;  // 1 + the largest block index in the tensor names (h.N. / layers.N.)
  for (auto& [name, shape] : shapes) {
    const std::string tag = gpt2 ? "h." : "layers.";
    for (size_t at = name.find(tag); at != std::string::npos; at = name.find(tag, at + 1)) {
      if (at > 0 && name[at - 1] != '.') continue;
      size_t i = at + tag.size(), j = i;
      while (j < name.size() && j - i < 9 && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
      if (j > i && j < name.size() && name[j] == '.')
        layers = std::max<int64_t>(layers, std::stoll(name.substr(i, j - i)) + 1);
    }
  }
  if (layers != s.n_layer)
    throw disagree(gpt2 ? "n_layer" : "num_hidden_layers", s.n_layer,
                   std::to_string(layers) + " blocks");
  const Shape* emb = gpt2 ? shape_of({"wte.weight", "transformer.wte.weight"})
                          : shape_of({"model.embed_tokens.weight"});
  if (emb && emb->size() == 2) {
    if ((*emb)[0] != s.vocab_size)
      throw disagree("vocab_size", s.vocab_size,
                     "an embedding of " + std::to_string((*emb)[0]) + " rows");
    if ((*emb)[1] != s.n_embd)
      throw disagree(gpt2 ? "n_embd" : "hidden_size", s.n_embd,
                     "an embedding " + std::to_string((*emb)[1]) + " wide");
  }
  if (gpt2)
    if (const Shape* wpe = shape_of({"wpe.weight", "transformer.wpe.weight"});
        wpe && wpe->size() == 2 && (*wpe)[0] != s.max_seq_len)
      throw disagree("n_positions", s.max_seq_len,
                     "a position embedding of " + std::to_string((*wpe)[0]) + " rows");
  const Shape* mlp = gpt2 ? shape_of({"h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.weight"})
                          : shape_of({"model.layers.0.mlp.up_proj.weight"});
  if (mlp && mlp->size() == 2 && (*mlp)[gpt2 ? 1 : 0] != s.ffn_dim())
    throw disagree(gpt2 ? "n_inner" : "intermediate_size", s.ffn_dim(),
                   "an MLP " + std::to_string((*mlp)[gpt2 ? 1 : 0]) + " wide");
}

}  // namespace

json hf_config_json(const models::ModelSpec& s, DType dt, const json& base) {
  json j = base.is_object() ? base : json::object();
  const char* torch_dtype = dt == DType::BF16  ? "bfloat16"
                            : dt == DType::F16 ? "float16"
                                               : "float32";
  if (s.family == "gpt2") {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["activation_function"] = "gelu_new";
    j["n_layer"] = s.n_layer;
    j["n_embd"] = s.n_embd;
    j["n_head"] = s.n_head;
    j["n_inner"] = s.intermediate_size > 0 ? json(s.intermediate_size) : json(nullptr);
    j["n_positions"] = s.max_seq_len;
    j["n_ctx"] = s.max_seq_len;
    j["vocab_size"] = s.vocab_size;
    j["layer_norm_epsilon"] = s.norm_eps;
    j["initializer_range"] = s.init_std;
    j["tie_word_embeddings"] = true;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    for (const char* k : {"resid_pdrop", "embd_pdrop", "attn_pdrop"})
      if (!j.contains(k)) j[k] = 0.0;
  } else {
    j["architectures"] = {"LlamaForCausalLM"};
    j["model_type"] = "llama";
    j["hidden_act"] = "silu";
    j["num_hidden_layers"] = s.n_layer;
    j["hidden_size"] = s.n_embd;
    j["num_attention_heads"] = s.n_head;
    j["num_key_value_heads"] = s.kv_heads();
    j["head_dim"] = s.head_dim();
    j["intermediate_size"] = s.ffn_dim();
    j["vocab_size"] = s.vocab_size;
    j["max_position_embeddings"] = s.max_seq_len;
    j["rms_norm_eps"] = s.norm_eps;
    j["rope_theta"] = s.rope_theta;
    j["rope_scaling"] = rope_scaling_json(s.rope_scaling);
    j["tie_word_embeddings"] = s.tie_embeddings;
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
    j["initializer_range"] = s.init_std;
  }
  j["torch_dtype"] = torch_dtype;
  return j;
}

namespace {

// The base parameters (adapter parameters excluded), in registration order.
std::vector<std::pair<std::string, Tensor>> base_parameters(models::CausalLM& model) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, p] : model.named_parameters())
    if (!nn::is_adapter_parameter(model, p)) out.emplace_back(name, p);
  return out;
}

void remove_if_exists(const std::string& path) {
  std::error_code ec;
  fs::remove(path, ec);
}

}  // namespace

HfConfig read_hf_config(const std::string& dir) {
  const std::string file = dir + "/config.json";
  if (!fs::exists(file))
    throw Error(dir + ": no config.json (model.path must be a Hugging Face model directory)");
  HfConfig out;
  out.json = read_json(file);
  const json& j = out.json;
  if (!j.is_object()) throw Error(file + ": expected a JSON object");
  ConfigReader c{j, file};
  models::ModelSpec& s = out.spec;
  s.family = family_of(j, file);
  auto unsupported = [&](const std::string& what) {
    return Error(file + ": " + what + " is not supported by keel's " + s.family + " model");
  };
  if (s.family == "gpt2") {
    s.n_layer = c.integer({"n_layer", "num_hidden_layers"});
    s.n_embd = c.integer({"n_embd", "hidden_size"});
    s.n_head = c.integer({"n_head", "num_attention_heads"});
    s.intermediate_size = c.integer({"n_inner", "intermediate_size"}, 0);
    s.vocab_size = c.integer({"vocab_size"});
    s.max_seq_len = c.integer({"n_positions", "n_ctx", "max_position_embeddings"});
    s.norm_eps = c.number({"layer_norm_epsilon"}, 1e-5);
    s.tie_embeddings = true;
    if (!c.boolean("tie_word_embeddings", true))
      throw unsupported("tie_word_embeddings = false (GPT-2's lm_head is tied to wte)");
    const std::string act = c.string("activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      throw unsupported("activation_function '" + act + "' (keel's GPT-2 uses gelu_new)");
    if (c.boolean("scale_attn_by_inverse_layer_idx", false))
      throw unsupported("scale_attn_by_inverse_layer_idx = true");
    if (!c.boolean("scale_attn_weights", true)) throw unsupported("scale_attn_weights = false");
    if (c.boolean("reorder_and_upcast_attn", false))
      throw unsupported("reorder_and_upcast_attn = true");
  } else {
    s.n_layer = c.integer({"num_hidden_layers", "n_layer"});
    s.n_embd = c.integer({"hidden_size", "n_embd"});
    s.n_head = c.integer({"num_attention_heads", "n_head"});
    s.n_kv_head = c.integer({"num_key_value_heads"}, s.n_head);
    s.intermediate_size = c.integer({"intermediate_size"});
    s.vocab_size = c.integer({"vocab_size"});
    s.max_seq_len = c.integer({"max_position_embeddings"}, 2048);
    s.rope_theta = c.number({"rope_theta"}, 10000.0);
    s.norm_eps = c.number({"rms_norm_eps"}, 1e-6);
    s.tie_embeddings = c.boolean("tie_word_embeddings", false);
    const std::string act = c.string("hidden_act", "silu");
    if (act != "silu") throw unsupported("hidden_act '" + act + "' (keel's Llama MLP is SwiGLU)");
    if (c.boolean("attention_bias", false)) throw unsupported("attention_bias = true");
    if (c.boolean("mlp_bias", false)) throw unsupported("mlp_bias = true");
    if (const json* rs = c.find({"rope_scaling"})) s.rope_scaling = read_rope_scaling(*rs, file);
    if (s.n_head > 0 && s.n_embd % s.n_head == 0) {
      const int64_t hd = c.integer({"head_dim"}, s.n_embd / s.n_head);
      if (hd != s.n_embd / s.n_head)
        throw unsupported("head_dim = " + std::to_string(hd) +
                          " != hidden_size / num_attention_heads");
    }
  }
  s.init_std = c.number({"initializer_range"}, 0.02);
  if (!(s.norm_eps > 0) || !std::isfinite(s.norm_eps))
    throw Error(file + ": field '" + (s.family == "gpt2" ? "layer_norm_epsilon" : "rms_norm_eps") +
                    "' must be a positive number, got " + std::to_string(s.norm_eps),
                Error::kUsage);
  if (!(s.rope_theta > 0) || !std::isfinite(s.rope_theta))
    throw Error(file + ": field 'rope_theta' must be a positive number, got " +
                    std::to_string(s.rope_theta),
                Error::kUsage);
  // transformers >= 4.56 writes "dtype"; earlier versions "torch_dtype".
  const std::string td = c.string("torch_dtype", c.string("dtype", "float32"));
  if (td == "bfloat16")
    out.dtype = DType::BF16;
  else if (td == "float16")
    out.dtype = DType::F16;
  else if (td == "float32")
    out.dtype = DType::F32;
  else
    throw Error(file + ": torch_dtype '" + td + "' is not one of float32, bfloat16, float16");
  try {
    s.validate();
  } catch (const Error& e) {
    throw Error(file + ": inconsistent sizes: " + e.what(), Error::kUsage);
  }
  // A keel checkpoint stores keel's layout (GPT-2 linears as [out, in]), not HF's: its own loader
  // checks every tensor.
  if (!is_keel_checkpoint(dir)) check_sizes_against_weights(dir, s);
  return out;
}

void load_hf_weights(models::CausalLM& model, const std::string& dir, const WeightCheck& check) {
  const models::ModelSpec& spec = model.spec();
  if (is_keel_checkpoint(dir)) {  // a run's checkpoint: keel's layout, its adapters merged
    TrainedModel t = load_trained_model(dir, "", DType::F32, spec.attention, check);
    nn::merge_adapters(*t.model);
    std::map<std::string, Tensor> merged;
    for (auto& [name, p] : base_parameters(*t.model)) merged[name] = p;
    for (auto& [name, p] : base_parameters(model)) {
      auto it = merged.find(name);
      if (it == merged.end() || it->second.shape() != p.shape())
        throw Error(dir + "/model.safetensors: tensor '" + name + "' is " +
                    (it == merged.end() ? std::string("missing") : shape_str(it->second.shape())) +
                    " for a model built from " + dir + "/config.json");
      Tensor dst = p;
      dst.copy_from(it->second);
      dst.bump_version();
    }
    return;
  }
  WeightSource src = read_weights(dir);
  std::set<std::string> used;
  for (auto& [name, p] : base_parameters(model)) {
    // GPT-2's own files name tensors without the `transformer.` prefix.
    std::string key = name;
    if (!src.tensors.count(key) && spec.family == "gpt2" && name.rfind("transformer.", 0) == 0 &&
        src.tensors.count(name.substr(12)))
      key = name.substr(12);
    auto it = src.tensors.find(key);
    if (it == src.tensors.end())
      throw Error(src.describe + ": tensor '" + name + "' is missing (config.json describes a " +
                  spec.family + " with " + std::to_string(spec.n_layer) + " layers, " +
                  std::to_string(spec.n_embd) + " wide, vocab " + std::to_string(spec.vocab_size) +
                  ")");
    const auto& [file, t] = it->second;
    used.insert(key);
    const bool conv = is_conv1d(spec.family, name);
    const Shape want = conv ? Shape{p.size(1), p.size(0)} : p.shape();
    if (!dtype_is_floating(t.dtype()))
      throw Error(file + ": tensor '" + key + "' has dtype " + dtype_name(t.dtype()) +
                  "; a weight must be F32, BF16 or F16");
    if (t.shape() != want)
      throw Error(file + ": tensor '" + key + "' has shape " + shape_str(t.shape()) + " but " +
                  dir + "/config.json implies " + shape_str(want) +
                  (conv ? " (GPT-2 Conv1D layout [in, out])" : ""));
    check_weights_finite(check, t, key, file);  // in the file's layout: Conv1D's [in, out]
    Tensor dst = p;
    dst.copy_from(conv ? transpose2d(t.to_dtype(p.dtype())) : t);
    dst.bump_version();
  }
  for (auto& [name, entry] : src.tensors)
    if (!used.count(name) && !ignorable(spec, name))
      throw Error(entry.first + ": unexpected tensor '" + name + "' (" + dir +
                  "/config.json describes a " + spec.family +
                  " that has no such parameter; was the file written for another model?)");
}

std::unique_ptr<models::CausalLM> load_hf_model(const std::string& dir, DType param_dtype,
                                                ops::AttentionBackend attention,
                                                const WeightCheck& check) {
  HfConfig cfg = read_hf_config(dir);
  cfg.spec.param_dtype = param_dtype;
  cfg.spec.attention = attention;
  auto model = models::make_causal_lm(cfg.spec, 0);
  load_hf_weights(*model, dir, check);
  return model;
}

void save_hf_model(models::CausalLM& model, const std::string& dir, const HfSaveOptions& opt) {
  const models::ModelSpec& spec = model.spec();
  if (opt.dtype && !dtype_is_floating(*opt.dtype))
    throw Error("save_hf_model: dtype must be F32, BF16 or F16", Error::kUsage);
  fs::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  int64_t total = 0;
  DType stored = DType::F32;
  for (auto& [name, p] : base_parameters(model)) {
    Tensor t = p;
    if (opt.dtype && t.dtype() != *opt.dtype) t = t.to_dtype(*opt.dtype);
    if (is_conv1d(spec.family, name)) t = transpose2d(t);  // back to Conv1D's [in, out]
    stored = t.dtype();
    total += static_cast<int64_t>(t.nbytes());
    tensors.emplace_back(name, t);
  }
  const std::map<std::string, std::string> meta{{"format", "pt"}};
  // Previous weight files: a loader must never see an old layout beside the new one.
  std::set<std::string> old_shards;
  const std::string index_path = dir + "/" + kIndex;
  if (fs::exists(index_path)) {
    try {
      const json old = read_json(index_path);
      if (old.contains("weight_map") && old["weight_map"].is_object())
        for (auto& [n, f] : old["weight_map"].items())
          if (f.is_string() && f.get<std::string>().find('/') == std::string::npos)
            old_shards.insert(f.get<std::string>());
    } catch (const Error&) {
    }
  }
  if (opt.max_shard_bytes <= 0) {
    write_safetensors(dir + "/" + kSingle, tensors, meta);
    remove_if_exists(index_path);
    for (const std::string& f : old_shards) remove_if_exists(dir + "/" + f);
  } else {
    std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
    int64_t in_shard = 0;
    for (auto& nt : tensors) {
      const int64_t n = static_cast<int64_t>(nt.second.nbytes());
      if (!shards.back().empty() && in_shard + n > opt.max_shard_bytes) {
        shards.emplace_back();
        in_shard = 0;
      }
      shards.back().push_back(nt);
      in_shard += n;
    }
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", json::object()}};
    const size_t k = shards.size();
    std::set<std::string> written;
    for (size_t i = 0; i < k; ++i) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, k);
      write_safetensors(dir + "/" + name, shards[i], meta);
      written.insert(name);
      for (auto& [n, t] : shards[i]) index["weight_map"][n] = name;
    }
    write_file_atomic(index_path, index.dump(2) + "\n");
    remove_if_exists(dir + "/" + kSingle);
    for (const std::string& f : old_shards)
      if (!written.count(f)) remove_if_exists(dir + "/" + f);
  }
  write_file_atomic(dir + "/config.json",
                    hf_config_json(spec, stored, opt.base_config).dump(2) + "\n");
}

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
    c["fan_in_fan_out"] = model.spec().family == "gpt2";
  }
  return c;
}

void save_peft_adapter(models::CausalLM& model, const nn::AdapterOptions& opt,
                       const std::string& dir, const std::string& base_model_name_or_path) {
  auto tensors = nn::peft_state_dict(model);
  if (tensors.empty())
    throw Error("save_peft_adapter: the model has no adapter (set model.adapter.kind)");
  const std::string text = peft_config_json(model, opt, base_model_name_or_path).dump(2) + "\n";
  write_dir_atomic(dir, [&](const std::string& tmp) {
    write_file_atomic(tmp + "/adapter_config.json", text);
    write_safetensors(tmp + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  });
}

nn::AdapterOptions read_peft_config(const std::string& dir) {
  const std::string cfg_path = dir + "/adapter_config.json";
  if (!fs::exists(cfg_path))
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
    throw Error(cfg_path + ": peft_type '" + type + "' is not supported (LORA or LOKR)");
  }
  if (!c.contains("target_modules") || !c["target_modules"].is_array())
    throw Error(cfg_path + ": target_modules must be a list of module names");
  opt.target_modules.clear();
  for (auto& t : c["target_modules"]) {
    if (!t.is_string()) throw Error(cfg_path + ": target_modules must hold strings");
    opt.target_modules.push_back(t.get<std::string>());
  }
  return opt;
}

nn::AdapterOptions load_peft_adapter(models::CausalLM& model, const std::string& dir) {
  const std::string st_path = dir + "/adapter_model.safetensors";
  const nn::AdapterOptions opt = read_peft_config(dir);
  nn::apply_adapters(model, opt);
  Safetensors st = read_safetensors(st_path);
  std::set<std::string> used;
  for (auto& [name, p] : nn::peft_state_dict(model)) {
    const Tensor& t = st.at(name);
    if (t.shape() != p.shape())
      throw Error(st_path + ": tensor '" + name + "' has shape " + shape_str(t.shape()) +
                  ", the adapter expects " + shape_str(p.shape()) +
                  " (r = " + std::to_string(opt.r) + ")");
    if (!dtype_is_floating(t.dtype()))
      throw Error(st_path + ": tensor '" + name + "' has non-floating dtype " +
                  dtype_name(t.dtype()));
    Tensor dst = p;
    dst.copy_from(t);
    dst.bump_version();
    used.insert(name);
  }
  for (auto& [name, t] : st.tensors)
    if (!used.count(name))
      throw Error(st_path + ": unexpected tensor '" + name + "' (no adapted module has it)");
  return opt;
}

}  // namespace keel::io
