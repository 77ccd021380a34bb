// GPT-2 (HF GPT2LMHeadModel names): learned positions, pre-LayerNorm blocks, tanh-GELU MLP, fused
// qkv projection, lm_head tied to wte.
#pragma once
#include <vector>

#include "keel/models/causal_lm.h"
#include "keel/models/kv_cache.h"
#include "keel/nn/layers.h"

namespace keel::models {

class GPT2Attention : public nn::Module {
 public:
  explicit GPT2Attention(const ModelSpec& s);
  Tensor forward(const Tensor& x, const ops::AttentionMask& mask, ops::AttentionBackend backend,
                 const KVCaches* caches = nullptr, size_t layer = 0);  // [B,T,C]
  nn::Linear *c_attn, *c_proj;
  nn::Dropout* resid_dropout;
  int64_t n_head, n_embd;
  int64_t n_kv_head;  // GPT-BigCode's multi_query: 1; else n_head
  // GPT-BigCode without multi_query: c_attn's rows each head's q, k, v side by side (GPT-2's are
  // all the queries, then the keys, then the values).
  bool per_head_qkv = false;
  double attention_dropout;  // on the probabilities (ModelSpec::attention_dropout)
};

class GPT2MLP : public nn::Module {
 public:
  explicit GPT2MLP(const ModelSpec& s);
  Tensor forward(const Tensor& x);
  nn::Linear *c_fc, *c_proj;
  nn::Dropout* dropout;
};

class GPT2Block : public nn::Module {
 public:
  explicit GPT2Block(const ModelSpec& s);
  Tensor forward(const Tensor& x, const ops::AttentionMask& mask, ops::AttentionBackend backend,
                 const KVCaches* caches = nullptr, size_t layer = 0);
  nn::LayerNorm *ln_1, *ln_2;
  GPT2Attention* attn;
  GPT2MLP* mlp;
};

class GPT2Model : public nn::Module {
 public:
  explicit GPT2Model(const ModelSpec& s);
  nn::Embedding *wte, *wpe;
  nn::Dropout* drop;
  std::vector<GPT2Block*> h;
  nn::LayerNorm* ln_f;
};

class GPT2LMHeadModel : public CausalLM {
 public:
  GPT2LMHeadModel(const ModelSpec& s, uint64_t seed);
  GPT2Model* transformer;

  // wte is tied to the head (every row gets the head's gradient); wpe is a pure lookup.
  std::vector<LookupTable> lookup_tables() const override {
    return {{"transformer.wpe.weight", true}};
  }

 protected:
  Tensor run(const Tensor& input_ids, const ops::AttentionMask& mask, const KVCaches* caches,
             const std::vector<int64_t>& keep) override;
};

}  // namespace keel::models
