// PEFT adapter directories in and out: adapter_config.json + adapter_model.safetensors, for
// PEFT's LoRA (use_dora for DoRA) and LoKr tuners.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "keel/io/weight_check.h"
#include "keel/models/causal_lm.h"
#include "keel/nn/adapters/adapter.h"

namespace keel::io {

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
// file and the tensor (missing, wrong shape, unexpected, holding nan/inf: `check`).
nn::AdapterOptions load_peft_adapter(models::CausalLM& model, const std::string& dir,
                                     const WeightCheck& check = {});

}  // namespace keel::io
