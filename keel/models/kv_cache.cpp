#include "keel/models/kv_cache.h"

#include <cmath>
#include <limits>

#include "keel/autograd/node.h"
#include "keel/numerics/error.h"
#include "keel/ops/activation.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"
#include "keel/ops/shape.h"
#include "keel/ops/softmax.h"

namespace keel::models {

std::pair<Tensor, Tensor> kv_append(KVCache::Layer& layer, int64_t capacity, int64_t past,
                                    const Tensor& k, const Tensor& v) {
  KEEL_CHECK(k.dim() == 4 && k.size(0) == 1 && k.shape() == v.shape(),
             "kv_append: keys and values must be [1, Hkv, T, D], got " + shape_str(k.shape()) +
                 " and " + shape_str(v.shape()));
  const int64_t hkv = k.size(1), tn = k.size(2), width = hkv * k.size(3);
  if (past + tn > capacity)
    throw Error("the key/value cache holds " + std::to_string(capacity) +
                " positions (the model's max_seq_len); position " + std::to_string(past + tn) +
                " does not fit: shorten the prompt or lower --max-new-tokens");
  auto store = [&](Tensor& cache, const Tensor& x) {
    if (!cache.defined()) cache = Tensor::empty({capacity, width}, x.dtype(), x.device());
    KEEL_CHECK(cache.dtype() == x.dtype() && cache.shape()[1] == width,
               "kv_append: the cache holds " + std::string(dtype_name(cache.dtype())) +
                   " rows; this step's keys are " + dtype_name(x.dtype()));
    Tensor rows = cache.slice_rows(past, past + tn);
    rows.copy_from(ops::merge_heads(x).view({tn, width}));
    return ops::split_heads(cache.slice_rows(0, past + tn).view({1, past + tn, width}), hkv);
  };
  Tensor all_k = store(layer.k, k);
  return {all_k, store(layer.v, v)};
}

Tensor cached_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                        ops::AttentionBackend backend, int64_t window,
                        const ops::AttentionScores& scores) {
  const int64_t tn = q.size(2), tk = k.size(2), past = tk - tn;
  if (tn == tk) {
    ops::AttentionMask all_keys;
    all_keys.window = window;
    return ops::attention(q, k, v, all_keys, backend, scores);
  }
  KEEL_CHECK(tn >= 1 && past > 0, "cached_attention: " + std::to_string(tn) + " queries over " +
                                      std::to_string(tk) + " keys");
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(3), g = hq / hkv;
  const DType dt = q.dtype();
  // The backend's roundings of one row: eager rounds the scores and the probabilities to the
  // compute dtype, flash the probabilities, math neither; products accumulate in f32.
  auto round = [&](const Tensor& x, bool on) {
    return on && dt != DType::F32 ? ops::cast(ops::cast(x, dt), DType::F32) : x;
  };
  // Query head h reads key/value head h / G: the group's G heads of Tn queries are one [G*Tn, D]
  // matrix (head-major, as q holds them).
  Tensor q32 = ops::cast(q, DType::F32).view({1, hkv, g * tn, d});
  Tensor s =
      ops::scale(ops::matmul(q32, ops::cast(k, DType::F32), false, true), scores.scale_for(d));
  s = round(s, backend == ops::AttentionBackend::kEager);
  if (scores.softcap > 0)  // Gemma-2's cap, rounded again by eager as its kernel does
    s = round(ops::softcap(s, scores.softcap), backend == ops::AttentionBackend::kEager);
  if (tn > 1 || (window > 0 && tk > window)) {
    // Several new tokens after the cached ones (a chat's next turn): query i, at position
    // past + i, sees keys up to it, and with a window the last `window` of them. -inf elsewhere
    // makes their probabilities exactly 0.
    Tensor mask = Tensor::zeros({1, hkv, g * tn, tk});
    float* m = mask.data_as<float>();
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < hkv * g * tn; ++r) {
      const int64_t at = past + r % tn;
      for (int64_t j = at + 1; j < tk; ++j) m[r * tk + j] = ninf;
      for (int64_t j = 0; window > 0 && j <= at - window; ++j) m[r * tk + j] = ninf;
    }
    s = ops::add(s, mask.to(s.device()));
  }
  Tensor p = round(ops::softmax(s), backend != ops::AttentionBackend::kMath);  // [1,Hkv,G*Tn,Tk]
  Tensor o = ops::matmul(p, ops::cast(v, DType::F32));                         // [1,Hkv,G*Tn,D]
  return ops::cast(o.view({1, hq, tn, d}), dt);
}

Tensor KVCaches::positions(int64_t tn) const {
  std::vector<int64_t> pos;
  for (const KVCache* c : rows)
    for (int64_t t = 0; t < tn; ++t) pos.push_back(c->length + t);
  return Tensor::from_ints(pos, {static_cast<int64_t>(rows.size()), tn});
}

Tensor cached_step_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                             const KVCaches& caches, size_t layer, ops::AttentionBackend backend,
                             int64_t window, const ops::AttentionScores& scores) {
  const int64_t rows = static_cast<int64_t>(caches.rows.size());
  KEEL_CHECK(rows >= 1 && q.size(0) == rows, "cached_step_attention: " + std::to_string(q.size(0)) +
                                                 " batch rows for " + std::to_string(rows) +
                                                 " caches");
  auto one = [&](int64_t b, const Tensor& qb, const Tensor& kb, const Tensor& vb) {
    KVCache& c = *caches.rows[static_cast<size_t>(b)];
    auto [k_all, v_all] = kv_append(c.layers[layer], c.capacity, c.length, kb, vb);
    return cached_attention(qb, k_all, v_all, backend, window, scores);
  };
  if (rows == 1) return one(0, q, k, v);
  // Rows of their own lengths: each attends over its own cache. Only the projections around this
  // (the weights, read once for every row) are shared; no graph is kept.
  KEEL_CHECK(!grad_mode_enabled(), "cached_step_attention: rows decode without gradients");
  Tensor out = Tensor::empty(q.shape(), q.dtype(), q.device());
  for (int64_t b = 0; b < rows; ++b) {
    Tensor at = out.slice_rows(b, b + 1);
    at.copy_from(one(b, q.slice_rows(b, b + 1), k.slice_rows(b, b + 1), v.slice_rows(b, b + 1)));
  }
  return out;
}

}  // namespace keel::models
