#include "keel/monitor/memory_estimate.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "keel/amp/precision.h"
#include "keel/data/tokenizer.h"
#include "keel/models/causal_lm.h"
#include "keel/models/param_shapes.h"
#include "keel/numerics/error.h"
#include "keel/tensor/host_memory.h"

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
    if (q.kv_heads < 0 || (q.kv_heads > 0 && h % q.kv_heads != 0))
      throw Error("memory: heads " + std::to_string(h) + " is not a multiple of kv heads " +
                      std::to_string(q.kv_heads) + "; pick --kv-heads dividing --heads",
                  Error::kUsage);
  }
}

std::string mb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

}  // namespace

int64_t count_parameters(const MemoryQuery& q) { return models::parameter_count(spec_of(q)); }

namespace {

// What host_memory hands out for a tensor of `n` bytes (none for an empty one). The rounding is real
// memory: GPT-2 with C = 768 has 9 MiB MLP weights that take 10 MiB blocks, and their weights,
// grads and two AdamW moments hold 99 MB more than their bytes (measured: 1463.7 MB live after a
// step of an 85M-parameter model whose state is 1364.8 MB).
int64_t block_bytes(int64_t n) {
  return n > 0 ? static_cast<int64_t>(host_memory::block_size(static_cast<size_t>(n))) : 0;
}

}  // namespace

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
  const int64_t kinds = q.optimizer == "adamw" ? 2 : (q.momentum != 0 ? 1 : 0);

  // With the model's sizes the state is counted tensor by tensor in host_memory's blocks (when
  // the sizes account for the parameter count: the whole model, or the frozen base under an
  // adapter, whose own small tensors are counted as bytes). With a bare parameter count it is
  // bytes: 100M parameters under 16-mixed with AdamW are 400 MB weights, 400 MB grads and 800 MB
  // optimizer state (issue 4).
  std::vector<models::ParamShape> tensors;
  if (q.layers > 0 && q.hidden > 0 && count_parameters(q) == (adapter ? N - Nt : N))
    tensors = models::parameter_shapes(spec_of(q));
  const bool sized = !tensors.empty();
  auto state_bytes = [&](int64_t bytes_per_param, bool cast_only) {
    int64_t sum = 0;
    for (const models::ParamShape& t : tensors)
      if (!cast_only || t.matmul) sum += block_bytes(t.numel() * bytes_per_param);
    return sum;
  };
  int64_t cast_params = N;  // the weights autocast casts (everything, without sizes)
  if (sized) {
    cast_params = 0;
    for (const models::ParamShape& t : tensors) cast_params += t.matmul ? t.numel() : 0;
  }

  if (adapter) {
    e.weights = (sized ? state_bytes(fb, false) : (N - Nt) * fb) + Nt * tb;
    e.weights_detail = std::string("frozen base in ") + (fb == 2 ? "16-bit" : "f32") +
                       ", adapters in " + (tb == 4 ? "f32" : "16-bit");
    e.grads = Nt * tb;
    e.optimizer_state = kinds * Nt * tb;
  } else {
    e.weights = sized ? state_bytes(pb, false) : N * pb;
    if (pol.autocast) e.weights_detail = "f32 masters";
    e.grads = sized ? state_bytes(tb, false) : N * tb;
    e.optimizer_state = kinds * (sized ? state_bytes(tb, false) : N * tb);
  }
  if (sized && e.weights != (adapter ? (N - Nt) * fb + Nt * tb : N * pb))
    e.weights_detail +=
        std::string(e.weights_detail.empty() ? "" : "; ") + "in host_memory's rounded blocks";

  // Autocast caches one low-precision copy per weight for the whole window: every Linear weight
  // and bias and the tied embedding used as lm_head; not norms or position tables. Measured: a
  // GPT-2 of 85M parameters peaks 105 MB higher under bf16-mixed than under 32-true (1738.4 vs
  // 1629.7 MB of live blocks), the 170 MB of bf16 copies less the halved activations.
  if (pol.autocast) {
    e.lowp_copies = sized ? state_bytes(c, true) : cast_params * c;
    // A frozen base already in the compute dtype is used as stored: no copy. (An f32 base is cast
    // per use; the copies are not cached, but each Linear's backward node keeps its cast weight
    // until backward, so they count the same.) The adapter's own f32 weights are cast and cached.
    if (adapter) e.lowp_copies = (fb == c ? 0 : e.lowp_copies) + Nt * c;
  }

  if (has_sizes(q)) {
    e.has_activations = true;
    const models::ModelSpec sp = spec_of(q);
    const int64_t B = q.batch, T = q.seq, C = sp.n_embd, F = sp.ffn_dim(), V = sp.vocab_size;
    const int64_t H = sp.n_head, L = sp.n_layer, BT = B * T;
    const int64_t kvC = sp.kv_heads() * sp.head_dim();
    const bool flash = q.attention == "flash";
    // `count` tensors of `each` bytes, in host_memory's blocks.
    auto add = [&](const std::string& name, int64_t count, int64_t each,
                   const std::string& detail) {
      const int64_t bytes = count * block_bytes(each);
      for (MemoryItem& it : e.activation_items)
        if (it.name == name) {
          it.bytes += bytes;
          e.activations += bytes;
          return;
        }
      e.activation_items.push_back({name, bytes, detail});
      e.activations += bytes;
    };
    const std::string sd = s == 4 ? "f32" : "16-bit", cd = c == 4 ? "f32" : "16-bit";
    const std::string attn_detail = flash ? "flash: output [B,T,C] " + cd + " + lse [B,H,T] f32"
                                          : "probabilities [B,H,T,T] f32 (" + q.attention + ")";
    auto add_attention = [&] {
      if (flash) {
        add("attention", L, c * BT * C, attn_detail);
        add("attention", L, 4 * B * H * T, attn_detail);
      } else {
        add("attention", L, 4 * B * H * T * T, attn_detail);
      }
    };
    if (q.family == "gpt2") {
      add("residual stream", 2 * L + 1, s * BT * C, "2 per layer + ln_f: [B,T,C] " + sd);
      add("norm statistics", 2 * (2 * L + 1), 4 * BT, "mean, rstd [B*T] f32 per LayerNorm");
      const std::string li =
          "c_attn, attn.c_proj, c_fc ([B,T,C]) and mlp.c_proj ([B,T,4C]) inputs, " + cd;
      add("linear inputs", 3 * L, c * BT * C, li);
      add("linear inputs", L, c * BT * F, li);
      add("q, k, v", 3 * L, c * BT * C, "split-heads copies [B,H,T,D] " + cd);
      add_attention();
      add("gelu input", L, c * BT * F, "c_fc output [B,T,F] " + cd);
    } else {
      const int64_t casts = pol.autocast ? 3 : 1, mlp_casts = pol.autocast ? 2 : 1;
      add("residual stream", 2 * L + 1, s * BT * C, "2 per layer + final norm: [B,T,C] " + sd);
      add("norm statistics", 2 * L + 1, 4 * BT, "rstd [B*T] f32 per RMSNorm");
      const std::string li =
          "normed input (one autocast copy per projection under -mixed), o_proj and down_proj "
          "inputs, " +
          cd;
      add("linear inputs", L * (casts + 1 + mlp_casts), c * BT * C, li);
      add("linear inputs", L, c * BT * F, li);
      add("q, k, v", L, c * BT * C, "after rope / split-heads, " + cd);
      add("q, k, v", 2 * L, c * BT * kvC, "after rope / split-heads, " + cd);
      add_attention();
      add("swiglu inputs", 2 * L, c * BT * F, "gate and up outputs [B,T,F] " + cd);
    }
    // Head: the lm_head input and the logits the step keeps. cross_entropy reads 16-bit logits
    // as they are (amp's kFp32Inside): no f32 copy.
    add("lm_head input", 1, c * BT * C, "[B,T,C] " + cd);
    add("logits", 1, c * BT * V, "[B*T,V] " + cd);
    add("ids and labels", 3, 8 * BT, "i64 [B,T]");

    // Backward transients: at the head, dlogits (in the logits' dtype) and the lm_head's input
    // and weight gradients, which linear writes in the f32 masters' dtype under -mixed
    // (ops::grad_dtype_for); inside a layer, attention's score gradient (with eager's rounded
    // probabilities) and dq/dk/dv.
    const int64_t gb = pol.autocast ? 4 : c;
    const int64_t head =
        block_bytes(c * BT * V) + block_bytes(gb * BT * C) + block_bytes(gb * V * C);
    const int64_t cdt = q.attention == "math" ? 4 : c;
    int64_t layer = 3 * block_bytes(c * BT * C) + 2 * block_bytes(s * BT * C);  // dq, dk, dv + dx
    if (!flash)
      layer += block_bytes(cdt * B * H * T * T) +
               (q.attention == "math" ? 4 * block_bytes(4 * BT * C) : 0);
    if (q.attention == "eager" && c != 4) layer += block_bytes(c * B * H * T * T);  // rounded P
    const int64_t mlp =
        (q.family == "gpt2" ? 2 : 3) * block_bytes(c * BT * F) + 2 * block_bytes(s * BT * C);
    e.transient = std::max({head, layer, mlp});
    e.transient_detail = head >= std::max(layer, mlp) ? "dlogits [B*T,V] and lm_head gradients"
                                                      : "attention / MLP backward buffers";

    // Matmul scratch. oneDNN keeps no packed copies of the weights: its matmul primitives take
    // the plain tensors (keel/backend/cpu/matmul_dnnl.cpp), and with freed memory returned at once
    // (MALLOC_MMAP_THRESHOLD_=65536) the process holds only 3-6 MB beyond host_memory's blocks at
    // 3M and 85M parameters alike, under 32-true and bf16-mixed (AMX): the same as a 1-layer,
    // 32-wide run, so nothing that grows with the model. (The former estimate, an f32 copy of
    // every Linear weight, put 341 MB on an 85M GPT-2 that peaks at 1630 MB of live blocks.) f16
    // is the exception: this oneDNN has no f16 matmul on the CPU, so each product converts its
    // operands and result to f32 vectors (malloc'd, outside host_memory); the largest product's
    // three set the scratch. Measured: 16-mixed peaks 7 MB (3M params, B8 T256) and 12.6 MB (85M
    // params, B4 T64) above bf16-mixed; this term gives 12.6 and 13.4 MB.
    if (pol.compute_dtype == DType::F16) {
      auto mm = [](int64_t batch, int64_t m, int64_t k, int64_t n) {
        return 4 * batch * (m * k + k * n + m * n);
      };
      int64_t big = std::max({mm(1, BT, C, 3 * C), mm(1, BT, C, F), mm(1, BT, F, C),
                              mm(1, BT, C, V), mm(1, BT, V, C), mm(1, C, BT, V)});
      if (!flash) big = std::max(big, mm(B * H, T, sp.head_dim(), T));
      e.matmul_scratch = big;
    }
  }
  e.live_peak =
      e.weights + e.grads + e.optimizer_state + e.lowp_copies + e.activations + e.transient;
  // A bf16 frozen base is built in the policy's dtype and cast after (keel/train/trainer.cpp,
  // build_model): the f32 base exists first, plus one tensor's worth while it is built and cast
  // (measured: 449.9 MB of live blocks for a 437.9 MB f32 base of 8 Llama layers with C = 1024,
  // 231.8 for 219.8 with 4: 12 MB, the largest weight's f32 block).
  if (adapter && fb < pb) {
    int64_t largest = 0;
    for (const models::ParamShape& t : tensors)
      largest = std::max(largest, block_bytes(t.numel() * pb));
    e.init_peak = (sized ? state_bytes(pb, false) : (N - Nt) * pb) + Nt * tb + largest;
  }
  // Block cache slack. host_memory keeps released blocks for the next request of their size and
  // unmaps cached blocks only when mapping a new one would take live + cached past the largest
  // live total so far plus 1/16 of it: the process keeps up to 1/16 of its peak above the live
  // bytes. Measured (peak mapped - peak live): 15.3 MB of 244.5 (GPT-2 L4 C256 B8 T256 32-true),
  // 11.2 of 186.0 (the same, bf16-mixed), 11.6 of 1630 and 26.1 of 1738 (85M GPT-2 B4 T64, 32-true
  // and bf16-mixed), 24 of 748 (102M Llama LoRA, bf16-mixed), 28 of 450 (its bf16 base while
  // building). Below 8 MiB the blocks come from malloc, and what the cache unmaps there stays in
  // glibc's heap: 9-22 MB more in the small GPT-2 runs, whose steps churn 2 MiB blocks (none in the
  // 85M runs, whose blocks all recur). The bound, 1/16, covers both within the 15% the estimate
  // is held to: the measured peaks are 0.88-1.06 of the total. A step whose sizes evict each other
  // every step under 1/16 teaches the cache up to 1/8 (host_memory.h); the estimate keeps 1/16,
  // the learned part having measured +1.7% of the peak at GPT-2 124M B8 T256 bf16-mixed (3365 ->
  // 3421 MB) and +5.8% in 32-true (3686 -> 3898 MB).
  const int64_t peak = std::max(e.live_peak, e.init_peak);
  e.cache_slack = e.has_activations ? peak / static_cast<int64_t>(host_memory::kSlackDivisor) : 0;
  e.total = peak + e.matmul_scratch + e.cache_slack;
  return e;
}

MemoryQuery memory_query_from_config(const Config& cfg) {
  MemoryQuery q;
  q.precision = cfg.train.precision;
  q.optimizer = cfg.optim.name;
  q.momentum = cfg.optim.sgd.momentum;
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
    row("matmul scratch", e.matmul_scratch, "f32 operand copies for f16 products");
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
    row("block cache slack", e.cache_slack, "released blocks host_memory keeps for reuse");
  }
  if (e.init_peak > 0)
    row("while building", e.init_peak, "the base exists in the policy's dtype before its cast");
  row("total", e.total,
      e.init_peak > e.live_peak ? "expected peak resident memory (while building)"
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
                      {"cache_slack", e.cache_slack},
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
