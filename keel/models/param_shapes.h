// The parameters of a model from its ModelSpec alone, without allocating: name (HF's), shape and
// whether autocast casts it, in named_parameters() order. The layouts are those gpt2.cpp and
// llama.cpp build (tests/models checks every name and shape against the built models); the memory
// estimate counts with them, so a model of billions of parameters is sized without building it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "keel/models/causal_lm.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/tensor/tensor.h"

namespace keel::models {

struct ParamShape {
  std::string name;  // e.g. "transformer.h.0.attn.c_attn.weight"
  Shape shape;       // nn.Linear weights [out, in], embeddings [rows, n_embd], norms [n_embd]
  // A matmul operand: a Linear's weight or bias, or the embedding that a tied lm_head multiplies
  // by. Autocast casts these to the compute dtype (and caches the copy for the step); norms,
  // position tables and an untied input embedding are read as stored.
  bool matmul = false;
  bool linear = false;  // an nn::Linear's weight (what model.adapter.target_modules can name)

  int64_t numel() const;
};

// spec.validate() is not called: the sizes are taken as given (GPT-2 always ties its lm_head).
std::vector<ParamShape> parameter_shapes(const ModelSpec& spec);
int64_t parameter_count(const ModelSpec& spec);

// The parameters apply_adapters would add to a model of `spec` for `opt` (kind, r, target
// modules): every Linear a target names gets the adapter's own parameter shapes
// (nn::adapter_parameter_shapes), named "<module path>.<local name>". Empty for kind "none". A
// target that names no Linear is an error (kUsage) listing the model's Linear names, as
// apply_adapters says it; `targets` is what the user set the targets with, named as the fix
// (`keel memory`'s --targets, not a config key the user never wrote).
std::vector<ParamShape> adapter_parameter_shapes(
    const ModelSpec& spec, const nn::AdapterOptions& opt,
    const std::string& targets = "model.adapter.target_modules");

}  // namespace keel::models
