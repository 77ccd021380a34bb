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
// gradient at the head, or an attention backward's score gradient) = `live_peak`, every tensor
// counted in the block host_memory hands out for it (keel/tensor/host_memory.h: 2 MiB multiples
// from 8 MiB up). On top: the block cache's slack (released blocks kept mapped for reuse, at most
// 1/16 of the peak) and, for f16 compute without an oneDNN kernel, the f32 operand copies of the
// largest matmul. `total` is what the process's peak RSS grows by; measured within 15% of real
// `keel train` runs (tests/cli/test_cli_nan.cpp; the numbers are in the .cpp).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/train/config.h"

namespace keel::monitor {

struct MemoryQuery {
  int64_t params = 0;  // total parameters; 0 = computed from the model sizes below
  // Parameters that train (have grads and optimizer state); 0 = all. Under an adapter only the
  // adapter's parameters train, in f32 whatever the policy.
  int64_t trainable = 0;
  bool trainable_f32 = false;
  // The frozen base's storage under an adapter (model.base_dtype): "" or "f32" = the policy's
  // parameter dtype, "bf16" = 2 bytes a weight (and no autocast copy where bf16 is the compute
  // dtype). Only with `trainable` > 0.
  std::string base_dtype;
  std::string precision = "32-true";
  std::string optimizer = "adamw";  // adamw | sgd
  double momentum = 0.9;            // sgd: 0 keeps no state
  // Model and batch sizes for the activation estimate (all of batch, seq, layers, hidden > 0, or
  // no activations are estimated).
  std::string family = "gpt2";  // gpt2 | llama
  int64_t batch = 0, seq = 0, layers = 0, hidden = 0;
  int64_t heads = 0;        // 0 = hidden / 64 (at least 1)
  int64_t kv_heads = 0;     // llama GQA; 0 = heads
  int64_t ffn = 0;          // 0 = the family's rule (gpt2 4*hidden, Llama 8/3*hidden rounded)
  int64_t vocab = 0;        // 0 = the byte tokenizer's 259
  int64_t max_seq_len = 0;  // gpt2 position table; 0 = seq
  bool tie_embeddings = true;
  std::string attention = "eager";  // eager | math | flash
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
  int64_t grads = 0;    // .grad buffers, in the parameters' dtype
  int64_t optimizer_state = 0;  // AdamW exp_avg + exp_avg_sq, SGD momentum
  int64_t lowp_copies = 0;      // autocast's per-step casts of the weights (-mixed only)
  int64_t matmul_scratch = 0;   // f32 operand copies where oneDNN has no kernel (f16), else 0
  int64_t activations = 0;      // saved for backward (one micro-batch)
  int64_t transient = 0;        // the largest short-lived buffer set on top of them
  int64_t live_peak = 0;    // weights .. transient (not matmul_scratch): tensor blocks at the peak
  int64_t cache_slack = 0;  // released blocks host_memory keeps mapped (see the .cpp)
  // Building the model: keel builds it in the policy's parameter dtype and only then casts a
  // frozen base to model.base_dtype, so a bf16 base first exists in f32, plus one tensor (measured:
  // a 102M Llama LoRA run holds 450 MB of blocks while building, 317 MB while training; the f32
  // base's released blocks stay in host_memory's cache, so its RSS stays near the build's while it
  // trains). 0 when no cast follows.
  int64_t init_peak = 0;
  // max(live_peak, init_peak) + matmul_scratch + cache_slack: the expected peak RSS increase
  int64_t total = 0;
  std::string weights_detail;  // what `weights` holds ("f32 masters", "frozen base in bf16", ...)
  bool has_activations = false;
  std::string transient_detail;
  std::vector<MemoryItem> activation_items;  // what `activations` is made of
};

// Errors (kUsage) name the bad field and its fix (unknown precision/optimizer/family/attention,
// no parameter count and no sizes, hidden not divisible by heads).
MemoryEstimate estimate_memory(const MemoryQuery& q);

// The query for a run's config (model sizes, batch_size, seq_len, precision, optimizer,
// attention; vocab from the byte tokenizer unless model.vocab_size is set).
MemoryQuery memory_query_from_config(const Config& cfg);

// Parameter count of a model given by sizes: models::parameter_count (models/param_shapes.h, the
// models' own layout: GPT-2 with tied embeddings and a position table, Llama with grouped-query
// k/v projections and an optional untied lm_head), nothing allocated.
int64_t count_parameters(const MemoryQuery& q);

// Human-readable table (decimal MB, as the issue states the reference numbers) and JSON (bytes).
std::string format_memory(const MemoryEstimate& e);
nlohmann::json memory_to_json(const MemoryEstimate& e);

// MemAvailable from /proc/meminfo in bytes, or -1 when unreadable.
int64_t available_memory_bytes();

}  // namespace keel::monitor
