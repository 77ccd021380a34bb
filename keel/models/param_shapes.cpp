#include "keel/models/param_shapes.h"

#include <algorithm>

#include "keel/numerics/error.h"

namespace keel::models {

int64_t ParamShape::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// nn::Linear(in, out, bias): weight [out, in], then bias [out].
void linear(std::vector<ParamShape>& out, const std::string& path, int64_t in, int64_t n_out,
            bool bias) {
  out.push_back({path + ".weight", {n_out, in}, true, true});
  if (bias) out.push_back({path + ".bias", {n_out}, true});
}

std::vector<ParamShape> gpt2(const ModelSpec& s) {
  const int64_t C = s.n_embd, F = s.ffn_dim();
  std::vector<ParamShape> p;
  p.push_back({"transformer.wte.weight", {s.vocab_size, C}, true});  // also the tied lm_head
  p.push_back({"transformer.wpe.weight", {s.max_seq_len, C}, false});
  for (int64_t l = 0; l < s.n_layer; ++l) {
    const std::string h = "transformer.h." + std::to_string(l);
    p.push_back({h + ".ln_1.weight", {C}, false});
    p.push_back({h + ".ln_1.bias", {C}, false});
    linear(p, h + ".attn.c_attn", C, C + 2 * s.kv_heads() * (C / s.n_head), true);
    linear(p, h + ".attn.c_proj", C, C, true);
    p.push_back({h + ".ln_2.weight", {C}, false});
    p.push_back({h + ".ln_2.bias", {C}, false});
    linear(p, h + ".mlp.c_fc", C, F, true);
    linear(p, h + ".mlp.c_proj", F, C, true);
  }
  p.push_back({"transformer.ln_f.weight", {C}, false});
  p.push_back({"transformer.ln_f.bias", {C}, false});
  return p;
}

std::vector<ParamShape> llama(const ModelSpec& s) {
  const int64_t C = s.n_embd, F = s.ffn_dim(), D = s.head_dim();
  const int64_t q_dim = s.n_head * D, kv_dim = s.kv_heads() * D;
  const ModelSpec::ModuleNames n = s.module_names();
  const std::string model = n.model, attn = std::string(".") + n.attention;
  std::vector<ParamShape> p;
  // A norm's weight, and a LayerNorm's bias (Phi's, GPT-NeoX's).
  auto add_norm = [&](const std::string& path) {
    if (s.olmo()) return;  // (OLMo's have no parameters)
    p.push_back({path + ".weight", {C}, false});
    if (s.biased_norms()) p.push_back({path + ".bias", {C}, false});
  };
  p.push_back({s.embedding_name(), {s.vocab_size, C}, s.tie_embeddings});
  for (int64_t l = 0; l < s.n_layer; ++l) {
    const std::string h = model + "." + n.layers + "." + std::to_string(l);
    if (!s.post_norms()) add_norm(h + "." + n.attn_in_norm);
    if (s.fused_qkv()) {
      linear(p, h + attn + "." + n.qkv, C, q_dim + 2 * kv_dim, s.qkv_bias());
    } else {
      linear(p, h + attn + ".q_proj", C, q_dim, s.qkv_bias());
      linear(p, h + attn + ".k_proj", C, kv_dim, s.qkv_bias());
      linear(p, h + attn + ".v_proj", C, kv_dim, s.qkv_bias());
    }
    linear(p, h + attn + "." + n.out, q_dim, C, s.out_bias());
    if (s.qk_norm() && s.phi()) {  // Phi's qk_layernorm: one LayerNorm for every head
      for (const char* qk : {".q_layernorm", ".k_layernorm"}) {
        p.push_back({h + attn + qk + ".weight", {D}, false});
        p.push_back({h + attn + qk + ".bias", {D}, false});
      }
    } else if (s.qk_norm()) {  // per head, or (OLMo-2) over the whole projection
      p.push_back(
          {h + ".self_attn.q_norm.weight", {s.qk_norm_over_projection() ? q_dim : D}, false});
      p.push_back(
          {h + ".self_attn.k_norm.weight", {s.qk_norm_over_projection() ? kv_dim : D}, false});
    }
    if (s.head_qk_layernorm() && s.stablelm()) {  // an nn.LayerNorm a head
      for (int64_t i = 0; i < s.n_head; ++i)
        p.push_back({h + attn + ".q_layernorm.norms." + std::to_string(i) + ".weight", {D}, false});
      for (int64_t i = 0; i < s.kv_heads(); ++i)
        p.push_back({h + attn + ".k_layernorm.norms." + std::to_string(i) + ".weight", {D}, false});
    } else if (s.head_qk_layernorm()) {  // Command-R+'s: a weight [heads, D]
      p.push_back({h + attn + ".q_norm.weight", {s.n_head, D}, false});
      p.push_back({h + attn + ".k_norm.weight", {s.kv_heads(), D}, false});
    }
    if (!s.shared_block_norm())  // (Cohere's and Phi's MLP share the attention's norm)
      add_norm(h + "." + (s.sandwich_norms() ? n.attn_out_norm : n.mlp_norm));
    if (s.sandwich_norms()) add_norm(h + "." + n.mlp_in_norm);
    if (s.moe_layer(l)) {  // the router, then each expert's MLP (Mixtral's w1, w3, w2)
      const std::string moe = h + (s.mixtral_names() ? ".block_sparse_moe" : ".mlp");
      const bool w123 = s.mixtral_names();
      linear(p, moe + ".gate", C, s.moe.experts, false);
      for (int64_t e = 0; e < s.moe.experts; ++e) {
        const std::string x = moe + ".experts." + std::to_string(e);
        linear(p, x + (w123 ? ".w1" : ".gate_proj"), C, s.moe.ffn, false);
        linear(p, x + (w123 ? ".w3" : ".up_proj"), C, s.moe.ffn, false);
        linear(p, x + (w123 ? ".w2" : ".down_proj"), s.moe.ffn, C, false);
      }
      if (s.moe.shared_ffn > 0) {  // Qwen2-MoE's shared expert and its gate
        linear(p, moe + ".shared_expert.gate_proj", C, s.moe.shared_ffn, false);
        linear(p, moe + ".shared_expert.up_proj", C, s.moe.shared_ffn, false);
        linear(p, moe + ".shared_expert.down_proj", s.moe.shared_ffn, C, false);
        linear(p, moe + ".shared_expert_gate", C, 1, false);
      }
    } else if (s.gelu_mlp()) {
      linear(p, h + ".mlp." + n.up, C, F, s.mlp_bias());
      linear(p, h + ".mlp." + n.down, F, C, s.mlp_bias());
    } else if (s.fused_gate_up()) {
      linear(p, h + ".mlp.gate_up_proj", C, 2 * F, false);
      linear(p, h + ".mlp.down_proj", F, C, false);
    } else {
      linear(p, h + ".mlp.gate_proj", C, F, false);
      linear(p, h + ".mlp.up_proj", C, F, false);
      linear(p, h + ".mlp.down_proj", F, C, false);
    }
    if (s.sandwich_norms() || s.post_norms()) add_norm(h + "." + n.mlp_out_norm);
  }
  add_norm(model + "." + n.final_norm);
  if (!s.tie_embeddings) linear(p, n.head, C, s.vocab_size, s.head_bias());
  return p;
}

}  // namespace

std::vector<ParamShape> parameter_shapes(const ModelSpec& spec) {
  return spec.family == "gpt2" ? gpt2(spec) : llama(spec);
}

int64_t parameter_count(const ModelSpec& spec) {
  int64_t n = 0;
  for (const ParamShape& p : parameter_shapes(spec)) n += p.numel();
  return n;
}

std::vector<ParamShape> adapter_parameter_shapes(const ModelSpec& spec,
                                                 const nn::AdapterOptions& opt,
                                                 const std::string& targets) {
  std::vector<ParamShape> out;
  if (opt.kind == "none") return out;
  const std::vector<ParamShape> base = parameter_shapes(spec);
  auto module_of = [](const ParamShape& p) { return p.name.substr(0, p.name.size() - 7); };
  for (const std::string& t : opt.target_modules) {
    bool found = false;
    for (const ParamShape& p : base)
      found = found || (p.linear && nn::adapter_targets(module_of(p), {t}));
    if (found) continue;
    std::vector<std::string> names;
    for (const ParamShape& p : base) {
      if (!p.linear) continue;
      const std::string m = module_of(p), last = m.substr(m.rfind('.') + 1);
      if (std::find(names.begin(), names.end(), last) == names.end()) names.push_back(last);
    }
    std::string list;
    for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
    throw Error("model.adapter: target module '" + t + "' matches no linear layer of this " +
                    spec.family + " model; its linear layers are named: " + list + " (fix " +
                    targets + ")",
                Error::kUsage);
  }
  for (const ParamShape& p : base) {
    if (!p.linear || !nn::adapter_targets(module_of(p), opt.target_modules)) continue;
    for (const nn::AdapterParamShape& a :
         nn::adapter_parameter_shapes(opt.kind, opt.r, p.shape[1], p.shape[0]))
      out.push_back({module_of(p) + "." + a.name, a.shape, false, false});
  }
  return out;
}

}  // namespace keel::models
