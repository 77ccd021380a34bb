// Key/value cache of incremental decoding: each layer keeps the keys and values (after RoPE, in
// the dtype attention reads them) of every position seen so far, so a new token costs one row of
// projections and one attention row over the cache — O(T) per token instead of re-running the
// whole prefix, O(T^2).
//
// Layout per layer: [capacity, Hkv*D] time-major (the projection's own layout), so appending a
// step is one contiguous copy; attention reads [1, Hkv, T, D] through split_heads. One sequence
// (batch 1).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "keel/ops/attention.h"
#include "keel/tensor/tensor.h"

namespace keel::models {

struct KVCache {
  struct Layer {
    Tensor k, v;  // [capacity, Hkv*D], allocated by the first append (its dtype and device)
  };
  KVCache(int64_t n_layer, int64_t capacity)
      : layers(static_cast<size_t>(n_layer)), capacity(capacity) {}
  std::vector<Layer> layers;
  int64_t length = 0;  // positions every layer holds (the model's forward_cached advances it)
  int64_t capacity;    // the model's max_seq_len
};

// The caches one forward appends to: batch row b's keys and values go to rows[b]. A decode of
// one prompt has one; rows decoding side by side (generate_rows) one each, each at its own length.
struct KVCaches {
  std::vector<KVCache*> rows;
  // The first new position of each row (what its cache holds), [B, Tn] positions from it:
  // RoPE's angles and GPT-2's wpe rows. I64 on the cpu.
  Tensor positions(int64_t tn) const;
};

// The step's keys and values appended to each row's cache of `layer`, and each row's attention
// over its cache (cached_attention): q [B, Hq, Tn, D], k, v [B, Hkv, Tn, D] with B the rows.
// Returns [B, Hq, Tn, D]. Several rows take Tn new positions each (a decode step's one; their
// prompts' passes side by side, CausalLM::prefill_rows), and no gradient.
Tensor cached_step_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                             const KVCaches& caches, size_t layer, ops::AttentionBackend backend,
                             int64_t window = 0, const ops::AttentionScores& scores = {});

// Stores k, v [1, Hkv, Tn, D] (positions [past, past + Tn)) in `layer` and returns the keys and
// values of every position so far, [1, Hkv, past + Tn, D].
std::pair<Tensor, Tensor> kv_append(KVCache::Layer& layer, int64_t capacity, int64_t past,
                                    const Tensor& k, const Tensor& v);

// Causal attention of the queries q [1, Hq, Tn, D] at positions [Tk - Tn, Tk) over every cached
// key k, v [1, Hkv, Tk, D]. The prompt's pass (Tn == Tk) is ops::attention itself, with
// `backend`; after it (a decoding step, Tn == 1, or a chat's next turn fed after the turns the
// cache holds) each query row sees the keys up to its position, computed with f32 products,
// rounding as the backend does (eager: scores and probabilities to q's dtype; flash: the
// probabilities; math: neither), the output rounded to q's dtype; scored as `scores` says (scale,
// Gemma-2's soft cap).
Tensor cached_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        ops::AttentionBackend backend, int64_t window = 0,
                        const ops::AttentionScores& scores = {});

}  // namespace keel::models
