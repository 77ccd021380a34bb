#include "keel/monitor/memory_estimate.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "keel/amp/precision.h"
#include "keel/data/tokenizer.h"
#include "keel/models/causal_lm.h"
#include "keel/numerics/error.h"

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
  s.intermediate_size = q.ffn;
  s.vocab_size = q.vocab > 0 ? q.vocab : data::ByteTokenizer::kVocab;
  s.max_seq_len = std::max(q.max_seq_len, q.seq);
  s.tie_embeddings = q.family == "gpt2" ? true : q.tie_embeddings;
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
  if (q.params <= 0 && !(q.layers > 0 && q.hidden > 0))
    throw Error(
        "memory: give the parameter count (--params N) or the model sizes (--layers L --hidden H)",
        Error::kUsage);
  if (q.hidden > 0) {
    const int64_t h = q.heads > 0 ? q.heads : default_heads(q.hidden);
    if (q.hidden % h != 0)
      throw Error("memory: hidden " + std::to_string(q.hidden) + " is not divisible by heads " +
                      std::to_string(h) + "; pick --heads dividing --hidden",
                  Error::kUsage);
  }
}

std::string mb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

}  // namespace

int64_t count_parameters(const MemoryQuery& q) {
  const models::ModelSpec s = spec_of(q);
  const int64_t C = s.n_embd, F = s.ffn_dim(), V = s.vocab_size, L = s.n_layer;
  if (q.family == "gpt2") {
    const int64_t layer = 2 * 2 * C                 // ln_1, ln_2
                          + 3 * C * C + 3 * C       // c_attn
                          + C * C + C               // attn.c_proj
                          + C * F + F + F * C + C;  // mlp.c_fc, mlp.c_proj
    return V * C + s.max_seq_len * C + L * layer + 2 * C;
  }
  const int64_t kvd = s.kv_heads() * s.head_dim();
  const int64_t layer = 2 * C + 2 * C * C + 2 * C * kvd + 3 * C * F;
  return V * C + L * layer + C + (s.tie_embeddings ? 0 : V * C);
}

MemoryEstimate estimate_memory(const MemoryQuery& q) {
  check_query(q);
  const PrecisionPolicy pol = resolve_precision(q.precision, Device::cpu());
  MemoryEstimate e;
  e.precision = pol.name();
  e.params = q.params > 0 ? q.params : count_parameters(q);
  const int64_t N = e.params;
  const int64_t pb = static_cast<int64_t>(dtype_size(pol.param_dtype));
  // c: bytes of the compute dtype (what linear/attention outputs are stored in); s: bytes of the
  // residual stream (f32 under -mixed, where residual_add promotes to the f32 branch).
  const int64_t c = static_cast<int64_t>(dtype_size(pol.compute_dtype));
  const int64_t s = pb;

  // Grads keep the parameter's dtype (f32 for masters and adapters).
  const int64_t Nt = q.trainable > 0 ? q.trainable : N;
  const int64_t tb = q.trainable_f32 ? 4 : pb;
  // Under an adapter the frozen base (N - Nt parameters) is stored in model.base_dtype.
  const bool adapter = q.trainable > 0 && q.trainable < N;
  if (!q.base_dtype.empty() && q.base_dtype != "f32" && q.base_dtype != "bf16")
    throw Error("memory: base dtype \"" + q.base_dtype + "\" is unknown; use f32 or bf16",
                Error::kUsage);
  // ("f32", the config's default, keeps the base in the policy's parameter dtype.)
  const int64_t fb = q.base_dtype == "bf16" ? 2 : pb;
  e.weights = adapter ? (N - Nt) * fb + Nt * tb : N * pb;
  if (adapter)
    e.weights_detail = std::string("frozen base in ") + (fb == 2 ? "16-bit" : "f32") +
                       ", adapters in " + (tb == 4 ? "f32" : "16-bit");
  else if (pol.autocast)
    e.weights_detail = "f32 masters";
  e.grads = Nt * tb;
  const int64_t kinds = q.optimizer == "adamw" ? 2 : (q.momentum != 0 ? 1 : 0);
  e.optimizer_state = kinds * Nt * tb;

  // Autocast caches one low-precision copy per weight for the whole window: every Linear weight
  // and bias and the tied embedding used as lm_head; not norms or position tables.
  if (pol.autocast) {
    int64_t cast_params = N;
    if (q.layers > 0 && q.hidden > 0) {
      const models::ModelSpec sp = spec_of(q);
      const int64_t C = sp.n_embd, L = sp.n_layer, V = sp.vocab_size;
      if (q.family == "gpt2")  // everything but the LayerNorms and the position table
        cast_params = N - (L * 4 * C + 2 * C) - sp.max_seq_len * C;
      else  // the projections and the lm_head weight (tied or not); not norms, not embed_tokens
        cast_params =
            L * (2 * C * C + 2 * C * sp.kv_heads() * sp.head_dim() + 3 * C * sp.ffn_dim()) + V * C;
    }
    e.lowp_copies = cast_params * c;
    // A frozen base already in the compute dtype is used as stored: no copy. (An f32 base is cast
    // per use; the copies are not cached, but each Linear's backward node keeps its cast weight
    // until backward, so they count the same.) The adapter's own f32 weights are cast and cached.
    if (adapter) e.lowp_copies = (fb == c ? 0 : cast_params * c) + Nt * c;
  }

  if (has_sizes(q)) {
    e.has_activations = true;
    const models::ModelSpec sp = spec_of(q);
    const int64_t B = q.batch, T = q.seq, C = sp.n_embd, F = sp.ffn_dim(), V = sp.vocab_size;
    const int64_t H = sp.n_head, L = sp.n_layer, BT = B * T;
    const int64_t kvC = sp.kv_heads() * sp.head_dim();
    const bool flash = q.attention == "flash";
    auto add = [&](const std::string& name, int64_t bytes, const std::string& detail) {
      e.activation_items.push_back({name, bytes, detail});
      e.activations += bytes;
    };
    const std::string sd = s == 4 ? "f32" : "16-bit", cd = c == 4 ? "f32" : "16-bit";
    const int64_t attn = flash ? c * BT * C + 4 * B * H * T : 4 * B * H * T * T;
    const std::string attn_detail = flash ? "flash: output [B,T,C] " + cd + " + lse [B,H,T] f32"
                                          : "probabilities [B,H,T,T] f32 (" + q.attention + ")";
    if (q.family == "gpt2") {
      add("residual stream", L * 2 * s * BT * C + s * BT * C, "2 per layer + ln_f: [B,T,C] " + sd);
      add("norm statistics", (L * 2 + 1) * 8 * BT, "mean, rstd [B*T] f32 per LayerNorm");
      add("linear inputs", L * 3 * c * BT * C + L * c * BT * F,
          "c_attn, attn.c_proj, c_fc ([B,T,C]) and mlp.c_proj ([B,T,4C]) inputs, " + cd);
      add("q, k, v", L * 3 * c * BT * C, "split-heads copies [B,H,T,D] " + cd);
      add("attention", L * attn, attn_detail);
      add("gelu input", L * c * BT * F, "c_fc output [B,T,F] " + cd);
    } else {
      const int64_t casts = pol.autocast ? 3 : 1, mlp_casts = pol.autocast ? 2 : 1;
      add("residual stream", L * 2 * s * BT * C + s * BT * C,
          "2 per layer + final norm: [B,T,C] " + sd);
      add("norm statistics", (L * 2 + 1) * 4 * BT, "rstd [B*T] f32 per RMSNorm");
      add("linear inputs", L * (casts + 1 + mlp_casts) * c * BT * C + L * c * BT * F,
          "normed input (one autocast copy per projection under -mixed), o_proj and down_proj "
          "inputs, " +
              cd);
      add("q, k, v", L * c * BT * (C + 2 * kvC), "after rope / split-heads, " + cd);
      add("attention", L * attn, attn_detail);
      add("swiglu inputs", L * 2 * c * BT * F, "gate and up outputs [B,T,F] " + cd);
    }
    // oneDNN: every cached matmul primitive (one per shape: forward, and backward's two products)
    // keeps a packed f32 copy of its weight operand; measured at about the f32 size of the
    // Linear weights (lm_head included) in total.
    const int64_t linear_params = q.family == "gpt2"
                                      ? L * (4 * C * C + 2 * C * F) + V * C
                                      : L * (2 * C * C + 2 * C * kvC + 3 * C * F) + V * C;
    e.matmul_scratch = 4 * linear_params;
    // Head: the lm_head input, the logits the step keeps, and cross-entropy's f32 copy.
    const int64_t ce_copy = c == 4 || !pol.autocast ? 0 : 4 * BT * V;
    add("lm_head input", c * BT * C, "[B,T,C] " + cd);
    add("logits", c * BT * V + ce_copy,
        "[B*T,V] " + cd + (ce_copy ? " + f32 copy for cross_entropy" : ""));
    add("ids and labels", 3 * 8 * BT, "i64 [B,T]");

    // Backward transients: at the head, dlogits (the cross-entropy input's dtype) plus its cast
    // back to the compute dtype and the lm_head gradients; inside a layer, attention's score
    // gradient (with eager's rounded probabilities) and dq/dk/dv.
    const int64_t dlogits_bytes = (pol.autocast ? 4 : c) * BT * V;
    const int64_t head = dlogits_bytes + (pol.autocast ? c * BT * V : 0) + c * BT * C +
                         (c + (pol.autocast ? 4 : 0)) * V * C;
    const int64_t cdt = q.attention == "math" ? 4 : c;
    int64_t layer = 3 * c * BT * C + 2 * s * BT * C;  // dq, dk, dv + residual grads pending
    if (!flash) layer += cdt * B * H * T * T + (q.attention == "math" ? 4 * 4 * BT * C : 0);
    if (q.attention == "eager" && c != 4) layer += c * B * H * T * T;  // rounded P for dV
    const int64_t mlp = (q.family == "gpt2" ? 2 : 3) * c * BT * F + 2 * s * BT * C;
    e.transient = std::max({head, layer, mlp});
    e.transient_detail = head >= std::max(layer, mlp) ? "dlogits [B*T,V] and lm_head gradients"
                                                      : "attention / MLP backward buffers";

    // Heap reserve. Tensors live in glibc's heap (aligned_alloc), and the forward's short-lived
    // tensors (each layer's fused projection output and its split copies, the attention output
    // before merge_heads, branch outputs before the residual add, f32 casts) are freed while the
    // layer's saved tensors, allocated around them, stay: the holes they leave are not returned to
    // the OS, so the process peak exceeds the live bytes by about one set of them per layer (the
    // f32 accumulators of low-precision products are reused in place and leave none). Measured on
    // GPT-2 configs: peak RSS with MALLOC_MMAP_THRESHOLD_=256k (freed tensors unmapped at once) is
    // within a few % of the live bytes above; with glibc's defaults it is higher by about this
    // reserve.
    const bool low = c != 4;
    int64_t per_layer = 0;
    if (q.family == "gpt2") {
      per_layer = 9 * c * BT * C;  // qkv, 3 split pieces, attention out, 2 branch outputs
    } else {
      per_layer = c * BT * (2 * C + 3 * kvC) + 3 * c * BT * C;  // projections, splits, outputs
    }
    if (pol.autocast) per_layer += 4 * 4 * BT * C;  // f32 norm outputs, f32 casts of branches
    if (q.attention == "eager" && low) per_layer += c * B * H * T * T;  // rounded probabilities
    e.heap_reserve = L * per_layer;
  }
  e.live_peak = e.weights + e.grads + e.optimizer_state + e.lowp_copies + e.matmul_scratch +
                e.activations + e.transient;
  if (adapter && fb < pb) e.init_peak = N * pb;
  e.total = std::max(e.live_peak + e.heap_reserve, e.init_peak);
  return e;
}

MemoryQuery memory_query_from_config(const Config& cfg) {
  MemoryQuery q;
  q.precision = cfg.train.precision;
  q.optimizer = cfg.optim.name;
  q.momentum = cfg.optim.momentum;
  q.family = cfg.model.family;
  q.batch = cfg.train.batch_size;
  q.seq = cfg.data.seq_len;
  q.layers = cfg.model.n_layer;
  q.hidden = cfg.model.n_embd;
  q.heads = cfg.model.n_head;
  q.kv_heads = cfg.model.n_kv_head;
  q.ffn = cfg.model.intermediate_size;
  q.vocab = cfg.model.vocab_size;
  q.max_seq_len = cfg.model.max_seq_len;
  q.tie_embeddings = cfg.model.tie_embeddings;
  q.attention = cfg.model.attention;
  if (cfg.model.adapter.kind != "none") q.base_dtype = cfg.model.base_dtype;
  return q;
}

std::string format_memory(const MemoryEstimate& e) {
  std::ostringstream o;
  char buf[160];
  std::snprintf(buf, sizeof buf, "memory estimate: %.2fM parameters, %s (1 MB = 10^6 bytes)\n",
                static_cast<double>(e.params) / 1e6, e.precision.c_str());
  o << buf;
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
    row("matmul scratch", e.matmul_scratch, "oneDNN's packed f32 weight copies");
    row("activations", e.activations, "saved for backward, one micro-batch:");
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
    row("heap reserve", e.heap_reserve, "freed forward temporaries glibc keeps");
  }
  if (e.init_peak > 0)
    row("while building", e.init_peak, "the base exists in the policy's dtype before its cast");
  row("total", e.total,
      e.init_peak > e.live_peak + e.heap_reserve ? "expected peak resident memory (while building)"
                                                 : "expected peak resident memory of the step");
  return o.str();
}

nlohmann::json memory_to_json(const MemoryEstimate& e) {
  nlohmann::json j = {{"precision", e.precision},
                      {"params", e.params},
                      {"weights", e.weights},
                      {"grads", e.grads},
                      {"optimizer_state", e.optimizer_state},
                      {"lowp_copies", e.lowp_copies},
                      {"activations", e.activations},
                      {"transient", e.transient},
                      {"matmul_scratch", e.matmul_scratch},
                      {"heap_reserve", e.heap_reserve},
                      {"live_peak", e.live_peak},
                      {"init_peak", e.init_peak},
                      {"total", e.total}};
  nlohmann::json items = nlohmann::json::array();
  for (const auto& it : e.activation_items)
    items.push_back({{"name", it.name}, {"bytes", it.bytes}, {"detail", it.detail}});
  j["activation_items"] = items;
  return j;
}

int64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (f >> key >> value) {
    std::getline(f, unit);
    if (key == "MemAvailable:") return value * 1024;
  }
  return -1;
}

}  // namespace keel::monitor
