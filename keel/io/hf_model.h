// Hugging Face model directories in and out (DESIGN §6), and PEFT adapter directories out.
//
// A model directory holds `config.json` and either `model.safetensors` or a sharded
// `model.safetensors.index.json` ({"weight_map": {tensor: shard file}}) with its shards. Two
// architectures are read:
//   GPT2LMHeadModel  (model_type "gpt2"): n_layer, n_embd, n_head, n_inner, vocab_size,
//     n_positions, layer_norm_epsilon; lm_head tied to wte. HF stores GPT-2's Conv1D weights
//     (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) as [in, out]: they are transposed into
//     keel's nn.Linear layout [out, in] on load and back on save. Tensor names may carry the
//     `transformer.` prefix (GPT2LMHeadModel.save_pretrained) or not (the original gpt2 files).
//   LlamaForCausalLM (model_type "llama"): num_hidden_layers, hidden_size, num_attention_heads,
//     num_key_value_heads, intermediate_size, vocab_size, max_position_embeddings, rope_theta,
//     rms_norm_eps, tie_word_embeddings (tied: no lm_head.weight).
// Every problem is an Error naming the file and the tensor or field: a missing tensor, a shape that
// disagrees with config.json, a non-floating dtype, a truncated file, an unexpected tensor, an
// unsupported architecture variant (e.g. Llama rope_scaling, attention biases).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "keel/io/weight_check.h"
#include "keel/models/causal_lm.h"
#include "keel/nn/adapters/adapter.h"

namespace keel::io {

struct HfConfig {
  models::ModelSpec spec;    // family, sizes, eps, rope_theta, tie_embeddings, init_std
  DType dtype = DType::F32;  // torch_dtype (F32 when absent)
  nlohmann::json json;       // the file as read
};

// Reads DIR/config.json. The spec's runtime fields (attention, dropout, param_dtype) keep their
// defaults; the caller sets them.
HfConfig read_hf_config(const std::string& dir);

// Copies the weights of DIR into `model` (built from a matching spec), converting to each
// parameter's dtype (exact for bf16/f16 -> f32). Bumps every parameter's version. DIR may be a
// keel checkpoint (io/trained_model.h): its weights are read in keel's layout, adapters merged.
// Non-finite weights are an Error naming the tensor and its index in the file (io/weight_check.h)
// unless `check` allows them.
void load_hf_weights(models::CausalLM& model, const std::string& dir,
                     const WeightCheck& check = {});

// read_hf_config + make_causal_lm (parameters in `param_dtype`) + load_hf_weights.
std::unique_ptr<models::CausalLM> load_hf_model(
    const std::string& dir, DType param_dtype = DType::F32,
    ops::AttentionBackend attention = ops::AttentionBackend::kEager, const WeightCheck& check = {});

struct HfSaveOptions {
  // Stored dtype; F32, BF16 or F16. Unset: each parameter's own dtype.
  std::optional<DType> dtype;
  // > 0: shards of at most this many bytes (a tensor larger than that gets a shard of its own),
  // named model-0000k-of-0000n.safetensors, with model.safetensors.index.json.
  int64_t max_shard_bytes = 0;
  // Fields of an original config.json to keep (token ids, ...); keel's own fields overwrite them.
  nlohmann::json base_config = nlohmann::json::object();
};

// The config.json of `spec` with weights stored in `stored` (torch_dtype); `base`'s fields that
// keel does not set (token ids, ...) are kept.
nlohmann::json hf_config_json(const models::ModelSpec& spec, DType stored,
                              const nlohmann::json& base = nlohmann::json::object());

// Writes config.json and the weights in HF's layout (adapter parameters excluded: merge first to
// save an adapted model as a plain one). Files are written atomically one by one; a previous
// layout's weight files in `dir` (single or sharded) are removed so that loaders never see both.
void save_hf_model(models::CausalLM& model, const std::string& dir, const HfSaveOptions& opt = {});

// The PEFT adapter directory of an adapted model: adapter_config.json (peft_type LORA or LOKR,
// task_type CAUSAL_LM, r, lora_alpha/alpha, dropout, target_modules, use_dora,
// base_model_name_or_path, fan_in_fan_out = true for GPT-2's Conv1D layout) and
// adapter_model.safetensors with PEFT's tensor names (nn::peft_state_dict), f32. The directory is
// replaced atomically (io::write_dir_atomic).
void save_peft_adapter(models::CausalLM& model, const nn::AdapterOptions& opt,
                       const std::string& dir, const std::string& base_model_name_or_path = "");

// The adapter_config.json save_peft_adapter writes.
nlohmann::json peft_config_json(const models::CausalLM& model, const nn::AdapterOptions& opt,
                                const std::string& base_model_name_or_path = "");

// The adapter options of DIR/adapter_config.json (PEFT's LORA, DoRA or LOKR); Errors name the
// file and the field.
nn::AdapterOptions read_peft_config(const std::string& dir);

// Reads a PEFT adapter directory written by save_peft_adapter (or by PEFT for these tuners):
// applies the adapters its config describes to `model`, then loads their tensors. Errors name the
// file and the tensor (missing, wrong shape, unexpected).
nn::AdapterOptions load_peft_adapter(models::CausalLM& model, const std::string& dir);

}  // namespace keel::io
