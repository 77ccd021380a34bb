// The run factory (DESIGN §9): everything a Config builds — device, precision policy, tokenizer
// and data, model (with padding row and adapters), optimizer, LR schedule and scaler. `keel
// train` (through Trainer), `replay`, `doctor` and the benches build their runs here and nowhere
// else, so a run means the same thing to all of them.
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/amp/grad_scaler.h"
#include "keel/amp/precision.h"
#include "keel/data/data.h"
#include "keel/models/causal_lm.h"
#include "keel/numerics/file_fingerprint.h"
#include "keel/optim/optimizer.h"
#include "keel/optim/schedule.h"
#include "keel/train/config.h"

namespace keel {

using Say = std::function<void(const std::string&)>;  // one-line notices

// The data of a run: the tokenizer, the training split and, for the built-in task, the
// held-out problems that evaluation decodes greedily.
struct RunData {
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::unique_ptr<data::Dataset> train, eval;  // eval: null when the task has no split
  std::vector<std::string> eval_prompts, eval_answers;
  int32_t stop_token = '\n';
  int64_t max_answer_tokens = 0;
  int64_t pad_id = 0;  // the id that fills padded positions (pad_fill_id)
  // The files read, by the key that named them ("data.path", "data.eval_path"), as they were
  // when loaded (a pipe: none): what a resume checks its checkpoint was trained on.
  std::vector<std::pair<std::string, FileFingerprint>> files;
};

struct RunOptions {
  int world_size = 1;  // data-parallel ranks: a step's global window is grad_accum * world_size
  // Replay: the step's micro-batches come from the capture, so a training file that cannot be
  // read (another machine, a moved file) is named in Run::not_rebuilt instead of failing the run.
  bool data_optional = false;
  Say say;  // notices while building (default: stderr)
};

struct Run {
  Config cfg;  // the effective config
  Device device;
  PrecisionPolicy policy;
  std::string out_dir;
  RunData data;
  std::unique_ptr<data::DataLoader> loader;  // null when the data was not rebuilt
  std::unique_ptr<models::CausalLM> model;
  std::vector<std::pair<std::string, Tensor>> trainable;  // what the optimizer updates, by name
  std::unique_ptr<optim::Optimizer> optimizer;
  optim::LrSchedule schedule;
  std::unique_ptr<GradScaler> scaler;  // 16-mixed with scaler.enabled only
  int64_t steps_per_epoch = 0, total_steps = 0;
  // What could not be rebuilt, each with why (RunOptions::data_optional); empty for a full run.
  std::vector<std::string> not_rebuilt;
  // The reference to the frozen base that checkpoints and NaN captures store instead of its
  // weights (train/checkpoint_contents.h), fingerprinted when the base was loaded: a base file
  // replaced later in the run must not pass for the one the adapters were trained on. Null when
  // they hold the whole model.
  nlohmann::json base_ref;
};

Run build_run(const Config& cfg, const RunOptions& options = {});

// The weights a 16-bit compute format cannot hold: under 16-mixed and 16-true, each matmul weight
// (every Linear, and a head tied to the embedding) whose values reach f16's overflow (|w| >= 65520
// rounds to inf; a 16-true parameter already holds that inf), one line each naming the tensor,
// the value, its index and the fix. A weight of 1e5 in model.path made the first step non-finite
// with nothing named. Empty for other policies. build_run says them as warnings; keel doctor
// lists them. `weights_dir` (model.path): for a model loaded from an HF directory, the first
// value's index and value are the file's (GPT-2's Conv1D weights are [in, out] there, and a bf16
// base holds the value rounded), naming the file.
std::vector<std::string> weights_beyond_compute_format(models::CausalLM& model,
                                                       const PrecisionPolicy& policy,
                                                       const std::string& weights_dir = "");

// The pieces build_run is made of, for the tools that need one of them alone.

// run.device, falling back to the CPU (with one notice) when no usable GPU is found.
Device run_device(const Config& cfg, const Say& say);
// The tokenizer, datasets and evaluation problems of cfg.data.
RunData build_data(const Config& cfg);
// The id that fills padded positions: the tokenizer's own pad when it names no real token; else,
// as data.pad says, a new id one past the vocabulary ("add") or its eos. Packed rows never add
// one (their padding is masked, read by no rule): see rows_are_packed.
int64_t pad_fill_id(const data::Tokenizer& tok, const std::string& mode, bool packed = false);
// Whether cfg's rows are cut from one stream (data.task = "tokens", or "text" with data.pack):
// full rows, the last one's tail their only padding.
bool rows_are_packed(const DataConfig& data);
// The model spec of a config without model.path (sizes from [model], the vocabulary from the
// tokenizer unless model.vocab_size is set). Errors name the key that cannot hold.
models::ModelSpec model_spec(const Config& cfg, int64_t tokenizer_vocab, DType param_dtype);
// The model of a run: from model.path or the sizes, parameters in `param_dtype`, embeddings grown
// to hold a dedicated pad id, then the adapters with the frozen base in model.base_dtype.
std::unique_ptr<models::CausalLM> build_model(const Config& cfg, const data::Tokenizer& tok,
                                              int64_t pad_id, DType param_dtype, const Say& say);
std::unique_ptr<optim::Optimizer> build_optimizer(
    const Config& cfg, const std::vector<std::pair<std::string, Tensor>>& trainable);
// The scaler of a policy that has one (16-mixed with scaler.enabled), else null.
std::unique_ptr<GradScaler> build_scaler(const Config& cfg, const PrecisionPolicy& policy);

}  // namespace keel
