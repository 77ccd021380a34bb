#include "keel/models/causal_lm.h"

#include <algorithm>

#include "keel/models/gpt2.h"
#include "keel/models/llama.h"
#include "keel/nn/checkpoint.h"
#include "keel/nn/layers.h"
#include "keel/numerics/error.h"
#include "keel/ops/shape.h"
#include "keel/tensor/random.h"

#include <cmath>

namespace keel::models {

int64_t ModelSpec::ffn_dim() const {
  if (intermediate_size > 0) return intermediate_size;
  if (family == "gpt2") return 4 * n_embd;
  const int64_t h = 8 * n_embd / 3;  // Llama: 2/3 of 4d, rounded up to a multiple of 32
  return (h + 31) / 32 * 32;
}

double ModelSpec::attention_scale() const {
  if (attention_multiplier > 0) return attention_multiplier;
  const double d =
      query_pre_attn_scalar > 0 ? query_pre_attn_scalar : static_cast<double>(head_dim());
  return 1.0 / std::sqrt(d);
}

ModelSpec::ModuleNames ModelSpec::module_names() const {
  if (gpt_neox())
    return {"gpt_neox",        "embed_in", "final_layer_norm", "embed_out",    "attention",
            "query_key_value", "dense",    "dense_h_to_4h",    "dense_4h_to_h"};
  if (phi())
    return {"model", "embed_tokens", "final_layernorm", "lm_head", "self_attn", "qkv_proj", "dense",
            "fc1",   "fc2"};
  if (starcoder2())
    return {"model",    "embed_tokens", "norm", "lm_head", "self_attn",
            "qkv_proj", "o_proj",       "c_fc", "c_proj"};
  if (gptj()) {
    ModuleNames n{"transformer", "wte",      "ln_f",  "lm_head", "attn",
                  "qkv_proj",    "out_proj", "fc_in", "fc_out"};
    n.layers = "h";
    n.attn_in_norm = "ln_1";
    return n;
  }
  if (falcon()) {
    ModuleNames n{"transformer", "word_embeddings", "ln_f",
                  "lm_head",     "self_attention",  "query_key_value",
                  "dense",       "dense_h_to_4h",   "dense_4h_to_h"};
    n.layers = "h";
    if (norm_per_branch) {
      n.attn_in_norm = "ln_attn";
      n.mlp_norm = "ln_mlp";
    }
    return n;
  }
  if (hf_model_type == "glm4")  // (its sandwich norms' names)
    return {"model",
            "embed_tokens",
            "norm",
            "lm_head",
            "self_attn",
            "qkv_proj",
            "o_proj",
            "up_proj",
            "down_proj",
            "post_self_attn_layernorm",
            "post_attention_layernorm",
            "post_mlp_layernorm"};
  return {"model",    "embed_tokens", "norm",    "lm_head",  "self_attn",
          "qkv_proj", "o_proj",       "up_proj", "down_proj"};
}

std::string ModelSpec::embedding_name() const {
  if (family == "gpt2") return "transformer.wte.weight";
  const ModuleNames n = module_names();
  return std::string(n.model) + "." + n.embed + ".weight";
}

void ModelSpec::validate() const {
  auto bad = [](const std::string& m) { return Error("model: " + m, Error::kUsage); };
  if (family != "gpt2" && family != "llama")
    throw bad("unknown family '" + family + "': use gpt2 or llama");
  if (n_layer < 1 || n_embd < 1 || n_head < 1) throw bad("n_layer, n_embd and n_head must be >= 1");
  if (head_width < 0) throw bad("head_width must be >= 0 (0: n_embd / n_head)");
  if (family == "gpt2" && kv_heads() != n_head && !(gpt_bigcode() && kv_heads() == 1))
    throw bad("gpt2's key/value heads are its query heads (" + std::to_string(n_head) +
              "), or one under gpt_bigcode's multi_query, not " + std::to_string(kv_heads()));
  if (head_width > 0 && family == "gpt2" && head_width * n_head != n_embd)
    throw bad("gpt2's heads are n_embd / n_head wide; head_width " + std::to_string(head_width) +
              " is llama's");
  if (head_width == 0 && n_embd % n_head)
    throw bad("n_embd " + std::to_string(n_embd) + " is not divisible by n_head " +
              std::to_string(n_head));
  if (family == "llama" && head_dim() % 2)
    throw bad("llama needs an even head dim for RoPE, got " + std::to_string(head_dim()));
  if (!(partial_rotary_factor > 0 && partial_rotary_factor <= 1))
    throw bad(
        "partial_rotary_factor must be in (0, 1] (the share of a head's channels RoPE "
        "turns), got " +
        std::to_string(partial_rotary_factor));
  if (family == "llama" && (rotary_dim() < 2 || rotary_dim() % 2))
    throw bad("RoPE turns pairs of channels: partial_rotary_factor " +
              std::to_string(partial_rotary_factor) + " of a head of " +
              std::to_string(head_dim()) + " gives " + std::to_string(rotary_dim()) +
              ", which is not an even number of 2 or more");
  if (n_head % kv_heads())
    throw bad("n_head " + std::to_string(n_head) + " is not a multiple of n_kv_head " +
              std::to_string(kv_heads()));
  // One token has nothing to predict: its softmax is 1 and the loss 0, whatever the weights.
  if (vocab_size < 2)
    throw bad("vocab_size = " + std::to_string(vocab_size) + ": a model needs at least 2 tokens");
  if (max_seq_len < 1) throw bad("max_seq_len must be >= 1");
  if (!(attn_softcap >= 0) || !(final_softcap >= 0) || !(query_pre_attn_scalar >= 0) ||
      !std::isfinite(attn_softcap + final_softcap + query_pre_attn_scalar))
    throw bad("attn_softcap, final_softcap and query_pre_attn_scalar must be finite and >= 0");
  if (sliding_period < 0) throw bad("sliding_period must be >= 0");
  if (nope_period < 0) throw bad("nope_period must be >= 0 (0: every layer rotates)");
  for (const double m : {embedding_multiplier, residual_multiplier, logits_scaling})
    if (!(m > 0) || !std::isfinite(m))
      throw bad(
          "embedding_multiplier, residual_multiplier and logits_scaling must be positive "
          "and finite");
  if (!(attention_multiplier >= 0) || !std::isfinite(attention_multiplier))
    throw bad("attention_multiplier must be finite and >= 0 (0: 1 / sqrt(head_dim))");
  if (!(rope_local_theta >= 0) || !std::isfinite(rope_local_theta))
    throw bad("rope_local_theta must be finite and >= 0 (0: rope_theta)");
  // (HF's PhiForCausalLM ties lm_head's weight but keeps its bias; no published Phi or GPT-NeoX
  // ties its head.)
  if ((phi() || gpt_neox() || gptj()) && tie_embeddings)
    throw bad(architecture() +
              "'s head is not tied to its embedding here: tie_embeddings must be "
              "false");
  if (gpt_neox() && kv_heads() != n_head)
    throw bad("gpt_neox's query_key_value holds as many key/value heads as query heads (" +
              std::to_string(n_head) + "), not " + std::to_string(kv_heads()));
  if (qk_layernorm && hf_model_type != "cohere" && !stablelm() && !phi())
    throw bad("qk_layernorm normalizes Command-R+'s, StableLM's and Phi's queries and keys only");
  if (gptj() && kv_heads() != n_head)
    throw bad(architecture() +
              "'s keys and values are as wide as its queries: n_kv_head must be n_head (" +
              std::to_string(n_head) + "), not " + std::to_string(kv_heads()));
  if (codegen() && n_head % kCodegenBlocks)
    throw bad(
        "codegen's qkv_proj holds its heads in 4 blocks: n_head must be a multiple of 4, "
        "not " +
        std::to_string(n_head));
  if ((gptj() || falcon()) && head_width > 0)
    throw bad(architecture() + "'s heads are n_embd / n_head wide (its head_dim is not a field)");
  if (falcon() && !new_decoder_architecture && kv_heads() != 1 && kv_heads() != n_head)
    throw bad(
        "falcon's query_key_value holds one key/value head (multi_query) or one a query head "
        "unless new_decoder_architecture, not " +
        std::to_string(kv_heads()) + " of " + std::to_string(n_head));
  if (falcon() && new_decoder_architecture && !parallel_residual)
    throw bad(
        "falcon's new_decoder_architecture runs its attention and MLP side by side "
        "(parallel_attn = true), as HF's FalconDecoderLayer");
  if (falcon() && norm_per_branch && !(new_decoder_architecture && parallel_residual))
    throw bad(
        "falcon's two norms a block (num_ln_in_parallel_attn 2) are new_decoder_architecture's");
  // (HF's rotary Falcon drops no attention probabilities; a parallel block not its attention's
  // output either: model.attention_dropout would change nothing.)
  if (falcon() && parallel_residual && attention_dropout > 0)
    throw bad(
        "falcon's parallel blocks drop no attention output or probabilities (HF's "
        "FalconDecoderLayer; its hidden_dropout is model.dropout): attention_dropout must be "
        "0, not " +
        std::to_string(attention_dropout));
  if (moe.experts > 0 && gelu_mlp())
    throw bad(architecture() + " has no mixture-of-experts layers");
  if (!(clip_qkv >= 0) || !std::isfinite(clip_qkv))
    throw bad("clip_qkv must be finite and >= 0 (0: no clamp)");
  if (clip_qkv > 0 && !olmo() && hf_model_type != "olmoe")
    throw bad("clip_qkv clamps OLMo's and OLMoE's projections only");
  if (moe.experts < 0) throw bad("moe.experts must be >= 0 (0: a dense model)");
  if (moe.experts > 0) {
    if (family != "llama") throw bad("only the llama family has mixture-of-experts layers");
    if (moe.per_token < 1 || moe.per_token > moe.experts)
      throw bad("experts a token (num_experts_per_tok) = " + std::to_string(moe.per_token) +
                " must be from 1 to the experts, " + std::to_string(moe.experts));
    if (moe.ffn < 1) throw bad("an expert's width (moe_intermediate_size) must be >= 1");
    if (moe.sparse_step < 1) throw bad("moe.sparse_step (decoder_sparse_step) must be >= 1");
    for (int64_t l : moe.dense_layers)
      if (l < 0 || l >= n_layer)
        throw bad("moe.dense_layers (mlp_only_layers) names layer " + std::to_string(l) + " of " +
                  std::to_string(n_layer));
  }
}

Tensor CausalLM::forward_cached(const Tensor& ids, KVCache& cache, bool last_only) {
  KEEL_CHECK(ids.dim() == 2 && ids.size(0) == 1,
             "forward_cached: input_ids must be [1, T], got " + shape_str(ids.shape()));
  const KVCaches one{{&cache}};
  Tensor logits = run(ids, ops::AttentionMask(), &one,
                      last_only ? std::vector<int64_t>{ids.size(1) - 1} : std::vector<int64_t>{});
  cache.length += ids.size(1);
  return logits;
}

Tensor CausalLM::keep_positions(const Tensor& x, const std::vector<int64_t>& keep) {
  if (keep.empty()) return x;
  KEEL_CHECK(!grad_mode_enabled(), "keep_positions: for decoding, without gradients");
  const int64_t c = x.size(-1), n = x.numel() / c, kept = std::ssize(keep);
  const Tensor flat = x.view({n, c});
  Tensor out = Tensor::empty({kept, 1, c}, x.dtype(), x.device());
  const Tensor rows = out.view({kept, c});
  for (int64_t k = 0; k < kept; ++k) {
    const int64_t at = keep[static_cast<size_t>(k)];
    KEEL_CHECK(at >= 0 && at < n,
               "keep_positions: position " + std::to_string(at) + " of " + std::to_string(n));
    Tensor row = rows.slice_rows(k, k + 1);
    row.copy_from(flat.slice_rows(at, at + 1));
  }
  return out;
}

Tensor CausalLM::forward_cached_rows(const Tensor& ids, const std::vector<KVCache*>& caches) {
  KEEL_CHECK(ids.dim() == 2 && ids.size(1) == 1 && ids.size(0) == std::ssize(caches),
             "forward_cached_rows: input_ids must be [" + std::to_string(caches.size()) +
                 ", 1], got " + shape_str(ids.shape()));
  const KVCaches rows{caches};
  Tensor logits = run(ids, ops::AttentionMask(), &rows, {});
  for (KVCache* c : caches) c->length += 1;
  return logits;
}

Tensor CausalLM::prefill_rows(const Tensor& ids, const std::vector<int64_t>& lengths,
                              const std::vector<KVCache*>& caches) {
  const int64_t rows = std::ssize(caches);
  KEEL_CHECK(ids.dim() == 2 && ids.size(0) == rows && std::ssize(lengths) == rows,
             "prefill_rows: input_ids must be [" + std::to_string(rows) +
                 ", T] with a length a row, got " + shape_str(ids.shape()) + " and " +
                 std::to_string(lengths.size()) + " lengths");
  for (int64_t b = 0; b < rows; ++b)
    KEEL_CHECK(caches[b]->length == 0 && lengths[b] >= 1 && lengths[b] <= ids.size(1),
               "prefill_rows: row " + std::to_string(b) + " needs an empty cache and 1 to " +
                   std::to_string(ids.size(1)) + " real tokens");
  const KVCaches all{caches};
  std::vector<int64_t> last;  // each row's last real position
  for (int64_t b = 0; b < rows; ++b) last.push_back(b * ids.size(1) + lengths[b] - 1);
  Tensor logits = run(ids, ops::AttentionMask(), &all, last);
  // The padding's keys and values stay past each row's length, where its decode writes over them.
  for (int64_t b = 0; b < rows; ++b) caches[b]->length = lengths[b];
  return logits;
}

Tensor CausalLM::run_blocks(const std::vector<nn::Module*>& blocks, Tensor x,
                            BlockForward block_forward, bool may_checkpoint) {
  const size_t every = static_cast<size_t>(std::max<int64_t>(blocks_per_segment_, 0));
  if (every == 0 || !may_checkpoint || !is_training() || !grad_mode_enabled()) {
    for (size_t i = 0; i < blocks.size(); ++i) x = block_forward(i, x);
    return x;
  }
  for (size_t first = 0; first < blocks.size(); first += every) {
    const size_t last = std::min(blocks.size(), first + every);
    bool trainable = false;
    for (size_t i = first; i < last && !trainable; ++i)
      trainable = blocks[i]->num_parameters(/*trainable_only=*/true) > 0;
    x = nn::checkpoint(
        [block_forward, first, last](const Tensor& in) {
          Tensor h = in;
          for (size_t i = first; i < last; ++i) h = block_forward(i, h);
          return h;
        },
        x, trainable);
  }
  return x;
}

ops::AttentionDropout attention_probability_dropout(const nn::Module& m, double p) {
  if (!m.is_training() || p == 0) return {};
  return {static_cast<float>(p), nn::dropout_mask_seed(m.path() + ".attn_dropout")};
}

std::vector<Tensor> split_grouped_qkv(const Tensor& qkv, int64_t n_head, int64_t n_kv_head) {
  const int64_t r = n_head / n_kv_head, d = qkv.size(-1) / (n_head + 2 * n_kv_head);
  Shape by_group = qkv.shape(), queries = qkv.shape(), keys = qkv.shape();
  by_group.back() = n_kv_head;
  by_group.push_back((r + 2) * d);
  queries.back() = n_head * d;
  keys.back() = n_kv_head * d;
  const std::vector<Tensor> parts = ops::split_last(ops::reshape(qkv, by_group), {r * d, d, d});
  return {ops::reshape(parts[0], queries), ops::reshape(parts[1], keys),
          ops::reshape(parts[2], keys)};
}

std::unique_ptr<CausalLM> make_causal_lm(const ModelSpec& spec, uint64_t seed) {
  spec.validate();
  std::unique_ptr<CausalLM> m;
  if (spec.family == "gpt2")
    m = std::make_unique<GPT2LMHeadModel>(spec, seed);
  else
    m = std::make_unique<LlamaForCausalLM>(spec, seed);
  m->assign_paths();
  return m;
}

std::unique_ptr<CausalLM> make_causal_lm_for_loading(const ModelSpec& spec) {
  DeferStorage deferred;
  std::unique_ptr<CausalLM> m = make_causal_lm(spec, 0);
  m->train(false);
  return m;
}

std::optional<double> init_std(const ModelSpec& spec, const std::string& name) {
  auto ends_with = [&](const char* suffix) {
    const size_t n = std::char_traits<char>::length(suffix);
    return name.size() > n && name.compare(name.size() - n, n, suffix) == 0;
  };
  if (spec.family == "gpt2") {
    // GPT2PreTrainedModel._init_weights: biases 0, LayerNorms 1, residual projections scaled.
    if (ends_with(".bias") || name.find(".ln_") != std::string::npos) return std::nullopt;
    if (name.find("c_proj.weight") != std::string::npos)
      return spec.init_std / std::sqrt(2.0 * spec.n_layer);
    return spec.init_std;
  }
  // LlamaPreTrainedModel._init_weights: N(0, initializer_range) for linears and embeddings;
  // norms 1 and biases 0 (Qwen2's q/k/v), as built. (Falcon's and GPT-J's norms are ln_attn,
  // ln_mlp, ln_1 and ln_f.)
  if (name.find("norm") != std::string::npos || name.find(".ln_") != std::string::npos ||
      ends_with(".bias"))
    return std::nullopt;
  return spec.init_std;
}

void init_parameters(CausalLM& m, uint64_t seed) {
  Rng rng(seed);
  for (auto& [name, p] : m.named_parameters()) {
    if (p.is_deferred()) continue;  // built for loading: the files provide every value
    if (const auto sd = init_std(m.spec(), name)) fill_normal(p, rng, 0.0, *sd);
  }
}

void replay_init(const ModelSpec& spec, uint64_t seed,
                 const std::function<bool(const std::string& name)>& want,
                 const std::function<void(const std::string& name, const Tensor& f32)>& use) {
  ModelSpec f32_spec = spec;
  f32_spec.param_dtype = DType::F32;
  const auto shapes = make_causal_lm_for_loading(f32_spec);  // names and shapes only
  Rng rng(seed);
  for (auto& [name, p] : shapes->named_parameters()) {
    const auto sd = init_std(spec, name);
    if (!sd) continue;
    if (!want(name)) {  // the same draws, not kept
      for (int64_t i = 0, n = p.numel(); i < n; ++i) rng.normal();
      continue;
    }
    Tensor v = Tensor::empty(p.shape(), DType::F32);
    fill_normal(v, rng, 0.0, *sd);
    use(name, v);
  }
}

}  // namespace keel::models
