// What `keel generate`, `eval` and `export` (and `model.path`) load: a Hugging Face model
// directory, or a run's checkpoint directory (out_dir/checkpoints/last, or the out_dir itself),
// optionally with a PEFT adapter directory on top.
//
// A checkpoint directory is a model directory too: beside model.safetensors (every parameter
// under keel's names and layouts, adapters included), optimizer.safetensors and trainer.json, the
// trainer writes config.json (HF's fields for the model, plus a "keel_checkpoint" object: layout
// "keel", the run's tokenizer spec, whether adapters are included) and, for an adapter run, the
// PEFT adapter_config.json. `model.path` pointed at one loads the adapted model merged.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "keel/io/weight_check.h"
#include "keel/models/causal_lm.h"
#include "keel/nn/adapters/adapter.h"

namespace keel::io {

// Writes config.json (and adapter_config.json when `adapter` is set) describing `model` into a
// checkpoint directory. `tokenizer` is the run's data.tokenizer (paths made absolute). `base`
// (io/base_reference.h; null = none) is stored as keel_checkpoint.base when model.safetensors
// holds only the trained tensors.
void write_checkpoint_model_files(const models::CausalLM& model,
                                  const std::optional<nn::AdapterOptions>& adapter,
                                  const std::string& tokenizer, const std::string& base_model,
                                  const std::string& dir, const nlohmann::json& base = nullptr);

// The dtype a checkpoint's frozen base is held in by the run (model.base_dtype, or the
// parameters' dtype).
DType stored_base_dtype(const models::CausalLM& model);

// Whether DIR is a checkpoint directory with the files above (config.json's keel_checkpoint).
bool is_keel_checkpoint(const std::string& dir);

// A data.tokenizer spec with its path made absolute ("byte" and "" as they are), as checkpoints
// and adapter directories record it, so that it is found from another directory.
std::string absolute_tokenizer_spec(const std::string& spec);

struct TrainedModel {
  std::unique_ptr<models::CausalLM> model;
  std::string dir;          // the directory the weights came from
  bool checkpoint = false;  // a keel checkpoint (else an HF directory)
  // A tokenizer spec for load_tokenizer: the run's data.tokenizer, or the HF directory itself
  // when it holds tokenizer files; "" when unknown.
  std::string tokenizer;
  std::optional<nn::AdapterOptions> adapter;  // the adapters the model carries (unmerged)
  std::string base_model;                     // the run's model.path ("" when trained from sizes)
  // The dtype the run held its frozen base in when it was not its parameters' (model.base_dtype
  // = bf16 under f32 parameters). Loaded with `hold_base`, the frozen base is held in it (to run
  // the run's products; a bf16 file stays a view of its mapping); else in f32 holding its values
  // (a merge into f32: export --dtype f32, model.path).
  std::optional<DType> base_dtype;
  // The OUT_DIR of the keel run whose PEFT directory (OUT_DIR/adapter) `adapter_dir` is, "" when
  // it is not one: its config.toml holds the data options the adapter trained with (eval's
  // defaults), and `tokenizer` and `base_dtype` above are that run's.
  std::string adapter_run;
  bool tokenizer_of_adapter_run = false;  // `tokenizer` is adapter_run's data.tokenizer
  // The adapter file whose keel.tokenizer record `tokenizer` is (io/peft_dir.h), when the adapter
  // was copied out of its run and the base has no tokenizer files of its own; else "".
  std::string tokenizer_recorded_in;
  // The checkpoint's own adapters were merged into its base because the --adapter directory was
  // trained on it (model.path = the checkpoint): that directory's base is `dir`, not base_model.
  bool merged_base = false;
};

// Loads `path` (an HF directory, a checkpoint directory or a run's out_dir), then the PEFT
// adapter directory `adapter_dir` when not empty. Parameters in `param_dtype` (adapters f32).
// Errors (kUsage) name the path and what it lacks, or a tensor with non-finite values (unless
// `check` allows them). `base_dir` (`--base DIR`) is where the frozen base of an adapter run's
// checkpoint is now, when it moved after training (checked against the checkpoint's reference).
// The checkpoint of an adapter run under a PEFT adapter trained with model.path = that checkpoint
// is read once (hf_weights.h's merge), not loaded with its adapters first. Base weights are
// attached from the files (hf_weights.h), never built whole in f32 first. `hold_base`: see
// TrainedModel::base_dtype.
TrainedModel load_trained_model(const std::string& path, const std::string& adapter_dir = "",
                                DType param_dtype = DType::F32,
                                ops::AttentionBackend attention = ops::AttentionBackend::kEager,
                                const WeightCheck& check = {}, const std::string& base_dir = "",
                                bool hold_base = false);

// The train.precision of the keel run `path` (its out_dir or a checkpoint) or, for an HF directory,
// of the run whose OUT_DIR/adapter `adapter_dir` is (or that recorded it in the adapter's files,
// peft_dir.h: then `recorded_in`, when given, is set to that file); "" when neither is a keel
// run's.
std::string run_precision(const std::string& path, const std::string& adapter_dir = "",
                          std::string* recorded_in = nullptr);

// load_trained_model in two halves, for a caller that checks memory between them: the model with
// its weights attached from the files (views of the mappings in the files' dtypes where exact;
// adapters and a checkpoint's own tensors loaded), then each parameter held in the dtype it is
// used in, one tensor converted at a time. bytes_to_hold is what hold_parameters allocates.
TrainedModel attach_trained_model(const std::string& path, const std::string& adapter_dir,
                                  DType param_dtype, ops::AttentionBackend attention,
                                  const WeightCheck& check, const std::string& base_dir);
size_t bytes_to_hold(TrainedModel& t, DType param_dtype, bool hold_base);
void hold_parameters(TrainedModel& t, DType param_dtype, bool hold_base);

}  // namespace keel::io
