#include "keel/amp/autocast.h"

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
  std::unordered_map<TensorImpl*, CacheEntry> cache;
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
    case AmpOp::kCrossEntropy:
      return CastPolicy::kFp32;
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
  if (--t_state.nesting == 0) t_state.cache.clear();
}

static Tensor cached_cast(const Tensor& t, DType dt) {
  // Only weights are worth caching: f32 leaves that require grad (PyTorch's rule).
  // A cast made under NoGradGuard has no graph node: caching it would silently cut the gradient
  // of a later use with grad mode on, so only casts that carry a node are cached.
  if (!(t.dtype() == DType::F32 && t.is_leaf() && t.requires_grad() && grad_mode_enabled()))
    return ops::cast(t, dt);
  auto it = t_state.cache.find(t.impl());
  if (it != t_state.cache.end() && !it->second.source.expired() &&
      it->second.version == t.version() && it->second.cast.dtype() == dt)
    return it->second.cast;
  Tensor c = ops::cast(t, dt);
  t_state.cache[t.impl()] = {t.impl_ptr(), t.version(), c};
  return c;
}

Tensor autocast(AmpOp op, const Tensor& t) {
  if (!t_state.enabled || !t.defined() || !dtype_is_floating(t.dtype())) return t;
  switch (cast_policy(op)) {
    case CastPolicy::kLowerPrecision:
      return t.dtype() == t_state.dtype ? t : cached_cast(t, t_state.dtype);
    case CastPolicy::kFp32:
      return t.dtype() == DType::F32 ? t : ops::cast(t, DType::F32);
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
