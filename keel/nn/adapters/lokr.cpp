#include "keel/nn/adapters/lokr.h"

#include <algorithm>

#include "keel/amp/autocast.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"
#include "keel/ops/shape.h"
#include "keel/tensor/random.h"

namespace keel::nn {

using amp::AmpOp;

Tensor kron(const Tensor& a, const Tensor& b) {
  KEEL_CHECK(a.dim() == 2 && b.dim() == 2, "kron: 2-D operands expected");
  const int64_t A = a.size(0), B = a.size(1), P = b.size(0), Q = b.size(1);
  // outer[(i, j), (k, l)] = a[i, j] · b[k, l]: a K = 1 product, so exact up to one rounding.
  Tensor outer = ops::matmul(ops::reshape(a, {A * B, 1}), ops::reshape(b, {1, P * Q}));
  Tensor t = ops::transpose(ops::reshape(outer, {A, B, P, Q}), 1, 2);  // [A, P, B, Q]
  return ops::reshape(t, {A * P, B * Q});
}

LokrAdapter::LokrAdapter(Linear& base, int64_t r, double alpha, uint64_t seed) {
  scaling = alpha / static_cast<double>(r);
  // The shapes (and PEFT's full-or-low-rank w2 rule) in one place: adapter_parameter_shapes.
  const std::vector<AdapterParamShape> p =
      adapter_parameter_shapes("lokr", r, base.in_features, base.out_features);
  w1 = base.add_adapter_parameter("lokr_w1", Tensor::zeros(p[0].shape));
  if (p.size() == 2) {
    w2 = base.add_adapter_parameter("lokr_w2", Tensor::zeros(p[1].shape));
    init_kaiming_uniform(w2, seed);
  } else {
    w2_a = base.add_adapter_parameter("lokr_w2_a", Tensor::zeros(p[1].shape));
    w2_b = base.add_adapter_parameter("lokr_w2_b", Tensor::zeros(p[2].shape));
    init_kaiming_uniform(w2_a, seed);
    init_kaiming_uniform(w2_b, mix_seed(seed, 1));
  }
}

Tensor LokrAdapter::delta_weight() const {
  Tensor right = w2.defined() ? w2
                              : ops::matmul(amp::autocast(AmpOp::kMatmul, w2_a),
                                            amp::autocast(AmpOp::kMatmul, w2_b));  // [out_k, in_n]
  auto [a, b] = amp::promote(w1, right);
  return ops::scale(kron(a, b), static_cast<float>(scaling));  // [out, in]
}

Tensor LokrAdapter::forward(Linear& base, const Tensor& x) {
  const DType prev = x.dtype();
  Tensor result = base.base_forward(x);  // [..., out]
  Tensor delta = delta_weight();         // [out, in]
  Tensor h = x.dtype() == delta.dtype() ? x : ops::cast(x, delta.dtype());
  Tensor update =
      ops::linear(amp::autocast(AmpOp::kLinear, h), amp::autocast(AmpOp::kLinear, delta));
  auto [a, b] = amp::promote(result, update);
  Tensor y = ops::add(a, b);
  return y.dtype() == prev ? y : ops::cast(y, prev);
}

Tensor LokrAdapter::merged_weight(const Linear& base) const {
  NoGradGuard no_grad;
  Tensor delta = delta_weight();
  if (delta.dtype() != DType::F32) delta = delta.to_dtype(DType::F32);
  Tensor w = base.weight.dtype() == DType::F32 ? base.weight : base.weight.to_dtype(DType::F32);
  return ops::add(w, delta);
}

std::vector<std::pair<std::string, Tensor>> LokrAdapter::peft_tensors() const {
  std::vector<std::pair<std::string, Tensor>> t{{"lokr_w1", w1}};
  if (w2.defined())
    t.emplace_back("lokr_w2", w2);
  else {
    t.emplace_back("lokr_w2_a", w2_a);
    t.emplace_back("lokr_w2_b", w2_b);
  }
  return t;
}

}  // namespace keel::nn
