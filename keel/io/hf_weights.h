// The weights of Hugging Face model directories in and out (DESIGN §6).
//
// A model directory holds `config.json` and either `model.safetensors` or a sharded
// `model.safetensors.index.json` ({"weight_map": {tensor: shard file}}) with its shards. HF stores
// GPT-2's Conv1D weights (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) as [in, out]: they are
// transposed into keel's nn.Linear layout [out, in] on load and back on save. GPT-2 tensor names
// may carry the `transformer.` prefix (GPT2LMHeadModel.save_pretrained) or not (the original gpt2
// files). Every problem is an Error naming the file and the tensor: a missing tensor, a shape that
// disagrees with config.json, a non-floating dtype, a truncated file, an unexpected tensor.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "keel/io/weight_check.h"
#include "keel/models/causal_lm.h"

namespace keel::io {

// The weight files of an HF directory: one file, or shards listed by the index.
inline constexpr const char* kSafetensorsSingle = "model.safetensors";
inline constexpr const char* kSafetensorsIndex = "model.safetensors.index.json";

// Copies the weights of DIR into `model` (built from a matching spec), converting to each
// parameter's dtype (exact for bf16/f16 -> f32). Bumps every parameter's version. DIR may be a
// keel checkpoint (io/trained_model.h): its weights are read in keel's layout, adapters merged.
// Non-finite weights are an Error naming the tensor and its index in the file (io/weight_check.h)
// unless `check` allows them. `base_dir` (--base): where a checkpoint DIR's referenced base is
// now, when it moved after training.
void load_hf_weights(models::CausalLM& model, const std::string& dir, const WeightCheck& check = {},
                     const std::string& base_dir = "");

// For a model built under DeferStorage (tensor.h) whose base will be frozen: every base parameter
// takes the tensor of the keel checkpoint DIR's model (its adapters merged) itself, not a copy of
// it in a model initialized only to be overwritten (two f32 models at once: 64 GB for an 8B second
// LoRA stage). `hold_base`: that model's frozen base is held as its run held it (bf16 under
// model.base_dtype = bf16; its merged weights rounded once, as the f32 merge's cast rounds them),
// else in f32. The caller casts the frozen base into its dtype (nn::cast_frozen_parameters).
// `base_dir`: as load_hf_weights'.
void attach_checkpoint_weights(models::CausalLM& model, const std::string& dir,
                               const WeightCheck& check, bool hold_base,
                               const std::string& base_dir = "");

// What attach_hf_weights did.
struct LoadedWeights {
  int64_t tensors = 0;      // base parameters attached
  int64_t mapped = 0;       // of them, views of the files' mappings (no copy)
  size_t mapped_bytes = 0;  // their bytes (the file's pages, resident once touched)
  size_t copied_bytes = 0;  // bytes of the others: converted, transposed or misaligned copies
};

// For a model built under DeferStorage (tensor.h) whose base will be frozen: every base parameter
// takes its tensor from DIR's mapped files itself. A tensor whose stored dtype is exact in the
// parameter's (f32 parameters: any stored dtype; a bf16 parameter: bf16) is used as stored, a view
// of the mapping without a copy where aligned (io/safetensors.h); any other is rounded into the
// parameter's dtype as load_hf_weights would (one tensor at a time, the view's pages dropped
// after). GPT-2's Conv1D weights are transposed into a fresh tensor of their stored dtype.
// Afterwards a parameter's dtype is the one it holds: the caller casts the frozen base into its
// dtype (nn::cast_frozen_parameters), tensor by tensor. DIR must be an HF directory (not a keel
// checkpoint). Errors as load_hf_weights, non-finite values as `check` says (io/weight_check.h).
LoadedWeights attach_hf_weights(models::CausalLM& model, const std::string& dir,
                                const WeightCheck& check = {});

// The loop both loaders run: each base parameter of `model` (registration order) with its tensor
// from DIR's mapped files, checked (dtype, shape against config.json) and in keel's layout (the
// file's dtype; a view of the mapping where aligned). Then the files' tensors that no parameter
// took are checked (unexpected ones are Errors). Each tensor's stored values are checked for
// non-finite ones first, in the file's layout (`check`).
void for_each_weight(models::CausalLM& model, const std::string& dir,
                     const std::function<void(Tensor& param, Tensor value)>& use,
                     const WeightCheck& check = {});

// DIR's model (read_hf_config's spec under `param_dtype` and `attention`) built for loading, its
// parameters attached from the files (attach_hf_weights): in the files' dtypes where exact in
// param_dtype, views of the mapping where aligned. The caller holds each parameter in the dtype it
// computes in (load_hf_model: all in param_dtype; keel generate and eval: a frozen bf16 base as
// the run held it, never whole in f32 first). In eval mode (make_causal_lm_for_loading).
std::unique_ptr<models::CausalLM> attach_hf_model(const models::ModelSpec& spec,
                                                  const std::string& dir,
                                                  const WeightCheck& check = {});

// attach_hf_model, then every parameter in `param_dtype` (one tensor converted at a time); a keel
// checkpoint's model with its adapters merged (attach_checkpoint_weights: its merged tensors, not
// a copy of them in a randomly initialized model). In eval mode.
std::unique_ptr<models::CausalLM> load_hf_model(
    const std::string& dir, DType param_dtype = DType::F32,
    ops::AttentionBackend attention = ops::AttentionBackend::kEager, const WeightCheck& check = {});

// Where element `index` (keel's layout) of base parameter `name` of a `spec` model lies in DIR's
// weight files, and the value stored there: GPT-2's Conv1D weights are [in, out] in the file, and
// a value rounded into a narrower parameter dtype (model.base_dtype = "bf16") is the file's before
// rounding. nullopt when DIR is a keel checkpoint or holds no such tensor. Reads one tensor.
struct FileElement {
  std::string file;  // the weight file holding the tensor
  std::string tensor;
  Shape index;  // in the file's shape
  double value = 0;
};
std::optional<FileElement> file_element(const models::ModelSpec& spec, const std::string& dir,
                                        const std::string& name, const Shape& index);

// config.json's sizes (`spec`, read from DIR/config.json) against the weights' headers, before any
// parameter is allocated: a layer count, width, vocabulary or context that the files do not hold
// is an Error (kUsage) naming the field. No-op when DIR holds no weights.
void check_sizes_against_weights(const std::string& dir, const models::ModelSpec& spec);

// A Gemma3ForConditionalGeneration's files (Gemma-3 4B-27B) hold its language model, keel's
// "model.X", as "language_model.model.X" (Google's files) or "model.language_model.X"
// (transformers >= 4.52), beside its vision tower and projector. The names keel's `name` may have
// there (none unless it starts with "model."), and the name of keel's a file's name is (empty for
// one outside the language model).
std::vector<std::string> multimodal_file_names(const std::string& name);
std::string multimodal_keel_name(const std::string& file_name);
// Whether a tensor (or an adapter's) of such files belongs to the vision tower or the projector,
// which keel leaves aside.
bool multimodal_vision_tensor(const std::string& name);

struct HfSaveOptions {
  // Stored dtype; F32, BF16 or F16. Unset: each parameter's own dtype.
  std::optional<DType> dtype;
  // > 0: shards of at most this many bytes (a tensor larger than that gets a shard of its own),
  // named model-0000k-of-0000n.safetensors, with model.safetensors.index.json.
  int64_t max_shard_bytes = 0;
  // Fields of an original config.json to keep (token ids, ...); keel's own fields overwrite them.
  nlohmann::json base_config = nlohmann::json::object();
};

// Writes config.json and the weights in HF's layout (adapter parameters excluded: merge first to
// save an adapted model as a plain one). Files are written atomically one by one; a previous
// layout's weight files in `dir` (single or sharded) are removed so that loaders never see both.
void save_hf_model(models::CausalLM& model, const std::string& dir, const HfSaveOptions& opt = {});

}  // namespace keel::io
