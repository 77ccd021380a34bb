#include "keel/nn/adapters/lora.h"

#include "keel/amp/autocast.h"
#include "keel/ops/dropout.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"

namespace keel::nn {

LoraAdapter::LoraAdapter(Linear& base, int64_t r, double alpha, double dropout, uint64_t seed) {
  scaling = alpha / static_cast<double>(r);
  // Adapter parameters are f32 whatever the base dtype (PEFT's autocast_adapter_dtype).
  if (dropout > 0)
    lora_dropout = base.add_adapter_module("lora_dropout", std::make_unique<Dropout>(dropout));
  lora_A = base.add_adapter_module(
      "lora_A", std::make_unique<Linear>(base.in_features, r, false, DType::F32));
  lora_B = base.add_adapter_module(
      "lora_B", std::make_unique<Linear>(r, base.out_features, false, DType::F32));
  init_kaiming_uniform(lora_A->weight, seed);  // B stays zero: the update starts at 0
}

Tensor LoraAdapter::adapter_input(const Tensor& x) const {
  const DType dt = lora_A->weight.dtype();
  return x.dtype() == dt ? x : ops::cast(x, dt);
}

Tensor LoraAdapter::dropped_input(const Tensor& x) const {
  const DType dt = lora_A->weight.dtype();
  // Under autocast, lora_A's product rounds the dropped f32 input straight into the compute
  // dtype: ops::dropout_cast gives that 16-bit tensor, and the f32 gradient the chain would
  // give, in one pass each way, bit for bit. Not when a hook watches the dropout or lora_A (the
  // tracer records their f32 input and output, a fault injection may replace them).
  const DType low = amp::autocast_dtype();
  const bool fused = lora_dropout && lora_dropout->is_training() && lora_dropout->p > 0 &&
                     dt == DType::F32 && amp::autocast_enabled() && dtype_size(low) < 4 &&
                     (x.dtype() == DType::F32 || x.dtype() == low) &&
                     amp::cast_policy(amp::AmpOp::kLinear) == amp::CastPolicy::kLowerPrecision &&
                     !lora_dropout->has_hooks() && !lora_A->has_hooks();
  if (fused)
    return ops::dropout_cast(x, static_cast<float>(lora_dropout->p), lora_dropout->mask_seed(),
                             low);
  Tensor h = adapter_input(x);  // [..., in] f32
  return lora_dropout ? lora_dropout->forward(h) : h;
}

Tensor LoraAdapter::forward(Linear& base, const Tensor& x) {
  Tensor result = base.base_forward(x);  // [..., out], base or compute dtype
  const DType out_dt = result.dtype();
  Tensor h = dropped_input(x);  // [..., in] f32, or under autocast its 16-bit copy
  // lora_B(lora_A(h)) * scaling: both products follow the linear autocast rule.
  Tensor ba = lora_B->forward(lora_A->forward(h));
  const float s = static_cast<float>(scaling);
  if (ba.dtype() == out_dt) return ops::add_scaled(result, ba, s);  // result + ba * s, one pass
  auto [a, b] = amp::promote(result, ops::scale(ba, s));
  Tensor y = ops::add(a, b);
  return y.dtype() == out_dt ? y : ops::cast(y, out_dt);
}

Tensor LoraAdapter::delta_weight() const {
  NoGradGuard no_grad;
  Tensor ba = ops::matmul(lora_B->weight, lora_A->weight);  // [out, r]·[r, in] -> [out, in] f32
  return ops::scale(ba, static_cast<float>(scaling));
}

Tensor LoraAdapter::merged_weight(const Linear& base) const {
  NoGradGuard no_grad;
  Tensor w = base.weight.dtype() == DType::F32 ? base.weight : base.weight.to_dtype(DType::F32);
  return ops::add(w, delta_weight());  // [out, in] f32
}

std::vector<std::pair<std::string, Tensor>> LoraAdapter::peft_tensors() const {
  return {{"lora_A.weight", lora_A->weight}, {"lora_B.weight", lora_B->weight}};
}

}  // namespace keel::nn
