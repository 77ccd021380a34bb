#include "keel/amp/autocast.h"

#include <algorithm>
#include <array>
#include <iterator>
#include <unordered_map>

#include "keel/autograd/node.h"
#include "keel/ops/elementwise.h"

namespace keel::amp {

namespace {
struct CacheEntry {
  std::weak_ptr<TensorImpl> source;
  uint64_t version;
  Tensor cast;
};
struct State {
  bool enabled = false;
  DType dtype = DType::BF16;
  int nesting = 0;
  std::unordered_map<TensorImpl*, CacheEntry> cache;  // this step's casts (with graph nodes)
  std::unordered_map<TensorImpl*, CacheEntry> kept;   // their values, across steps (no nodes)
  // The two newest casts of anything else (activations), newest first: their values (no nodes).
  // Two, so that a cast between the uses of one activation (LoKr's delta weight for q, between
  // q's and k's casts of the normed input) does not evict it.
  std::array<CacheEntry, 2> last_activations;
};
thread_local State t_state;
}  // namespace

CastPolicy cast_policy(AmpOp op) {
  switch (op) {
    case AmpOp::kLinear:
    case AmpOp::kMatmul:
    case AmpOp::kAttention:
      return CastPolicy::kLowerPrecision;
    case AmpOp::kSoftmax:
    case AmpOp::kLogSoftmax:
    case AmpOp::kLayerNorm:
    case AmpOp::kRmsNorm:
      return CastPolicy::kFp32;
    case AmpOp::kCrossEntropy:
      return CastPolicy::kFp32Inside;
    default:
      return CastPolicy::kInputDtype;
  }
}

const char* amp_op_name(AmpOp op) {
  static const char* names[] = {"linear",      "matmul",     "attention", "softmax",
                                "log_softmax", "layer_norm", "rms_norm",  "cross_entropy",
                                "gelu",        "silu",       "swiglu",    "embedding",
                                "rope",        "dropout",    "add",       "mul"};
  return names[static_cast<int>(op)];
}

bool autocast_enabled() { return t_state.enabled; }
DType autocast_dtype() { return t_state.dtype; }

AutocastGuard::AutocastGuard(bool enabled, DType dtype)
    : prev_enabled_(t_state.enabled), prev_dtype_(t_state.dtype) {
  t_state.enabled = enabled;
  t_state.dtype = dtype;
  ++t_state.nesting;
}

AutocastGuard::~AutocastGuard() {
  t_state.enabled = prev_enabled_;
  t_state.dtype = prev_dtype_;
  if (--t_state.nesting == 0) {
    t_state.cache.clear();
    t_state.last_activations = {};
    for (auto it = t_state.kept.begin(); it != t_state.kept.end();)  // weights that are gone
      it = it->second.source.expired() ? t_state.kept.erase(it) : std::next(it);
  }
}

// An activation read by several products in a row (a norm's f32 output by q, k and v, or by gate
// and up) is rounded once: each later cast reuses the values of the first under a graph node of
// its own, so the graph, and every bit of the backward, is the one separate casts give. Only the
// two newest casts are kept (a step's activations are not held past the next ones); a new tensor,
// view or in-place version misses.
static Tensor reused_activation_cast(const Tensor& t, DType dt) {
  auto& kept = t_state.last_activations;
  for (size_t i = 0; i < kept.size(); ++i) {
    const CacheEntry& e = kept[i];
    if (e.cast.defined() && e.cast.dtype() == dt && e.version == t.version() &&
        !e.source.expired() && e.source.lock().get() == t.impl()) {
      Tensor c = ops::cast_precomputed(t, e.cast);
      std::rotate(kept.begin(), kept.begin() + i, kept.begin() + i + 1);  // newest first
      return c;
    }
  }
  Tensor c = ops::cast(t, dt);
  std::rotate(kept.begin(), kept.end() - 1, kept.end());
  kept[0] = {t.impl_ptr(), t.version(), c.view(c.shape())};  // values only
  return c;
}

static Tensor cached_cast(const Tensor& t, DType dt) {
  // Only weights are worth caching: f32 leaves that require grad (PyTorch's rule).
  // A cast made under NoGradGuard has no graph node: caching it would silently cut the gradient
  // of a later use with grad mode on, so only casts that carry a node are cached.
  if (!(t.dtype() == DType::F32 && t.is_leaf() && t.requires_grad() && grad_mode_enabled()))
    return reused_activation_cast(t, dt);
  auto current = [&](const CacheEntry& e) {
    return !e.source.expired() && e.version == t.version() && e.cast.dtype() == dt;
  };
  auto it = t_state.cache.find(t.impl());
  if (it != t_state.cache.end() && current(it->second)) return it->second.cast;
  auto kept = t_state.kept.find(t.impl());
  Tensor c = kept != t_state.kept.end() && current(kept->second)
                 ? ops::cast_precomputed(t, kept->second.cast)
                 : ops::cast(t, dt);
  t_state.cache[t.impl()] = {t.impl_ptr(), t.version(), c};
  t_state.kept[t.impl()] = {t.impl_ptr(), t.version(), c.view(c.shape())};  // values only
  return c;
}

Tensor weight_copy(const Tensor& weight) {
  auto it = t_state.kept.find(weight.impl());
  if (it == t_state.kept.end() || it->second.source.expired() ||
      it->second.version != weight.version())
    return Tensor();
  return it->second.cast;
}

void weight_copy_refreshed(const Tensor& weight) {
  auto it = t_state.kept.find(weight.impl());
  KEEL_CHECK(it != t_state.kept.end() && !it->second.source.expired(),
             "weight_copy_refreshed: no kept copy for this weight");
  it->second.version = weight.version();
}

size_t weight_copy_count() { return t_state.kept.size(); }
void clear_weight_copies() { t_state.kept.clear(); }

Tensor autocast(AmpOp op, const Tensor& t) {
  if (!t_state.enabled || !t.defined() || !dtype_is_floating(t.dtype())) return t;
  switch (cast_policy(op)) {
    case CastPolicy::kLowerPrecision:
      return t.dtype() == t_state.dtype ? t : cached_cast(t, t_state.dtype);
    case CastPolicy::kFp32:
      return t.dtype() == DType::F32 ? t : ops::cast(t, DType::F32);
    case CastPolicy::kFp32Inside:
    case CastPolicy::kInputDtype:
      return t;
  }
  return t;
}

std::pair<Tensor, Tensor> promote(const Tensor& a, const Tensor& b) {
  if (a.dtype() == b.dtype()) return {a, b};
  // Different floating dtypes: f32 wins; bf16 with f16 meet in f32 (neither holds the other).
  return {ops::cast(a, DType::F32), ops::cast(b, DType::F32)};
}

size_t cast_cache_size() { return t_state.cache.size(); }

}  // namespace keel::amp
