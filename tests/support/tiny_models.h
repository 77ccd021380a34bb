// The tiny GPT-2, Llama, Qwen2, Qwen3, Phi-3 and Gemma of tests/fixtures/gen_models.py
// (header-only: tests of any layer from models/ on include it). Qwen2 and Qwen3 are the Llama
// family with q/k/v biases and with per-head q/k norms.
#pragma once
#include <cmath>
#include <string>
#include <vector>

#include "keel/models/causal_lm.h"

namespace keel::test {

// "qwen3_d8": the Qwen3 with heads 8 wide over n_embd 16 / 4 heads (Qwen3-0.6B's head_dim 128
// over 1024 / 16). "mistral_w3": the Llama as a Mistral whose attention slides over the last 3
// positions (Mistral-7B-v0.1's sliding_window 4096). "qwen2_w3": the Qwen2 with use_sliding_window,
// a window of 3 on layer 1 only (max_window_layers 1). "phi3_w3": the Llama as a Phi-3, its q/k/v
// one qkv_proj and gate/up one gate_up_proj, sliding over the last 3 positions on every layer
// (Phi-3-mini-4k's sliding_window 2047). "phi3_lr" and "phi3_sr": the Phi-3 without a window,
// its RoPE Phi-3-128k's longrope (max_position_embeddings 32) past an original context of 4 (the
// long factors at T = 8) and within one of 16 (the short ones). "phi4m": a Phi-4-mini (heads 8
// wide whose RoPE turns 6 channels, partial_rotary_factor 0.75, with longrope past an original
// context of 4; the head tied to the embedding). "gemma": the Llama as a Gemma (1 +
// weight norms, GeGLU, the embedding times sqrt(16), the head tied to it). "gemma2": a Gemma-2
// (and its sandwich norms, a window of 3 on layer 0 only, query_pre_attn_scalar 6 beside head_dim
// 4, attention and final soft caps of 2 and 3). "gemma3": a Gemma-3 (Gemma-2's layers with 1 + w
// q/k norms and no caps; its sliding layer 0 rotating by a RoPE base of 100, layer 1 by 1e4).
// "smollm3": a SmolLM3 (layer 1 without RoPE, its every 4th of 36; the head tied). "granite": a
// Granite (embedding times 3, sublayer outputs times 0.22, q·kᵀ times 0.3, logits / 4). "olmo2":
// an OLMo-2 (norms after the attention and the MLP only, q/k norms over the whole projections).
// "yarn": the Llama with heads 8 wide and YaRN rope_scaling (factor 4 over an original context of
// 1000: pair 0 kept, 1 and 2 blended, 3 interpolated; attention factor 0.1 ln 4 + 1). "olmo3": an
// OLMo-3 (OLMo-2's layers with the yarn family's heads and rope_scaling; layer 0 sliding over 3
// positions and rotating without the scaling, layer 1 full with it). "exaone4": an EXAONE-4
// (OLMo-2's norms with per-head q/k norms, the yarn family's heads and rope_scaling; layer 0
// sliding over 3 positions and rotating, layer 1 full and without RoPE). "qwen3_moe", "olmoe",
// "mixtral": mixtures of 4 experts 24 wide, 2 a token: a Qwen3-MoE (Qwen3's q/k norms, weights
// renormalized, layer 0 dense: its mlp_only_layers), an OLMoE (q/k norms over the projections,
// weights not renormalized), a Mixtral (w1/w3/w2, renormalized). "phi": a Phi-2 (two heads 8 wide
// over one key/value head, RoPE on 4 of their channels, the tanh gelu, biases, parallel blocks on
// one LayerNorm, lm_head with a bias). "gpt_neox": a Pythia (two heads, RoPE on 2 of 8 channels,
// the exact gelu, q/k/v one product head by head, a norm for each branch); "gpt_neox_seq": the
// same without use_parallel_residual (the branches in sequence). "stablelm": a StableLM-2 (Llama's
// layers with biased LayerNorms and q/k/v biases, RoPE on 2 of 8 channels, two query heads a
// key/value head); "stablelm_par": with use_parallel_residual and no q/k/v biases. "olmo": an OLMo
// (Llama's layers with LayerNorms that have no parameters); "olmo_clip": with clip_qkv 1. "glm": a
// GLM-4 (q/k/v biases, gate_up_proj, heads 8 wide whose RoPE turns adjacent pairs of the first 4
// channels); "glm4": a GLM-4-0414 (and a norm after the attention and after the MLP). "dynamic":
// the Llama with dynamic NTK RoPE (factor 2) past an original context of 4. "falcon": a Falcon-7B
// (one key/value head for 4 query heads, q/k/v fused a group at a time, parallel blocks on one
// LayerNorm, no biases, the exact gelu, the head tied); "falcon40b": a Falcon-40B
// (new_decoder_architecture: 2 groups of 2 queries, ln_attn and ln_mlp, an lm_head of its own);
// "falcon_seq": the older layout (a group a head) with its branches in sequence. "gptj": a GPT-J
// (two heads 8 wide, RoPE on adjacent pairs of their first 4 channels, Phi's block under GPT-2's
// names, q/k/v without biases, lm_head with one). "cohere_qk", "stablelm_qk", "phi_qk": the cohere,
// stablelm_par and phi families with LayerNorms over each head's query and key before RoPE
// (Command-R+'s use_qk_norm: a weight [heads, head_dim]; StableLM-2-12B's qk_layernorm: one per
// head; Phi's qk_layernorm: one weight and bias for every head). "codegen": a CodeGen (GPT-J's
// block with q, v and k one qkv_proj in 4 blocks of 2 heads; 8 heads 4 wide over 32 channels).
// "starcoder2": a StarCoder2 (biased LayerNorms and projections, the tanh-gelu MLP c_fc / c_proj,
// every layer sliding over 3 positions, the head tied). "gpt_bigcode", "gpt_bigcode_mha": GPT-2's
// tiny model as a GPT-BigCode (nn.Linear weights), with multi_query (one key/value head for its
// two) and without (each head's q, k, v side by side).
// Every family above, each with its PyTorch fixtures in tests/fixtures/models.safetensors (the
// parity and optimizer-step tests run over all of them).
inline const std::vector<std::string> kFixtureFamilies = {
    "gpt2",         "llama",     "qwen2",      "qwen3",       "qwen3_d8",       "mistral_w3",
    "qwen2_w3",     "phi3_w3",   "phi3_lr",    "phi3_sr",     "phi4m",          "gemma",
    "gemma2",       "gemma3",    "smollm3",    "granite",     "olmo2",          "yarn",
    "olmo3",        "exaone4",   "qwen3_moe",  "olmoe",       "mixtral",        "cohere",
    "cohere2",      "qwen2_moe", "phi",        "gpt_neox",    "gpt_neox_seq",   "stablelm",
    "stablelm_par", "olmo",      "olmo_clip",  "glm",         "glm4",           "dynamic",
    "falcon",       "falcon40b", "falcon_seq", "gptj",        "cohere_qk",      "stablelm_qk",
    "phi_qk",       "codegen",   "starcoder2", "gpt_bigcode", "gpt_bigcode_mha"};

inline models::ModelSpec tiny_model_spec(const std::string& family) {
  if (family.ends_with("_qk")) {  // a base family with its q/k LayerNorms
    models::ModelSpec s = tiny_model_spec(
        family == "stablelm_qk" ? "stablelm_par" : family.substr(0, family.size() - 3));
    s.qk_layernorm = true;
    return s;
  }
  models::ModelSpec s;
  const bool wide_heads = family == "qwen3_d8";
  const bool qwen_window = family == "qwen2_w3";
  const bool qwen = family == "qwen2" || family == "qwen3" || wide_heads || qwen_window;
  const bool mistral = family == "mistral_w3";
  const bool phi4_mini = family == "phi4m";
  const bool phi3_long = family == "phi3_lr" || family == "phi3_sr" || phi4_mini;
  const bool phi3 = family == "phi3_w3" || phi3_long;
  const bool gemma = family == "gemma" || family == "gemma2" || family == "gemma3";
  const bool smollm3 = family == "smollm3", granite = family == "granite",
             olmo2 = family == "olmo2", olmo3 = family == "olmo3", exaone4 = family == "exaone4",
             cohere = family == "cohere" || family == "cohere2";
  const bool moe = models::ModelSpec::is_moe_type(family);
  const bool phi = family == "phi", neox = family.starts_with("gpt_neox"),
             stablelm = family.starts_with("stablelm"), falcon = family.starts_with("falcon");
  const bool bigcode = family.starts_with("gpt_bigcode");
  s.family = family != "gpt2" && !bigcode ? "llama" : "gpt2";
  s.hf_model_type = qwen       ? family.substr(0, 5)
                    : mistral  ? "mistral"
                    : phi3     ? "phi3"
                    : gemma    ? (family == "gemma3" ? "gemma3_text" : family)
                    : smollm3  ? "smollm3"
                    : granite  ? "granite"
                    : olmo2    ? "olmo2"
                    : olmo3    ? "olmo3"
                    : exaone4  ? "exaone4"
                    : cohere   ? family
                    : phi      ? "phi"
                    : neox     ? "gpt_neox"
                    : stablelm ? "stablelm"
                    : falcon   ? "falcon"
                    : family == "gptj" || family == "codegen" || family == "starcoder2" ? family
                    : family == "glm" || family == "glm4"                               ? family
                    : family.starts_with("olmo_") || family == "olmo"                   ? "olmo"
                    : moe                                                               ? family
                                                                                        : "";
  if (moe) {
    s.moe.experts = 4;
    s.moe.per_token = 2;
    s.moe.ffn = 24;
    s.moe.normalize = family != "olmoe" && family != "qwen2_moe";
    if (family == "qwen3_moe") s.moe.dense_layers = {0};
    if (family == "qwen2_moe") s.moe.shared_ffn = 32;
  }
  if (granite) {
    s.embedding_multiplier = 3;
    s.residual_multiplier = 0.22;
    s.attention_multiplier = 0.3;
    s.logits_scaling = 4;
  }
  if (smollm3) s.nope_period = 2;
  if (cohere) s.logit_scale = 0.5;  // (Command-R's 0.0625 would flatten these logits)
  const bool yarn = family == "yarn" || olmo3 || exaone4;
  if (wide_heads || phi4_mini || yarn) s.head_width = 8;
  if (yarn) {
    s.rope_scaling.kind = ops::RopeScaling::Kind::kYarn;
    s.rope_scaling.factor = 4;
    s.rope_scaling.original_max_position = 1000;
    s.rope_scaling.attention_factor = 0.1 * std::log(4.0) + 1.0;
  }
  if (phi4_mini) s.partial_rotary_factor = 0.75;
  if (mistral || qwen_window || family == "phi3_w3") s.sliding_window = 3;
  if (phi3_long) {  // gen_models.py's longrope: rows of 8 past an original context of 4, or within
                    // 16
    const double original = family == "phi3_sr" ? 16 : 4;
    s.rope_scaling.kind = ops::RopeScaling::Kind::kLongRope;
    s.rope_scaling.short_factor = phi4_mini ? std::vector{1.0, 1.25, 1.5} : std::vector{1.0, 1.5};
    s.rope_scaling.long_factor = phi4_mini ? std::vector{2.0, 3.0, 7.0} : std::vector{2.0, 7.0};
    s.rope_scaling.original_max_position = static_cast<int64_t>(original);
    s.rope_scaling.attention_factor = std::sqrt(1 + std::log(32 / original) / std::log(original));
  }
  if (qwen_window) s.sliding_from_layer = 1;
  s.n_layer = 2;
  s.n_embd = 16;
  s.vocab_size = 37;
  s.max_seq_len = 8;
  s.norm_eps = 1e-5;
  if (s.family == "gpt2") {
    s.n_head = 2;
    if (bigcode) {
      s.hf_model_type = "gpt_bigcode";
      s.n_kv_head = family == "gpt_bigcode" ? 1 : 2;
    }
  } else {
    s.n_head = 4;
    s.n_kv_head = 2;
    s.intermediate_size = 48;
    // these tie their head to the embedding
    s.tie_embeddings = gemma || phi4_mini || smollm3 || cohere;
  }
  if (family == "gemma2" || family == "gemma3") {  // a window of 3 on layer 0, scale 6^-1/2
    s.sliding_window = 3;
    s.sliding_period = 2;
    s.query_pre_attn_scalar = 6;
  }
  if (family == "gemma2") {  // caps that bend
    s.attn_softcap = 2;
    s.final_softcap = 3;
  }
  if (family == "gemma3") s.rope_local_theta = 100;  // layer 0's RoPE base, layer 1's 1e4
  // layer 0 slides (OLMo-3's unscaled); layer 1 full (EXAONE-4's and Cohere2's NoPE)
  if (olmo3 || exaone4 || family == "cohere2") {
    s.sliding_window = 3;
    s.sliding_period = 2;
  }
  if (phi || neox) {  // two heads 8 wide; Phi's share one key/value head
    s.n_head = 2;
    s.n_kv_head = phi ? 1 : 2;
    s.partial_rotary_factor = phi ? 0.5 : 0.25;
    s.mlp_gelu = phi ? ops::GeluApprox::Tanh : ops::GeluApprox::None;
    s.parallel_residual = family != "gpt_neox_seq";
  }
  if (family == "olmo_clip") s.clip_qkv = 1;
  if (family == "dynamic") {  // dynamic NTK past an original context of 4 (rows of 8)
    s.rope_scaling.kind = ops::RopeScaling::Kind::kDynamic;
    s.rope_scaling.factor = 2;
    s.rope_scaling.original_max_position = 4;
  }
  if (family == "glm" || family == "glm4") {
    s.head_width = 8;
    s.partial_rotary_factor = 0.5;
    s.attention_bias = true;
  }
  if (family == "gptj" || family == "codegen") {  // gptj: two heads 8 wide, RoPE on 4 channels
    s.n_head = 2;
    s.n_kv_head = 2;
    s.partial_rotary_factor = 0.5;
    s.mlp_gelu = ops::GeluApprox::Tanh;
    s.tie_embeddings = false;
  }
  if (family == "starcoder2") {  // Mistral's window of 3 on every layer, biases, the head tied
    s.sliding_window = 3;
    s.attention_bias = true;
    s.mlp_gelu = ops::GeluApprox::Tanh;
    s.tie_embeddings = true;
  }
  if (family == "codegen") {  // 8 heads 4 wide over 32 channels (4 blocks of 2), RoPE on all
    s.n_embd = 32;
    s.n_head = s.n_kv_head = 8;
    s.partial_rotary_factor = 1;
  }
  if (falcon) {
    s.mlp_gelu = ops::GeluApprox::None;
    s.n_kv_head = family == "falcon" ? 1 : family == "falcon_seq" ? 4 : 2;
    s.new_decoder_architecture = s.norm_per_branch = family == "falcon40b";
    s.tie_embeddings = family != "falcon40b";
    s.parallel_residual = family != "falcon_seq";
  }
  if (stablelm) {
    s.n_head = 2;
    s.n_kv_head = 1;
    s.partial_rotary_factor = 0.25;
    s.parallel_residual = family == "stablelm_par";
    s.attention_bias = family == "stablelm";
  }
  return s;
}

}  // namespace keel::test
