// Memory estimate behind `keel memory` and `keel doctor` (DESIGN §4, numerics explainer): weights,
// gradients, optimizer state, the low-precision weight copies autocast caches for a step, and the
// activations keel's autograd actually keeps.
//
// The activation model is not a rule of thumb: it counts the tensors that the ops' backward nodes
// save (keel/ops/*.cpp: LinearNode keeps its input and weight, LayerNormNode its input and two f32
// row statistics, AttentionNode q, k, v and, for eager/math, the f32 probabilities [B, H, T, T],
// GeluNode its input, SwigluNode both inputs, CrossEntropyNode the f32 logits it was given), in
// the dtypes the precision policy gives them (autocast casts of non-leaf activations are fresh
// copies per consumer: Llama's q/k/v projections each keep their own cast of the normed input).
// The engine keeps every saved tensor until backward returns, so the peak is: static state +
// every saved activation of one micro-batch + the largest backward transient (the f32 logit
// gradient at the lm_head's input, or an attention backward's score gradient, or with
// checkpointing one recomputed segment, counted beside the logits: see the .cpp) = `live_peak`,
// every tensor counted in the block host_memory hands out for it (keel/tensor/host_memory.h: 2 MiB
// multiples from 8 MiB up). On top: the block cache's slack (released blocks kept mapped for
// reuse, at most 1/16 of the peak; none over a frozen base used from its mapped files), for f16
// compute without an oneDNN kernel the f32 operand copies of the largest matmul, and the process
// itself (`runtime`). Adapters add what their forward keeps (nn/adapters/*.cpp), activation
// checkpointing keeps segment inputs and one recomputed segment, and loading (from sizes or
// model.path's files) has its own peak. `total` is the expected peak RSS of the process, measured
// within 10% of real `keel train` runs of each kind (tests/cli/test_cli_memory_rss.cpp prints the
// table).
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/models/causal_lm.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/train/config.h"

namespace keel::monitor {

struct MemoryQuery {
  int64_t params = 0;  // total parameters; 0 = computed from the model sizes below
  // Without model sizes (a bare --params count): the parameters that train (have grads and
  // optimizer state); 0 = all, trainable_f32 = they are f32 whatever the policy (adapters). With
  // sizes and an adapter, the trainable count comes from the adapters' own shapes instead.
  int64_t trainable = 0;
  bool trainable_f32 = false;
  // The frozen base's storage under an adapter (model.base_dtype): "" or "f32" = the policy's
  // parameter dtype, "bf16" = 2 bytes a weight (and no autocast copy where bf16 is the compute
  // dtype).
  std::string base_dtype;
  std::string precision = "32-true";
  std::string optimizer = "adamw";  // adamw | sgd
  double momentum = 0.9;            // sgd: 0 keeps no state
  // Model and batch sizes for the activation estimate (all of batch, seq, layers, hidden > 0, or
  // no activations are estimated).
  std::string family = "gpt2";  // gpt2 | llama
  int64_t batch = 0, seq = 0, layers = 0, hidden = 0;
  // The longest example the data holds, in tokens (arith's from its digits, a text or JSONL file's
  // when it was counted whole): a batch's rows are padded to its longest (data::padded_length),
  // so the activations are of rows that long. 0 = not known: rows of `seq` tokens.
  int64_t longest_row = 0;
  int64_t heads = 0;     // 0 = hidden / 64 (at least 1)
  int64_t kv_heads = 0;  // llama GQA; 0 = heads
  int64_t head_dim = 0;  // llama: a head's channels; 0 = hidden / heads
  // A llama-family architecture's own tensors and activations: "qwen2", "qwen3", "phi3",
  // "gemma", "gemma2".
  std::string hf_model_type;
  int64_t ffn = 0;          // 0 = the family's rule (gpt2 4*hidden, Llama 8/3*hidden rounded)
  models::MoeSpec moe;      // a mixture of experts' (llama family: Qwen3-MoE, OLMoE, Mixtral)
  int64_t vocab = 0;        // 0 = the byte tokenizer's 259
  int64_t max_seq_len = 0;  // gpt2 position table; 0 = seq
  bool tie_embeddings = true;
  // A GPT-NeoX's use_parallel_residual and attention_bias (ModelSpec's).
  bool parallel_residual = true, attention_bias = true;
  std::string attention = "eager";  // eager | math | flash
  double attention_dropout = 0;     // model.attention_dropout (a dropped copy of P, eager/math)
  // model.adapter: kind (none | lora | dora | lokr), r, dropout and target_modules. With the
  // model's sizes the adapters' parameters are counted from their own shapes
  // (models::adapter_parameter_shapes) and their saved activations are modelled per kind.
  nn::AdapterOptions adapter;
  std::string targets_key = "model.adapter.target_modules";  // what sets them, in messages
  // Whether messages name `keel memory`'s flags beside the config keys; keel train and doctor
  // read only a config, and a --adapter-dropout the user never passed was named to them.
  bool flags = true;
  // train.activation_checkpointing: 0 = none; N = a checkpoint every N blocks ("blocks" = 1). What
  // is kept is each checkpointed segment's input; during backward one segment's activations are
  // recomputed and held on top.
  int64_t checkpoint_every = 0;
  // train.grad_accum: micro-batches per step (see MemoryEstimate::grads).
  int64_t grad_accum = 1;
  // model.path's weight files (memory_query_from_config reads them): the stored dtype's bytes (0 =
  // no files: the model is initialized from its sizes). See init_peak.
  int64_t file_dtype_bytes = 0;
  bool checkpoint_dir =
      false;  // model.path is a keel checkpoint (loaded through a model of its own)
  // Such a checkpoint's frozen base as its run held it (its config.json's torch_dtype): a new
  // adapter over it takes that model's tensors (io::attach_checkpoint_weights).
  int64_t checkpoint_base_bytes = 0;
  std::string source;  // where the sizes came from ("DIR/config.json"), shown by format_memory
  // A text or JSONL run's data (data.path and data.eval_path, data::dataset_footprint): what the
  // datasets hold for the run, and the most at once while they load (before the model, beside
  // the file's text). 0 = not estimated (arith, a pipe, no files yet).
  int64_t dataset_bytes = 0, dataset_load_bytes = 0;
  std::string dataset_detail;  // "data.jsonl: 12.3M tokens in 41k examples"
  std::string dataset_advice;  // how the data would hold less ("" when nothing keel offers would)
};

struct MemoryItem {
  std::string name;
  int64_t bytes = 0;
  std::string detail;  // shapes and dtypes behind the number
};

struct MemoryEstimate {
  std::string precision;  // canonical policy name
  int64_t params = 0;
  int64_t weights = 0;  // parameters as stored (f32 masters under -mixed; a bf16 frozen base)
  int64_t grads = 0;    // .grad buffers, in the parameters' dtype (one set, whatever grad_accum)
  int64_t optimizer_state = 0;  // AdamW exp_avg + exp_avg_sq, SGD momentum
  int64_t lowp_copies = 0;      // autocast's per-step casts of the weights (-mixed only)
  int64_t matmul_scratch = 0;   // f32 operand copies where oneDNN has no kernel here, else 0
  // A mixture of experts: oneDNN's kernels for the experts' padded batch shapes (the .cpp).
  int64_t expert_kernels = 0;
  std::string expert_kernels_detail;
  int64_t activations = 0;  // saved for backward (one micro-batch)
  int64_t transient = 0;    // the largest short-lived buffer set on top of them
  int64_t live_peak = 0;    // weights .. transient (not matmul_scratch): tensor blocks at the peak
  int64_t cache_slack = 0;  // released blocks host_memory keeps mapped (see the .cpp)
  // Loading the model: the weights as built (a frozen base attached from the mapped files, or drawn
  // in its dtype) plus one tensor as stored or drawn; a keel checkpoint adds an f32 model of its
  // own (the .cpp). 0 when nothing is loaded or converted.
  int64_t init_peak = 0;
  int64_t trainable = 0;       // parameters with grads and optimizer state
  int64_t adapter_params = 0;  // of which adapter parameters (0 without an adapter)
  int64_t runtime = 0;         // the process without the model: binary, libraries, thread pools
  int64_t dataset = 0, dataset_load = 0;  // the query's: held for the run; while loading
  std::string dataset_detail, dataset_advice;
  // runtime + max(dataset + max(live_peak, init_peak), dataset_load) + matmul_scratch +
  // expert_kernels + cache_slack: the expected peak RSS
  int64_t total = 0;
  std::string source;          // the query's source
  std::string checkpoint;      // "" or how activation checkpointing changes the activations
  std::string weights_detail;  // what `weights` holds ("f32 masters", "frozen base in bf16", ...)
  bool has_activations = false;
  // The micro-batch the activations are of: "32 x 10 tokens", and why T is below data.seq_len
  // when it is (data.padding = longest and the data's longest row).
  std::string batch_detail;
  std::string transient_detail;
  std::vector<MemoryItem> activation_items;  // what `activations` is made of
};

// Errors (kUsage) name the bad field and its fix (unknown precision/optimizer/family/attention,
// no parameter count and no sizes, hidden not divisible by heads).
MemoryEstimate estimate_memory(const MemoryQuery& q);

// The query for a run's config: model sizes from model.path's config.json when it is set (its
// weight files' dtype and sizes too), else the model.* keys (vocab from the byte tokenizer unless
// model.vocab_size is set); batch_size, seq_len, precision, optimizer, attention, base_dtype,
// the adapter and activation checkpointing; a text or JSONL run's data files (their first MiB
// tokenized with data.tokenizer; a file or tokenizer that cannot be read is left to the run). `keel
// train`'s check, `keel doctor` and `keel memory
// --config` all use it.
MemoryQuery memory_query_from_config(const Config& cfg);

// train.activation_checkpointing's value: "none" = 0, "blocks" = 1, "N" = every N blocks (N >= 1).
// A bad value is an error (kUsage) naming `where` and the accepted forms.
int64_t parse_checkpointing(const std::string& value, const std::string& where);

// The model sizes of `spec` (an HF config.json's, or a built model's) into `q`.
void set_sizes(MemoryQuery& q, const models::ModelSpec& spec);

// A run that does not fit: the message `keel train` stops with before loading anything, naming
// the estimate, the available bytes, and each option that would lower the estimate with what it
// would bring it down to ("train.activation_checkpointing = blocks: 12.3 GB"), those that fit
// first. "" when the estimate fits in `available`.
std::string memory_fit_advice(const MemoryQuery& q, int64_t available);

// Sizes no option of memory_fit_advice would bring within reach (a lower bound of 2 bytes a
// parameter and 16-bit logits beyond 100 times `available`), or whose products would overflow the
// full estimate's int64 arithmetic: the refusal `keel train` and `keel doctor` give before anything
// is built, naming the keys to lower. "" when the sizes are within reach or `available` < 0.
std::string memory_floor_refusal(const MemoryQuery& q, int64_t available);

// `keel train`'s check before anything large is allocated: throws (kUsage) memory_floor_refusal,
// then memory_fit_advice, against MemAvailable. A combination the estimate does not model is
// said through `say` ("note: no memory estimate before loading: ...") and left to the run's own
// checks.
void check_run_memory(const Config& cfg, const std::function<void(const std::string&)>& say);

// Parameter count of a model given by sizes: models::parameter_count (models/param_shapes.h, the
// models' own layout: GPT-2 with tied embeddings and a position table, Llama with grouped-query
// k/v projections and an optional untied lm_head), nothing allocated.
int64_t count_parameters(const MemoryQuery& q);

// Human-readable table (decimal MB, as the issue states the reference numbers) and JSON (bytes).
std::string format_memory(const MemoryEstimate& e);
nlohmann::json memory_to_json(const MemoryEstimate& e);

// "12.3 MB" below 10 GB, "37.83 GB" above (decimal units).
std::string format_bytes(int64_t bytes);

// The ranks of an MPI job on this machine (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS); 1 outside
// mpirun.
int ranks_on_this_machine();
// MemAvailable from /proc/meminfo in bytes, shared out among ranks_on_this_machine(), or -1 when
// unreadable; available_memory_source() says which of the two it is, for messages.
int64_t available_memory_bytes();
std::string available_memory_source();

}  // namespace keel::monitor
