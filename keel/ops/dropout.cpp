#include "keel/ops/dropout.h"

#include <cmath>

#include "keel/backend/dropout.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {
// out = x * mask * scale with the mask of (seed, index): the forward and its backward.
Tensor apply_mask(const Tensor& x, uint64_t seed, const DropoutMask& m) {
  Tensor out = Tensor::empty_like(x);
  dropout_kernels(x.device())
      .apply(out.data(), x.data(), x.dtype(), x.numel(), seed, m.threshold, m.scale);
  return out;
}
}  // namespace

struct DropoutNode final : Node {
  uint64_t seed = 0;
  DropoutMask mask;
  std::vector<Tensor> backward(const Tensor& g) override {
    // The mask is regenerated from the seed rather than stored: dx = g * mask * scale.
    return {apply_mask(g, seed, mask)};
  }
  const char* name() const override { return "dropout"; }
};

// The node of dropout_cast: in the graph it stands for cast(dropout(cast(x, f32)), a 16-bit
// dtype), so it asks for its gradient in f32 as that narrowing cast did.
struct DropoutCastNode final : Node {
  DType in = DType::F32;  // x's dtype: the gradient's
  float scale = 1.f;
  Tensor keep;  // the forward's mask, a bit per element: the backward does not hash again
  std::vector<Tensor> backward(const Tensor& g) override;
  DType wanted_grad_dtype(DType) const override { return DType::F32; }
  const char* name() const override { return "dropout_cast"; }
};

// An element survives when its 32 hash bits are >= p * 2^32 (exact: p has 24 significant bits;
// p < 1 keeps it below 2^32). p == 0: every element kept and scaled by 1, which is exact.
DropoutMask dropout_mask(float p) {
  if (!(p >= 0.f && p < 1.f))
    throw Error("dropout: p = " + std::to_string(p) +
                " is outside [0, 1); set the dropout probability (e.g. model.dropout) to a value "
                "in [0, 1)");
  if (p == 0.f) return {};
  return {static_cast<uint32_t>(static_cast<double>(p) * 4294967296.0),
          static_cast<float>(1.0 / (1.0 - static_cast<double>(p)))};
}

std::vector<Tensor> DropoutCastNode::backward(const Tensor& g) {
  // g is in f32 when the consumer wrote it there (a matmul from its f32 accumulator), else in the
  // output's dtype; either way the f32 product g * mask * scale is rounded once into x's dtype, as
  // dropout's backward in f32 followed by the widening cast's backward rounded it.
  Tensor gx = Tensor::empty(g.shape(), in, g.device());
  dropout_kernels(g.device())
      .apply_kept(gx.data(), in, g.data(), g.dtype(), g.numel(), keep.data_as<uint8_t>(), scale);
  return {gx};
}

Tensor dropout_cast(const Tensor& x, float p, uint64_t seed, DType out) {
  check_floating("dropout_cast", x);
  const DropoutMask mask = dropout_mask(p);
  KEEL_CHECK(dtype_is_floating(out) && dtype_size(out) < 4 && dtype_size(x.dtype()) <= 4,
             std::string("dropout_cast: rounds f32 math into a 16-bit dtype, got x ") +
                 dtype_name(x.dtype()) + " and out " + dtype_name(out));
  Tensor y = Tensor::empty(x.shape(), out, x.device());
  const bool grad = any_requires_grad({&x});
  Tensor keep =
      grad ? Tensor::empty({dropout_keep_bytes(x.numel())}, DType::U8, x.device()) : Tensor();
  dropout_kernels(x.device())
      .apply_cast(y.data(), out, x.data(), x.dtype(), x.numel(), seed, mask.threshold, mask.scale,
                  grad ? keep.data_as<uint8_t>() : nullptr);
  if (grad) {
    auto node = std::make_shared<DropoutCastNode>();
    node->in = x.dtype();
    node->scale = mask.scale;
    node->keep = keep;
    record_node(y, node, {&x});
  }
  return y;
}

Tensor dropout(const Tensor& x, float p, uint64_t seed) {
  check_floating("dropout", x);
  const DropoutMask mask = dropout_mask(p);
  if (p == 0.f) return x;
  Tensor out = apply_mask(x, seed, mask);
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<DropoutNode>();
    node->seed = seed;
    node->mask = mask;
    record_node(out, node, {&x});
  }
  return out;
}

}  // namespace keel::ops
