// Hugging Face config.json in and out (DESIGN §6). These architectures are read:
//   GPT2LMHeadModel  (model_type "gpt2"): n_layer, n_embd, n_head, n_inner, vocab_size,
//     n_positions, layer_norm_epsilon; lm_head tied to wte.
//   LlamaForCausalLM (model_type "llama"): num_hidden_layers, hidden_size, num_attention_heads,
//     num_key_value_heads, intermediate_size, vocab_size, max_position_embeddings, rope_theta,
//     rope_scaling (default, linear, llama3, yarn), rms_norm_eps, tie_word_embeddings (tied: no
//     lm_head.weight).
//   MistralForCausalLM (model_type "mistral"): Llama's fields and layers, and sliding_window
//     (null: none), the keys a query sees (ModelSpec::sliding_window); written back as Mistral.
//   GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (model_type "gemma", "gemma2",
//     "gemma3_text"): Llama's fields and layers with Gemma's norms, GeGLU and scaled embedding
//     (ModelSpec::gemma()); Gemma-2's and -3's sandwich norms, query_pre_attn_scalar, soft caps
//     and sliding layers (sliding_window_pattern / layer_types); Gemma-3's q/k norms and
//     rope_local_base_freq; written back as each. A Gemma3ForConditionalGeneration (4B+, vision)
//     is read as its language model (text_config), written back as a Gemma3ForCausalLM.
//   Phi3ForCausalLM (model_type "phi3"): Llama's fields and layers with q/k/v as one qkv_proj and
//     gate/up as one gate_up_proj (ModelSpec::fused_projections()), sliding_window as Mistral's,
//     rope_scaling longrope and partial_rotary_factor (Phi-4-mini's 0.75: RoPE turns the first
//     int(head_dim * factor) channels of a head); written back as Phi-3.
//   Qwen2ForCausalLM (model_type "qwen2"): Llama's fields and layers with q/k/v biases
//     (ModelSpec::qkv_bias()); use_sliding_window = true slides the layers from
//     max_window_layers on (layer_types, when given, must say the same); written back as Qwen2.
//   GraniteForCausalLM (model_type "granite"): Llama's fields and layers, and
//     embedding_multiplier, residual_multiplier, attention_multiplier (the scale of q·kᵀ) and
//     logits_scaling (GraniteConfig's defaults: 1); written back as Granite.
//   Olmo2ForCausalLM (model_type "olmo2"): Llama's fields and layers, normalized after the
//     attention and the MLP instead of before (ModelSpec::post_norms()), its q_norm and k_norm
//     over the whole projections; use_sinks refused; written back as OLMo-2.
//   Olmo3ForCausalLM (model_type "olmo3"): OLMo-2's, and sliding_window over the layers
//     layer_types names "sliding_attention" (three of every four), which rotate without
//     rope_scaling (OLMo-core's, vLLM's and transformers 4.57's and current RoPE; some 5.x releases
//     scaled every layer); a null sliding_window refused (transformers' Olmo3 cannot run one);
//     written back as OLMo-3, its RoPE also per layer type (rope_parameters).
//   Exaone4ForCausalLM (model_type "exaone4"): OLMo-2's norms with a q_norm and k_norm per head,
//     sliding_window (4096; null: none) over the layers layer_types names "sliding_attention"
//     (else every sliding_window_pattern-th layer full: 4, or "LLLG"), the full ones without RoPE
//     where there is a window (HF's global NoPE); written back as EXAONE-4.
//   SmolLM3ForCausalLM (model_type "smollm3"): Llama's fields and layers, every
//     no_rope_layer_interval-th without RoPE as no_rope_layers lists them (ModelSpec::nope_period);
//     use_sliding_window refused; written back as SmolLM3.
//   Qwen3ForCausalLM (model_type "qwen3"): Llama's with q_norm/k_norm (ModelSpec::qk_norm()), its
//     head_dim hidden_size / num_attention_heads (Qwen3-1.7B, -8B, -14B); written back as Qwen3.
//   CohereForCausalLM (model_type "cohere"): Llama's fields (layer_norm_eps for rms_norm_eps),
//     its layers' attention and MLP side by side on one LayerNorm without bias, RoPE on adjacent
//     channel pairs, the tied head's logits times logit_scale (ModelSpec::cohere()); use_qk_norm
//     (Command-R+) refused; written back as Cohere.
//   Cohere2ForCausalLM (model_type "cohere2"): Cohere's, and EXAONE-4's sliding layers (three of
//     four, rotating) and full ones without RoPE; a null sliding_window refused; written back as
//     Cohere2.
// Every problem is an Error naming the file and the field: a missing or mistyped field, sizes that
// disagree with each other or with the weights' headers, an unsupported architecture variant
// (e.g. attention biases).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/models/causal_lm.h"

namespace keel::io {

struct HfConfig {
  models::ModelSpec spec;    // family, sizes, eps, rope_theta, tie_embeddings, init_std
  DType dtype = DType::F32;  // torch_dtype (F32 when absent)
  nlohmann::json json;       // the file as read
};

// Reads DIR/config.json and checks its sizes against the weight files' headers (nothing else of
// them is read). The spec's runtime fields (attention, dropout, param_dtype) keep their defaults;
// the caller sets them.
HfConfig read_hf_config(const std::string& dir);

// The ids that end a generation by DIR/generation_config.json's eos_token_id (an id or a list:
// Llama-3.1-Instruct's [128001, 128008, 128009]); empty when the file is absent or names none.
// A file that is not JSON, or an id that is not a non-negative integer, is an Error (kUsage)
// naming the file and the field.
std::vector<int64_t> generation_eos_ids(const std::string& dir);

// The config.json of `spec` with weights stored in `stored` (torch_dtype); `base`'s fields that
// keel does not set (token ids, ...) are kept. Its dropout probabilities are the spec's (a run's
// model.dropout and model.attention_dropout: what it trained with), not the base's.
nlohmann::json hf_config_json(const models::ModelSpec& spec, DType stored,
                              const nlohmann::json& base = nlohmann::json::object());

}  // namespace keel::io
