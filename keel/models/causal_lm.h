// Decoder-only language models with HF parameter names: GPT-2 (GPT2LMHeadModel) and the Llama
// family (LlamaForCausalLM). Linear weights use the nn.Linear layout [out, in]; GPT-2's HF
// checkpoints store Conv1D weights transposed, which the loader (io/) undoes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "keel/models/kv_cache.h"
#include "keel/nn/module.h"
#include "keel/ops/activation.h"
#include "keel/ops/attention.h"
#include "keel/ops/rope.h"

namespace keel::models {

// A sparse layer's mixture of experts (ModelSpec::moe): `experts` SwiGLU MLPs `ffn` wide and a
// router (mlp.gate, Mixtral's block_sparse_moe.gate: [experts, n_embd], no bias) that sends each
// token to its `per_token` most probable experts and sums their outputs weighted by the router's
// softmax, renormalized over the chosen ones when `normalize` (HF's norm_topk_prob; ops/moe.h).
// Qwen3-MoE's layers are sparse every `sparse_step`-th (its decoder_sparse_step: layer + 1 a
// multiple of it) but those `dense_layers` lists (its mlp_only_layers), whose MLP is the dense
// intermediate_size one.
struct MoeSpec {
  int64_t experts = 0, per_token = 0, ffn = 0, sparse_step = 1;
  bool normalize = false;
  std::vector<int64_t> dense_layers;
  // The load-balancing loss's weight in training (HF's router_aux_loss_coef where
  // output_router_logits is set; keel's model.router_aux_loss_coef): 0 adds none.
  double aux_coef = 0;
  // Qwen2-MoE's shared expert: an MLP this wide that every token goes through, its output times
  // sigmoid(shared_expert_gate(x)) added to the routed experts'; 0: none.
  int64_t shared_ffn = 0;
};

struct ModelSpec {
  std::string family = "gpt2";  // gpt2 | llama
  int64_t n_layer = 2, n_embd = 64, n_head = 4;
  int64_t n_kv_head = 0;  // llama: grouped-query heads; 0 = n_head
  // llama: a head's channels where they are not n_embd / n_head (HF's head_dim: Qwen3-0.6B's 128
  // with hidden_size 1024 and 16 heads, Mistral-Nemo's 128 with 5120 and 32); 0 = n_embd / n_head.
  // q_proj then maps n_embd to n_head * head_dim and o_proj back.
  int64_t head_width = 0;
  static constexpr int64_t kMaxHeadWidth = 1024;  // (published models: 64 to 256)
  int64_t intermediate_size = 0;  // 0: 4*n_embd (gpt2); Llama's rule (8/3 n_embd, multiple of 32)
  int64_t vocab_size = 0;
  int64_t max_seq_len = 128;
  bool tie_embeddings = true;  // gpt2 always ties
  double rope_theta = 10000.0;
  ops::RopeScaling rope_scaling;  // llama: HF `rope_scaling` (none, linear, llama3, longrope)
  // HF's partial_rotary_factor (Phi-4-mini's 0.75): RoPE turns the first rotary_dim() channels of
  // each query and key head and passes the rest (ops::rope's rotary_dim).
  double partial_rotary_factor = 1.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  // gpt2: residual, MLP and embedding dropout; Phi, GPT-NeoX and StableLM: their sublayers'
  // (ModelSpec::branch_dropout).
  double dropout = 0.0;
  // Dropout on the attention probabilities while training (HF's attn_pdrop for GPT-2,
  // attention_dropout for the Llama family; ops::AttentionDropout).
  double attention_dropout = 0.0;
  ops::AttentionBackend attention = ops::AttentionBackend::kEager;
  DType param_dtype = DType::F32;
  // The HF architecture a "llama" family model is written back as: "" (Llama), "gemma", "gemma2",
  // "gemma3_text", "granite", "mistral", "olmo2", "olmo3", "exaone4", "phi3", "qwen2", "qwen3" or
  // "smollm3" (SmolLM3ForCausalLM:
  // Llama's layers, some without RoPE: nope_period; GraniteForCausalLM: Llama's layers with the
  // multipliers below). An HF Mistral (model_type "mistral",
  // MistralForCausalLM): Llama's layers under another name, whose attention slides over the last
  // sliding_window positions (a query sees itself and the sliding_window - 1 before it; 0: every
  // earlier position, Mistral v0.2 on). Qwen2 and Qwen3 with use_sliding_window slide the layers
  // from sliding_from_layer on (their max_window_layers), Mistral and Phi-3 all of them, Gemma-2
  // every other one from the first (sliding_period 2: a layer slides unless layer % period ==
  // period - 1), Gemma-3 five of six, OLMo-3 and EXAONE-4-32B three of four. Empty and 0 for every
  // other model.
  std::string hf_model_type;
  int64_t sliding_window = 0, sliding_from_layer = 0, sliding_period = 0;
  // The window of decoder layer `layer` (0: full attention).
  int64_t layer_window(int64_t layer) const {
    if (sliding_window <= 0 || layer < sliding_from_layer) return 0;
    return sliding_period > 0 && layer % sliding_period == sliding_period - 1 ? 0 : sliding_window;
  }
  // Gemma-2's soft caps (HF's attn_logit_softcapping, final_logit_softcapping): a score s becomes
  // cap * tanh(s / cap) before the softmax, a logit the same before the loss; 0: none. Its
  // query_pre_attn_scalar: the attention scale is its inverse square root; 0: the head width's.
  double attn_softcap = 0, final_softcap = 0, query_pre_attn_scalar = 0;
  // Gemma-3's rope_local_base_freq: the RoPE base of its sliding layers, which take no
  // rope_scaling; 0: rope_theta (and OLMo-3's sliding layers take no rope_scaling either).
  double rope_local_theta = 0;
  // The RoPE base and scaling of decoder layer `layer`: a sliding layer of a Gemma-3 or an OLMo-3
  // rotates by rope_local_theta (or rope_theta) without rope_scaling; every other by rope_theta
  // and rope_scaling.
  double layer_rope_theta(int64_t layer) const {
    return unscaled_local_rope() && layer_window(layer) > 0 && rope_local_theta > 0
               ? rope_local_theta
               : rope_theta;
  }
  ops::RopeScaling layer_rope_scaling(int64_t layer) const {
    return unscaled_local_rope() && layer_window(layer) > 0 ? ops::RopeScaling{} : rope_scaling;
  }
  // SmolLM3's NoPE layers (HF's no_rope_layers, every no_rope_layer_interval-th from the first
  // one: layer 3, 7, ... of its 36 with interval 4): their queries and keys are not rotated; 0:
  // every layer rotates.
  int64_t nope_period = 0;
  // An EXAONE-4 with a window rotates its sliding layers only: its full ones see positions only
  // through the causal mask (HF's "global NoPE"); without a window every layer rotates.
  bool layer_rotates(int64_t layer) const {
    if ((hf_model_type == "exaone4" || hf_model_type == "cohere2") && sliding_window > 0 &&
        layer_window(layer) == 0)
      return false;
    return nope_period <= 0 || (layer + 1) % nope_period != 0;
  }
  // Granite's multipliers (GraniteForCausalLM): the embedding's output times
  // embedding_multiplier, each sublayer's output times residual_multiplier before its residual
  // add, q·kᵀ times attention_multiplier (in place of 1 / sqrt(head_dim); 0: none), the logits
  // divided by logits_scaling. 1 (0 for attention_multiplier) for every other model.
  double embedding_multiplier = 1, residual_multiplier = 1, attention_multiplier = 0,
         logits_scaling = 1;
  // An HF Cohere (CohereForCausalLM: Command-R, Aya-23, Aya Expanse): Llama's layers with the
  // attention and the MLP side by side on one norm's output, both added to the residual (HF's
  // CohereDecoderLayer: no post_attention_layernorm), LayerNorms without bias (HF's
  // CohereLayerNorm: centered_norms), RoPE on adjacent channel pairs (interleaved_rope), the head
  // tied to the embedding and the logits times logit_scale (0.0625 for Command-R; 1 for every
  // other model). A Cohere2 (Cohere2ForCausalLM: Command-R7B): Cohere's layers, all but every
  // fourth sliding (sliding_period 4, or as layer_types lists them) and only those rotating: the
  // full ones take no RoPE (layer_rotates, as EXAONE-4's).
  double logit_scale = 1;
  bool cohere() const { return hf_model_type == "cohere" || hf_model_type == "cohere2"; }
  // Cohere's and GLM's RoPE turns adjacent channel pairs (2i, 2i + 1) (GLM's on the first
  // rotary_dim() channels of a head).
  bool interleaved_rope() const { return cohere() || glm() || gptj(); }
  // An HF GLM (GlmForCausalLM: GLM-4-9B; Glm4ForCausalLM: GLM-4-0414, GLM-Z1): Llama's layers with
  // q/k/v biases (attention_bias), gate and up as one gate_up_proj (Phi-3's), RoPE on adjacent
  // pairs of half of each head (partial_rotary_factor 0.5); GLM-4-0414 adds a norm after the
  // attention and one after the MLP (sandwich_norms: post_self_attn_layernorm and
  // post_mlp_layernorm, its post_attention_layernorm the MLP's input norm).
  bool glm() const { return hf_model_type == "glm" || hf_model_type == "glm4"; }
  // An HF Phi (PhiForCausalLM: Phi-1, Phi-1.5, Phi-2): the attention and the MLP side by side on
  // one LayerNorm (with a bias), summed, then added to the residual (HF's PhiDecoderLayer:
  // attention + mlp + residual); biases on q, k, v and the output projection (self_attn.dense),
  // an MLP of two biased Linears around a gelu (mlp.fc1, mlp.fc2: gelu_mlp), a partial RoPE
  // (Phi-2's 0.4 of each head), model.final_layernorm, and an untied lm_head with a bias.
  bool phi() const { return hf_model_type == "phi"; }
  // An HF GPT-NeoX (GPTNeoXForCausalLM: Pythia, GPT-NeoX-20B, Dolly-v2, RedPajama-INCITE): Phi's
  // sublayers under other names (gpt_neox.embed_in, .layers.N.attention.query_key_value and
  // .dense, .mlp.dense_h_to_4h and .dense_4h_to_h, gpt_neox.final_layer_norm, embed_out), the
  // query, key and value projections one Linear whose rows go head by head (each head's q, then
  // its k, then its v: per_head_qkv), a norm before the MLP of its own, and the two branches side
  // by side (parallel_residual, its use_parallel_residual) or one after the other.
  bool gpt_neox() const { return hf_model_type == "gpt_neox"; }
  // An HF StableLM (StableLmForCausalLM: StableLM-2-1.6B, StableLM-3B-4E1T, StableLM-Zephyr):
  // Llama's names and SwiGLU MLP with LayerNorms that have a bias, RoPE on a share of each head
  // (partial_rotary_factor, 0.25), q/k/v biases where use_qkv_bias says (attention_bias here), and
  // with use_parallel_residual (the 12B's) Cohere's parallel block on one norm.
  bool stablelm() const { return hf_model_type == "stablelm"; }
  // An HF Falcon (FalconForCausalLM: Falcon-7B, -40B, -180B, Falcon2-11B): GPT-NeoX's attention
  // and gelu MLP under its names (transformer.word_embeddings, .h.N.self_attention.query_key_value
  // and .dense, .mlp.dense_h_to_4h and .dense_4h_to_h, transformer.ln_f, lm_head), without
  // biases, the head tied unless the file says otherwise. Its query_key_value's rows go key/value
  // group by group (grouped_qkv): Falcon-7B's multi_query one group of all its queries, the
  // older layout one group a head, new_decoder_architecture's num_kv_heads groups. The attention
  // and the MLP side by side ((attention + mlp) + x, parallel_attn) on one LayerNorm or, with
  // new_decoder_architecture's num_ln_in_parallel_attn 2, one each (ln_attn, ln_mlp:
  // norm_per_branch), or one after the other.
  bool falcon() const { return hf_model_type == "falcon"; }
  // An HF GPT-J (GPTJForCausalLM: GPT-J-6B, GPT4All-J): Phi's parallel block on one LayerNorm,
  // (attention + mlp) + x, under GPT-2's names (transformer.wte, .h.N.ln_1, .attn.q_proj, k_proj,
  // v_proj and out_proj without biases, .mlp.fc_in and fc_out with them, transformer.ln_f) and an
  // untied lm_head with a bias; RoPE (base 10000) on adjacent pairs of the first rotary_dim
  // channels of each head (GLM's), gelu_new; its resid_pdrop on the attention's and the MLP's
  // outputs and embd_pdrop on the embedding's are one key, model.dropout (as GPT-2's).
  // An HF CodeGen (CodeGenForCausalLM: CodeGen-350M/2B/6B/16B mono, multi, nl) is GPT-J's block
  // with q, k and v one qkv_proj (codegen_qkv); gptj() holds for it too.
  bool gptj() const { return hf_model_type == "gptj" || codegen(); }
  // An HF StarCoder2 (Starcoder2ForCausalLM: StarCoder2-3B, 7B, 15B): Llama's names and
  // grouped-query attention with LayerNorms that have a bias (norm_epsilon), biases on q, k, v,
  // o_proj and the MLP where use_bias says (attention_bias here), an MLP of two Linears around a
  // gelu (mlp.c_fc, mlp.c_proj: gelu_mlp), and Mistral's window on every layer; its
  // residual_dropout on the attention's and the MLP's outputs and embedding_dropout on the
  // embedding's are one key, model.dropout.
  bool starcoder2() const { return hf_model_type == "starcoder2"; }
  // An HF GPT-BigCode (GPTBigCodeForCausalLM: StarCoder, StarCoderBase, SantaCoder, WizardCoder,
  // tiny_starcoder), in the gpt2 family: GPT-2's blocks and names with nn.Linear weights (no
  // Conv1D transpose) and, with multi_query, one key/value head: c_attn's rows the queries, then
  // one key, then one value; without it each head's q, k, v side by side.
  bool gpt_bigcode() const { return hf_model_type == "gpt_bigcode"; }
  // HF stores the attention's and the MLP's weights as Conv1D [in, out] (GPT-2's; GPT-BigCode's
  // are nn.Linear [out, in]): transposed on load and save, PEFT's fan_in_fan_out.
  bool conv1d_weights() const { return family == "gpt2" && !gpt_bigcode(); }
  bool codegen() const { return hf_model_type == "codegen"; }
  // CodeGen's qkv_proj: its rows in 4 blocks (the TPU-v4 shards it was trained on, HF's mp_num),
  // each a quarter of the heads' queries, then their values, then their keys.
  static constexpr int64_t kCodegenBlocks = 4;
  // Falcon's new_decoder_architecture and num_ln_in_parallel_attn 2 (only read for it).
  bool new_decoder_architecture = false, norm_per_branch = false;
  // GPT-NeoX's and StableLM's use_parallel_residual, Falcon's parallel_attn (only read for them:
  // GPTNeoXConfig's and FalconConfig's default true, StableLmConfig's false).
  bool parallel_residual = true;
  // GPT-NeoX's attention_bias (biases on query_key_value and dense), StableLM's use_qkv_bias,
  // GLM's attention_bias (on q, k and v) and StarCoder2's use_bias (on q, k, v, o_proj and its
  // MLP); only read for them.
  bool attention_bias = true;
  // The attention and the MLP read the same residual stream and their outputs are added to it
  // together: Cohere's and StableLM's (x + attention) + mlp (residual_first_sum), Phi's and
  // GPT-NeoX's (attention + mlp) + x.
  bool parallel_block() const {
    return cohere() || phi() || gptj() ||
           ((gpt_neox() || stablelm() || falcon()) && parallel_residual);
  }
  bool residual_first_sum() const { return cohere() || stablelm(); }
  // A parallel block's one norm, whose output both branches read (Cohere's, Phi's, StableLM's,
  // most Falcons'; a GPT-NeoX normalizes the MLP's input with post_attention_layernorm of its own,
  // a Falcon-40B with ln_mlp).
  bool shared_block_norm() const {
    return parallel_block() && !gpt_neox() && !(falcon() && norm_per_branch);
  }
  // LayerNorms (the mean subtracted before the root mean square) in place of RMSNorms: Cohere's
  // without a bias, Phi's, GPT-NeoX's and StableLM's with one (torch's nn.LayerNorm), OLMo's with
  // neither weight nor bias.
  bool centered_norms() const { return cohere() || biased_norms() || olmo(); }
  bool biased_norms() const {
    return phi() || gpt_neox() || stablelm() || falcon() || gptj() || starcoder2();
  }
  // An HF OLMo (OlmoForCausalLM: OLMo-1B, OLMo-7B, OLMo-1.7): Llama's layers with LayerNorms that
  // have neither weight nor bias (HF's OlmoLayerNorm, its eps 1e-5 whatever the file says).
  bool olmo() const { return hf_model_type == "olmo"; }
  // OLMo's and OLMoE's clip_qkv: the query, key and value projections (OLMoE's after its q/k
  // norms) clamped to [-clip_qkv, clip_qkv] (OLMo-1.7's 8); 0: none.
  double clip_qkv = 0;
  // The Llama-family layers whose HF models drop a sublayer's output while training, with
  // `dropout`: Phi's resid_pdrop (the attention's and the MLP's outputs), GPT-NeoX's
  // hidden_dropout (those and the embedding's), StableLM's hidden_dropout (the MLP's alone),
  // Falcon's hidden_dropout (a parallel block's branch sum, else the MLP's; a Falcon in sequence
  // drops the attention's output by attention_dropout, and no Falcon its probabilities), GPT-J's
  // resid_pdrop and StarCoder2's residual_dropout (the attention's and the MLP's outputs; their
  // embedding's by the same key).
  bool branch_dropout() const {
    return phi() || gpt_neox() || stablelm() || falcon() || gptj() || starcoder2();
  }
  // The config.json field that dropout is read from and written back as: Phi's and GPT-J's
  // resid_pdrop, StarCoder2's residual_dropout, GPT-NeoX's, StableLM's and Falcon's
  // hidden_dropout; nullptr for the others.
  const char* branch_dropout_field() const {
    return phi() || gptj()    ? "resid_pdrop"
           : starcoder2()     ? "residual_dropout"
           : branch_dropout() ? "hidden_dropout"
                              : nullptr;
  }
  // Phi's, GPT-NeoX's, Falcon's, GPT-J's and StarCoder2's MLP: up (fc1, dense_h_to_4h, fc_in,
  // c_fc) and down (fc2, dense_4h_to_h, fc_out, c_proj), with biases but Falcon's (StarCoder2's as
  // use_bias says: mlp_bias), around a gelu (mlp_gelu: Phi's and GPT-J's gelu_new and
  // StarCoder2's gelu_pytorch_tanh are the tanh form, Pythia's and Falcon's gelu the exact one).
  bool gelu_mlp() const { return phi() || gpt_neox() || falcon() || gptj() || starcoder2(); }
  bool mlp_bias() const {
    return phi() || gpt_neox() || gptj() || (starcoder2() && attention_bias);
  }
  ops::GeluApprox mlp_gelu = ops::GeluApprox::Tanh;
  // GPT-NeoX's and Falcon's query_key_value: one Linear whose rows go key/value head by head,
  // each group its kv_heads() / n_head queries, then its key, then its value (GPT-NeoX's a group a
  // head: q, k, v of head 0, then head 1).
  bool grouped_qkv() const { return gpt_neox() || falcon(); }
  // q, k and v one Linear (names.qkv): Phi-3's, GPT-NeoX's, Falcon's and CodeGen's, each with its
  // own row layout.
  bool fused_qkv() const { return fused_projections() || grouped_qkv() || codegen(); }
  bool out_bias() const { return phi() || ((gpt_neox() || starcoder2()) && attention_bias); }
  bool head_bias() const { return phi() || gptj(); }
  // The HF names of the modules a Llama-family model registers (its parameters' names, what an
  // adapter's target_modules and a PEFT directory name): Llama's, Phi's, GPT-NeoX's, Falcon's,
  // GPT-J's (and CodeGen's), StarCoder2's or GLM-4-0414's (its sandwich norms).
  struct ModuleNames {
    const char *model, *embed, *final_norm, *head;  // model.embed_tokens, model.norm, lm_head
    const char *attention, *qkv, *out;              // self_attn, qkv_proj, o_proj
    const char *up, *down;                          // an MLP's up_proj and down_proj
    // sandwich_norms(): the attention's output norm, the MLP's input and output norms
    const char* attn_out_norm = "post_attention_layernorm";
    const char* mlp_in_norm = "pre_feedforward_layernorm";
    const char* mlp_out_norm = "post_feedforward_layernorm";
    const char* layers = "layers";  // the decoder layers' list (Falcon's h)
    // The attention's input norm, and the MLP's (a layer's second: Falcon-40B's ln_attn, ln_mlp)
    const char* attn_in_norm = "input_layernorm";
    const char* mlp_norm = "post_attention_layernorm";
  };
  ModuleNames module_names() const;
  // The token embedding's parameter ("model.embed_tokens.weight", GPT-2's
  // "transformer.wte.weight").
  std::string embedding_name() const;
  // A mixture-of-experts model (HF's Qwen3-MoE "qwen3_moe", OLMoE "olmoe", Mixtral "mixtral"):
  // the MLP of each sparse layer (moe_layer) is a MoeSpec; `moe.experts` 0: every layer dense.
  MoeSpec moe;
  bool moe_layer(int64_t layer) const {
    return moe.experts > 0 && (layer + 1) % std::max<int64_t>(moe.sparse_step, 1) == 0 &&
           std::find(moe.dense_layers.begin(), moe.dense_layers.end(), layer) ==
               moe.dense_layers.end();
  }
  static bool is_moe_type(const std::string& model_type) {
    return model_type == "qwen3_moe" || model_type == "olmoe" || model_type == "mixtral" ||
           model_type == "qwen2_moe";
  }
  static constexpr int64_t kMaxExperts = 1024;  // (published models: 8 to 256)
  // Mixtral's names: block_sparse_moe for the layer's MoE, w1, w3 and w2 for an expert's gate,
  // up and down projections.
  bool mixtral_names() const { return hf_model_type == "mixtral"; }

  // The name a message gives the model: "gpt2", "llama", "gemma", "gemma2", "gemma3_text",
  // "granite", "mistral", "mixtral", "olmo2", "olmo3", "olmoe", "exaone4", "phi3", "qwen2",
  // "qwen3", "qwen3_moe", "qwen2_moe", "smollm3", "cohere", "cohere2", "phi", "gpt_neox",
  // "stablelm", "olmo", "glm", "glm4", "falcon", "gptj", "codegen" or "starcoder2".
  const std::string& architecture() const { return hf_model_type.empty() ? family : hf_model_type; }
  // An HF Qwen2 (Qwen2ForCausalLM): Llama's layers with biases on the q, k and v projections (not
  // o_proj).
  // Phi's and GPT-NeoX's too (the latter's attention_bias), StableLM's and GLM's where
  // use_qkv_bias / attention_bias says.
  bool qkv_bias() const {
    return hf_model_type == "qwen2" || hf_model_type == "qwen2_moe" || out_bias() ||
           ((stablelm() || glm()) && attention_bias);
  }
  // An HF Qwen3 (Qwen3ForCausalLM): Llama's layers with an RMSNorm over each head's query and key
  // (q_norm, k_norm: weights [head_dim]) before RoPE. Phi's qk_layernorm: a LayerNorm with a bias
  // there (q_layernorm, k_layernorm).
  bool qk_norm() const {
    return hf_model_type == "qwen3" || hf_model_type == "qwen3_moe" || hf_model_type == "olmoe" ||
           hf_model_type == "gemma3_text" || post_norms() || (phi() && qk_layernorm);
  }
  // Command-R+'s use_qk_norm (Cohere), StableLM-2-12B's and Phi's qk_layernorm: LayerNorms over
  // each head's query and key before RoPE; Cohere's and StableLM's without a bias and with a
  // weight of each head's own (head_qk_layernorm: nn::HeadLayerNorm, Cohere's q_norm [heads,
  // head_dim], StableLM's q_layernorm.norms.<h>), Phi's one weight and bias for every head
  // (qk_norm()). Only read for them.
  bool qk_layernorm = false;
  bool head_qk_layernorm() const {
    return qk_layernorm && (hf_model_type == "cohere" || stablelm());
  }
  // An HF OLMo-2 (Olmo2ForCausalLM): Llama's layers with no norm before the attention or the MLP
  // but one after each (post_attention_layernorm on the attention's output,
  // post_feedforward_layernorm on the MLP's, before their residual adds), and its q_norm and
  // k_norm over the whole query and key projections (n_head x head_dim and kv_heads x head_dim
  // wide) before the heads are split. An OLMo-3 (Olmo3ForCausalLM): OLMo-2's layers, three of
  // every four sliding (sliding_period 4), its sliding layers rotating without rope_scaling as
  // OLMo-core trained them (unscaled_local_rope()). An EXAONE-4 (Exaone4ForCausalLM): OLMo-2's
  // norms with Qwen3's q/k norms, one per head (qk_norm_over_projection() false), its layers
  // sliding as layer_types lists them (three of every four in the 32B; none with a null window),
  // the full ones without RoPE where it slides (layer_rotates).
  bool post_norms() const {
    return hf_model_type == "olmo2" || hf_model_type == "olmo3" || hf_model_type == "exaone4";
  }
  // OLMo-2's, OLMo-3's and OLMoE's q_norm and k_norm: over the whole projections, before the
  // heads split (OLMoE's layers otherwise Llama's, a norm before each sublayer).
  bool qk_norm_over_projection() const {
    return hf_model_type == "olmo2" || hf_model_type == "olmo3" || hf_model_type == "olmoe";
  }
  // Whether sliding layers rotate without rope_scaling: Gemma-3's (by rope_local_theta) and
  // OLMo-3's (by rope_theta: OLMo-core's, vLLM's and transformers' RoPE; some transformers 5.x
  // releases scaled every layer).
  static bool unscaled_local_rope(const std::string& model_type) {
    return model_type == "gemma3_text" || model_type == "olmo3";
  }
  bool unscaled_local_rope() const { return unscaled_local_rope(hf_model_type); }
  // An HF Phi-3 (Phi3ForCausalLM: Phi-3-mini/medium, Phi-3.5-mini, Phi-4): Llama's layers with the
  // query, key and value projections as one Linear (self_attn.qkv_proj: q's rows, then k's, then
  // v's) and gate and up as one (mlp.gate_up_proj: gate's rows, then up's), so that an adapter on
  // qkv_proj or gate_up_proj is PEFT's on those modules.
  bool fused_projections() const { return hf_model_type == "phi3"; }
  // gate and up as one gate_up_proj: Phi-3's and GLM's.
  bool fused_gate_up() const { return fused_projections() || glm(); }
  // An HF Gemma (GemmaForCausalLM) or Gemma-2 (Gemma2ForCausalLM): Llama's layers with RMSNorms
  // that scale by 1 + weight (weights stored as the offset, 0 at init), the embedding's output
  // times sqrt(hidden_size) rounded to its dtype, and a GeGLU MLP (gelu-tanh(gate) * up). Gemma-2
  // adds a norm after the attention and one on each side of the MLP (pre_ and
  // post_feedforward_layernorm; post_attention_layernorm then normalizes the attention's output),
  // the soft caps and its query_pre_attn_scalar.
  // A Gemma-3 (Gemma3ForCausalLM, model_type "gemma3_text": Gemma-3-1B, 270M): Gemma-2's layers
  // with Qwen3's q/k norms (scaling by 1 + weight), five sliding layers to one full one
  // (sliding_period 6), the sliding ones rotating by rope_local_theta (its rope_local_base_freq)
  // without rope_scaling, and no soft caps.
  bool gemma() const {
    return hf_model_type == "gemma" || hf_model_type == "gemma2" || hf_model_type == "gemma3_text";
  }
  bool sandwich_norms() const {
    return hf_model_type == "gemma2" || hf_model_type == "gemma3_text" || hf_model_type == "glm4";
  }
  // The scale of q·kᵀ: Granite's attention_multiplier, else 1 / sqrt(query_pre_attn_scalar),
  // else 1 / sqrt(head_dim()).
  double attention_scale() const;
  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t ffn_dim() const;
  int64_t head_dim() const { return head_width > 0 ? head_width : n_embd / n_head; }
  // The channels of a head RoPE turns: HF's int(head_dim * partial_rotary_factor).
  int64_t rotary_dim() const {
    return static_cast<int64_t>(static_cast<double>(head_dim()) * partial_rotary_factor);
  }
  // A head width given as a size key is (model.head_dim, --head-dim; 0 = none): a width of its own
  // only where it is not n_embd / n_head (n_embd and n_head set first).
  void set_head_dim(int64_t d) { head_width = d * n_head == n_embd ? 0 : d; }
  void validate() const;  // Error (kUsage) naming the inconsistent sizes
};

class CausalLM : public nn::Module {
 public:
  CausalLM(std::string type, ModelSpec spec)
      : nn::Module(std::move(type)), spec_(std::move(spec)) {}
  // input_ids: I64 [B, T]; attention_mask: U8 [B, T] (1 real, 0 pad) or undefined;
  // position_ids: I64 [B, T] on the CPU, or undefined (0..T-1): a packed row's positions, which
  // restart at 0 on each example's first token; each example then attends only to itself
  // (ops/attention.h) and takes the positions (RoPE's angles, GPT-2's wpe rows) it takes alone.
  // Returns logits [B, T, V] in the dtype of the last projection (compute dtype under autocast).
  Tensor forward(const Tensor& input_ids, const Tensor& attention_mask,
                 const Tensor& position_ids = Tensor()) {
    return run(input_ids, ops::AttentionMask(attention_mask, position_ids), nullptr, {});
  }
  // Incremental decoding (batch 1, no padding): the logits [1, Tn, V] of input_ids [1, Tn] at
  // positions [cache.length, cache.length + Tn), attending to every position the cache holds,
  // which it then holds too. The prompt's pass (cache.length == 0) computes what forward() does.
  // `last_only`: the logits [1, 1, V] of the last position alone (what a decode chooses from; a
  // 4,096-token prompt's whole logits over Llama-3's vocabulary are 2 GB in f32).
  Tensor forward_cached(const Tensor& input_ids, KVCache& cache, bool last_only = false);
  // One decoding step of rows side by side (generate_rows): input_ids [B, 1], row b the next
  // token of the sequence caches[b] holds (each of its own length). The logits [B, 1, V]; each
  // cache then holds one position more. Without gradients.
  Tensor forward_cached_rows(const Tensor& input_ids, const std::vector<KVCache*>& caches);
  // The prompts' passes of rows side by side (generate_rows): input_ids [B, T], row b's prompt in
  // its first lengths[b] positions and anything after (right padding: causal queries never see
  // it), caches[b] empty with room for T positions. The logits [B, 1, V] of each row's last real
  // position, lengths[b] - 1; each cache then holds its prompt's lengths[b] positions. Without
  // gradients.
  Tensor prefill_rows(const Tensor& input_ids, const std::vector<int64_t>& lengths,
                      const std::vector<KVCache*>& caches);
  // A cache with room for max_seq_len positions of every layer.
  // A cache for at most `positions` tokens (0: the model's max_seq_len). Each layer's keys and
  // values are allocated whole at the first step: Llama-3.1-8B's 131,072 positions would take
  // 16 GB in bf16, so a decode asks for the prompt plus the tokens it may add.
  KVCache make_kv_cache(int64_t positions = 0) const {
    return KVCache(spec_.n_layer,
                   positions > 0 ? std::min(positions, spec_.max_seq_len) : spec_.max_seq_len);
  }
  const ModelSpec& spec() const { return spec_; }
  void set_attention_backend(ops::AttentionBackend b) { spec_.attention = b; }
  // Activation checkpointing (train.activation_checkpointing): 0 = off; N = the decoder blocks run
  // in segments of N consecutive blocks (the last may be shorter), each keeping only its input
  // until backward recomputes it (nn/checkpoint.h). Only a training forward with grad mode on and
  // no KV cache is checkpointed; evaluation and generation run plainly.
  void set_activation_checkpointing(int64_t blocks_per_segment) {
    blocks_per_segment_ = blocks_per_segment;
  }
  int64_t activation_checkpointing() const { return blocks_per_segment_; }
  // The untied lookup tables: parameters whose gradient comes only from an embedding lookup, and
  // whether positions (0..T-1) or token ids select their rows. A row no input of a step selected
  // keeps a gradient of exactly 0 in any precision: the per-layer underflow statistics leave such
  // rows out (Trainer::last_unselected).
  struct LookupTable {
    std::string param;
    bool by_position = false;
  };
  virtual std::vector<LookupTable> lookup_tables() const { return {}; }

 protected:
  // The forward of the family; with a cache, positions start at cache->length (batch 1, no mask)
  // and every layer appends its keys and values. `keep` empty: the logits [B, T, V] of every
  // position; else [K, 1, V] of the K positions keep names (flat indices b * T + t), the final
  // norm and the head computed for those alone (keep_positions).
  virtual Tensor run(const Tensor& input_ids, const ops::AttentionMask& mask,
                     const KVCaches* caches, const std::vector<int64_t>& keep) = 0;
  // x [B, T, C] at the positions `keep` names, [K, 1, C]; x itself when keep is empty. Without
  // gradients (decoding).
  static Tensor keep_positions(const Tensor& x, const std::vector<int64_t>& keep);
  // x through `blocks` in order, block i's forward being block_forward(i, x) (which must own what
  // it captures: a checkpointed segment calls it again inside backward); checkpointed as
  // set_activation_checkpointing() says when `may_checkpoint` (no KV cache) and training.
  using BlockForward = std::function<Tensor(size_t block, const Tensor& x)>;
  Tensor run_blocks(const std::vector<nn::Module*>& blocks, Tensor x, BlockForward block_forward,
                    bool may_checkpoint);
  ModelSpec spec_;
  int64_t blocks_per_segment_ = 0;
  friend void resize_token_embeddings(CausalLM& model, int64_t new_vocab);  // models/resize.h
};

// The queries, keys and values [B, T, n_head * D], [B, T, n_kv_head * D] (twice) of one fused
// product qkv [B, T, (n_head + 2 * n_kv_head) * D] whose rows go key/value group by group, each
// group its n_head / n_kv_head queries, then its key, then its value: GPT-NeoX's and GPT-BigCode's
// (without multi_query) a group a head, Falcon's num_kv_heads groups. Group g's queries are heads
// g * r to g * r + r - 1, which read key/value head g as grouped-query heads do.
std::vector<Tensor> split_grouped_qkv(const Tensor& qkv, int64_t n_head, int64_t n_kv_head);

// Builds a model with deterministic initialization from `seed` (GPT-2: N(0, init_std), residual
// projections scaled by 1/sqrt(2 n_layer), biases 0, norms 1; Llama: N(0, init_std), norms 1).
std::unique_ptr<CausalLM> make_causal_lm(const ModelSpec& spec, uint64_t seed);

// The dropout attention module `m` applies to its probabilities (ModelSpec::attention_dropout
// p): p while it trains, none in eval mode, its mask seeded by the step's seed and m's path +
// ".attn_dropout" (nn::dropout_mask_seed), so a replay or a checkpointed recompute draws it again.
ops::AttentionDropout attention_probability_dropout(const nn::Module& m, double p);

// The model of `spec` with every parameter deferred (tensor.h's DeferStorage): shapes, dtypes and
// names, no memory and no initialization. For a model whose weights come from files
// (io::attach_hf_weights). In eval mode, as transformers' from_pretrained returns one: a file's
// dropouts (GPT-2's 0.1 each) apply only where a run trains it (the Trainer switches it to
// training mode each step, under the run's model.dropout and model.attention_dropout).
std::unique_ptr<CausalLM> make_causal_lm_for_loading(const ModelSpec& spec);

// make_causal_lm's random initialization of parameter `name` (HF's _init_weights): the standard
// deviation of its N(0, std) draw, or nullopt for one that keeps its construction value (biases 0,
// norms 1). Draws come from one Rng(seed) over the parameters in registration order.
std::optional<double> init_std(const ModelSpec& spec, const std::string& name);

// That initialization, of a built model (the families' constructors run it). Deferred parameters
// are left alone.
void init_parameters(CausalLM& model, uint64_t seed);

// Replays make_causal_lm(spec, seed)'s draws without building the model: `use` gets the f32
// value (before any rounding into spec.param_dtype) of every randomly initialized parameter that
// `want` names, one tensor at a time, in registration order.
void replay_init(const ModelSpec& spec, uint64_t seed,
                 const std::function<bool(const std::string& name)>& want,
                 const std::function<void(const std::string& name, const Tensor& f32)>& use);

}  // namespace keel::models
