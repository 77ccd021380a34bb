#include "keel/io/hf_weights.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "keel/io/atomic_file.h"
#include "keel/io/hf_config.h"
#include "keel/io/hf_json.h"
#include "keel/io/safetensors.h"
#include "keel/io/trained_model.h"
#include "keel/numerics/input_file.h"
#include "keel/tensor/convert_mapped.h"

namespace keel::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
// GPT-2's Conv1D layers: stored [in, out] by HF.
bool is_conv1d(const models::ModelSpec& spec, const std::string& name) {
  return spec.conv1d_weights() &&
         (ends_with(name, ".attn.c_attn.weight") || ends_with(name, ".attn.c_proj.weight") ||
          ends_with(name, ".mlp.c_fc.weight") || ends_with(name, ".mlp.c_proj.weight"));
}

// Tensors HF files may hold that keel has no parameter for and may skip: GPT-2's causal-mask
// buffers (and GPT-NeoX's and GPT-J's, as Pythia's files hold them), Llama's rotary inverse
// frequencies, a tied lm_head.
bool ignorable(const models::ModelSpec& spec, const std::string& name) {
  if (spec.family == "gpt2")
    return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||
           name == "lm_head.weight";
  if (spec.gpt_neox() &&
      (ends_with(name, ".attention.bias") || ends_with(name, ".attention.masked_bias")))
    return true;
  if (spec.gptj() && (ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||
                      ends_with(name, ".attn.causal_mask")))  // (CodeGen's)
    return true;
  // A Gemma3ForConditionalGeneration's vision tower and projector: keel reads its language model.
  if (spec.hf_model_type == "gemma3_text" && multimodal_vision_tensor(name)) return true;
  return ends_with(name, ".rotary_emb.inv_freq") ||
         (spec.tie_embeddings && name == "lm_head.weight");
}

// (file prefix, keel prefix) of a multimodal Gemma-3's language model.
constexpr std::pair<const char*, const char*> kMultimodalPrefixes[] = {
    {"language_model.model.", "model."}, {"model.language_model.", "model."}};

// The name parameter `name` has in a model directory's files: its own, or GPT-2's without the
// `transformer.` prefix (OpenAI's files), or a Gemma3ForConditionalGeneration's language model's
// ("language_model.model.X" as Google's files name it, "model.language_model.X" as transformers
// >= 4.52 saves it, for keel's "model.X"). `has` says whether the files hold a name.
std::string file_name_of(const models::ModelSpec& spec, const std::string& name,
                         const std::function<bool(const std::string&)>& has) {
  if (has(name)) return name;
  if (spec.family == "gpt2" && name.rfind("transformer.", 0) == 0 && has(name.substr(12)))
    return name.substr(12);
  if (spec.hf_model_type == "gemma3_text")
    for (const std::string& k : multimodal_file_names(name))
      if (has(k)) return k;
  return name;
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

// Every tensor of a model directory, mapped: nothing is read until a tensor is taken.
struct WeightSource {
  struct Entry {
    const MappedSafetensors* file;
    const TensorInfo* info;
  };
  std::vector<std::unique_ptr<MappedSafetensors>> files;
  std::map<std::string, Entry> tensors;
  std::string describe;  // "DIR/model.safetensors" or "DIR/model.safetensors.index.json"
};

WeightSource map_weights(const std::string& dir) {
  WeightSource src;
  const std::string single = dir + "/" + kSafetensorsSingle, index = dir + "/" + kSafetensorsIndex;
  if (path_exists(single)) {
    src.describe = single;
    const auto& f = src.files.emplace_back(std::make_unique<MappedSafetensors>(single));
    for (const TensorInfo& t : f->header().tensors) src.tensors[t.name] = {f.get(), &t};
    return src;
  }
  if (!path_exists(index)) {
    std::string hint;
    if (path_exists(dir + "/pytorch_model.bin"))
      hint = " (pytorch_model.bin is not read: convert it to safetensors first)";
    throw Error(dir + ": no " + kSafetensorsSingle + " or " + kSafetensorsIndex + " found" + hint);
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
    if (!path_exists(path))
      throw Error(index + ": shard '" + file + "' (holding '" + names.front() +
                  "') does not exist in " + dir);
    const auto& f = src.files.emplace_back(std::make_unique<MappedSafetensors>(path));
    for (const std::string& n : names) {
      const TensorInfo* t = f->find(n);
      if (!t)
        throw Error(path + ": tensor '" + n + "' is missing (" + kSafetensorsIndex +
                    " places it in this shard)");
      src.tensors[n] = {f.get(), t};
    }
  }
  return src;
}

// The shapes the weight files' headers declare (nothing else is read), name -> shape; empty when
// the directory holds no weights.
std::map<std::string, Shape> weight_shapes(const std::string& dir) {
  std::map<std::string, Shape> out;
  const std::string single = dir + "/" + kSafetensorsSingle, index = dir + "/" + kSafetensorsIndex;
  std::set<std::string> files;
  if (path_exists(single)) {
    files.insert(single);
  } else if (path_exists(index)) {
    const json j = read_json(index);
    if (j.is_object() && j.contains("weight_map") && j["weight_map"].is_object())
      for (auto& [name, file] : j["weight_map"].items())
        if (file.is_string() && file.get<std::string>().find('/') == std::string::npos &&
            path_exists(dir + "/" + file.get<std::string>()))
          files.insert(dir + "/" + file.get<std::string>());
  }
  for (const std::string& f : files)
    for (TensorInfo& t : read_safetensors_header(f).tensors) out[t.name] = std::move(t.shape);
  return out;
}

// config.json's sizes against the weights' headers, before any parameter is allocated: a layer
// count, width, vocabulary or context that the files do not hold is an error naming the field

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

std::vector<std::string> multimodal_file_names(const std::string& name) {
  std::vector<std::string> out;
  for (const auto& [file, keel] : kMultimodalPrefixes)
    if (name.rfind(keel, 0) == 0) out.push_back(file + name.substr(std::strlen(keel)));
  return out;
}

bool multimodal_vision_tensor(const std::string& name) {
  return name.find("vision_tower.") != std::string::npos ||
         name.find("multi_modal_projector.") != std::string::npos;
}

std::string multimodal_keel_name(const std::string& file_name) {
  for (const auto& [file, keel] : kMultimodalPrefixes)
    if (file_name.rfind(file, 0) == 0) return keel + file_name.substr(std::strlen(file));
  return "";
}

// (the full per-tensor check follows in load_hf_weights).
void check_sizes_against_weights(const std::string& dir, const models::ModelSpec& s) {
  std::map<std::string, Shape> shapes = weight_shapes(dir);
  if (shapes.empty()) return;
  if (s.hf_model_type == "gemma3_text") {  // a multimodal file's language model, by keel's names
    std::map<std::string, Shape> text;
    for (auto& [name, shape] : shapes)
      if (const std::string keel = multimodal_keel_name(name); !keel.empty()) text[keel] = shape;
    if (!text.empty()) shapes = std::move(text);
  }
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
    const std::string tag = gpt2 ? "h." : std::string(s.module_names().layers) + ".";
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
  const std::string embedding = s.embedding_name();
  const Shape* emb =
      gpt2 ? shape_of({"wte.weight", "transformer.wte.weight"}) : shape_of({embedding.c_str()});
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
  // A query projection of another width: head_dim (or its absence) is wrong for these weights.
  // Phi-3's qkv_proj (GPT-NeoX's query_key_value) holds the query's rows and then the keys' and
  // values' (head by head).
  const bool fused = s.fused_qkv();
  const int64_t kv_rows = fused ? 2 * s.kv_heads() * s.head_dim() : 0;
  const models::ModelSpec::ModuleNames n = s.module_names();
  const std::string layer0 = std::string(n.model) + "." + n.layers + ".0.",
                    attn0 = layer0 + n.attention + "." + (fused ? n.qkv : "q_proj") + ".weight",
                    mlp0 =
                        layer0 + "mlp." + (s.fused_gate_up() ? "gate_up_proj" : n.up) + ".weight";
  if (const Shape* q = shape_of({attn0.c_str()});
      !gpt2 && q && q->size() == 2 && (*q)[0] != s.n_head * s.head_dim() + kv_rows)
    throw disagree(s.head_width > 0 ? "head_dim" : "num_attention_heads",
                   s.head_width > 0 ? s.head_width : s.n_head,
                   std::string("a ") + (fused ? n.qkv : "q_proj") + " of " +
                       std::to_string((*q)[0]) + " rows, not " +
                       (fused ? "(num_attention_heads " + std::to_string(s.n_head) + " + 2 x " +
                                    (s.falcon() ? "num_kv_heads " : "num_key_value_heads ") +
                                    std::to_string(s.kv_heads()) + ")"
                              : "num_attention_heads " + std::to_string(s.n_head)) +
                       " x head_dim " + std::to_string(s.head_dim()));
  // Phi-3's gate_up_proj holds gate's rows, then up's.
  const bool gate_up = s.fused_gate_up();
  const Shape* mlp = gpt2 ? shape_of({"h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.weight"})
                          : shape_of({mlp0.c_str()});
  const int64_t mlp_rows = gate_up ? 2 * s.ffn_dim() : s.ffn_dim();
  const size_t out_dim = s.conv1d_weights() ? 1 : 0;  // (Conv1D is [in, out])
  if (mlp && mlp->size() == 2 && (*mlp)[out_dim] != mlp_rows)
    throw disagree(gpt2         ? "n_inner"
                   : s.falcon() ? "ffn_hidden_size"
                                : "intermediate_size",
                   s.ffn_dim(),
                   "an MLP " + std::to_string((*mlp)[out_dim] / (gate_up ? 2 : 1)) + " wide");
  // A mixture of experts: the first sparse layer's router [experts, n_embd], an expert's width.
  int64_t sparse = 0;
  while (sparse < s.n_layer && !s.moe_layer(sparse)) ++sparse;
  if (s.moe.experts > 0 && sparse < s.n_layer) {
    const bool mixtral = s.mixtral_names(),
               qwen = s.hf_model_type == "qwen3_moe" || s.hf_model_type == "qwen2_moe";
    const std::string moe =
        "model.layers." + std::to_string(sparse) + (mixtral ? ".block_sparse_moe" : ".mlp");
    const std::string router = moe + ".gate.weight",
                      up = moe + ".experts.0." + (mixtral ? "w3" : "up_proj") + ".weight";
    if (const Shape* g = shape_of({router.c_str()});
        g && g->size() == 2 && (*g)[0] != s.moe.experts)
      throw disagree(mixtral ? "num_local_experts" : "num_experts", s.moe.experts,
                     "a router (" + router + ") of " + std::to_string((*g)[0]) + " experts");
    if (const Shape* u = shape_of({up.c_str()}); u && u->size() == 2 && (*u)[0] != s.moe.ffn)
      throw disagree(qwen ? "moe_intermediate_size" : "intermediate_size", s.moe.ffn,
                     "experts " + std::to_string((*u)[0]) + " wide");
    const std::string shared = moe + ".shared_expert.up_proj.weight";
    if (const Shape* u = shape_of({shared.c_str()});
        u && u->size() == 2 && (*u)[0] != s.moe.shared_ffn)
      throw disagree("shared_expert_intermediate_size", s.moe.shared_ffn,
                     "a shared expert " + std::to_string((*u)[0]) + " wide");
  }
}

namespace {

// The base parameters of the keel checkpoint DIR's model, its adapters merged, by name, each
// checked against `model`'s (present, same shape). `hold_base`: its frozen base held as its run
// held it (load_trained_model: bf16 under model.base_dtype = bf16), else every tensor in f32.
std::map<std::string, Tensor> merged_checkpoint_weights(models::CausalLM& model,
                                                        const std::string& dir,
                                                        const WeightCheck& check,
                                                        const std::string& base_dir,
                                                        bool hold_base) {
  TrainedModel t =
      load_trained_model(dir, "", DType::F32, model.spec().attention, check, base_dir, hold_base);
  nn::merge_adapters(*t.model);
  std::map<std::string, Tensor> merged;
  for (auto& [name, p] : base_parameters(*t.model)) merged[name] = p;
  for (auto& [name, p] : base_parameters(model)) {
    auto it = merged.find(name);
    if (it == merged.end() || it->second.shape() != p.shape())
      throw Error(dir + "/model.safetensors: tensor '" + name + "' is " +
                  (it == merged.end() ? std::string("missing") : shape_str(it->second.shape())) +
                  " for a model built from " + dir + "/config.json");
  }
  return merged;
}

}  // namespace

void load_hf_weights(models::CausalLM& model, const std::string& dir, const WeightCheck& check,
                     const std::string& base_dir) {
  if (is_keel_checkpoint(dir)) {  // a run's checkpoint: keel's layout, its adapters merged
    const std::map<std::string, Tensor> merged =
        merged_checkpoint_weights(model, dir, check, base_dir, /*hold_base=*/false);
    for (auto& [name, p] : base_parameters(model)) {
      Tensor dst = p;
      dst.copy_from(merged.at(name));
      dst.bump_version();
    }
    return;
  }
  for_each_weight(
      model, dir,
      [](Tensor& p, Tensor value) {
        p.copy_from(value);  // converts; the view dies here and its pages are dropped
        p.bump_version();
      },
      check);
}

void attach_checkpoint_weights(models::CausalLM& model, const std::string& dir,
                               const WeightCheck& check, bool hold_base,
                               const std::string& base_dir) {
  std::map<std::string, Tensor> merged =
      merged_checkpoint_weights(model, dir, check, base_dir, hold_base);
  for (auto& [name, p] : base_parameters(model)) {
    auto it = merged.find(name);
    p.attach_storage(it->second);  // shared: the checkpoint's model is gone after this loop
    merged.erase(it);
  }
}

LoadedWeights attach_hf_weights(models::CausalLM& model, const std::string& dir,
                                const WeightCheck& check) {
  LoadedWeights stats;
  for_each_weight(
      model, dir,
      [&](Tensor& p, Tensor value) {
        ++stats.tensors;
        // A value exact in the parameter's dtype is kept as it is stored (f32 parameters: any
        // floating dtype); otherwise it is rounded as load_hf_weights' copy would round it.
        const bool exact = value.dtype() == p.dtype() || p.dtype() == DType::F32;
        if (!exact) value = convert_mapped(value, p.dtype());  // a chunk at a time
        if (value.is_external()) {
          ++stats.mapped;
          stats.mapped_bytes += value.nbytes();
        } else {
          stats.copied_bytes += value.nbytes();
        }
        p.attach_storage(value);
      },
      check);
  return stats;
}

void for_each_weight(models::CausalLM& model, const std::string& dir,
                     const std::function<void(Tensor& param, Tensor value)>& use,
                     const WeightCheck& check) {
  const models::ModelSpec& spec = model.spec();
  WeightSource src = map_weights(dir);
  std::set<std::string> used;
  for (auto& [name, p] : base_parameters(model)) {
    const std::string key =
        file_name_of(spec, name, [&](const std::string& k) { return src.tensors.count(k) > 0; });
    auto it = src.tensors.find(key);
    if (it == src.tensors.end())
      throw Error(src.describe + ": tensor '" + name + "' is missing (config.json describes a " +
                  spec.architecture() + " with " + std::to_string(spec.n_layer) + " layers, " +
                  std::to_string(spec.n_embd) + " wide, vocab " + std::to_string(spec.vocab_size) +
                  ")");
    const MappedSafetensors& file = *it->second.file;
    const TensorInfo& info = *it->second.info;
    used.insert(key);
    const bool conv = is_conv1d(spec, name);
    const Shape want = conv ? Shape{p.size(1), p.size(0)} : p.shape();
    if (!dtype_is_floating(info.dtype))
      throw Error(file.path() + ": tensor '" + key + "' has dtype " + dtype_name(info.dtype) +
                  "; a weight must be F32, BF16 or F16");
    if (info.shape != want)
      throw Error(file.path() + ": tensor '" + key + "' has shape " + shape_str(info.shape) +
                  " but " + dir + "/config.json implies " + shape_str(want) +
                  (conv ? " (GPT-2 Conv1D layout [in, out])" : ""));
    // Each weight's raw data is checked before anything is made of it, in the file's layout
    // (GPT-2's Conv1D weights are [in, out]), so a message's index is the file's.
    check_weights_finite(check, file.raw(info), info.dtype, info.shape, key, file.path());
    Tensor value = file.tensor(info);  // a view of the mapping where aligned
    // The check read every page of it: drop them (a later read faults them in from the page cache
    // again), or an f32 file loaded into a bf16 base would be resident whole until the cast.
    drop_mapped_pages(value);
    if (conv) value = transpose2d(value);
    use(p, std::move(value));
  }
  for (auto& [name, entry] : src.tensors)
    if (!used.count(name) && !ignorable(spec, name))
      throw Error(entry.file->path() + ": unexpected tensor '" + name + "' (" + dir +
                  "/config.json describes a " + spec.architecture() +
                  " that has no such parameter; was the file written for another model?)");
}

std::optional<FileElement> file_element(const models::ModelSpec& spec, const std::string& dir,
                                        const std::string& name, const Shape& index) {
  if (is_keel_checkpoint(dir) || index.size() != 2) return std::nullopt;
  const WeightSource src = map_weights(dir);
  const std::string key =
      file_name_of(spec, name, [&](const std::string& k) { return src.tensors.count(k) > 0; });
  const auto it = src.tensors.find(key);
  if (it == src.tensors.end() || it->second.info->shape.size() != 2) return std::nullopt;
  const TensorInfo& info = *it->second.info;
  FileElement e{it->second.file->path(), key, index, 0};
  if (is_conv1d(spec, name)) std::swap(e.index[0], e.index[1]);
  if (e.index[0] >= info.shape[0] || e.index[1] >= info.shape[1]) return std::nullopt;
  const int64_t flat = e.index[0] * info.shape[1] + e.index[1];
  const Tensor t = it->second.file->tensor(info);
  e.value = t.view({-1}).slice_rows(flat, flat + 1).to_dtype(DType::F32).item();
  return e;
}

std::unique_ptr<models::CausalLM> load_hf_model(const std::string& dir, DType param_dtype,
                                                ops::AttentionBackend attention,
                                                const WeightCheck& check) {
  HfConfig cfg = read_hf_config(dir);
  cfg.spec.param_dtype = param_dtype;
  cfg.spec.attention = attention;
  std::unique_ptr<models::CausalLM> model;
  if (is_keel_checkpoint(dir)) {  // its merged tensors themselves, not copied into a random model
    model = models::make_causal_lm_for_loading(cfg.spec);
    attach_checkpoint_weights(*model, dir, check, /*hold_base=*/false);
  } else {
    model = attach_hf_model(cfg.spec, dir, check);
  }
  for (auto& [name, p] : model->named_parameters())
    if (p.dtype() != param_dtype) Tensor(p).attach_storage(convert_mapped(p, param_dtype));
  return model;
}

std::unique_ptr<models::CausalLM> attach_hf_model(const models::ModelSpec& spec,
                                                  const std::string& dir,
                                                  const WeightCheck& check) {
  auto model = models::make_causal_lm_for_loading(spec);
  attach_hf_weights(*model, dir, check);
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
    if (is_conv1d(spec, name)) t = transpose2d(t);  // back to Conv1D's [in, out]
    stored = t.dtype();
    total += static_cast<int64_t>(t.nbytes());
    tensors.emplace_back(name, t);
  }
  const std::map<std::string, std::string> meta{{"format", "pt"}};
  // Previous weight files: a loader must never see an old layout beside the new one.
  std::set<std::string> old_shards;
  const std::string index_path = dir + "/" + kSafetensorsIndex;
  if (path_exists(index_path)) {
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
    write_safetensors(dir + "/" + kSafetensorsSingle, tensors, meta);
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
    remove_if_exists(dir + "/" + kSafetensorsSingle);
    for (const std::string& f : old_shards)
      if (!written.count(f)) remove_if_exists(dir + "/" + f);
  }
  write_file_atomic(dir + "/config.json",
                    hf_config_json(spec, stored, opt.base_config).dump(2) + "\n");
}
}  // namespace keel::io
