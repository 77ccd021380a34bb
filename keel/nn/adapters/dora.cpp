#include "keel/nn/adapters/dora.h"

#include <omp.h>

#include <cmath>
#include <vector>

#include "keel/amp/autocast.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"
#include "keel/tensor/convert_mapped.h"

namespace keel::nn {

using amp::AmpOp;

namespace {

// norm[o] = ||W[o, :] + round(s·L[o, :])||, round() to L's dtype (torch rounds the scaled product
// in lora_weight's dtype and adds it to W.to(f32) in f32); L null: ||W[o, :]||. One pass over W and
// L, no [out, in] temporaries (three f32 copies before: a Llama-3-8B MLP weight's are 235 MB each,
// written and page-faulted twice per target per micro-batch). Rows go to threads; each row is
// summed in column order in f64, so the bits depend neither on the thread count nor on the pass.
template <class TW, class TL>
void row_norms_of(float* norm, const TW* w, const TL* l, DType l_dt, float s, int64_t out,
                  int64_t in) {
#pragma omp parallel for schedule(static) if (out * in >= (int64_t{1} << 16) && !omp_in_parallel())
  for (int64_t o = 0; o < out; ++o) {
    const TW* wr = w + o * in;
    const TL* lr = l ? l + o * in : nullptr;
    double acc = 0;  // f64: a fixed order, no cancellation (all terms >= 0)
    for (int64_t i = 0; i < in; ++i) {
      float v = load_f32(wr + i);
      if (lr) v += round_to(l_dt, s * load_f32(lr + i));
      acc += static_cast<double>(v) * v;
    }
    norm[o] = static_cast<float>(std::sqrt(acc));
  }
}

template <class F>
void visit_floating(const Tensor& t, F&& f) {
  switch (t.dtype()) {
    case DType::F32:
      return f(t.data_as<float>());
    case DType::BF16:
      return f(t.data_as<bf16_t>());
    case DType::F16:
      return f(t.data_as<f16_t>());
    default:
      KEEL_CHECK(false, "DoRA weight_norm: a floating weight is required");
  }
}

// ||W + s·L||_row [out] f32 of CPU tensors; lora_weight undefined: ||W||_row.
Tensor row_norms(const Tensor& w, const Tensor& lora_weight, double s) {
  const int64_t out = w.size(0), in = w.size(1);
  std::vector<float> norm(static_cast<size_t>(out));
  visit_floating(w, [&](const auto* wp) {
    if (!lora_weight.defined()) {
      row_norms_of(norm.data(), wp, static_cast<const float*>(nullptr), DType::F32, 0.f, out, in);
      return;
    }
    visit_floating(lora_weight, [&](const auto* lp) {
      row_norms_of(norm.data(), wp, lp, lora_weight.dtype(), static_cast<float>(s), out, in);
    });
  });
  return Tensor::from_floats(norm, {out});
}

}  // namespace

DoraAdapter::DoraAdapter(Linear& base, int64_t r, double alpha, double dropout, uint64_t seed)
    : LoraAdapter(base, r, alpha, dropout, seed) {
  // B = 0, so the initial magnitude is ||W||_row and the adapted layer starts equal to the base.
  const Tensor& w = base.weight;
  const bool streamed = w.device().is_cpu() && dtype_is_floating(w.dtype()) && w.dim() == 2;
  magnitude = base.add_adapter_parameter(
      "lora_magnitude_vector",
      streamed ? row_norms(w, Tensor(), 0) : weight_norm(w, delta_weight(), 1.0));
  // A weight used from its file's mapping (a frozen base being loaded) need not stay resident
  // until the base is cast: an f32 file's adapted weights would all be, on top of the base.
  drop_mapped_pages(w);
}

Tensor DoraAdapter::weight_norm(const Tensor& w, const Tensor& lora_weight, double s) {
  NoGradGuard no_grad;
  KEEL_CHECK(lora_weight.shape() == w.shape(), "DoRA weight_norm: shapes differ");
  // torch: weight + scaling * lora_weight, the product rounded in lora_weight's dtype, the sum in
  // the wider dtype (f32 here), then the row norm.
  if (!w.device().is_cpu()) return weight_norm_by_ops(w, lora_weight, s);
  return row_norms(w, lora_weight.device().is_cpu() ? lora_weight : lora_weight.to(w.device()), s);
}

Tensor DoraAdapter::weight_norm_by_ops(const Tensor& w, const Tensor& lora_weight, double s) {
  NoGradGuard no_grad;
  const int64_t out = w.size(0), in = w.size(1);
  auto f32 = [](const Tensor& t) { return t.dtype() == DType::F32 ? t : ops::cast(t, DType::F32); };
  Tensor v = f32(w);
  if (lora_weight.defined())
    v = ops::add(v, f32(ops::scale(lora_weight.device() == w.device() ? lora_weight
                                                                      : lora_weight.to(w.device()),
                                   static_cast<float>(s))));
  const Tensor ones = Tensor::full({in, 1}, 1.0f).to(w.device());
  const std::vector<float> sums = ops::matmul(ops::mul(v, v), ones).to_floats();  // [out]
  std::vector<float> norm(static_cast<size_t>(out));
  for (int64_t o = 0; o < out; ++o) norm[o] = static_cast<float>(std::sqrt(double(sums[o])));
  return Tensor::from_floats(norm, {out});
}

Tensor DoraAdapter::forward(Linear& base, const Tensor& x) {
  Tensor result = base.base_forward(x);  // [..., out], includes the bias
  const DType out_dt = result.dtype();
  Tensor h = adapter_input(x);  // [..., in] f32
  const bool dropping = lora_dropout && base.is_training();
  if (dropping) h = lora_dropout->forward(h);

  // n = ||W.to(x.dtype) + s·B·A||_row, detached; B·A under the matmul autocast rule. B·A is
  // formed with grad mode on, as PEFT does (its graph is simply dropped): under autocast the cast
  // weights are cached for the step, and a cast made under NoGradGuard would be cached without its
  // graph edge, cutting lora_A/lora_B off from their gradients in the products below.
  Tensor lora_weight = ops::matmul(amp::autocast(AmpOp::kMatmul, lora_B->weight),
                                   amp::autocast(AmpOp::kMatmul, lora_A->weight));  // [out, in]
  Tensor inv_norm;  // [out] f32, 1/n
  {
    NoGradGuard no_grad;
    Tensor n = weight_norm(base.weight, lora_weight, scaling);
    std::vector<float> inv = n.to_floats();
    for (float& v : inv) v = 1.0f / v;  // a zero row gives inf, as m / 0 does in torch
    inv_norm = Tensor::from_floats(inv, {n.size(0)}).to(magnitude.device());
  }
  Tensor mag_norm_scale = ops::mul(magnitude, inv_norm);     // [out] f32, m / n
  Tensor lora_result = lora_B->forward(lora_A->forward(h));  // [..., out]

  Tensor base_result;  // [..., out]: x'·Wᵀ without the bias
  if (!dropping) {
    base_result = result;
    if (base.bias.defined()) {
      auto [r, b] = amp::promote(result, base.bias);
      base_result = ops::add(r, ops::scale(b, -1.0f));
    }
  } else {
    // PEFT: F.linear(x', W.to(x'.dtype)), under the linear autocast rule. When that rule takes
    // the f32 copy straight back to W's own dtype (a bf16 base under bf16-mixed), the round trip
    // is exact and W is used as it is: two [out, in] copies per call fewer.
    const DType wdt = base.weight.dtype();
    const bool round_trip = amp::autocast_enabled() && amp::autocast_dtype() == wdt &&
                            amp::cast_policy(AmpOp::kLinear) == amp::CastPolicy::kLowerPrecision;
    Tensor w = wdt == h.dtype() || round_trip ? base.weight : ops::cast(base.weight, h.dtype());
    base_result = ops::linear(amp::autocast(AmpOp::kLinear, h), amp::autocast(AmpOp::kLinear, w));
  }
  // (m/n - 1) * base_result + (m/n) * lora_result * s, in f32 (torch promotes to m's dtype).
  const int64_t out = mag_norm_scale.size(0);
  Tensor scale_minus_one =
      ops::add(mag_norm_scale, Tensor::full({out}, -1.0f).to(mag_norm_scale.device()));
  if (base_result.dtype() != DType::F32) base_result = ops::cast(base_result, DType::F32);
  if (lora_result.dtype() != DType::F32) lora_result = ops::cast(lora_result, DType::F32);
  Tensor dora = ops::add(ops::mul(base_result, scale_minus_one),
                         ops::scale(ops::mul(lora_result, mag_norm_scale),
                                    static_cast<float>(scaling)));  // [..., out] f32
  auto [a, b] = amp::promote(result, dora);
  Tensor y = ops::add(a, b);
  return y.dtype() == out_dt ? y : ops::cast(y, out_dt);
}

Tensor DoraAdapter::merged_weight(const Linear& base) const {
  // PEFT's merge: dora_factor = m / ||W + ΔW||_row; W' = dora_factor[:, None] * (W + ΔW).
  NoGradGuard no_grad;
  Tensor delta = delta_weight();  // [out, in] f32, s·B·A
  Tensor n = weight_norm(base.weight, delta, 1.0);
  Tensor w = base.weight.dtype() == DType::F32 ? base.weight : base.weight.to_dtype(DType::F32);
  std::vector<float> wd = ops::add(w, delta).to_floats();
  const std::vector<float> m = magnitude.to_floats(), nv = n.to_floats();
  const int64_t out = w.size(0), in = w.size(1);
  for (int64_t o = 0; o < out; ++o) {
    const float f = m[static_cast<size_t>(o)] / nv[static_cast<size_t>(o)];
    for (int64_t i = 0; i < in; ++i) wd[static_cast<size_t>(o * in + i)] *= f;
  }
  return Tensor::from_floats(wd, {out, in});
}

std::vector<std::pair<std::string, Tensor>> DoraAdapter::peft_tensors() const {
  auto t = LoraAdapter::peft_tensors();
  t.emplace_back("lora_magnitude_vector", magnitude);
  return t;
}

}  // namespace keel::nn
