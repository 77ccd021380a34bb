#include "keel/ops/cross_entropy.h"

#include "keel/backend/cross_entropy.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {
void check_targets(const char* op, const Tensor& targets) {
  KEEL_CHECK(targets.dtype() == DType::I32 || targets.dtype() == DType::I64,
             std::string(op) + ": targets must be i32 or i64, got " + dtype_name(targets.dtype()));
}
}  // namespace

struct CrossEntropyNode final : Node {
  Tensor logits, targets;  // [N, V], [N]
  Tensor stats;            // [N, 2] f32: row max and log-sum-exp of the shifted row
  int64_t ignore_index = -100, count = 0;
  Reduction reduction = Reduction::kMean;
  std::vector<Tensor> backward(const Tensor& g) override {  // g: scalar
    if (!needs_grad(0)) return {Tensor(), Tensor()};
    KEEL_CHECK(logits.defined(),
               "cross_entropy: backward ran a second time through this graph, but the first one "
               "wrote the gradient over the logits it saved (as PyTorch frees saved tensors); run "
               "the forward again");
    const double gv = g.to_floats()[0];
    // Mean with nothing counted: the loss was the constant 0, so its gradient is 0.
    const double denom = reduction == Reduction::kMean ? static_cast<double>(count) : 1.0;
    const float scale = count > 0 ? static_cast<float>(gv / denom) : 0.f;
    const int64_t n = logits.size(0), v = logits.size(1);
    // [N, V]. When this node holds the only handle to the logits (the model's output was dropped
    // after the loss), their buffer takes the gradient in place: no second [N, V] buffer at the
    // step's peak (411 MB for GPT-2 at B8 T256 in f32).
    Tensor dlogits = sole_owner(logits) ? logits : Tensor::empty_like(logits);
    cross_entropy_kernels(logits.device())
        .backward(dlogits.data(), logits.data(), logits.dtype(), stats.data_as<float>(),
                  targets.data(), targets.dtype(), n, v, ignore_index, scale);
    if (dlogits.impl_ptr() == logits.impl_ptr()) logits = Tensor();  // the gradient's alone now
    return {dlogits, Tensor()};
  }
  const char* name() const override { return "cross_entropy"; }
};

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index,
                     Reduction reduction) {
  check_floating("cross_entropy", logits);
  check_targets("cross_entropy", targets);
  KEEL_CHECK(targets.device() == logits.device(),
             "cross_entropy: targets on " + targets.device().str() + " but logits on " +
                 logits.device().str() + "; move the targets with .to(device)");
  KEEL_CHECK(logits.dim() == 2 && logits.size(1) > 0,
             "cross_entropy: logits must be [N, V] with V > 0, got " + shape_str(logits.shape()) +
                 " (flatten [B, T, V] to [B*T, V] first)");
  KEEL_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0),
             "cross_entropy: targets " + shape_str(targets.shape()) + " do not match logits " +
                 shape_str(logits.shape()) + " (need [N] for [N, V])");
  const int64_t n = logits.size(0), v = logits.size(1);
  const auto& k = cross_entropy_kernels(logits.device());
  const int64_t bad = k.find_invalid(targets.data(), targets.dtype(), n, v, ignore_index);
  if (bad >= 0) {
    const int64_t t = targets.slice_rows(bad, bad + 1).to_ints()[0];  // any device
    throw Error("cross_entropy: target " + std::to_string(t) + " at row " + std::to_string(bad) +
                " is outside [0, " + std::to_string(v) + ") and is not ignore_index (" +
                std::to_string(ignore_index) +
                "); labels must be class ids below the vocabulary size, with padding set to "
                "ignore_index");
  }
  const int64_t count = k.count(targets.data(), targets.dtype(), n, ignore_index);
  Tensor stats = Tensor::empty({n, 2}, DType::F32, logits.device());
  const double sum = k.forward(stats.data_as<float>(), logits.data(), logits.dtype(),
                               targets.data(), targets.dtype(), n, v, ignore_index);
  double loss = sum;
  if (reduction == Reduction::kMean) loss = count > 0 ? sum / static_cast<double>(count) : 0.0;
  Tensor out = Tensor::full({}, static_cast<float>(loss), DType::F32);  // scalar
  if (any_requires_grad({&logits, &targets})) {
    auto node = std::make_shared<CrossEntropyNode>();
    node->logits = logits;
    node->targets = targets;
    node->stats = stats;
    node->ignore_index = ignore_index;
    node->count = count;
    node->reduction = reduction;
    record_node(out, node, {&logits, &targets});
  }
  return out;
}

int64_t count_targets(const Tensor& targets, int64_t ignore_index) {
  check_targets("count_targets", targets);
  return cross_entropy_kernels(targets.device())
      .count(targets.data(), targets.dtype(), targets.numel(), ignore_index);
}

}  // namespace keel::ops
