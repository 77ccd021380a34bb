// Llama family (HF LlamaForCausalLM names): RMSNorm, RoPE, SwiGLU MLP, grouped-query attention,
// no biases, tied or untied lm_head; and the architectures built of its layers (ModelSpec's
// hf_model_type: Gemma, Gemma-2, Mistral, Phi-3, Qwen2, Qwen3).
#pragma once
#include <memory>
#include <vector>

#include "keel/models/causal_lm.h"
#include "keel/models/kv_cache.h"
#include "keel/nn/layers.h"
#include "keel/ops/moe.h"

namespace keel::models {

class LlamaAttention : public nn::Module {
 public:
  LlamaAttention(const ModelSpec& s, int64_t layer);
  Tensor forward(const Tensor& x, const ops::AttentionMask& mask, ops::AttentionBackend backend,
                 const KVCaches* caches = nullptr, size_t layer = 0);  // [B,T,C]
  // Phi-3 (ModelSpec::fused_projections()), GPT-NeoX and Falcon (their query_key_value,
  // grouped_qkv): qkv_proj alone, q_proj, k_proj and v_proj null. o_proj: Phi's, GPT-NeoX's and
  // Falcon's dense.
  nn::Linear *q_proj = nullptr, *k_proj = nullptr, *v_proj = nullptr, *qkv_proj = nullptr, *o_proj;
  // GPT-NeoX's and Falcon's qkv_proj rows: key/value group by group, each its queries, its key,
  // then its value (ModelSpec::grouped_qkv)
  bool grouped_qkv = false;
  bool codegen_qkv = false;                          // CodeGen's qkv_proj rows (ModelSpec::codegen)
  nn::RMSNorm *q_norm = nullptr, *k_norm = nullptr;  // ModelSpec::qk_norm() (Qwen3, Gemma-3)
  // ModelSpec::head_qk_layernorm() (Command-R+'s q_norm, StableLM-2-12B's q_layernorm): over
  // [B, T, heads, head_dim], before the heads split.
  nn::HeadLayerNorm *q_head_norm = nullptr, *k_head_norm = nullptr;
  bool norm_whole_projection = false;  // OLMo-2's: q_norm and k_norm before the heads split
  int64_t n_head, n_kv_head;
  double rope_theta;
  ops::RopeScaling rope_scaling;
  int64_t rotary_dim;           // the channels of a head RoPE turns (Phi-4-mini: 3/4 of them)
  bool rotates;                 // false: a NoPE layer (SmolLM3's every 4th), q and k as projected
  bool interleaved;             // Cohere's RoPE on adjacent channel pairs (ModelSpec's)
  int64_t sliding_window;       // this layer's window (ModelSpec::layer_window); 0: every key
  ops::AttentionScores scores;  // q·kᵀ's scale and soft cap (Gemma-2's)
  double attention_dropout;     // on the probabilities (ModelSpec::attention_dropout; Falcon 0)
  float clip_qkv;               // OLMo's clamp of q, k and v (ModelSpec::clip_qkv); 0: none
};

class LlamaMLP : public nn::Module {
 public:
  // `width`: the hidden width (0: s.ffn_dim(); an expert's: s.moe.ffn); `expert`: one of a
  // mixture's experts (Mixtral's name their projections w1, w3 and w2).
  explicit LlamaMLP(const ModelSpec& s, int64_t width = 0, bool expert = false);
  Tensor forward(const Tensor& x);
  // Phi-3 (ModelSpec::fused_projections()): gate_up_proj alone, gate_proj and up_proj null.
  // Phi and GPT-NeoX (ModelSpec::gelu_mlp()): up_proj (fc1, dense_h_to_4h) and down_proj (fc2,
  // dense_4h_to_h) with biases, gate_proj null: down(gelu(up(x))).
  nn::Linear *gate_proj = nullptr, *up_proj = nullptr, *gate_up_proj = nullptr, *down_proj;
  bool gelu_gate = false;                        // Gemma's GeGLU: gelu-tanh(gate) * up; else SwiGLU
  ops::GeluApprox gelu = ops::GeluApprox::Tanh;  // gelu_mlp's (ModelSpec::mlp_gelu)
};

// A sparse layer's MLP (ModelSpec::moe_layer; HF's Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock,
// MixtralSparseMoeBlock): the router sends each token to its moe.per_token experts, each
// expert's MLP runs on its tokens, and their outputs are summed weighted by the routing
// (ops/moe.h). An expert no token chose does not run, and its parameters get no gradient.
class LlamaSparseMoe : public nn::Module {
 public:
  explicit LlamaSparseMoe(const ModelSpec& s);
  Tensor forward(const Tensor& x);  // [..., C]
  nn::Linear* gate;                 // the router: [moe.experts, C]
  std::vector<LlamaMLP*> experts;
  // Qwen2-MoE's (MoeSpec::shared_ffn): every token's MLP, gated by sigmoid(shared_expert_gate(x));
  // null for the others.
  LlamaMLP* shared_expert = nullptr;
  nn::Linear* shared_expert_gate = nullptr;  // [1, C]
  int64_t top_k;
  bool normalize;  // norm_topk_prob
  // The tokens routed to each expert by the forwards since the last reset_routed() (a
  // checkpointed block's recompute is not counted again): what expert_load reports.
  std::vector<int64_t> routed;
  void reset_routed() { std::fill(routed.begin(), routed.end(), 0); }
  // The model's, shared by its sparse layers: the load-balancing loss of each forward's routing.
  std::shared_ptr<ops::MoeBalance> balance;
};

// The experts' load since the last reset_expert_load(), over every sparse layer of `model`: how
// many (layer, expert) pairs no token was routed to, and the busiest expert's tokens over a layer's
// mean (1: even; experts / top_k: one expert took every token's choices it could). A router that
// sends everything to a few experts (collapse) or never to some (dead experts) shows here.
struct ExpertLoad {
  int64_t layers = 0, unused = 0;  // layers: 0 for a dense model
  double max_load = 0;
  // The load-balancing loss (ops::MoeBalance) of those forwards' tokens together: top_k when the
  // router spreads them evenly, up to the experts' count as it collapses onto one.
  double balance_loss = 0;
};
ExpertLoad expert_load(nn::Module& model);
void reset_expert_load(nn::Module& model);

// The load-balancing loss of `model`'s last forward, whose backward adds its gradient times
// balance->grad (what training sets when model.router_aux_loss_coef asks for it); null for a
// dense model.
ops::MoeBalance* router_balance(nn::Module& model);

class LlamaDecoderLayer : public nn::Module {
 public:
  LlamaDecoderLayer(const ModelSpec& s, int64_t layer);
  Tensor forward(const Tensor& x, const ops::AttentionMask& mask, ops::AttentionBackend backend,
                 const KVCaches* caches = nullptr, size_t layer = 0);
  nn::RMSNorm* input_layernorm = nullptr;  // null for OLMo-2 (ModelSpec::post_norms())
  // Null for Cohere and Phi (ModelSpec::shared_block_norm(): the attention and the MLP share
  // input_layernorm's output); a parallel GPT-NeoX's normalizes the MLP's input.
  nn::RMSNorm* post_attention_layernorm = nullptr;
  bool parallel = false;        // ModelSpec::parallel_block()
  bool residual_first = false;  // its sum's order: (x + attention) + mlp (Cohere's, StableLM's)
  // Gemma-2's (ModelSpec::sandwich_norms()): the MLP's input and output norms, and
  // post_attention_layernorm then normalizes the attention's output; else null.
  nn::RMSNorm *pre_feedforward_layernorm = nullptr, *post_feedforward_layernorm = nullptr;
  double residual_multiplier = 1;  // Granite's: each sublayer's output scaled before its add
  // ModelSpec::branch_dropout's on the attention's output (Phi, GPT-NeoX, a Falcon in sequence)
  // and the MLP's (and StableLM's); else null. (Not the attention probabilities' dropout:
  // LlamaAttention's.) A parallel Falcon's post_mlp_dropout drops the branches' sum
  // (falcon_sum_dropout).
  nn::Dropout *post_attention_dropout = nullptr, *post_mlp_dropout = nullptr;
  bool falcon_sum_dropout = false;
  LlamaAttention* self_attn;
  LlamaMLP* mlp = nullptr;        // a dense layer's
  LlamaSparseMoe* moe = nullptr;  // a sparse layer's (ModelSpec::moe_layer)
  Tensor feed_forward(const Tensor& h) { return moe ? moe->forward(h) : mlp->forward(h); }
};

class LlamaModel : public nn::Module {
 public:
  explicit LlamaModel(const ModelSpec& s);
  nn::Embedding* embed_tokens;  // GPT-NeoX's embed_in
  std::vector<LlamaDecoderLayer*> layers;
  nn::RMSNorm* norm;                     // Phi's final_layernorm, GPT-NeoX's final_layer_norm
  nn::Dropout* embed_dropout = nullptr;  // GPT-NeoX's emb_dropout, GPT-J's drop (branch_dropout)
};

class LlamaForCausalLM : public CausalLM {
 public:
  LlamaForCausalLM(const ModelSpec& s, uint64_t seed);
  LlamaModel* model;
  nn::Linear* lm_head = nullptr;  // null when tied to embed_tokens (GPT-NeoX's embed_out)
  std::shared_ptr<ops::MoeBalance> balance;  // a mixture's (its sparse layers share it); else null

  std::vector<LookupTable> lookup_tables() const override {
    if (spec_.tie_embeddings) return {};  // the tied head gives every row a gradient
    return {{spec_.embedding_name(), false}};
  }

 protected:
  Tensor run(const Tensor& input_ids, const ops::AttentionMask& mask, const KVCaches* caches,
             const std::vector<int64_t>& keep) override;
};

}  // namespace keel::models
