#include "keel/models/llama.h"

#include "keel/amp/autocast.h"
#include "keel/ops/activation.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"
#include "keel/ops/moe.h"
#include "keel/ops/rope.h"
#include "keel/ops/shape.h"
#include "keel/tensor/random.h"

namespace keel::models {

namespace {
// [..., D] with the first `width` channels of each row reordered 0, 2, 4, ..., 1, 3, 5, ...
// (width even) and the rest left where they are.
Tensor evens_first(const Tensor& x, int64_t width) {
  if (width < x.size(-1)) {
    const std::vector<Tensor> parts = ops::split_last(x, {width, x.size(-1) - width});
    return ops::concat_last(evens_first(parts[0], width), parts[1]);
  }
  Shape pairs = x.shape(), out = x.shape();
  pairs.back() /= 2;
  pairs.push_back(2);
  return ops::reshape(ops::transpose(ops::reshape(x, pairs), -1, -2), out);
}
}  // namespace

LlamaAttention::LlamaAttention(const ModelSpec& s, int64_t layer)
    : nn::Module("LlamaAttention"),
      n_head(s.n_head),
      n_kv_head(s.kv_heads()),
      // Gemma-3's and OLMo-3's sliding layers rotate unscaled (Gemma-3's by a base of their own).
      rope_theta(s.layer_rope_theta(layer)),
      rope_scaling(s.layer_rope_scaling(layer)),
      rotary_dim(s.rotary_dim()),
      rotates(s.layer_rotates(layer)),
      interleaved(s.interleaved_rope()),
      sliding_window(s.layer_window(layer)),
      scores{static_cast<float>(s.attention_scale()), static_cast<float>(s.attn_softcap)},
      // (HF's rotary Falcon drops no probabilities: its attention_dropout is a sequential block's
      // output's.)
      attention_dropout(s.falcon() ? 0.0 : s.attention_dropout),
      clip_qkv(static_cast<float>(s.clip_qkv)) {
  const int64_t d = s.head_dim();
  const ModelSpec::ModuleNames names = s.module_names();
  auto lin = [&](int64_t in, int64_t out, bool bias) {
    return std::make_unique<nn::Linear>(in, out, bias, s.param_dtype);
  };
  grouped_qkv = s.grouped_qkv();
  codegen_qkv = s.codegen();
  if (s.fused_qkv()) {
    qkv_proj =
        register_module(names.qkv, lin(s.n_embd, (n_head + 2 * n_kv_head) * d, s.qkv_bias()));
  } else {
    q_proj = register_module("q_proj", lin(s.n_embd, n_head * d, s.qkv_bias()));
    k_proj = register_module("k_proj", lin(s.n_embd, n_kv_head * d, s.qkv_bias()));
    v_proj = register_module("v_proj", lin(s.n_embd, n_kv_head * d, s.qkv_bias()));
  }
  o_proj = register_module(names.out, lin(n_head * d, s.n_embd, s.out_bias()));
  if (s.qk_norm()) {
    // (Gemma-3's scale by 1 + weight, as its other norms; OLMo-2's span the whole projection;
    // Phi's are LayerNorms with a bias, q_layernorm and k_layernorm)
    const int64_t q_width = s.qk_norm_over_projection() ? n_head * d : d;
    const int64_t k_width = s.qk_norm_over_projection() ? n_kv_head * d : d;
    const bool phi = s.phi();
    auto norm = [&](int64_t width) {
      return std::make_unique<nn::RMSNorm>(
          width, s.norm_eps, s.param_dtype, s.gemma(), phi,
          phi ? nn::RMSNorm::Affine::kWeightAndBias : nn::RMSNorm::Affine::kWeight);
    };
    q_norm = register_module(phi ? "q_layernorm" : "q_norm", norm(q_width));
    k_norm = register_module(phi ? "k_layernorm" : "k_norm", norm(k_width));
    norm_whole_projection = s.qk_norm_over_projection();
  }
  if (s.head_qk_layernorm()) {  // Command-R+'s q_norm [heads, d]; StableLM-2-12B's one a head
    const bool per_head = s.stablelm();
    q_head_norm = register_module(
        per_head ? "q_layernorm" : "q_norm",
        std::make_unique<nn::HeadLayerNorm>(n_head, d, s.norm_eps, s.param_dtype, per_head));
    k_head_norm = register_module(
        per_head ? "k_layernorm" : "k_norm",
        std::make_unique<nn::HeadLayerNorm>(n_kv_head, d, s.norm_eps, s.param_dtype, per_head));
  }
}

Tensor LlamaAttention::forward(const Tensor& x, const ops::AttentionMask& mask,
                               ops::AttentionBackend backend, const KVCaches* caches,
                               size_t layer) {
  return call({x}, [&] {
    using amp::AmpOp;
    const float theta = static_cast<float>(rope_theta);
    // A decode of one prompt: positions from what its cache holds; rows side by side: each row's.
    const int64_t past = caches && caches->rows.size() == 1 ? caches->rows[0]->length : 0;
    Tensor q, k, v;
    // OLMo's clip_qkv: each projection (OLMoE's q and k after their norms) clamped, as HF's clamp_.
    auto clipped = [this](const Tensor& t) { return clip_qkv > 0 ? ops::clamp(t, clip_qkv) : t; };
    if (grouped_qkv) {
      // GPT-NeoX, Falcon: one product whose columns go key/value group by group (HF's GPT-NeoX
      // view(B, T, H, 3D) chunked in three, Falcon's view(B, T, groups, queries + 2, D)).
      const std::vector<Tensor> parts = split_grouped_qkv(qkv_proj->forward(x), n_head, n_kv_head);
      q = ops::split_heads(parts[0], n_head);
      k = ops::split_heads(parts[1], n_kv_head);
      v = ops::split_heads(parts[2], n_kv_head);
    } else if (codegen_qkv) {
      // CodeGen: one product whose columns go in 4 blocks, each a quarter of the heads' queries,
      // values, then keys (HF's reshape(..., mp_num, -1) split in that order): block b holds
      // heads b * n_head / 4 onwards.
      const int64_t d = o_proj->in_features / n_head, per = n_head / ModelSpec::kCodegenBlocks;
      const Tensor qkv = qkv_proj->forward(x);
      Shape by_block = qkv.shape(), merged = qkv.shape();
      by_block.back() = ModelSpec::kCodegenBlocks;
      by_block.push_back(3 * per * d);
      merged.back() = n_head * d;
      const std::vector<Tensor> parts =
          ops::split_last(ops::reshape(qkv, by_block), {per * d, per * d, per * d});
      q = ops::split_heads(ops::reshape(parts[0], merged), n_head);
      v = ops::split_heads(ops::reshape(parts[1], merged), n_head);
      k = ops::split_heads(ops::reshape(parts[2], merged), n_head);
    } else if (qkv_proj) {  // Phi-3: one product, its columns q's, k's, then v's (Phi3Attention)
      const int64_t d = o_proj->in_features / n_head;
      const std::vector<Tensor> qkv =
          ops::split_last(qkv_proj->forward(x), {n_head * d, n_kv_head * d, n_kv_head * d});
      q = ops::split_heads(qkv[0], n_head);
      k = ops::split_heads(qkv[1], n_kv_head);
      v = ops::split_heads(qkv[2], n_kv_head);
    } else if (norm_whole_projection) {  // OLMo-2: q and k normalized over all their heads
      q = ops::split_heads(clipped(q_norm->forward(q_proj->forward(x))), n_head);
      k = ops::split_heads(clipped(k_norm->forward(k_proj->forward(x))), n_kv_head);
    } else if (q_head_norm) {  // Command-R+, StableLM-2-12B: each head by a weight of its own
      // ([B, T, heads * D] seen as [B, T, heads, D] for the norm, as HF's view before it)
      auto by_head = [](nn::HeadLayerNorm& norm, const Tensor& y) {
        Shape heads = y.shape();
        heads.back() = norm.heads;
        heads.push_back(norm.dim);
        return ops::reshape(norm.forward(ops::reshape(y, heads)), y.shape());
      };
      q = ops::split_heads(by_head(*q_head_norm, q_proj->forward(x)), n_head);
      k = ops::split_heads(by_head(*k_head_norm, k_proj->forward(x)), n_kv_head);
    } else {
      q = ops::split_heads(clipped(q_proj->forward(x)), n_head);     // [B,H,T,D]
      k = ops::split_heads(clipped(k_proj->forward(x)), n_kv_head);  // [B,Hkv,T,D]
    }
    if (q_norm && !norm_whole_projection) {  // Qwen3, Gemma-3, EXAONE-4: each head's D channels
      q = q_norm->forward(q);
      k = k_norm->forward(k);
    }
    if (interleaved && rotates) {
      // Cohere's (and GLM's) RoPE turns the pairs (2i, 2i + 1), ops::rope the pairs
      // (i, i + D/2): the same rotation once each head's turned channels are reordered evens
      // first. q·kᵀ does not change when q's and k's channels are reordered alike, so they stay
      // reordered (the cache's keys too).
      q = evens_first(q, rotary_dim);
      k = evens_first(k, rotary_dim);
    }
    const Tensor positions = mask.positions.defined()            ? mask.positions
                             : caches && caches->rows.size() > 1 ? caches->positions(x.size(1))
                                                                 : Tensor();
    // (SmolLM3's NoPE layers, and EXAONE-4's full ones, see positions only through the causal
    // mask.)
    if (rotates && positions.defined()) {  // a packed row's (each from 0), or decoding rows'
      q = ops::rope(q, theta, positions, rope_scaling, rotary_dim);
      k = ops::rope(k, theta, positions, rope_scaling, rotary_dim);
    } else if (rotates) {
      q = ops::rope(q, theta, past, rope_scaling, rotary_dim);
      k = ops::rope(k, theta, past, rope_scaling, rotary_dim);
    }
    if (!qkv_proj) v = ops::split_heads(clipped(v_proj->forward(x)), n_kv_head);  // [B,Hkv,T,D]
    q = amp::autocast(AmpOp::kAttention, q);
    k = amp::autocast(AmpOp::kAttention, k);
    v = amp::autocast(AmpOp::kAttention, v);
    Tensor y;
    if (caches) {
      y = cached_step_attention(q, k, v, *caches, layer, backend, sliding_window, scores);
    } else {
      ops::AttentionMask seen = mask;
      seen.window = sliding_window;
      y = ops::attention(q, k, v, seen, backend, scores,
                         attention_probability_dropout(*this, attention_dropout));
    }
    return o_proj->forward(ops::merge_heads(y));  // [B, T, C]
  });
}

LlamaMLP::LlamaMLP(const ModelSpec& s, int64_t width, bool expert) : nn::Module("LlamaMLP") {
  auto lin = [&](int64_t in, int64_t out) {
    return std::make_unique<nn::Linear>(in, out, false, s.param_dtype);
  };
  const int64_t f = width > 0 ? width : s.ffn_dim();
  const bool w123 = expert && s.mixtral_names();  // Mixtral's experts: w1 gate, w3 up, w2 down
  gelu_gate = s.gemma();
  if (s.gelu_mlp()) {  // Phi's fc1 and fc2, GPT-NeoX's and Falcon's dense_h_to_4h, dense_4h_to_h
    const ModelSpec::ModuleNames names = s.module_names();
    gelu = s.mlp_gelu;
    up_proj = register_module(
        names.up, std::make_unique<nn::Linear>(s.n_embd, f, s.mlp_bias(), s.param_dtype));
    down_proj = register_module(
        names.down, std::make_unique<nn::Linear>(f, s.n_embd, s.mlp_bias(), s.param_dtype));
    return;
  }
  if (s.fused_gate_up()) {
    gate_up_proj = register_module("gate_up_proj", lin(s.n_embd, 2 * f));
  } else {
    gate_proj = register_module(w123 ? "w1" : "gate_proj", lin(s.n_embd, f));
    up_proj = register_module(w123 ? "w3" : "up_proj", lin(s.n_embd, f));
  }
  down_proj = register_module(w123 ? "w2" : "down_proj", lin(f, s.n_embd));
}

Tensor LlamaMLP::forward(const Tensor& x) {
  return call({x}, [&] {
    // Phi, GPT-NeoX: the gelu in the product's dtype (not an autocast op), as HF's ACT2FN runs.
    if (!gate_proj && !gate_up_proj)
      return down_proj->forward(ops::gelu(up_proj->forward(x), gelu));
    if (gate_up_proj) {  // Phi-3: gate's columns, then up's (HF's Phi3MLP chunks in two)
      const int64_t f = down_proj->in_features;
      const std::vector<Tensor> gate_up = ops::split_last(gate_up_proj->forward(x), {f, f});
      return down_proj->forward(ops::swiglu(gate_up[0], gate_up[1]));
    }
    // The two projections can differ in dtype when only one carries an adapter (PEFT's LoKr
    // returns its input's dtype, f32, while a plain projection under autocast returns bf16):
    // promote to the wider, as PyTorch's mixed-dtype multiply does.
    auto [gate, up] = amp::promote(gate_proj->forward(x), up_proj->forward(x));
    if (gelu_gate)  // Gemma: HF's act_fn(gate_proj(x)) * up_proj(x), gelu_pytorch_tanh
      return down_proj->forward(ops::mul(ops::gelu(gate, ops::GeluApprox::Tanh), up));
    return down_proj->forward(ops::swiglu(gate, up));
  });
}

LlamaSparseMoe::LlamaSparseMoe(const ModelSpec& s)
    : nn::Module("LlamaSparseMoe"),
      top_k(s.moe.per_token),
      normalize(s.moe.normalize),
      routed(static_cast<size_t>(s.moe.experts), 0) {
  gate = register_module(
      "gate", std::make_unique<nn::Linear>(s.n_embd, s.moe.experts, false, s.param_dtype));
  for (int64_t e = 0; e < s.moe.experts; ++e)
    experts.push_back(register_module("experts." + std::to_string(e),
                                      std::make_unique<LlamaMLP>(s, s.moe.ffn, true)));
  if (s.moe.shared_ffn > 0) {
    shared_expert =
        register_module("shared_expert", std::make_unique<LlamaMLP>(s, s.moe.shared_ffn));
    shared_expert_gate = register_module(
        "shared_expert_gate", std::make_unique<nn::Linear>(s.n_embd, 1, false, s.param_dtype));
  }
}

Tensor LlamaSparseMoe::forward(const Tensor& x) {
  return call({x}, [&] {
    // HF: hidden_states.view(-1, C); the router's logits under autocast in its compute dtype,
    // the routing in f32; each expert's tokens gathered from the layer's input (f32 in the
    // residual stream) and its output summed into zeros of the input's dtype.
    const Shape shape = x.shape();
    const Tensor flat = ops::reshape(x, {-1, shape.back()});
    const ops::MoeRouting r =
        ops::moe_route(gate->forward(flat), top_k, normalize, balance, !nn::Module::recomputing());
    std::vector<Tensor> outputs(experts.size());
    for (size_t e = 0; e < experts.size(); ++e) {
      const std::vector<int64_t>& rows = r.rows_of[e];
      if (!nn::Module::recomputing()) routed[e] += std::ssize(rows);
      if (!rows.empty())
        outputs[e] = experts[e]->forward(
            ops::gather_rows(flat, rows, ops::moe_padded_rows(std::ssize(rows))));
    }
    Tensor out = ops::moe_combine(outputs, r, x.dtype());
    if (shared_expert) {
      // HF's Qwen2MoeSparseMoeBlock: routed + sigmoid(shared_expert_gate(x)) * shared_expert(x),
      // the gated product in the experts' compute dtype, added to the routed sum's.
      auto [shared, logit] =
          amp::promote(shared_expert->forward(flat), shared_expert_gate->forward(flat));
      out = nn::residual_add(out, ops::gate_rows(shared, logit));
    }
    return ops::reshape(out, shape);
  });
}

ExpertLoad expert_load(nn::Module& model) {
  ExpertLoad out;
  for (nn::Module* m : model.modules()) {
    auto* moe = dynamic_cast<LlamaSparseMoe*>(m);
    if (!moe) continue;
    ++out.layers;
    int64_t total = 0, most = 0;
    for (int64_t n : moe->routed) {
      total += n;
      most = std::max(most, n);
      if (n == 0) ++out.unused;
    }
    if (total > 0)
      out.max_load = std::max(out.max_load, static_cast<double>(most) * std::ssize(moe->routed) /
                                                static_cast<double>(total));
  }
  if (const ops::MoeBalance* b = router_balance(model)) out.balance_loss = b->step.loss();
  return out;
}

void reset_expert_load(nn::Module& model) {
  for (nn::Module* m : model.modules())
    if (auto* moe = dynamic_cast<LlamaSparseMoe*>(m)) moe->reset_routed();
  if (ops::MoeBalance* b = router_balance(model)) b->clear_step();
}

ops::MoeBalance* router_balance(nn::Module& model) {
  auto* lm = dynamic_cast<LlamaForCausalLM*>(&model);
  return lm ? lm->balance.get() : nullptr;
}

namespace {
// A norm over the hidden size: Gemma's scale by 1 + weight, Cohere's a LayerNorm without bias,
// Phi's, GPT-NeoX's and StableLM's a LayerNorm with one, OLMo's one without parameters.
std::unique_ptr<nn::RMSNorm> hidden_norm(const ModelSpec& s) {
  using Affine = nn::RMSNorm::Affine;
  return std::make_unique<nn::RMSNorm>(s.n_embd, s.norm_eps, s.param_dtype, s.gemma(),
                                       s.centered_norms(),
                                       s.olmo()           ? Affine::kNone
                                       : s.biased_norms() ? Affine::kWeightAndBias
                                                          : Affine::kWeight);
}
}  // namespace

LlamaDecoderLayer::LlamaDecoderLayer(const ModelSpec& s, int64_t layer)
    : nn::Module("LlamaDecoderLayer") {
  residual_multiplier = s.residual_multiplier;
  parallel = s.parallel_block();
  residual_first = s.residual_first_sum();
  const ModelSpec::ModuleNames names = s.module_names();
  if (!s.post_norms()) input_layernorm = register_module(names.attn_in_norm, hidden_norm(s));
  self_attn = register_module(names.attention, std::make_unique<LlamaAttention>(s, layer));
  if (!s.shared_block_norm())
    post_attention_layernorm =
        register_module(s.sandwich_norms() ? names.attn_out_norm : names.mlp_norm, hidden_norm(s));
  if (s.sandwich_norms())
    pre_feedforward_layernorm = register_module(names.mlp_in_norm, hidden_norm(s));
  if (s.moe_layer(layer))
    moe = register_module(s.mixtral_names() ? "block_sparse_moe" : "mlp",
                          std::make_unique<LlamaSparseMoe>(s));
  else
    mlp = register_module("mlp", std::make_unique<LlamaMLP>(s));
  if (s.sandwich_norms() || s.post_norms())
    post_feedforward_layernorm = register_module(names.mlp_out_norm, hidden_norm(s));
  if (s.branch_dropout()) {  // HF's post_attention_dropout / post_mlp_dropout (Phi's resid_dropout)
    // (A Falcon drops its parallel branches' sum, or in sequence the attention's output by
    // attention_dropout and the MLP's by hidden_dropout.)
    falcon_sum_dropout = s.falcon() && parallel;
    if (!s.stablelm() && !falcon_sum_dropout)
      post_attention_dropout = register_module(
          "post_attention_dropout",
          std::make_unique<nn::Dropout>(s.falcon() ? s.attention_dropout : s.dropout));
    post_mlp_dropout =
        register_module("post_mlp_dropout", std::make_unique<nn::Dropout>(s.dropout));
  }
}

Tensor LlamaDecoderLayer::forward(const Tensor& x, const ops::AttentionMask& mask,
                                  ops::AttentionBackend backend, const KVCaches* caches,
                                  size_t layer) {
  return call({x}, [&] {
    if (!input_layernorm) {  // OLMo-2 (HF's Olmo2DecoderLayer): each sublayer's output normalized
      Tensor h = nn::residual_add(x, post_attention_layernorm->forward(
                                         self_attn->forward(x, mask, backend, caches, layer)));
      return nn::residual_add(h, post_feedforward_layernorm->forward(feed_forward(h)));
    }
    // Phi's, GPT-NeoX's and StableLM's dropout of a sublayer's output while training.
    auto dropped = [](nn::Dropout* d, const Tensor& y) { return d ? d->forward(y) : y; };
    if (parallel) {  // both branches read x (through one norm, or a GPT-NeoX's two)
      const Tensor h = input_layernorm->forward(x);
      Tensor a =
          dropped(post_attention_dropout, self_attn->forward(h, mask, backend, caches, layer));
      // Cohere, StableLM: (x + attention(h)) + mlp(h).
      if (residual_first)
        return nn::residual_add(nn::residual_add(x, a), dropped(post_mlp_dropout, feed_forward(h)));
      // Phi, GPT-NeoX and Falcon: (attention + mlp) + x, the branches' sum in their dtype (16-bit
      // under -mixed, as HF's autocast adds them) before the f32 residual; Falcon's dropout on the
      // sum (HF's dropout_add(mlp_output + attention_output, residual)).
      Tensor m = feed_forward(post_attention_layernorm ? post_attention_layernorm->forward(x) : h);
      if (falcon_sum_dropout)
        return nn::residual_add(dropped(post_mlp_dropout, nn::residual_add(a, m)), x);
      return nn::residual_add(nn::residual_add(a, dropped(post_mlp_dropout, m)), x);
    }
    Tensor a = dropped(post_attention_dropout, self_attn->forward(input_layernorm->forward(x), mask,
                                                                  backend, caches, layer));
    if (residual_multiplier != 1) {  // Granite: residual + sublayer(x) * residual_multiplier
      const float m = static_cast<float>(residual_multiplier);
      Tensor h = nn::residual_add(x, ops::scale(a, m));
      return nn::residual_add(h, ops::scale(feed_forward(post_attention_layernorm->forward(h)), m));
    }
    if (!pre_feedforward_layernorm) {
      Tensor h = nn::residual_add(x, a);
      return nn::residual_add(
          h, dropped(post_mlp_dropout, feed_forward(post_attention_layernorm->forward(h))));
    }
    // Gemma-2 (HF's Gemma2DecoderLayer): each sublayer's output normalized before its residual.
    Tensor h = nn::residual_add(x, post_attention_layernorm->forward(a));
    return nn::residual_add(h, post_feedforward_layernorm->forward(
                                   feed_forward(pre_feedforward_layernorm->forward(h))));
  });
}

LlamaModel::LlamaModel(const ModelSpec& s) : nn::Module("LlamaModel") {
  const ModelSpec::ModuleNames names = s.module_names();
  embed_tokens = register_module(
      names.embed, std::make_unique<nn::Embedding>(s.vocab_size, s.n_embd, s.param_dtype));
  for (int64_t i = 0; i < s.n_layer; ++i)
    layers.push_back(register_module(std::string(names.layers) + "." + std::to_string(i),
                                     std::make_unique<LlamaDecoderLayer>(s, i)));
  norm = register_module(names.final_norm, hidden_norm(s));
  // (HF's GPTNeoXModel drops the embedding's output by hidden_dropout too, GPTJModel's by
  // embd_pdrop, Starcoder2Model's by embedding_dropout: model.dropout as well)
  if (s.gpt_neox() || s.gptj() || s.starcoder2())
    embed_dropout = register_module(s.gptj()         ? "drop"
                                    : s.starcoder2() ? "embedding_dropout"
                                                     : "emb_dropout",
                                    std::make_unique<nn::Dropout>(s.dropout));
}

LlamaForCausalLM::LlamaForCausalLM(const ModelSpec& s, uint64_t seed)
    : CausalLM("LlamaForCausalLM", s) {
  const ModelSpec::ModuleNames names = spec_.module_names();
  model = register_module(names.model, std::make_unique<LlamaModel>(spec_));
  if (!spec_.tie_embeddings)  // (Phi's with a bias)
    lm_head = register_module(
        names.head, std::make_unique<nn::Linear>(spec_.n_embd, spec_.vocab_size, spec_.head_bias(),
                                                 spec_.param_dtype));
  init_parameters(*this, seed);  // HF's LlamaPreTrainedModel._init_weights (init_std)
  for (LlamaDecoderLayer* layer : model->layers)
    if (layer->moe) {
      if (!balance) balance = std::make_shared<ops::MoeBalance>();
      layer->moe->balance = balance;
    }
}

Tensor LlamaForCausalLM::run(const Tensor& ids, const ops::AttentionMask& mask,
                             const KVCaches* caches, const std::vector<int64_t>& keep) {
  return call({ids}, [&] {
    KEEL_CHECK(ids.dim() == 2, "Llama input_ids must be [B, T], got " + shape_str(ids.shape()));
    // HF's load_balancing_loss_func counts the tokens its attention mask does (a cached decode's
    // mask covers the cache's keys too: its new tokens are all counted).
    if (balance && !nn::Module::recomputing())
      balance->begin(caches ? Tensor() : mask.key_padding, ids.numel());
    Tensor x = model->embed_tokens->forward(ids);
    if (model->embed_dropout) x = model->embed_dropout->forward(x);
    if (spec_.gemma()) {
      // HF's GemmaModel: the embeddings times sqrt(hidden_size), that factor rounded to their
      // dtype first (torch.tensor(hidden_size**0.5, dtype=hidden_states.dtype)).
      const Tensor f =
          Tensor::full({}, static_cast<float>(std::sqrt(double(spec_.n_embd))), x.dtype());
      x = ops::scale(x, f.item());
    }
    // Granite: times embedding_multiplier (a Python float: not rounded to the dtype first).
    if (spec_.embedding_multiplier != 1)
      x = ops::scale(x, static_cast<float>(spec_.embedding_multiplier));
    const ops::AttentionBackend backend = spec_.attention;
    x = run_blocks(
        {model->layers.begin(), model->layers.end()}, x,
        [this, mask, backend, caches](size_t i, const Tensor& h) {
          return model->layers[i]->forward(h, mask, backend, caches, i);
        },
        caches == nullptr);
    x = model->norm->forward(keep_positions(x, keep));
    using amp::AmpOp;
    Tensor logits = lm_head
                        ? lm_head->forward(x)
                        : ops::linear(amp::autocast(AmpOp::kLinear, x),
                                      amp::autocast(AmpOp::kLinear, model->embed_tokens->weight));
    // Gemma-2's final_logit_softcapping.
    if (spec_.final_softcap > 0)
      logits = ops::softcap(logits, static_cast<float>(spec_.final_softcap));
    // Granite's logits / logits_scaling, as a product with its inverse: the same bits for the
    // powers of two its files give (8, 16), and what HF's CUDA division computes.
    if (spec_.logits_scaling != 1)
      logits = ops::scale(logits, static_cast<float>(1.0 / spec_.logits_scaling));
    // Cohere's logits * logit_scale.
    if (spec_.logit_scale != 1) logits = ops::scale(logits, static_cast<float>(spec_.logit_scale));
    return logits;
  });
}

}  // namespace keel::models
