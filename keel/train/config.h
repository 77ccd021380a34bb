// Config: one TOML file per run (DESIGN §6). Every key, its type and default is documented in
// docs/config.md; unknown keys are errors naming the key and the nearest valid one; --set
// section.key=value overrides a key after the file is read.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "keel/amp/grad_scaler.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/optim/adamw.h"
#include "keel/optim/sgd.h"

namespace keel {

struct RunConfig {
  std::string out_dir;  // "" -> out/<UTC timestamp>
  uint64_t seed = 1337;
  bool resume = false;
  bool resume_force = false;   // resume even where the config changes what the checkpoint fixes
  bool overwrite = false;      // start from scratch in an out_dir that holds a previous run
  std::string device = "cpu";  // cpu | cuda | cuda:N
  int threads = 0;             // OpenMP threads; 0 = all cores
};

struct ModelConfig {
  std::string family = "gpt2";  // gpt2 | llama
  std::string path;             // HF directory (config.json + model.safetensors); "" = from sizes
  int64_t n_layer = 2;
  int64_t n_embd = 64;
  int64_t n_head = 4;
  int64_t n_kv_head = 0;          // llama GQA; 0 = n_head
  int64_t head_dim = 0;           // llama: a head's channels; 0 = n_embd / n_head
  int64_t intermediate_size = 0;  // 0 = 4*n_embd (gpt2) or the Llama rule
  int64_t vocab_size = 0;         // 0 = the tokenizer's
  int64_t max_seq_len = 128;
  bool tie_embeddings = true;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  double dropout = 0.0;
  double attention_dropout = 0.0;   // on the attention probabilities (ModelSpec's)
  std::string attention = "eager";  // eager | math | flash
  std::string base_dtype = "f32";   // storage of a frozen base under adapters: f32 | bf16
  nn::AdapterOptions adapter;       // [model.adapter]; its seed is run.seed
  // Load weights (model.path, resume) that hold nan/inf instead of stopping with an error naming
  // the tensor and the index (io/weight_check.h).
  bool allow_nonfinite_weights = false;
  // A mixture of experts' load-balancing loss, added to the training loss times this weight (HF's
  // router_aux_loss_coef where output_router_logits is set); 0: none.
  double router_aux_loss_coef = 0;
};

struct DataConfig {
  std::string task = "arith";  // arith (built in) | text | jsonl
  std::string path;            // text / jsonl file
  std::string tokenizer = "byte";
  std::string pad = "add";  // add | eos: padding when the tokenizer has no usable pad token
  int64_t seq_len = 32;
  bool pack = false;  // pack text into full seq_len rows instead of one example per row
  // longest: a batch is padded to its longest row (data::padded_length); max_length: to seq_len
  // (every batch one shape, as before keel padded to the longest).
  std::string padding = "longest";
  bool shuffle = true;
  int64_t num_examples = 20000;  // arith: training examples generated
  int64_t eval_examples = 500;   // arith: held-out examples
  std::string eval_path;         // text / jsonl: a validation file (same format as path)
  double eval_fraction = 0;      // text / jsonl: hold out this share of path's examples
  // jsonl conversations: the day a chat template's strftime_now writes, "YYYY-MM-DD" (Granite's
  // default system message and SmolLM3's header hold it); empty leaves strftime_now undefined, so
  // that the data renders the same on every day (Llama-3.1's template then writes its own fixed
  // date).
  std::string chat_date;
  int64_t digits = 2;         // arith: max digits per operand
  bool arith_reverse = true;  // arith: aligned operands, answer least-significant digit first
};

struct TrainConfig {
  std::string precision = "32-true";  // 32-true | bf16-mixed | 16-mixed | bf16-true | 16-true
                                      // (aliases 32, bf16, 16) | auto
  int64_t batch_size = 32;
  int64_t grad_accum = 1;
  int64_t max_steps = 0;  // 0 = run `epochs` epochs
  int64_t epochs = 1;
  double max_grad_norm = 1.0;            // 0 = no clipping
  std::string on_nonfinite = "capture";  // capture | skip | abort
  int64_t eval_every = 0;                // steps; 0 = at the end only
  bool allow_cpu_bf16 = false;           // auto picks bf16-mixed on CPUs with AVX512_BF16
  // none | blocks | N (an integer >= 1, also as a TOML integer): the decoder blocks run in
  // checkpointed segments of N consecutive blocks (`blocks` = 1), each keeping only its input
  // between forward and backward and recomputing its forward inside backward. Gradients and losses
  // are bit-identical to `none`; evaluation and generation ignore it.
  std::string activation_checkpointing = "none";
};

// train.activation_checkpointing as blocks per checkpointed segment: 0 (none), 1 (blocks) or N.
int64_t activation_checkpointing_blocks(const TrainConfig& t);

// The keys shared by every optimizer, and each optimizer's own options (keys optim.beta1, ...,
// optim.momentum: the section is flat in the file).
struct OptimConfig {
  std::string name = "adamw";  // adamw | sgd
  double lr = 3e-3;
  double weight_decay = 0.01;        // not applied to norms and biases
  bool stochastic_rounding = false;  // bf16 parameters (bf16-true): unbiased rounding of updates
  optim::AdamWOptions adamw;         // beta1, beta2, eps
  optim::SGDOptions sgd;             // momentum, dampening, nesterov
};

struct SchedConfig {
  std::string name = "cosine";  // constant | linear | cosine
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;  // used when warmup_steps == 0
  double min_lr_ratio = 0.0;  // floor of cosine/linear decay, as a fraction of lr
};

struct LogConfig {
  int64_t every = 10;  // console line every N steps
  bool console = true;
  bool metrics = true;      // out_dir/metrics.jsonl
  bool tensorboard = true;  // out_dir/tb/events.out.tfevents.*
  bool per_layer_grad_norm = false;
  int64_t checkpoint_every = 0;  // steps; 0 = only at the end
  int64_t keep_checkpoints = 0;  // step-N directories kept (the newest); 0 = all
};

struct UnderflowOverflowConfig {
  bool enabled = false;
  int64_t max_frames_to_save = 21;
  std::vector<int64_t> trace_batch_nums;
  int64_t abort_after_batch_num = -1;  // -1 = none
};

struct InjectConfig {
  std::string module;  // "" = no injection
  int64_t step = -1;
  std::string kind = "nan";  // nan | inf | scale
  double factor = 1.0;       // kind = scale
  int64_t only_rank = -1;    // data-parallel: inject on this rank only; -1 = every rank
  // What it puts where: "nan into transformer.h.0.attn's output", "a factor of 1e+06 into ...".
  std::string what() const;
};

struct DebugConfig {
  bool nan_capture = true;
  UnderflowOverflowConfig underflow_overflow;
  InjectConfig inject;
};

struct DistConfig {
  std::string backend = "auto";  // auto (mpi under mpirun, else single) | single | mpi | nccl
  double bucket_mb = 25;         // gradient all-reduce bucket size (MB = 10^6 bytes)
  int64_t check_every = 100;     // rank-consistency check every N steps (and at the first); 0 = off
  bool rank_weights = false;     // ranks > 0 also write their final state to debug/rank{R}/
  double timeout_s = 600;  // a collective not completed by every rank in this time is an error
};

struct Config {
  RunConfig run;
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  OptimConfig optim;
  SchedConfig sched;
  GradScalerOptions scaler;  // [scaler]: only meaningful under 16-mixed
  LogConfig log;
  DebugConfig debug;
  DistConfig dist;
  std::string source;  // the file it was read from ("" = defaults)
};

// Reads `path` ("" = defaults only), then applies `overrides` ("section.key=value", TOML value
// syntax, bare strings allowed). Errors (kind kUsage) name the file, the key, the line when known,
// and the fix: an unknown key names the nearest valid key.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from TOML text already in memory (a capture's config, a service request); `source`
// names it in messages ("capture.json's config_toml").
Config load_config_text(const std::string& text, const std::string& source,
                        const std::vector<std::string>& overrides = {});
// The same from a JSON object with the TOML file's shape (sections as objects; keel serve's
// request bodies): the same checks and messages, `source` standing for the file name.
Config load_config_json(const nlohmann::json& root, const std::string& source);
// The effective config as TOML (written to out_dir/config.toml; a capture embeds it).
std::string config_to_toml(const Config& c);

// Every key with its effective value as TOML text, in file order ("train.batch_size" -> "8"):
// what resume compares against a checkpoint and what ranks compare before they talk.
std::vector<std::pair<std::string, std::string>> config_values(const Config& c);

// The key table's check of one number (finite, in the key's range) for a command whose flag sets
// what a config key would (init-model's --n-layer is model.n_layer): the loader's message, with
// `origin` ("init-model --n-layer 5000") where a file and line would be.
void check_config_number(const std::string& key, double value, const std::string& shown,
                         const std::string& origin);

// Keys a `keel train` run would accept and then never act on (train.eval_every without a
// validation split, sched.min_lr_ratio under a constant schedule, ...): an Error (kUsage) naming
// them and the fix. keel train calls it before anything is built or written, and keel doctor
// before its checks, so that doctor never passes a config train refuses. Not part of loading: a
// run's saved config.toml that holds them still loads in eval and replay.
void check_keys_take_effect(const Config& c);

// The paths a run reads, by key (model.path, data.path, data.eval_path; "" when unset): what
// run.overwrite must not remove (io::claim_out_dir), for keel train and keel doctor alike.
std::vector<std::pair<std::string, std::string>> input_paths(const Config& c);

// Of `keys` ("optim.momentum", ...), those whose value differs from the default, each as
// "key = value" (TOML): the keys a user set, for messages about keys that would not act.
std::vector<std::string> keys_off_default(const Config& c, const std::vector<std::string>& keys);

// Every key the loader knows, in file order: "section.key", its type as docs/config.md spells it
// (bool, int, float, string, string[], int[]) and its default as a TOML value. docs/config.md is
// checked against this list by a test, so the docs cannot drift from the code.
struct ConfigKeyInfo {
  std::string key;
  std::string type;
  std::string default_toml;
  std::vector<std::string> choices;  // a string key's valid values (empty = any)
};
std::vector<ConfigKeyInfo> config_keys();

// Names of other systems (HF TrainingArguments, PEFT, Lightning, llm.c: "learning_rate", "steps",
// "data.kind") -> the keel key each means ("optim.lr", or with the value: `train.precision =
// "bf16-mixed"` for "bf16"), offered for an unknown key before the nearest spelling.
const std::map<std::string, std::string>& peer_key_names();

}  // namespace keel
