#include "keel/monitor/memory_estimate.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "keel/amp/precision.h"
#include "keel/backend/matmul.h"
#include "keel/data/arith.h"
#include "keel/data/dataset.h"
#include "keel/data/loader.h"
#include "keel/data/tokenizer.h"
#include "keel/io/hf_model.h"
#include "keel/io/safetensors.h"
#include "keel/models/causal_lm.h"
#include "keel/models/param_shapes.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/numerics/error.h"
#include "keel/ops/moe.h"
#include "keel/tensor/host_memory.h"

namespace keel::monitor {

namespace {

int64_t default_heads(int64_t hidden) { return std::max<int64_t>(1, hidden / 64); }

models::ModelSpec spec_of(const MemoryQuery& q) {
  models::ModelSpec s;
  s.family = q.family;
  s.n_layer = q.layers;
  s.n_embd = q.hidden;
  s.n_head = q.heads > 0 ? q.heads : default_heads(q.hidden);
  s.n_kv_head = q.kv_heads;
  s.set_head_dim(q.head_dim);
  s.hf_model_type = q.hf_model_type;
  s.intermediate_size = q.ffn;
  s.moe = q.moe;
  s.vocab_size = q.vocab > 0 ? q.vocab : data::ByteTokenizer::kVocab;
  s.max_seq_len = std::max(q.max_seq_len, q.seq);
  s.tie_embeddings = q.family == "gpt2" ? true : q.tie_embeddings;
  s.parallel_residual = q.parallel_residual;
  s.attention_bias = q.attention_bias;
  return s;
}

bool has_sizes(const MemoryQuery& q) {
  return q.batch > 0 && q.seq > 0 && q.layers > 0 && q.hidden > 0;
}

void check_query(const MemoryQuery& q) {
  if (q.family != "gpt2" && q.family != "llama")
    throw Error("memory: family \"" + q.family + "\" is unknown; use gpt2 or llama", Error::kUsage);
  if (q.optimizer != "adamw" && q.optimizer != "sgd")
    throw Error("memory: optimizer \"" + q.optimizer + "\" is unknown; use adamw or sgd",
                Error::kUsage);
  if (q.attention != "eager" && q.attention != "math" && q.attention != "flash")
    throw Error("memory: attention \"" + q.attention + "\" is unknown; use eager, math or flash",
                Error::kUsage);
  if (q.adapter.kind != "none" && q.adapter.kind != "lora" && q.adapter.kind != "dora" &&
      q.adapter.kind != "lokr")
    throw Error(
        "memory: adapter \"" + q.adapter.kind + "\" is unknown; use none, lora, dora or lokr",
        Error::kUsage);
  if (q.checkpoint_every < 0)
    throw Error("memory: activation checkpointing every " + std::to_string(q.checkpoint_every) +
                    " blocks; use none (0), blocks (1) or a positive N",
                Error::kUsage);
  if (q.params <= 0 && !(q.layers > 0 && q.hidden > 0))
    throw Error(
        "memory: give the parameter count (--params N) or the model sizes (--layers L --hidden H)",
        Error::kUsage);
  // Each size within the bounds of the config key it stands for, the numbers keel train accepts
  // (0 = not given). --layers 99999999 (or a config.json saying so) used to run for minutes
  // listing parameter shapes, a negative size to drop the activations without a word.
  auto check = [&](const char* key, const char* what, const char* flag, double v,
                   const std::string& shown) {
    check_config_number(key, v, shown,
                        std::string("memory: ") + what + " = " + shown + " (" +
                            (q.flags ? flag : key) + (q.source.empty() ? "" : " or " + q.source) +
                            ")");
  };
  auto bound = [&](const char* key, const char* what, const char* flag, int64_t v) {
    if (v != 0) check(key, what, flag, static_cast<double>(v), std::to_string(v));
  };
  bound("train.batch_size", "batch", "--batch", q.batch);
  check("train.grad_accum", "grad accum", "--grad-accum", static_cast<double>(q.grad_accum),
        std::to_string(q.grad_accum));
  bound("data.seq_len", "seq", "--seq", q.seq);
  bound("model.n_layer", "layers", "--layers", q.layers);
  bound("model.n_embd", "hidden", "--hidden", q.hidden);
  bound("model.n_head", "heads", "--heads", q.heads);
  bound("model.n_kv_head", "kv heads", "--kv-heads", q.kv_heads);
  bound("model.head_dim", "head dim", "--head-dim", q.head_dim);
  bound("model.intermediate_size", "ffn", "--ffn", q.ffn);
  // A mixture's experts: their width within intermediate_size's bounds, their count keel's.
  bound("model.intermediate_size", "expert width", "--ffn", q.moe.ffn);
  if (q.moe.experts < 0 || q.moe.experts > models::ModelSpec::kMaxExperts)
    throw Error("memory: experts = " + std::to_string(q.moe.experts) + " (" +
                    (q.source.empty() ? "the model" : q.source) + ") must be from 0 to " +
                    std::to_string(models::ModelSpec::kMaxExperts),
                Error::kUsage);
  bound("model.vocab_size", "vocab", "--vocab", q.vocab);
  if (q.adapter.kind != "none") {
    // Not bound(): r = 0 is no "not given" (it said "adapter r = 0 must be >= 1", not --r's range).
    check("model.adapter.r", "adapter r", "--r", static_cast<double>(q.adapter.r),
          std::to_string(q.adapter.r));
    std::ostringstream p;
    p << q.adapter.dropout;
    check("model.adapter.dropout", "adapter dropout", "--adapter-dropout", q.adapter.dropout,
          p.str());
    // keel train refuses it (nn::apply_adapters): the estimate was of a run that cannot start.
    if (q.adapter.kind == "lokr" && q.adapter.dropout > 0)
      throw Error("memory: adapter dropout = " + p.str() +
                      (q.flags ? " (--adapter-dropout or model.adapter.dropout)"
                               : " (model.adapter.dropout)") +
                      " with lokr: LoKr has no input dropout; drop it or use lora / dora",
                  Error::kUsage);
  }
  // Within those bounds the activations can still exceed what an int64 byte count holds (65536
  // sequences of 2^20 tokens): refused far above any machine and below any wrap.
  const double width =
      static_cast<double>(q.seq) * static_cast<double>(std::max<int64_t>(
                                       q.heads, q.hidden > 0 ? default_heads(q.hidden) : 1)) +
      static_cast<double>(std::max<int64_t>(q.vocab, data::ByteTokenizer::kVocab)) +
      16.0 * static_cast<double>(std::max({q.hidden, q.ffn, int64_t{1}}));
  const double activation_bound = static_cast<double>(q.batch) * static_cast<double>(q.seq) *
                                  width * (static_cast<double>(q.layers) + 2) * 8;
  if (activation_bound > 0x1p60)
    throw Error("memory: batch " + std::to_string(q.batch) + " x seq " + std::to_string(q.seq) +
                    " tokens through " + std::to_string(q.layers) +
                    " layers need more than 2^60 bytes (1.15 EB) of activations; lower the batch "
                    "(--batch, train.batch_size) or the sequence (--seq, data.seq_len)",
                Error::kUsage);
  if (q.hidden > 0) {
    const int64_t h = q.heads > 0 ? q.heads : default_heads(q.hidden);
    if (q.head_dim == 0 && q.hidden % h != 0)
      throw Error("memory: hidden " + std::to_string(q.hidden) + " is not divisible by heads " +
                      std::to_string(h) + "; pick --heads dividing --hidden (or give --head-dim)",
                  Error::kUsage);
    if (q.kv_heads < 0 || (q.kv_heads > 0 && h % q.kv_heads != 0))
      throw Error("memory: heads " + std::to_string(h) + " is not a multiple of kv heads " +
                      std::to_string(q.kv_heads) + "; pick --kv-heads dividing --heads",
                  Error::kUsage);
  }
}

std::string mb(int64_t bytes) {
  // A part under 0.05 MB (a few LayerNorm statistics, the ids) printed "0.0 MB": nothing, while
  // the rows add up to the total with it.
  if (bytes > 0 && bytes < 50'000) return "<0.1 MB";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

}  // namespace

std::string format_bytes(int64_t bytes) {
  if (bytes < 10'000'000'000) return mb(bytes);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GB", static_cast<double>(bytes) / 1e9);
  return buf;
}

int64_t count_parameters(const MemoryQuery& q) { return models::parameter_count(spec_of(q)); }

namespace {

// What host_memory hands out for a tensor of `n` bytes (none for an empty one). The rounding is
// real memory: GPT-2 with C = 768 has 9 MiB MLP weights that take 10 MiB blocks, and their weights,
// grads and two AdamW moments hold 99 MB more than their bytes (measured: 1463.7 MB live after a
// step of an 85M-parameter model whose state is 1364.8 MB).
int64_t block_bytes(int64_t n) {
  return n > 0 ? static_cast<int64_t>(host_memory::block_size(static_cast<size_t>(n))) : 0;
}

}  // namespace

namespace {

// Bytes of the run's parameters as stored, tensor by tensor in host_memory's blocks.
int64_t blocks_of(const std::vector<models::ParamShape>& tensors, int64_t bytes_per_param,
                  bool cast_only = false) {
  int64_t sum = 0;
  for (const models::ParamShape& t : tensors)
    if (!cast_only || t.matmul) sum += block_bytes(t.numel() * bytes_per_param);
  return sum;
}

int64_t numel_of(const std::vector<models::ParamShape>& tensors) {
  int64_t n = 0;
  for (const models::ParamShape& t : tensors) n += t.numel();
  return n;
}

// The process without a model: the keel binary, its libraries (oneDNN, OpenMP, libstdc++), the
// thread pool's stacks, the config, tokenizer and the built-in dataset. Measured as the peak RSS
// of 1-layer, 32-wide runs (whose tensors are under 1 MB): 22.2-23.0 MB for gpt2 and llama,
// 32-true and bf16-mixed, with and without an adapter, on AVX-512 machines; 26.4-26.8 MB where
// oneDNN runs its AVX2 code (an AMD EPYC without AVX-512, session 17), which is also where it has
// no bf16 matmul, so that is the test.
int64_t runtime_bytes() { return cpu_matmul_native(DType::BF16) ? 22'500'000 : 26'600'000; }

}  // namespace

MemoryEstimate estimate_memory(const MemoryQuery& q) {
  check_query(q);
  const PrecisionPolicy pol = resolve_precision(q.precision, Device::cpu());
  MemoryEstimate e;
  e.precision = pol.name();
  e.source = q.source;
  const bool sized = q.layers > 0 && q.hidden > 0;
  const models::ModelSpec sp = spec_of(q);
  // The base model's tensors (with sizes); an adapter's own tensors, from the adapters' shapes.
  std::vector<models::ParamShape> tensors, adapter_tensors;
  if (sized) tensors = models::parameter_shapes(sp);
  const bool adapter_kind = q.adapter.kind != "none";
  if (adapter_kind && !sized && q.trainable <= 0)
    throw Error(
        "memory: an adapter's parameters are counted from the model's sizes; give a model "
        "directory (--model DIR), a config (--config FILE) or --layers and --hidden",
        Error::kUsage);
  if (adapter_kind && sized)
    adapter_tensors = models::adapter_parameter_shapes(sp, q.adapter, q.targets_key);
  // A bare count (or one that is not these sizes' count) is counted as bytes.
  if (sized && q.params > 0 && q.params != numel_of(tensors) + numel_of(adapter_tensors) &&
      q.params != numel_of(tensors))
    tensors.clear(), adapter_tensors.clear();
  const bool shaped = !tensors.empty();

  const int64_t pb = static_cast<int64_t>(dtype_size(pol.param_dtype));
  // c: bytes of the compute dtype (what linear/attention outputs are stored in); s: bytes of the
  // residual stream (f32 under -mixed, where residual_add promotes to the f32 branch).
  const int64_t c = static_cast<int64_t>(dtype_size(pol.compute_dtype));
  const int64_t s = pb;
  if (!q.base_dtype.empty() && q.base_dtype != "f32" && q.base_dtype != "bf16")
    throw Error("memory: base dtype \"" + q.base_dtype + "\" is unknown; use f32 or bf16",
                Error::kUsage);

  int64_t N = 0, Nt = 0;  // all parameters; those that train
  if (shaped) {
    e.adapter_params = numel_of(adapter_tensors);
    N = numel_of(tensors) + e.adapter_params;
    Nt = adapter_kind ? e.adapter_params : N;
  } else {
    N = q.params > 0 ? q.params : count_parameters(q);
    Nt = q.trainable > 0 ? std::min(q.trainable, N) : N;
  }
  e.params = N;
  e.trainable = Nt;
  // Under an adapter the frozen base (N - Nt parameters) is stored in model.base_dtype ("f32",
  // the config's default, keeps the base in the policy's parameter dtype); the adapters are f32.
  const bool adapter = (adapter_kind || q.trainable > 0) && Nt < N;
  const int64_t tb = adapter_kind || q.trainable_f32 ? 4 : pb;
  const int64_t fb = adapter && q.base_dtype == "bf16" ? 2 : pb;
  const int64_t kinds = q.optimizer == "adamw" ? 2 : (q.momentum != 0 ? 1 : 0);
  const int64_t trainable_blocks =
      shaped ? blocks_of(adapter_kind ? adapter_tensors : tensors, tb) : Nt * tb;

  if (adapter) {
    e.weights = (shaped ? blocks_of(tensors, fb) : (N - Nt) * fb) + trainable_blocks;
    e.weights_detail = std::string("frozen base in ") + (fb == 2 ? "16-bit" : "f32") +
                       ", adapters in " + (tb == 4 ? "f32" : "16-bit");
    if (adapter_kind)
      e.weights_detail += " (" + q.adapter.kind + " r=" + std::to_string(q.adapter.r) + ": " +
                          std::to_string(Nt) + " trainable)";
  } else {
    e.weights = shaped ? blocks_of(tensors, pb) : N * pb;
    if (pol.autocast) e.weights_detail = "f32 masters";
  }
  // One set, whatever train.grad_accum: each micro-batch has its own autocast scope, so its weight
  // gradients go into .grad as backward makes them (measured: a 12.6M-parameter Llama under
  // bf16-mixed peaks 262.5 MB with grad_accum = 2, 259.7 MB with 1; 308.5 MB when the window
  // shared one scope and a later micro-batch's gradients waited for the first forward's casts).
  e.grads = trainable_blocks;
  e.optimizer_state = kinds * trainable_blocks;
  if (shaped && e.weights != (adapter ? (N - Nt) * fb + Nt * tb : N * pb))
    e.weights_detail +=
        std::string(e.weights_detail.empty() ? "" : "; ") + "in host_memory's rounded blocks";

  // Autocast caches one low-precision copy per weight for the whole window: every Linear weight
  // and bias and the tied embedding used as lm_head; not norms or position tables. Measured: a
  // GPT-2 of 85M parameters peaks 105 MB higher under bf16-mixed than under 32-true (1738.4 vs
  // 1629.7 MB of live blocks), the 170 MB of bf16 copies less the halved activations.
  if (pol.autocast) {
    const int64_t cast_params = shaped ? blocks_of(tensors, c, true) : (N - (adapter ? Nt : 0)) * c;
    // A frozen base already in the compute dtype is used as stored: no copy. (An f32 base is cast
    // per use; the copies are not cached, but each Linear's backward node keeps its cast weight
    // until backward, so they count the same.) The adapter's own f32 weights are cast and cached.
    e.lowp_copies = adapter ? (fb == c ? 0 : cast_params) + Nt * c : cast_params;
  }

  const bool acts = has_sizes(q);
  int64_t recompute = 0;  // checkpointing: one segment's activations, held during its backward
  int64_t layer_transient = 0, head_transient = 0;
  if (acts) {
    e.has_activations = true;
    const int64_t T = q.longest_row > 0 ? data::padded_length(q.longest_row, q.seq) : q.seq;
    e.batch_detail = std::to_string(q.batch) + " x " + std::to_string(T) + " tokens";
    if (T < q.seq)
      e.batch_detail +=
          " (data.padding = longest: a batch is padded to its longest row, not to data.seq_len = " +
          std::to_string(q.seq) + "; the data's longest holds " + std::to_string(q.longest_row) +
          ")";
    const int64_t B = q.batch, C = sp.n_embd, F = sp.ffn_dim(), V = sp.vocab_size;
    const int64_t H = sp.n_head, L = sp.n_layer, BT = B * T;
    // A sparse MLP's widths: each token's k experts, each expert_ffn wide (ModelSpec::moe).
    const bool sparse = sp.moe.experts > 0;
    const int64_t topk = sparse ? sp.moe.per_token : 1, Fk = sparse ? topk * sp.moe.ffn : F;
    // Attention's widths: the query heads' H * D (C unless the model has a head width of its
    // own) and the key/value heads'.
    const int64_t qC = H * sp.head_dim(), kvC = sp.kv_heads() * sp.head_dim();
    const bool flash = q.attention == "flash";
    const bool llama = q.family == "llama";
    // Items of one block (counted per block) and of the model outside its blocks.
    struct Item {
      std::string name, detail;
      int64_t per_block = 0, outside = 0;
    };
    std::vector<Item> items;
    auto add = [&](const std::string& name, int64_t count, int64_t each, const std::string& detail,
                   bool per_block) {
      const int64_t bytes = count * block_bytes(each);
      auto it =
          std::find_if(items.begin(), items.end(), [&](const Item& i) { return i.name == name; });
      if (it == items.end()) it = items.insert(items.end(), Item{name, detail});
      (per_block ? it->per_block : it->outside) += bytes;
    };
    const std::string sd = s == 4 ? "f32" : "16-bit", cd = c == 4 ? "f32" : "16-bit";
    // The attention's inputs: the queries, and the keys and values of kv_heads() heads (one under
    // GPT-BigCode's multi_query, fewer than the queries' under grouped-query attention).
    auto add_qkv = [&](const std::string& detail) {
      add("q, k, v", 1, c * BT * qC, detail, true);
      add("q, k, v", 2, c * BT * kvC, detail, true);
    };
    const std::string attn_detail = flash ? "flash: output [B,T,C] " + cd + " + lse [B,H,T] f32"
                                          : "probabilities [B,H,T,T] f32 (" + q.attention + ")";
    if (flash) {
      add("attention", 1, c * BT * qC, attn_detail, true);
      add("attention", 1, 4 * B * H * T, attn_detail, true);
    } else {
      add("attention", 1, 4 * B * H * T * T, attn_detail, true);
    }
    // The first norm's consumers (c_attn; q, k, v) share one autocast copy under -mixed: the
    // later casts reuse the first's values (amp/autocast.cpp), as gate and up do.
    if (!llama) {
      add("residual stream", 2, s * BT * C, "2 per block + ln_f: [B,T,C] " + sd, true);
      add("norm statistics", 4, 4 * BT, "mean, rstd [B*T] f32 per LayerNorm", true);
      const std::string li =
          "c_attn, attn.c_proj, c_fc ([B,T,C]) and mlp.c_proj ([B,T,4C]) inputs, " + cd;
      add("linear inputs", 3, c * BT * C, li, true);
      add("linear inputs", 1, c * BT * F, li, true);
      add_qkv("split-heads copies [B,H,T,D], k and v [B,kv,T,D], " + cd);
      add("gelu input", 1, c * BT * F, "c_fc output [B,T,F] " + cd, true);
      add("residual stream", 1, s * BT * C, "", false);
      add("norm statistics", 2, 4 * BT, "", false);
    } else {
      // (A parallel block's branches read one residual stream: Cohere's and Phi's through one
      // norm, whose output the attention and the MLP share, a GPT-NeoX's through one each.)
      const int64_t streams = sp.parallel_block() ? 1 : 2, norms = sp.shared_block_norm() ? 1 : 2;
      add("residual stream", streams, s * BT * C,
          std::to_string(streams) + " per block + final norm: [B,T,C] " + sd, true);
      add("norm statistics", sp.centered_norms() ? 2 * norms : norms, 4 * BT,
          sp.centered_norms() ? "mean, rstd [B*T] f32 per LayerNorm" : "rstd [B*T] f32 per RMSNorm",
          true);
      const std::string li =
          std::string(sp.post_norms()       ? "the residual stream's copies under -mixed (OLMo-2's "
                                              "projections read it unnormed)"
                      : sp.parallel_block() ? "the normed input (one autocast copy shared by q, "
                                              "k, v, gate and up under -mixed)"
                                            : "normed inputs (one autocast copy shared by q, k, v "
                                              "and one by gate, up under -mixed)") +
          ", o_proj and down_proj inputs, " + cd;
      // normed (q, k, v), normed (gate, up); OLMo-2's read the residual stream itself (its
      // autocast copy under -mixed)
      add("linear inputs", sp.post_norms() && !pol.autocast ? 0 : norms, c * BT * C, li, true);
      add("linear inputs", 1, c * BT * qC, li, true);  // o_proj's [B,T,H*D]
      add("linear inputs", 1, c * BT * Fk, li, true);  // down_proj's (each expert's rows)
      add_qkv("after rope / split-heads, " + cd);
      // Qwen3's q_norm and k_norm keep their inputs, in f32 (RMSNorm runs in f32: under -mixed
      // its own cast of the split heads), and a statistic per head and token.
      // (Phi's are LayerNorms, a mean beside each rstd; Command-R+'s and StableLM-2-12B's weight
      // per head multiplies the normalized f32 values, which it keeps too.)
      if (sp.qk_norm() || sp.head_qk_layernorm()) {
        const int64_t nb = pol.autocast ? 4 : c;
        const std::string qk = "q_norm and k_norm inputs [B,H,T,D] and statistics, " +
                               std::string(nb == 4 ? "f32" : "16-bit");
        const int64_t copies = sp.head_qk_layernorm() ? 2 : 1;
        const int64_t stats = sp.head_qk_layernorm() || (sp.qk_norm() && sp.phi()) ? 2 : 1;
        add("q, k norms", copies, nb * BT * qC, qk, true);
        add("q, k norms", copies, nb * BT * kvC, qk, true);
        add("q, k norms", stats, 4 * BT * H, qk, true);
        add("q, k norms", stats, 4 * BT * sp.kv_heads(), qk, true);
      }
      // (Phi's and GPT-NeoX's MLP keeps its gelu's input, fc1's output, beside fc2's input.)
      if (sp.gelu_mlp())
        add("gelu input", 1, c * BT * F, "fc1 (dense_h_to_4h) output [B,T,F] " + cd, true);
      else
        add("swiglu inputs", 2, c * BT * Fk, "gate and up outputs [B,T,F] " + cd, true);
      // A mixture of experts (counted for every block: Qwen3-MoE's dense mlp_only_layers are
      // few): each expert's gathered tokens (B*T*k rows of the normed input) and their autocast
      // copy, its output rows the combine keeps, the routing's probabilities and weights.
      if (sparse) {
        // (the gathered f32 rows are only cast under -mixed: what the experts' products keep is
        // their autocast copy)
        const std::string mo =
            "experts' rows (B*T*k of [C]) and outputs, " + cd + ", routing [B*T,E] f32";
        add("mixture of experts", 2, c * BT * topk * C, mo, true);
        add("mixture of experts", 1, 4 * BT * (sp.moe.experts + topk), mo, true);
        // Qwen2-MoE's shared expert on every token: its gate and up outputs and down_proj's
        // input [B,T,Fs], and the output its sigmoid gate multiplies.
        if (const int64_t Fs = sp.moe.shared_ffn; Fs > 0) {
          const std::string sh =
              "shared expert: gate, up outputs and down input [B,T,Fs], its "
              "output [B,T,C], " +
              cd;
          add("mixture of experts", 3, c * BT * Fs, sh, true);
          add("mixture of experts", 1, c * BT * C, sh, true);
        }
      }
      // Gemma's GeGLU is gelu(gate) * up: the product keeps the gelu's output too.
      if (sp.gemma()) add("geglu", 1, c * BT * F, "gelu(gate) [B,T,F] " + cd, true);
      // Gemma-2's and -3's norms of the attention's and the MLP's outputs keep their f32 inputs
      // (the norm's own cast under -mixed) and a statistic per token.
      if (sp.sandwich_norms() || sp.post_norms()) {  // (and OLMo-2's, its only norms)
        const std::string sn = "post-attention and post-feedforward norm inputs [B,T,C] f32";
        add("output norms", 2, 4 * BT * C, sn, true);
        add("output norms", 2, 4 * BT, sn, true);
      }
      add("residual stream", 1, s * BT * C, "", false);
      add("norm statistics", 1, 4 * BT, "", false);
    }
    // What each adapted Linear keeps on top (nn/adapters/*.cpp forward): the adapter's own cast
    // of its input (autocast's copy for lora_A under -mixed; an f32 copy of a 16-bit input under
    // -true; none when the f32 input is shared with the base product), LoRA's [rows, r] middle,
    // DoRA's f32 base and LoRA results (its two products by m/n), LoKr's cast delta weight
    // [out, in] (x·ΔWᵀ keeps it).
    int64_t adapter_transient = 0;
    if (adapter_kind) {
      const std::string k = q.adapter.kind;
      const bool dropout = q.adapter.dropout > 0;
      const int64_t in_copy = pol.autocast ? c : (pb != 4 ? 4 : (dropout ? 4 : 0));
      const int64_t mid = pol.autocast ? c : 4;
      std::string detail = k + ": ";
      detail += k == "lokr"   ? "input copy, delta weight [out,in] " + cd
                : k == "dora" ? "input copy, [rows,r], base and LoRA results f32"
                              : "input copy [rows,in] and [rows,r]";
      std::set<std::string> modules;
      for (const models::ParamShape& a : adapter_tensors)
        modules.insert(a.name.substr(0, a.name.rfind(k == "lokr" ? ".lokr_" : ".lora_")));
      for (const models::ParamShape& t : tensors) {
        if (!t.linear || !modules.count(t.name.substr(0, t.name.size() - 7))) continue;
        const int64_t out = t.shape[0], in = t.shape[1];
        // An expert's module sees its tokens only: B*T*k rows among the experts, on average.
        const int64_t rows =
            t.name.find(".experts.") != std::string::npos ? BT * topk / sp.moe.experts : BT;
        // Blocks repeat: count layer 0's modules per block, the head's (lm_head) outside.
        const bool l0 = t.name.find(".0.") != std::string::npos;
        const bool head = t.name.rfind("lm_head", 0) == 0;
        if (!l0 && !head) continue;
        add(k + " adapters", 1, in_copy * rows * in, detail, !head);
        // LoRA's fused dropout keeps its mask, a bit per input element, for its backward
        // (ops::dropout_cast).
        if (k == "lora" && dropout && pol.autocast && c < 4)
          add(k + " adapters", 1, (rows * in + 7) / 8, detail + ", dropout mask bits", !head);
        if (k == "lokr") {
          add(k + " adapters", 1, (pol.autocast ? c : 4) * out * in, detail, !head);
          // LoKr returns its input's dtype (PEFT's result.to(previous_dtype)): under -mixed a
          // normed input is f32, so the op after c_fc (gelu) or gate/up (swiglu) keeps an f32
          // output where the plain Linear's was 16-bit (gpt2 LoKr on c_fc measured 0.88).
          const std::string m = t.name.substr(0, t.name.size() - 7);
          const bool mlp_in = m.ends_with(".c_fc") || m.ends_with(".gate_proj") ||
                              m.ends_with(".up_proj") || m.ends_with(".gate_up_proj");
          if (pol.autocast && c < 4 && mlp_in) {
            add(k + " adapters", 1, 4 * rows * out, detail + ", f32 MLP outputs", !head);
            add(k + " adapters", -1, c * rows * out, detail + ", f32 MLP outputs", !head);
          }
          adapter_transient = std::max(adapter_transient, 3 * block_bytes(4 * out * in));
        } else {
          add(k + " adapters", 1, mid * rows * q.adapter.r, detail, !head);
          if (k == "dora") {
            add(k + " adapters", 2, 4 * rows * out, detail, !head);
            // Its backward holds f32 [rows, out] gradients at once: the output's (cast to f32),
            // the scaled LoRA product's, base_result's and lora_result's, and the result's sum
            // (gpt2 DoRA on c_attn measured 0.93 of its peak without them, at 2 to 6 layers).
            adapter_transient = std::max(adapter_transient, 5 * block_bytes(4 * rows * out));
          }
          // Under dropout DoRA's base product of the dropped input keeps that input's copy in
          // the compute dtype, and a 16-bit base in another compute dtype (bf16 base, 16-mixed)
          // its cast weight; a base in the compute dtype is used as it is, an f32 one through
          // autocast's cached cast (lowp_copies).
          if (k == "dora" && dropout && pol.autocast)
            add(k + " adapters", 1,
                c * rows * in + (fb == 2 && pol.compute_dtype != DType::BF16 ? c * out * in : 0),
                detail, !head);
        }
      }
    }
    // Head: the lm_head input and the logits the step keeps. cross_entropy reads 16-bit logits
    // as they are (amp's kFp32Inside): no f32 copy.
    add("lm_head input", 1, c * BT * C, "[B,T,C] " + cd, false);
    add("logits", 1, c * BT * V, "[B*T,V] " + cd, false);
    // Gemma-2's final soft cap (final_logit_softcapping, 30 in its files; Gemma-3 has none)
    // keeps the logits before it as well.
    if (q.hf_model_type == "gemma2")
      add("logits", 1, c * BT * V, "[B*T,V] " + cd + ", and those before the soft cap", false);
    add("ids and labels", 3, 8 * BT, "i64 [B,T]", false);

    int64_t per_block = 0, outside = 0;
    for (const Item& i : items) per_block += i.per_block, outside += i.outside;
    // Under an adapter the embedding is frozen: the first block's input needs no gradient, so its
    // first norm and the base products reading that norm record nothing (ops record a node only
    // when an input requires grad); the adapters' own copies (counted above) are saved.
    int64_t first_block_less = 0;
    if (adapter) {
      first_block_less = block_bytes(s * BT * C) + (llama ? 1 : 2) * block_bytes(4 * BT);
      first_block_less +=
          (pol.autocast || adapter_tensors.empty() ? 1 : 0) * block_bytes(c * BT * C);
    }
    // Checkpointing: a segment of N blocks keeps only its input; its backward first recomputes
    // its blocks' activations (the input being the first of them) and holds them on top.
    const int64_t every = std::min(q.checkpoint_every, L);
    int64_t kept_blocks = L * per_block - first_block_less;
    if (every > 0) {
      const int64_t segments = (L + every - 1) / every;
      kept_blocks = segments * block_bytes(s * BT * C);
      recompute = every * per_block - block_bytes(s * BT * C);
      e.checkpoint = "checkpoint every " + std::to_string(every) + " block" +
                     (every == 1 ? "" : "s") + ": " + std::to_string(segments) +
                     " segment inputs kept, one segment recomputed in backward";
    }
    e.activations = kept_blocks + outside;
    for (const Item& i : items) {
      const int64_t bytes = (every > 0 ? 0 : L * i.per_block) + i.outside;
      if (bytes > 0) e.activation_items.push_back({i.name, bytes, i.detail});
    }
    if (every > 0) {
      e.activation_items.push_back({"segment inputs", kept_blocks, "[B,T,C] " + sd + " each"});
    } else if (first_block_less > 0) {
      e.activation_items.push_back(
          {"first block", -first_block_less, "no gradient reaches its input (frozen embedding)"});
    }

    // Backward transients: at the head, the lm_head's input gradient, which linear writes in the
    // f32 masters' dtype under -mixed (ops::grad_dtype_for). Its weight gradient is no transient:
    // it becomes the weight's .grad (counted in `grads`). dlogits take no memory of their own:
    // cross_entropy's backward writes them over the logits it saved, their sole owner (measured:
    // a 128256-row vocabulary at B8 T128 peaks 0.53 GB below logits + dlogits). Inside a block,
    // attention's score gradient (with eager's rounded probabilities) and dq/dk/dv, or the MLP's.
    const int64_t gb = pol.autocast ? 4 : c;
    head_transient = block_bytes(gb * BT * C);
    const int64_t cdt = q.attention == "math" ? 4 : c;
    // dq, dk, dv (each [B,H,T,D]: a grouped key/value head's gradient is summed from its
    // queries' afterwards) + dx
    int64_t layer = 3 * block_bytes(c * BT * qC) + 2 * block_bytes(s * BT * C);
    if (!flash)
      layer += block_bytes(cdt * B * H * T * T) +
               (q.attention == "math" ? 4 * block_bytes(4 * BT * qC) : 0);
    if (q.attention == "eager" && c != 4) layer += block_bytes(c * B * H * T * T);  // rounded P
    // Dropout on the probabilities: dV's dropped P where it cannot overwrite a rounded copy (math,
    // and eager in f32, whose P is the f32 one the softmax's backward reads).
    if (!flash && q.attention_dropout > 0 && cdt == 4) layer += block_bytes(4 * B * H * T * T);
    // (GeGLU's backward holds the gelu's gradient beside gate's and up's)
    const int64_t mlp_rows = !llama || sp.gelu_mlp() ? 2 : sp.gemma() ? 4 : 3;
    int64_t mlp = mlp_rows * block_bytes(c * BT * Fk) + 2 * block_bytes(s * BT * C);
    if (sparse) mlp += block_bytes(c * BT * topk * C);  // the experts' output gradients
    // A Phi-3's fused qkv_proj and gate_up_proj take their pieces' gradients in one buffer of the
    // fused output's shape (ops::split_last), beside the pieces' own.
    // (GPT-NeoX's and Falcon's query_key_value too; GLM's gate_up_proj alone.)
    if (sp.fused_qkv()) layer += block_bytes(c * BT * (qC + 2 * kvC));
    if (sp.fused_gate_up()) mlp += block_bytes(c * BT * 2 * F);
    layer_transient = std::max({layer, mlp, adapter_transient});
    // A block's backward runs after the lm_head's has dropped the logits (cross_entropy's node
    // hands them over as dlogits), yet the measured peaks of small configurations are not lower
    // by the logits (subtracting them put gpt2 LoRA 32-true at 0.897 of its measured peak): the
    // freed block most likely stays mapped in the block cache. Not verified.
    e.transient = std::max(head_transient, recompute + layer_transient);
    e.transient_detail = head_transient >= recompute + layer_transient
                             ? "lm_head input gradient (dlogits overwrite the logits)"
                         : every > 0 ? "one recomputed segment + its backward buffers"
                                     : "attention / MLP backward buffers";

    // Matmul scratch. oneDNN keeps no packed copies of the weights: its matmul primitives take
    // the plain tensors (keel/backend/cpu/matmul_dnnl.cpp), and with freed memory returned at once
    // (MALLOC_MMAP_THRESHOLD_=65536) the process holds only 3-6 MB beyond host_memory's blocks at
    // 3M and 85M parameters alike, under 32-true and bf16-mixed (AMX). A 16-bit dtype without a
    // kernel on this CPU is the exception (f16 on most CPUs, bf16 on those without AVX-512, such
    // as the AMD EPYC kernel set `avx2`): each product converts its operands and result to f32
    // vectors (malloc'd, outside host_memory); the largest product's three set the scratch.
    // Measured: 16-mixed peaks 7 MB (3M params, B8 T256) and 12.6 MB (85M params, B4 T64) above
    // bf16-mixed; this term gives 12.6 and 13.4 MB.
    if (pol.compute_dtype != DType::F32 && !cpu_matmul_native(pol.compute_dtype)) {
      auto mm = [](int64_t batch, int64_t m, int64_t k, int64_t n) {
        return 4 * batch * (m * k + k * n + m * n);
      };
      int64_t big = std::max({mm(1, BT, C, 3 * C), mm(1, BT, C, F), mm(1, BT, F, C),
                              mm(1, BT, C, V), mm(1, BT, V, C), mm(1, C, BT, V)});
      if (!flash) big = std::max(big, mm(B * H, T, sp.head_dim(), T));
      e.matmul_scratch = big;
    }
    // A mixture of experts: each expert's batch is padded to a bucketed row count
    // (ops::moe_padded_rows) and oneDNN builds and keeps a kernel per shape: per bucket, the base
    // products' forwards and input gradients (their weight gradients too when they train), and
    // each adapted (in, out) shape's products. The buckets a run meets are taken as those from a
    // quarter to four times an expert's mean rows (a random router's spread). Measured on a
    // 2-layer, 8-expert Qwen3-MoE (B8 T128, 30 steps): 139 such kernels whole, 408 with LoRA on
    // gate/up/down, about 100 KB each.
    if (sparse) {
      const int64_t mean = std::max<int64_t>(1, BT * topk / sp.moe.experts);
      const int64_t last = ops::moe_padded_rows(std::min(BT, 4 * mean));
      int64_t buckets = 0;
      for (int64_t b = ops::moe_padded_rows(std::max<int64_t>(1, mean / 4)); b <= last;
           b = ops::moe_padded_rows(b + 1))
        ++buckets;
      std::set<std::pair<int64_t, int64_t>> adapted;  // the adapted experts' (in, out) shapes
      for (const models::ParamShape& a : adapter_tensors)
        if (a.name.find(".experts.") != std::string::npos)
          for (const models::ParamShape& t : tensors)
            if (t.linear && a.name.rfind(t.name.substr(0, t.name.size() - 7) + ".", 0) == 0)
              adapted.insert({t.shape[1], t.shape[0]});
      const int64_t per_bucket = (adapter ? 5 : 7) + 8 * std::ssize(adapted);
      e.expert_kernels = buckets * per_bucket * 100'000;
      e.expert_kernels_detail = "oneDNN's, for the experts' padded batch shapes (" +
                                std::to_string(buckets) + " row counts x " +
                                std::to_string(per_bucket) + " products, ~100 KB each)";
    }
  }
  e.live_peak =
      e.weights + e.grads + e.optimizer_state + e.lowp_copies + e.activations + e.transient;

  // Loading (train/run.cpp build_model, io/hf_weights.cpp). Under an adapter a model.path base is
  // attached from the mapped files: a tensor stored in the base's dtype is a view of the mapping
  // (its pages are file-backed RSS once touched: the base's bytes, counted once in `weights`), any
  // other is converted one tensor at a time, a chunk at a time (the converted base + 8 MB). Full
  // fine-tuning allocates the parameters and copies each tensor from its mapped pages, dropped
  // after (the model + one tensor as stored); a keel checkpoint is first loaded into an f32 model
  // of its own (one more f32 model). From sizes, a low-precision frozen base is drawn directly in
  // its dtype, with one f32 tensor while an embedding grows or DoRA's magnitude is drawn.
  int64_t largest = 0, largest_stored = 0;
  for (const models::ParamShape& t : tensors) {
    largest = std::max(largest, block_bytes(t.numel() * pb));
    largest_stored = std::max(largest_stored, t.numel() * q.file_dtype_bytes);
  }
  const int64_t built = shaped ? blocks_of(tensors, pb) : (N - Nt) * pb;
  // A keel checkpoint under a new adapter gives its own model's tensors, merged, held as its run
  // held its base (io::attach_checkpoint_weights): in this run's base dtype, that base is used from
  // the files as an HF directory's is; else its f32 model is cast a tensor at a time.
  const bool from_files_as_stored =
      q.checkpoint_dir ? q.checkpoint_base_bytes == fb : q.file_dtype_bytes == fb;
  if (q.file_dtype_bytes > 0 && adapter && (!q.checkpoint_dir || from_files_as_stored)) {
    // Converted from the mapping a chunk at a time (tensor/convert_mapped.h), the chunk's pages
    // dropped as it goes: one chunk as stored, not one whole tensor.
    e.init_peak =
        e.weights + (from_files_as_stored ? 0 : std::min<int64_t>(largest_stored, 8 << 20));
  } else if (q.file_dtype_bytes > 0 && adapter) {
    e.init_peak = (shaped ? blocks_of(tensors, 4) : (N - Nt) * 4) + (fb < 4 ? largest : 0);
  } else if (q.file_dtype_bytes > 0) {
    e.init_peak = built + largest_stored;
    if (q.checkpoint_dir) e.init_peak += shaped ? blocks_of(tensors, 4) : (N - Nt) * 4;
  } else if (adapter && fb < pb) {
    e.init_peak = e.weights + largest;
  }
  // Block cache slack. host_memory keeps released blocks for the next request of their size and
  // unmaps cached blocks only when mapping a new one would take live + cached past the largest
  // live total so far plus 1/16 of it: the process keeps up to 1/16 of its peak above the live
  // bytes. Measured (peak mapped - peak live): 15.3 MB of 244.5 (GPT-2 L4 C256 B8 T256 32-true),
  // 11.2 of 186.0 (the same, bf16-mixed), 11.6 of 1630 and 26.1 of 1738 (85M GPT-2 B4 T64, 32-true
  // and bf16-mixed), 24 of 748 (102M Llama LoRA, bf16-mixed), 28 of 450 (its bf16 base while
  // building). (Those figures predate blocks under 8 MiB being mapped: from malloc, what the cache
  // dropped there stayed in glibc's heap, 9-22 MB more in the small GPT-2 runs and 34 MB in a
  // small Llama LoRA with checkpointing.) A step whose sizes evict each other every step under
  // 1/16 teaches the cache up to 1/8 (host_memory.h); the estimate keeps 1/16, the learned part
  // having measured +1.7% of the peak at GPT-2 124M B8 T256 bf16-mixed and +5.8% in 32-true.
  // With activation checkpointing it charges 1/8: a recomputed segment's activations and the
  // backward buffers beside them differ in size from block to block, and the learned slack stood
  // at its cap in every measured configuration (Llama 4 x 256 B8 T256: full, LoRA and DoRA under
  // `blocks`, full under every 2).
  const int64_t peak = std::max(e.live_peak, e.init_peak);
  // A frozen base used from the mapped files (stored in its dtype) is file-backed pages, not
  // host_memory blocks: no cache slack over it (the 1B seed bench's 2.47 GB bf16 base would add
  // 154 MB of slack that no block cache holds).
  const int64_t mapped_base =
      q.file_dtype_bytes > 0 && adapter && from_files_as_stored ? e.weights - trainable_blocks : 0;
  const int64_t slack_divisor = static_cast<int64_t>(
      q.checkpoint_every > 0 ? host_memory::kMaxSlackDivisor : host_memory::kSlackDivisor);
  e.cache_slack = e.has_activations ? (peak - std::min(peak, mapped_base)) / slack_divisor : 0;
  e.runtime = e.has_activations ? runtime_bytes() : 0;
  // The data loads first (its text, or a packed text's piece, beside its tokens), then stays for
  // the run.
  e.dataset = q.dataset_bytes;
  e.dataset_load = q.dataset_load_bytes;
  e.dataset_detail = q.dataset_detail;
  e.dataset_advice = q.dataset_advice;
  e.total = e.runtime + std::max(e.dataset + peak, e.dataset_load) + e.matmul_scratch +
            e.expert_kernels + e.cache_slack;
  return e;
}

namespace {

// The weight files of an HF directory as the loader finds them (model.safetensors, or the shards
// model.safetensors.index.json names): their total size and the stored dtype's bytes
// (the first tensor's; 0 when there are none or a file cannot be read, which the loader reports).
struct WeightFiles {
  int64_t total = 0, dtype_bytes = 0;
  bool checkpoint = false;  // a keel checkpoint (trainer.json beside the weights)
};

WeightFiles weight_files(const std::string& dir) {
  namespace fs = std::filesystem;
  WeightFiles w;
  std::set<std::string> files;
  std::error_code ec;
  w.checkpoint = fs::exists(dir + "/trainer.json", ec);
  if (fs::exists(dir + "/model.safetensors", ec)) {
    files.insert(dir + "/model.safetensors");
  } else {
    std::ifstream in(dir + "/model.safetensors.index.json");
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_object() && j.contains("weight_map") && j["weight_map"].is_object())
      for (const auto& [name, f] : j["weight_map"].items())
        if (f.is_string()) files.insert(dir + "/" + f.get<std::string>());
  }
  for (const std::string& f : files) {
    const auto size = fs::file_size(f, ec);
    if (ec) continue;
    w.total += static_cast<int64_t>(size);
    if (w.dtype_bytes == 0) try {
        const io::SafetensorsHeader h = io::read_safetensors_header(f);
        if (!h.tensors.empty())
          w.dtype_bytes = static_cast<int64_t>(dtype_size(h.tensors.front().dtype));
      } catch (const Error&) {
      }
  }
  return w;
}

}  // namespace

namespace {

// 950, 41.2k, 1.73M, 4.92B
std::string count_text(int64_t n) {
  char buf[32];
  const double v = static_cast<double>(n);
  if (n >= 1'000'000'000)
    std::snprintf(buf, sizeof buf, "%.3gB", v / 1e9);
  else if (n >= 1'000'000)
    std::snprintf(buf, sizeof buf, "%.3gM", v / 1e6);
  else if (n >= 1000)
    std::snprintf(buf, sizeof buf, "%.3gk", v / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  return buf;
}

// data.path and data.eval_path of a text, JSONL or token-file run, as data::dataset_footprint
// counts them.
void add_datasets(MemoryQuery& q, const Config& cfg) {
  const DataConfig& dc = cfg.data;
  const bool longest = dc.padding == "longest";  // else every row is data.seq_len long
  if (dc.task == "arith") {
    if (longest) q.longest_row = data::arith_longest_example(dc.digits);
    return;
  }
  try {
    if (dc.task == "text" && dc.pack)
      q.dataset_advice =
          "tokenize it once into a token file, which the run maps instead of holding (it is read "
          "in "
          "8 MiB pieces, so a corpus larger than memory converts: keel "
          "tokenize --tokenizer " +
          dc.tokenizer + " --file " + dc.path + " --output " + dc.path +
          ".bin; then data.task = \"tokens\", data.path = \"" + dc.path + ".bin\")";
    const std::unique_ptr<data::Tokenizer> tok = data::load_tokenizer(dc.tokenizer);
    for (const std::string& path : {dc.path, dc.eval_path}) {
      if (path.empty()) continue;
      data::JsonlOptions jsonl;
      jsonl.chat_date = dc.chat_date;
      const data::DatasetFootprint f =
          data::dataset_footprint(path, dc.task, *tok, dc.seq_len, dc.pack, jsonl);
      if (!f.estimated) continue;
      // The training file's longest row sizes the activations when every row of it was seen.
      if (longest && path == dc.path && f.whole) q.longest_row = f.longest;
      q.dataset_load_bytes = std::max(q.dataset_load_bytes, q.dataset_bytes + f.load_peak);
      q.dataset_bytes += f.held;
      q.dataset_detail += (q.dataset_detail.empty() ? "" : "; ") + path + ": " +
                          count_text(f.tokens) + " tokens in " + count_text(f.examples) +
                          (dc.task == "tokens" ? " rows, mapped (page cache, not counted)"
                           : dc.pack           ? " rows"
                                               : " examples");
    }
  } catch (const Error&) {
    // The run's own loading names a bad file or tokenizer; the estimate goes on without it.
  }
}

}  // namespace

MemoryQuery memory_query_from_config(const Config& cfg) {
  MemoryQuery q;
  add_datasets(q, cfg);
  q.precision = cfg.train.precision;
  q.optimizer = cfg.optim.name;
  q.momentum = cfg.optim.sgd.momentum;
  q.batch = cfg.train.batch_size;
  q.seq = cfg.data.seq_len;
  q.attention = cfg.model.attention;
  q.attention_dropout = cfg.model.attention_dropout;
  q.adapter = cfg.model.adapter;
  q.checkpoint_every = activation_checkpointing_blocks(cfg.train);
  q.grad_accum = cfg.train.grad_accum;
  if (cfg.model.adapter.kind != "none") q.base_dtype = cfg.model.base_dtype;
  if (cfg.model.path.empty()) {
    q.family = cfg.model.family;
    q.layers = cfg.model.n_layer;
    q.hidden = cfg.model.n_embd;
    q.heads = cfg.model.n_head;
    q.kv_heads = cfg.model.n_kv_head;
    q.head_dim = cfg.model.head_dim;
    q.ffn = cfg.model.intermediate_size;
    q.vocab = cfg.model.vocab_size;
    q.max_seq_len = cfg.model.max_seq_len;
    q.tie_embeddings = cfg.model.tie_embeddings;
    q.source = "the config's model.* sizes";
    return q;
  }
  // model.path: the sizes of its config.json, and its weight files as the loader reads them.
  const io::HfConfig hf = io::read_hf_config(cfg.model.path);
  set_sizes(q, hf.spec);
  q.source = cfg.model.path + "/config.json";
  const WeightFiles w = weight_files(cfg.model.path);
  if (w.total > 0) {
    q.file_dtype_bytes =
        w.dtype_bytes > 0 ? w.dtype_bytes : static_cast<int64_t>(dtype_size(hf.dtype));
    q.checkpoint_dir = w.checkpoint;
    if (w.checkpoint) q.checkpoint_base_bytes = static_cast<int64_t>(dtype_size(hf.dtype));
  }
  return q;
}

int64_t parse_checkpointing(const std::string& value, const std::string& where) {
  if (value == "none") return 0;
  if (value == "blocks") return 1;
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != value.size() || n < 1)
    throw Error(
        where + " = \"" + value +
            "\": use none, blocks (every block) or a positive N (a checkpoint every N blocks)",
        Error::kUsage);
  return n;
}

void set_sizes(MemoryQuery& q, const models::ModelSpec& s) {
  q.family = s.family;
  q.layers = s.n_layer;
  q.hidden = s.n_embd;
  q.heads = s.n_head;
  q.kv_heads = s.kv_heads();
  q.head_dim = s.head_width;
  q.hf_model_type = s.hf_model_type;
  q.ffn = s.ffn_dim();
  q.moe = s.moe;
  q.vocab = s.vocab_size;
  q.max_seq_len = s.max_seq_len;
  q.tie_embeddings = s.tie_embeddings;
  q.parallel_residual = s.parallel_residual;
  q.attention_bias = s.attention_bias;
}

std::string memory_fit_advice(const MemoryQuery& q, int64_t available) {
  const MemoryEstimate e = estimate_memory(q);
  if (available < 0 || e.total <= available) return "";
  struct Option {
    std::string what;
    int64_t total;
  };
  std::vector<Option> options;
  auto consider = [&](const std::string& what, MemoryQuery alt) {
    try {
      const int64_t t = estimate_memory(alt).total;
      // Below 1% it lowers nothing worth a change (under data that dominates: a few MB of GBs).
      if (t < e.total - e.total / 100) options.push_back({what, t});
    } catch (const Error&) {
    }
  };
  if (q.checkpoint_every != 1 && q.layers > 1) {
    MemoryQuery a = q;
    a.checkpoint_every = 1;
    consider("train.activation_checkpointing = blocks", a);
  }
  if (q.adapter.kind != "none" && q.base_dtype != "bf16") {
    MemoryQuery a = q;
    a.base_dtype = "bf16";
    consider("model.base_dtype = bf16", a);
  }
  if (q.adapter.kind == "none" && q.layers > 0) {
    MemoryQuery a = q;
    a.adapter.kind = "lora";
    a.adapter.r = 16;
    // PEFT's usual targets: q and v, or the one Linear that holds them (Phi-3's qkv_proj,
    // GPT-NeoX's and Falcon's query_key_value, CodeGen's qkv_proj).
    const models::ModelSpec sp = spec_of(q);
    a.adapter.target_modules = q.family != "llama" ? std::vector<std::string>{"c_attn", "c_proj"}
                               : sp.fused_qkv()    ? std::vector<std::string>{sp.module_names().qkv}
                                                   : std::vector<std::string>{"q_proj", "v_proj"};
    a.base_dtype = "bf16";
    std::string targets;
    for (const std::string& t : a.adapter.target_modules)
      targets += (targets.empty() ? "" : ", ") + t;
    consider("an adapter: model.adapter.kind = lora (r = 16 on " + targets +
                 ") with model.base_dtype = bf16",
             a);
  }
  if (resolve_precision(q.precision, Device::cpu()).name() == "32-true") {
    MemoryQuery a = q;
    a.precision = "bf16-mixed";
    consider("train.precision = bf16-mixed", a);
  }
  if (q.batch > 1) {
    MemoryQuery a = q;
    a.batch = 1;
    consider("train.batch_size = 1 (raise train.grad_accum to keep the batch)", a);
  }
  if (q.seq > 128) {
    MemoryQuery a = q;
    a.seq = q.seq / 4;
    consider("data.seq_len = " + std::to_string(a.seq), a);
  }
  // The step's own options together (the model, precision and sequence unchanged).
  {
    MemoryQuery a = q;
    std::vector<std::string> parts;
    if (q.checkpoint_every != 1 && q.layers > 1) a.checkpoint_every = 1, parts.push_back("blocks");
    if (q.adapter.kind != "none" && q.base_dtype != "bf16")
      a.base_dtype = "bf16", parts.push_back("base_dtype bf16");
    if (q.batch > 1) a.batch = 1, parts.push_back("batch_size 1");
    if (parts.size() > 1) {
      std::string what = "together (";
      for (size_t i = 0; i < parts.size(); ++i) what += (i ? ", " : "") + parts[i];
      consider(what + ")", a);
    }
  }
  std::stable_sort(options.begin(), options.end(),
                   [&](const Option& a, const Option& b) { return a.total < b.total; });
  std::string m = "the run needs an estimated " + format_bytes(e.total) + " but only " +
                  format_bytes(available) + " are available (" + available_memory_source() +
                  "); nothing was loaded";
  // A loading peak no option of the step lowers: say so rather than list nothing.
  if (e.init_peak >= e.live_peak)
    m += std::string(". The peak is while loading (") +
         (q.file_dtype_bytes > 0 ? "the model and one tensor of its files as stored"
                                 : "the model and one f32 tensor while its base is drawn") +
         ": " + format_bytes(e.init_peak) + ")";
  // No option of the step lowers what the data holds: say what it holds and what would.
  if (e.dataset > 0 && 4 * std::max(e.dataset, e.dataset_load) >= e.total)
    m += ". The data holds " + format_bytes(e.dataset) + " for the run (" + e.dataset_detail +
         ") and " + format_bytes(e.dataset_load) + " while it loads: " +
         (e.dataset_advice.empty() ? std::string() : e.dataset_advice + "; or ") +
         "train on a part of the file at a time, or with a tokenizer of fewer tokens a byte (a "
         "BPE tokenizer's token covers about 4 bytes of English, the byte tokenizer's 1)";
  if (!options.empty()) {
    m += ". What lowers the estimate:";
    for (const Option& o : options)
      m += "\n  " + o.what + ": " + format_bytes(o.total) + (o.total <= available ? " (fits)" : "");
  }
  m += "\n`keel memory --config FILE` breaks the estimate down";
  return m;
}

std::string format_memory(const MemoryEstimate& e) {
  std::ostringstream o;
  char buf[200];
  std::snprintf(buf, sizeof buf, "memory estimate: %.2fM parameters, %s (1 MB = 10^6 bytes)\n",
                static_cast<double>(e.params) / 1e6, e.precision.c_str());
  o << buf;
  if (!e.source.empty()) o << "  sizes from " << e.source << "\n";
  if (e.adapter_params > 0) {
    std::snprintf(buf, sizeof buf, "  trainable: %.3fM adapter parameters (%.3f%% of the model)\n",
                  static_cast<double>(e.adapter_params) / 1e6,
                  100.0 * static_cast<double>(e.adapter_params) / static_cast<double>(e.params));
    o << buf;
  }
  auto row = [&](const char* name, int64_t b, const std::string& note) {
    std::snprintf(buf, sizeof buf, "  %-22s %12s  %s\n", name, mb(b).c_str(), note.c_str());
    o << buf;
  };
  const bool mixed = e.lowp_copies > 0;
  row("weights", e.weights, e.weights_detail);
  row("gradients", e.grads, "");
  row("optimizer state", e.optimizer_state, "");
  if (mixed) row("low-precision copies", e.lowp_copies, "autocast's per-step weight casts");
  if (e.has_activations) {
    // The "no kernel" note only where there is scratch: under 0 MB it contradicted doctor's
    // "the CPU has native bf16 dot products" one line above it.
    row("matmul scratch", e.matmul_scratch,
        e.matmul_scratch > 0 ? "f32 operand copies: no kernel for the dtype here"
                             : "none: the matmuls take their operands as they are");
    row("activations", e.activations,
        "saved for backward, one micro-batch of " + e.batch_detail +
            (e.checkpoint.empty() ? "" : " (" + e.checkpoint + ")") + ":");
    for (const auto& it : e.activation_items) {
      std::snprintf(buf, sizeof buf, "    %-20s %12s  %s\n", it.name.c_str(), mb(it.bytes).c_str(),
                    it.detail.c_str());
      o << buf;
    }
    row("backward transient", e.transient, e.transient_detail);
  } else {
    o << "  activations            (give --batch --seq --layers --hidden to estimate them)\n";
  }
  if (e.has_activations) {
    row("live peak", e.live_peak, "tensor bytes alive at once");
    row("block cache slack", e.cache_slack, "released blocks host_memory keeps for reuse");
    row("runtime", e.runtime, "binary, libraries, thread pools");
    if (e.expert_kernels > 0) row("expert kernels", e.expert_kernels, e.expert_kernels_detail);
  }
  if (e.dataset > 0) row("dataset", e.dataset, e.dataset_detail + " (held for the run)");
  if (e.dataset_load > e.dataset)
    row("loading the data", e.dataset_load,
        "the file's text (packed: a piece of it) beside its tokens, before the model");
  if (e.init_peak > 0)
    row("while loading", e.init_peak,
        "the model as loaded (a base in its stored dtype mapped from its files) and one tensor "
        "being converted");
  const int64_t model_peak = std::max(e.live_peak, e.init_peak);
  row("total", e.total,
      e.dataset_load > e.dataset + model_peak ? "expected peak resident memory (loading the data)"
      : e.init_peak > e.live_peak             ? "expected peak resident memory (while loading)"
                                              : "expected peak resident memory of the step");
  return o.str();
}

nlohmann::json memory_to_json(const MemoryEstimate& e) {
  nlohmann::json j = {{"precision", e.precision},
                      {"params", e.params},
                      {"trainable", e.trainable},
                      {"adapter_params", e.adapter_params},
                      {"weights", e.weights},
                      {"grads", e.grads},
                      {"optimizer_state", e.optimizer_state},
                      {"lowp_copies", e.lowp_copies},
                      {"activations", e.activations},
                      {"transient", e.transient},
                      {"matmul_scratch", e.matmul_scratch},
                      {"cache_slack", e.cache_slack},
                      {"live_peak", e.live_peak},
                      {"init_peak", e.init_peak},
                      {"runtime", e.runtime},
                      {"expert_kernels", e.expert_kernels},
                      {"dataset", e.dataset},
                      {"dataset_load", e.dataset_load},
                      {"total", e.total},
                      {"source", e.source},
                      {"checkpoint", e.checkpoint}};
  nlohmann::json items = nlohmann::json::array();
  for (const auto& it : e.activation_items)
    items.push_back({{"name", it.name}, {"bytes", it.bytes}, {"detail", it.detail}});
  j["activation_items"] = items;
  return j;
}

int ranks_on_this_machine() {
  // Open MPI's mpirun and MPICH's hydra say how many of the job's ranks run on this machine.
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const char* v = std::getenv(var)) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && n >= 1 && n <= 1 << 20) return static_cast<int>(n);
    }
  return 1;
}

int64_t available_memory_bytes() {
  // Testing only: KEEL_TEST_MEM_AVAILABLE=BYTES stands in for MemAvailable (a test cannot shrink
  // the machine, and a model larger than any machine's memory takes minutes to read).
  if (const char* v = std::getenv("KEEL_TEST_MEM_AVAILABLE"); v && *v)
    return std::strtoll(v, nullptr, 10) / ranks_on_this_machine();
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (f >> key >> value) {
    std::getline(f, unit);
    // Each rank on this machine estimates its own step: against all of MemAvailable, N ranks
    // that each fitted alone were killed together by the OOM killer.
    if (key == "MemAvailable:") return value * 1024 / ranks_on_this_machine();
  }
  return -1;
}

std::string available_memory_source() {
  const int ranks = ranks_on_this_machine();
  return ranks == 1 ? "MemAvailable in /proc/meminfo"
                    : "a rank's share of MemAvailable in /proc/meminfo: " + std::to_string(ranks) +
                          " ranks run on this machine";
}

}  // namespace keel::monitor

namespace keel::monitor {

namespace {
std::string megabytes(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  return buf;
}
}  // namespace

std::string memory_floor_refusal(const MemoryQuery& q, int64_t available) {
  if (available < 0) return "";
  // In doubles: sizes near their upper bounds would overflow the int64 arithmetic of the full
  // estimate (products of sizes near int64's range).
  const double B = static_cast<double>(q.batch), T = static_cast<double>(q.seq),
               L = static_cast<double>(q.layers), E = static_cast<double>(q.hidden),
               V = static_cast<double>(q.vocab > 0 ? q.vocab : 259);
  // (a mixture of experts: its experts' three matrices each)
  const double experts =
      static_cast<double>(q.moe.experts) * 3 * E * static_cast<double>(q.moe.ffn);
  const double floor_bytes = 2 * (V * E + L * (12 * E * E + experts)) + 2 * B * T * V;
  const double products = B * T * T * std::max(1.0, E / 64) * 8 + B * T * (V + 16 * E) * 8;
  if (floor_bytes <= 100 * static_cast<double>(available) && products <= 4e18) return "";
  return "the run needs at least " + megabytes(floor_bytes) +
         " (parameters in 16 bits and one micro-batch's logits) but only " +
         megabytes(static_cast<double>(available)) + " are available (" +
         available_memory_source() +
         "); nothing was loaded. Lower "
         "train.batch_size or data.seq_len (activations), or model.n_layer, model.n_embd, "
         "model.vocab_size (weights); `keel memory --config FILE` breaks the estimate down";
}

void check_run_memory(const Config& cfg, const std::function<void(const std::string&)>& say) {
  const int64_t available = available_memory_bytes();
  if (available < 0) return;
  nn::check_adapter_options(cfg.model.adapter);  // the run refuses these first, whatever it needs
  MemoryQuery q = memory_query_from_config(cfg);
  q.flags = false;  // its messages name the config's keys, not keel memory's flags
  const std::string refusal = memory_floor_refusal(q, available);
  if (!refusal.empty()) throw Error(refusal, Error::kUsage);
  std::string advice;
  try {
    advice = memory_fit_advice(q, available);
  } catch (const Error& e) {
    // A combination the estimate does not model: the run's own checks follow (and name it).
    if (say) say(std::string("note: no memory estimate before loading: ") + e.what());
    return;
  }
  if (!advice.empty()) throw Error(advice, Error::kUsage);
}

}  // namespace keel::monitor
