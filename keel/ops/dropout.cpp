#include "keel/ops/dropout.h"

#include <cmath>

#include "keel/backend/dropout.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {
// out = x * mask * scale with the mask of (seed, index): the forward and its backward.
Tensor apply_mask(const Tensor& x, uint64_t seed, uint32_t threshold, float scale) {
  Tensor out = Tensor::empty_like(x);
  dropout_kernels(x.device())
      .apply(out.data(), x.data(), x.dtype(), x.numel(), seed, threshold, scale);
  return out;
}
}  // namespace

struct DropoutNode final : Node {
  uint64_t seed = 0;
  uint32_t threshold = 0;
  float scale = 1.f;
  std::vector<Tensor> backward(const Tensor& g) override {
    // The mask is regenerated from the seed rather than stored: dx = g * mask * scale.
    return {apply_mask(g, seed, threshold, scale)};
  }
  const char* name() const override { return "dropout"; }
};

Tensor dropout(const Tensor& x, float p, uint64_t seed) {
  check_floating("dropout", x);
  if (!(p >= 0.f && p < 1.f))
    throw Error("dropout: p = " + std::to_string(p) +
                " is outside [0, 1); set the dropout probability (e.g. model.dropout) to a value "
                "in [0, 1)");
  if (p == 0.f) return x;
  // An element survives when its 32 hash bits are >= p * 2^32 (exact: p has 24 significant bits;
  // p < 1 keeps it below 2^32).
  const uint32_t threshold = static_cast<uint32_t>(static_cast<double>(p) * 4294967296.0);
  const float scale = static_cast<float>(1.0 / (1.0 - static_cast<double>(p)));
  Tensor out = apply_mask(x, seed, threshold, scale);
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<DropoutNode>();
    node->seed = seed;
    node->threshold = threshold;
    node->scale = scale;
    record_node(out, node, {&x});
  }
  return out;
}

}  // namespace keel::ops
