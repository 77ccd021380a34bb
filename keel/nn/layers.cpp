#include "keel/nn/layers.h"

#include "keel/amp/autocast.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/ops/dropout.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/embedding.h"
#include "keel/ops/linear.h"
#include "keel/ops/norm.h"
#include "keel/ops/shape.h"
#include "keel/tensor/random.h"

namespace keel::nn {

using amp::AmpOp;
using amp::autocast;

Linear::Linear(int64_t in, int64_t out, bool has_bias, DType dt)
    : Module("Linear"), in_features(in), out_features(out) {
  weight = register_parameter("weight", Tensor::zeros({out, in}, dt));
  if (has_bias) bias = register_parameter("bias", Tensor::zeros({out}, dt));
}

Tensor Linear::forward(const Tensor& x) {
  return call({x}, [&] {
    if (adapter && !adapter->merged) return adapter->forward(*this, x);
    return base_forward(x);
  });
}

Tensor Linear::base_forward(const Tensor& x) {
  return ops::linear(autocast(AmpOp::kLinear, x), autocast(AmpOp::kLinear, weight),
                     autocast(AmpOp::kLinear, bias));
}

LayerNorm::LayerNorm(int64_t dim, double e, DType dt) : Module("LayerNorm"), eps(e) {
  weight = register_parameter("weight", Tensor::full({dim}, 1.0f, dt));
  bias = register_parameter("bias", Tensor::zeros({dim}, dt));
}

Tensor LayerNorm::forward(const Tensor& x) {
  return call({x}, [&] {
    return ops::layer_norm(autocast(AmpOp::kLayerNorm, x), autocast(AmpOp::kLayerNorm, weight),
                           autocast(AmpOp::kLayerNorm, bias), static_cast<float>(eps));
  });
}

RMSNorm::RMSNorm(int64_t dim, double e, DType dt, bool offset, bool center, Affine affine)
    : Module("RMSNorm"), eps(e), unit_offset(offset), centered(center) {
  KEEL_CHECK(affine == Affine::kWeight || center,
             "RMSNorm: only a centered norm (a LayerNorm) has a bias or no weight");
  if (affine != Affine::kNone)
    weight = register_parameter("weight", Tensor::full({dim}, offset ? 0.0f : 1.0f, dt));
  if (affine == Affine::kWeightAndBias) bias = register_parameter("bias", Tensor::zeros({dim}, dt));
}

Tensor RMSNorm::forward(const Tensor& x) {
  return call({x}, [&] {
    Tensor xn = autocast(AmpOp::kRmsNorm, x);
    Tensor w = weight.defined() ? autocast(AmpOp::kRmsNorm, weight) : Tensor();
    if (centered) {  // HF's CohereLayerNorm, OlmoLayerNorm, nn.LayerNorm: in f32, then x's dtype
      const DType out = xn.dtype();
      if (out != DType::F32) xn = ops::cast(xn, DType::F32);
      if (w.defined() && w.dtype() != DType::F32) w = ops::cast(w, DType::F32);
      Tensor b = bias.defined() ? autocast(AmpOp::kRmsNorm, bias) : Tensor();
      if (b.defined() && b.dtype() != DType::F32) b = ops::cast(b, DType::F32);
      const Tensor y = ops::layer_norm(xn, w, b, static_cast<float>(eps));
      return out == DType::F32 ? y : ops::cast(y, out);
    }
    if (!unit_offset) return ops::rms_norm(xn, w, static_cast<float>(eps));
    // HF's GemmaRMSNorm: x.float() normalized, times (1 + weight.float()), cast back to x's
    // dtype: in f32 whatever the dtypes (under -mixed autocast has made both f32 already).
    const DType out = xn.dtype();
    if (out != DType::F32) xn = ops::cast(xn, DType::F32);
    if (w.dtype() != DType::F32) w = ops::cast(w, DType::F32);
    w = ops::add(w, Tensor::full(w.shape(), 1.0f, DType::F32).to(w.device()));
    const Tensor y = ops::rms_norm(xn, w, static_cast<float>(eps));
    return out == DType::F32 ? y : ops::cast(y, out);
  });
}

HeadLayerNorm::HeadLayerNorm(int64_t h, int64_t d, double e, DType dt, bool module_per_head)
    : Module("HeadLayerNorm"), heads(h), dim(d), eps(e) {
  if (!module_per_head) {
    weight = register_parameter("weight", Tensor::full({heads, dim}, 1.0f, dt));
    return;
  }
  for (int64_t i = 0; i < heads; ++i)
    norms.push_back(register_module("norms." + std::to_string(i),
                                    std::make_unique<RMSNorm>(dim, e, dt, false, true)));
}

Tensor HeadLayerNorm::forward(const Tensor& x) {
  return call({x}, [&] {
    KEEL_CHECK(x.dim() >= 2 && x.size(-2) == heads && x.size(-1) == dim,
               "HeadLayerNorm: x must end in [" + std::to_string(heads) + ", " +
                   std::to_string(dim) + "], got " + shape_str(x.shape()));
    // The heads' weights as one [heads, dim] (StableLM's gathered from its modules).
    Tensor w = weight;
    if (!w.defined()) {
      std::vector<Tensor> rows;
      for (RMSNorm* n : norms) rows.push_back(n->weight);
      w = ops::reshape(ops::concat_last(rows), {heads, dim});
    }
    Tensor xn = autocast(AmpOp::kRmsNorm, x);
    w = autocast(AmpOp::kRmsNorm, w);
    const DType out = xn.dtype();
    if (out != DType::F32) xn = ops::cast(xn, DType::F32);
    if (w.dtype() != DType::F32) w = ops::cast(w, DType::F32);
    // (CohereLayerNorm: the normalized f32 values times the f32 weight, then x's dtype)
    const Tensor y = ops::mul(ops::layer_norm(xn, Tensor(), Tensor(), static_cast<float>(eps)), w);
    return out == DType::F32 ? y : ops::cast(y, out);
  });
}

Embedding::Embedding(int64_t num, int64_t dim, DType dt) : Module("Embedding") {
  weight = register_parameter("weight", Tensor::zeros({num, dim}, dt));
}

Tensor Embedding::forward(const Tensor& ids) {
  return call({ids}, [&] { return ops::embedding(ids, weight); });
}

namespace {
thread_local uint64_t t_step_seed = 0;
}  // namespace

Dropout::Dropout(double prob) : Module("Dropout"), p(prob) {}

void Dropout::set_step_seed(uint64_t seed) { t_step_seed = seed; }
uint64_t Dropout::step_seed() { return t_step_seed; }

uint64_t dropout_mask_seed(const std::string& path) {
  return mix_seed(t_step_seed, name_seed(path));
}

uint64_t Dropout::mask_seed() const { return dropout_mask_seed(path()); }

Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p == 0) return x;
  return call({x}, [&] { return ops::dropout(x, static_cast<float>(p), mask_seed()); });
}

Tensor residual_add(const Tensor& x, const Tensor& y) {
  auto [a, b] = amp::promote(x, y);
  return ops::add(a, b);
}

}  // namespace keel::nn
