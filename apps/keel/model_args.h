// The options `keel generate` and `keel eval` share — which model (MODEL, --adapter, --tokenizer)
// and how to run it (--precision, --attention, --device) — and loading it for use.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>

#include "keel/amp/precision.h"
#include "keel/data/tokenizer_base.h"
#include "keel/io/trained_model.h"

namespace keel::cli {

struct ModelArgs {
  // precision "": the run's train.precision when MODEL (or --adapter) is a keel run's;
  // bf16-true when MODEL is an HF directory stored in bf16 (its files used as they are); else
  // 32-true.
  std::string model, adapter, base, tokenizer, precision, attention = "eager", device = "cpu";
  bool allow_nonfinite_weights = false;  // load weights holding nan/inf (io/weight_check.h)
};

void add_model_options(CLI::App* sub, ModelArgs& a);

struct ModelForUse {
  io::TrainedModel trained;  // on `device`
  PrecisionPolicy policy;
  Device device;
  std::string tokenizer_spec;  // --tokenizer, else the run's or the directory's own
  // io::run_precision of MODEL and --adapter ("" for no keel run), and the adapter file that
  // recorded it when its run is not at hand.
  std::string run_precision, run_precision_recorded_in;
  std::unique_ptr<data::Tokenizer> tokenizer;
};

// Usage errors name the flag: no usable GPU for --device cuda, no tokenizer known, a tokenizer
// with more ids than the model's vocabulary.
ModelForUse load_model_for_use(const ModelArgs& a);

// What to try when the model's outputs are not finite (a NaN loss, NaN logits), for the error that
// says so: a wider --precision where low precision is a suspect; under 32-true, the weights
// themselves (loaded despite NaN/inf with --allow-nonfinite-weights, or too large for f32).
std::string nonfinite_advice(const ModelArgs& a, const PrecisionPolicy& policy);

// Loads a model in two halves (io::attach_trained_model, then io::hold_parameters): `attach`
// returns the bytes holding its weights will allocate (io::bytes_to_hold), refused (kUsage) with
// `fix()` before `hold` runs when they exceed MemAvailable (past it the OOM killer ended the
// process with no word, minutes into loading). An allocation that fails anyway is an error naming
// `what` and `fix()`.
void hold_weights_checked(const std::string& what, const std::function<size_t()>& attach,
                          const std::function<std::string()>& fix,
                          const std::function<void()>& hold);

// --allow-nonfinite-weights as the loaders' check (warnings to stderr).
io::WeightCheck weight_check_of_flag(bool allow);

}  // namespace keel::cli
