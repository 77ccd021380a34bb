// PEFT adapter directories in and out: adapter_config.json + adapter_model.safetensors, for
// PEFT's LoRA (use_dora for DoRA) and LoKr tuners.
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "keel/io/weight_check.h"
#include "keel/models/causal_lm.h"
#include "keel/nn/adapters/adapter.h"

namespace keel::io {

// How the keel run that trained an adapter used it: its train.precision, the dtype it held its
// frozen base in under f32 parameters (model.base_dtype; f32 under bf16-true/16-true, whose
// parameters are all in one dtype) and its data.tokenizer (paths absolute). Recorded in
// adapter_model.safetensors' __metadata__ ("keel.precision", "keel.base_dtype", "keel.tokenizer";
// PEFT reads only "format") so that the directory, copied out of its run or exported with
// --adapter-only, is used as the run used it: eval gives the run's eval_loss, not another
// precision's. Empty fields: not recorded (PEFT's own directories).
struct AdapterRunRecord {
  std::string precision;
  std::optional<DType> base_dtype;
  std::string tokenizer;
};

// The PEFT adapter directory of an adapted model: adapter_config.json (peft_type LORA or LOKR,
// task_type CAUSAL_LM, r, lora_alpha/alpha, dropout, target_modules, use_dora,
// base_model_name_or_path, fan_in_fan_out = true for GPT-2's Conv1D layout) and
// adapter_model.safetensors with PEFT's tensor names (nn::peft_state_dict), f32, and `record` in
// its metadata. The directory is replaced atomically (io::write_dir_atomic).
void save_peft_adapter(models::CausalLM& model, const nn::AdapterOptions& opt,
                       const std::string& dir, const std::string& base_model_name_or_path = "",
                       const AdapterRunRecord& record = {});

// What DIR/adapter_model.safetensors records (its header alone is read); empty when the file is
// missing, unreadable (loading names it) or records nothing. A recorded value that is not a
// precision or a floating dtype is an Error (kUsage) naming the file and the key.
AdapterRunRecord read_adapter_run_record(const std::string& dir);

// The adapter_config.json save_peft_adapter writes.
nlohmann::json peft_config_json(const models::CausalLM& model, const nn::AdapterOptions& opt,
                                const std::string& base_model_name_or_path = "");

// The adapter options of DIR/adapter_config.json (PEFT's LORA, DoRA or LOKR); Errors name the
// file and the field.
nn::AdapterOptions read_peft_config(const std::string& dir);

// Reads a PEFT adapter directory written by save_peft_adapter (or by PEFT for these tuners):
// applies the adapters its config describes to `model`, then loads their tensors. Errors name the
// file and the tensor (missing, wrong shape, unexpected, holding nan/inf: `check`).
nn::AdapterOptions load_peft_adapter(models::CausalLM& model, const std::string& dir,
                                     const WeightCheck& check = {});

}  // namespace keel::io
