#include "keel/models/gpt2.h"

#include <algorithm>

#include <cmath>

#include "keel/amp/autocast.h"
#include "keel/ops/linear.h"
#include "keel/ops/shape.h"
#include "keel/tensor/random.h"

namespace keel::models {

GPT2Attention::GPT2Attention(const ModelSpec& s)
    : nn::Module("GPT2Attention"),
      n_head(s.n_head),
      n_embd(s.n_embd),
      n_kv_head(s.kv_heads()),
      per_head_qkv(s.gpt_bigcode() && s.kv_heads() == s.n_head),
      attention_dropout(s.attention_dropout) {
  const int64_t d = s.n_embd / s.n_head;
  c_attn = register_module(
      "c_attn",
      std::make_unique<nn::Linear>(s.n_embd, s.n_embd + 2 * n_kv_head * d, true, s.param_dtype));
  c_proj = register_module("c_proj",
                           std::make_unique<nn::Linear>(s.n_embd, s.n_embd, true, s.param_dtype));
  resid_dropout = register_module("resid_dropout", std::make_unique<nn::Dropout>(s.dropout));
}

Tensor GPT2Attention::forward(const Tensor& x, const ops::AttentionMask& mask,
                              ops::AttentionBackend backend, const KVCaches* caches, size_t layer) {
  return call({x}, [&] {
    const int64_t d = n_embd / n_head;
    Tensor qkv = c_attn->forward(x);  // [B, T, C + 2 * kv * D]
    // GPT-BigCode without multi_query: a group a head (HF's view(B, T, H, 3D) split in D, D,
    // D); else the queries, then the keys, then the values (3 x [B, T, C] for GPT-2).
    const std::vector<Tensor> parts =
        per_head_qkv ? split_grouped_qkv(qkv, n_head, n_head)
                     : ops::split_last(qkv, {n_embd, n_kv_head * d, n_kv_head * d});
    using amp::AmpOp;
    Tensor q = amp::autocast(AmpOp::kAttention, ops::split_heads(parts[0], n_head));  // [B,H,T,D]
    Tensor k = amp::autocast(AmpOp::kAttention, ops::split_heads(parts[1], n_kv_head));
    Tensor v = amp::autocast(AmpOp::kAttention, ops::split_heads(parts[2], n_kv_head));
    Tensor y;  // [B, T, C]
    if (caches) {
      y = ops::merge_heads(cached_step_attention(q, k, v, *caches, layer, backend));
    } else {
      y = ops::merge_heads(ops::attention(q, k, v, mask, backend, {},
                                          attention_probability_dropout(*this, attention_dropout)));
    }
    return resid_dropout->forward(c_proj->forward(y));
  });
}

GPT2MLP::GPT2MLP(const ModelSpec& s) : nn::Module("GPT2MLP") {
  c_fc = register_module("c_fc",
                         std::make_unique<nn::Linear>(s.n_embd, s.ffn_dim(), true, s.param_dtype));
  c_proj = register_module(
      "c_proj", std::make_unique<nn::Linear>(s.ffn_dim(), s.n_embd, true, s.param_dtype));
  dropout = register_module("dropout", std::make_unique<nn::Dropout>(s.dropout));
}

Tensor GPT2MLP::forward(const Tensor& x) {
  return call({x}, [&] {
    Tensor h = ops::gelu(c_fc->forward(x), ops::GeluApprox::Tanh);  // [B, T, 4C]
    return dropout->forward(c_proj->forward(h));
  });
}

GPT2Block::GPT2Block(const ModelSpec& s) : nn::Module("GPT2Block") {
  ln_1 =
      register_module("ln_1", std::make_unique<nn::LayerNorm>(s.n_embd, s.norm_eps, s.param_dtype));
  attn = register_module("attn", std::make_unique<GPT2Attention>(s));
  ln_2 =
      register_module("ln_2", std::make_unique<nn::LayerNorm>(s.n_embd, s.norm_eps, s.param_dtype));
  mlp = register_module("mlp", std::make_unique<GPT2MLP>(s));
}

Tensor GPT2Block::forward(const Tensor& x, const ops::AttentionMask& mask,
                          ops::AttentionBackend backend, const KVCaches* caches, size_t layer) {
  return call({x}, [&] {
    Tensor h = nn::residual_add(x, attn->forward(ln_1->forward(x), mask, backend, caches, layer));
    return nn::residual_add(h, mlp->forward(ln_2->forward(h)));
  });
}

GPT2Model::GPT2Model(const ModelSpec& s) : nn::Module("GPT2Model") {
  wte = register_module("wte",
                        std::make_unique<nn::Embedding>(s.vocab_size, s.n_embd, s.param_dtype));
  wpe = register_module("wpe",
                        std::make_unique<nn::Embedding>(s.max_seq_len, s.n_embd, s.param_dtype));
  drop = register_module("drop", std::make_unique<nn::Dropout>(s.dropout));
  for (int64_t i = 0; i < s.n_layer; ++i)
    h.push_back(register_module("h." + std::to_string(i), std::make_unique<GPT2Block>(s)));
  ln_f =
      register_module("ln_f", std::make_unique<nn::LayerNorm>(s.n_embd, s.norm_eps, s.param_dtype));
}

GPT2LMHeadModel::GPT2LMHeadModel(const ModelSpec& s, uint64_t seed)
    : CausalLM("GPT2LMHeadModel", s) {
  transformer = register_module("transformer", std::make_unique<GPT2Model>(spec_));
  init_parameters(*this, seed);  // HF's GPT2PreTrainedModel._init_weights (init_std)
}

Tensor GPT2LMHeadModel::run(const Tensor& ids, const ops::AttentionMask& mask,
                            const KVCaches* caches, const std::vector<int64_t>& keep) {
  return call({ids}, [&] {
    KEEL_CHECK(ids.dim() == 2, "GPT-2 input_ids must be [B, T], got " + shape_str(ids.shape()));
    const int64_t B = ids.size(0), T = ids.size(1);
    // The longest sequence: a decode's rows go on from what their caches hold; a packed row's
    // positions stay below T.
    int64_t longest = T;
    if (caches)
      for (const KVCache* c : caches->rows) longest = std::max(longest, c->length + T);
    if (longest > spec_.max_seq_len)
      throw Error("sequence length " + std::to_string(longest) +
                  " exceeds the model's max_seq_len " + std::to_string(spec_.max_seq_len) +
                  " (raise model.max_seq_len or lower data.seq_len)");
    // Each row's positions: a packed row's own (each example from 0), a decode's from what its
    // cache holds, else 0..T-1.
    Tensor pos = mask.positions;
    if (!pos.defined() && caches) pos = caches->positions(T);
    if (!pos.defined()) {
      std::vector<int64_t> p(B * T);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) p[b * T + t] = t;
      pos = Tensor::from_ints(p, {B, T});
    }
    Tensor x = nn::residual_add(transformer->wte->forward(ids),
                                transformer->wpe->forward(pos.to(ids.device())));
    x = transformer->drop->forward(x);
    const ops::AttentionBackend backend = spec_.attention;
    x = run_blocks(
        {transformer->h.begin(), transformer->h.end()}, x,
        [this, mask, backend, caches](size_t i, const Tensor& h) {
          return transformer->h[i]->forward(h, mask, backend, caches, i);
        },
        caches == nullptr);
    x = transformer->ln_f->forward(keep_positions(x, keep));
    // lm_head is tied to wte: logits = x·wteᵀ, under the linear autocast rule.
    using amp::AmpOp;
    return ops::linear(amp::autocast(AmpOp::kLinear, x),
                       amp::autocast(AmpOp::kLinear, transformer->wte->weight));
  });
}

}  // namespace keel::models
