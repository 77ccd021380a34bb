// What a run's checkpoints (and NaN captures) hold of its model (issue 25): every parameter, or —
// for an adapter run whose frozen base came from an HF directory (model.path) — the trained
// tensors only plus a reference to that directory (io/base_reference.h). Whoever reads them back
// builds the run first (build_run rebuilds the base from model.path) and checks the reference.
#pragma once
#include <nlohmann/json.hpp>

#include "keel/io/checkpoint.h"
#include "keel/models/causal_lm.h"
#include "keel/train/config.h"

namespace keel {

// Whether the run's checkpoints reference the frozen base instead of holding it: an adapter run
// over an HF directory (a base from a keel checkpoint, or drawn from run.seed, is saved whole).
bool base_by_reference(const Config& c);

// The parameters to save: all of them, or under a base reference the trained ones and any frozen
// one the base's files do not hold as it is (embeddings grown by data.pad = "add").
io::NamedTensors saved_parameters(models::CausalLM& model, const Config& c);

// The reference to store (io::base_reference), or null when the base is saved whole. build_run
// takes it once, right after loading the base (Run::base_ref).
nlohmann::json saved_base_reference(models::CausalLM& model, const Config& c);

// Checks a saved reference (`ref`, from the checkpoint or capture at `dir`) against the run's
// model.path; no-op when `ref` is null. The fix names model.path (and `resume_force` when set).
// `what` names `dir`: "checkpoint" or "capture".
void check_saved_base(const nlohmann::json& ref, const std::string& dir, const Config& c,
                      const std::string& fix, const std::string& what = "checkpoint");

// Whether a parameter absent from a checkpoint holding `ref` comes from the rebuilt base.
bool from_referenced_base(const nlohmann::json& ref, models::CausalLM& model, const Tensor& p);

}  // namespace keel
