#include "keel/ops/norm.h"

#include "keel/backend/norm.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {
const NormKernels& nk(const Tensor& t) { return norm_kernels(t.device()); }

void* data_or_null(const Tensor& t) { return t.defined() ? t.data() : nullptr; }

// x [..., C]; an affine parameter (weight or bias) is undefined or [C] of x's dtype.
void check_norm_args(const char* op, const Tensor& x, const Tensor& p, const char* what,
                     float eps) {
  check_floating(op, x);
  KEEL_CHECK(x.dim() >= 1, std::string(op) + ": needs at least 1 dimension, got a scalar");
  KEEL_CHECK(eps >= 0.f, std::string(op) + ": eps must be >= 0, got " + std::to_string(eps));
  if (!p.defined()) return;
  check_operands(op, x, p);
  KEEL_CHECK(p.dim() == 1 && p.size(0) == x.size(-1),
             std::string(op) + ": " + what + " " + shape_str(p.shape()) + " does not match input " +
                 shape_str(x.shape()) + " (expected [" + std::to_string(x.size(-1)) +
                 "], the size of the normalized last dimension)");
}

Tensor grad_as(const Tensor& g, const Tensor& like, const char* op) {
  KEEL_CHECK(g.numel() == like.numel(), std::string(op) + " backward: gradient " +
                                            shape_str(g.shape()) + " for an output of " +
                                            shape_str(like.shape()));
  return g.dtype() == like.dtype() ? g : g.to_dtype(like.dtype());
}
}  // namespace

struct LayerNormNode final : Node {
  Tensor x, w, mean, rstd;  // x [rows, cols], w [cols] or undefined, mean/rstd [rows] f32
  bool has_bias = false;
  int64_t rows = 0, cols = 0;
  std::vector<Tensor> backward(const Tensor& grad) override {
    const Tensor g = grad_as(grad, x, "layer_norm");
    Tensor dx, dw, db;
    if (needs_grad(0)) dx = Tensor::empty_like(x);
    if (w.defined() && needs_grad(1)) dw = grad_buffer(1, w.shape(), w.dtype(), w.device());
    if (has_bias && needs_grad(2)) db = grad_buffer(2, {cols}, x.dtype(), x.device());
    nk(x).layer_norm_backward(data_or_null(dx), data_or_null(dw), data_or_null(db), g.data(),
                              x.data(), data_or_null(w), mean.data_as<float>(),
                              rstd.data_as<float>(), x.dtype(), rows, cols);
    return {dx, dw, db};
  }
  const char* name() const override { return "layer_norm"; }
};

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps) {
  check_norm_args("layer_norm", x, weight, "weight", eps);
  check_norm_args("layer_norm", x, bias, "bias", eps);
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  Tensor y = Tensor::empty_like(x);
  Tensor mean = Tensor::empty({rows}, DType::F32, x.device());
  Tensor rstd = Tensor::empty({rows}, DType::F32, x.device());
  nk(x).layer_norm(y.data(), mean.data_as<float>(), rstd.data_as<float>(), x.data(),
                   data_or_null(weight), data_or_null(bias), x.dtype(), rows, cols, eps);
  if (any_requires_grad({&x, &weight, &bias})) {
    auto n = std::make_shared<LayerNormNode>();
    n->x = x;
    n->w = weight;
    n->mean = mean;
    n->rstd = rstd;
    n->has_bias = bias.defined();
    n->rows = rows;
    n->cols = cols;
    record_node(y, n, {&x, &weight, &bias});
  }
  return y;
}

struct RmsNormNode final : Node {
  Tensor x, w, rstd;  // x [rows, cols], w [cols] or undefined, rstd [rows] f32
  int64_t rows = 0, cols = 0;
  std::vector<Tensor> backward(const Tensor& grad) override {
    const Tensor g = grad_as(grad, x, "rms_norm");
    Tensor dx, dw;
    if (needs_grad(0)) dx = Tensor::empty_like(x);
    if (w.defined() && needs_grad(1)) dw = grad_buffer(1, w.shape(), w.dtype(), w.device());
    nk(x).rms_norm_backward(data_or_null(dx), data_or_null(dw), g.data(), x.data(), data_or_null(w),
                            rstd.data_as<float>(), x.dtype(), rows, cols);
    return {dx, dw};
  }
  const char* name() const override { return "rms_norm"; }
};

Tensor rms_norm(const Tensor& x, const Tensor& weight, float eps) {
  check_norm_args("rms_norm", x, weight, "weight", eps);
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;
  Tensor y = Tensor::empty_like(x);
  Tensor rstd = Tensor::empty({rows}, DType::F32, x.device());
  nk(x).rms_norm(y.data(), rstd.data_as<float>(), x.data(), data_or_null(weight), x.dtype(), rows,
                 cols, eps);
  if (any_requires_grad({&x, &weight})) {
    auto n = std::make_shared<RmsNormNode>();
    n->x = x;
    n->w = weight;
    n->rstd = rstd;
    n->rows = rows;
    n->cols = cols;
    record_node(y, n, {&x, &weight});
  }
  return y;
}

}  // namespace keel::ops
