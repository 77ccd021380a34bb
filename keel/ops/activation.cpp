#include "keel/ops/activation.h"

#include <cmath>

#include "keel/backend/activation.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {
const ActivationKernels& act(const Tensor& t) { return activation_kernels(t.device()); }

// The upstream gradient in the dtype the kernels read (that of the forward input).
Tensor grad_as(const Tensor& g, const Tensor& like) {
  KEEL_CHECK(g.numel() == like.numel(), "activation backward: gradient " + shape_str(g.shape()) +
                                            " for an output of " + shape_str(like.shape()));
  return g.dtype() == like.dtype() ? g : g.to_dtype(like.dtype());
}
}  // namespace

struct GeluNode final : Node {
  Tensor x;
  bool tanh_approx = false;
  std::vector<Tensor> backward(const Tensor& grad) override {
    const Tensor g = grad_as(grad, x);
    Tensor dx = Tensor::empty_like(x);
    act(x).gelu_backward(dx.data(), g.data(), x.data(), x.dtype(), x.numel(), tanh_approx);
    return {dx};
  }
  const char* name() const override { return "gelu"; }
};

Tensor gelu(const Tensor& x, GeluApprox approx) {
  check_floating("gelu", x);
  const bool tanh_approx = approx == GeluApprox::Tanh;
  Tensor out = Tensor::empty_like(x);
  act(x).gelu(out.data(), x.data(), x.dtype(), x.numel(), tanh_approx);
  if (any_requires_grad({&x})) {
    auto n = std::make_shared<GeluNode>();
    n->x = x;
    n->tanh_approx = tanh_approx;
    record_node(out, n, {&x});
  }
  return out;
}

struct SoftcapNode final : Node {
  Tensor x;
  float cap = 1;
  std::vector<Tensor> backward(const Tensor& grad) override {
    const Tensor g = grad_as(grad, x);
    Tensor dx = Tensor::empty_like(x);
    act(x).softcap_backward(dx.data(), g.data(), x.data(), x.dtype(), x.numel(), cap);
    return {dx};
  }
  const char* name() const override { return "softcap"; }
};

Tensor softcap(const Tensor& x, float cap) {
  check_floating("softcap", x);
  KEEL_CHECK(cap > 0 && std::isfinite(cap),
             "softcap: cap = " + std::to_string(cap) + " must be positive and finite");
  Tensor out = Tensor::empty_like(x);
  act(x).softcap(out.data(), x.data(), x.dtype(), x.numel(), cap);
  if (any_requires_grad({&x})) {
    auto n = std::make_shared<SoftcapNode>();
    n->x = x;
    n->cap = cap;
    record_node(out, n, {&x});
  }
  return out;
}

struct ClampNode final : Node {
  Tensor x;
  float bound = 1;
  std::vector<Tensor> backward(const Tensor& grad) override {
    const Tensor g = grad_as(grad, x);
    Tensor dx = Tensor::empty_like(x);
    act(x).clamp_backward(dx.data(), g.data(), x.data(), x.dtype(), x.numel(), -bound, bound);
    return {dx};
  }
  const char* name() const override { return "clamp"; }
};

Tensor clamp(const Tensor& x, float bound) {
  check_floating("clamp", x);
  KEEL_CHECK(bound > 0 && std::isfinite(bound),
             "clamp: bound = " + std::to_string(bound) + " must be positive and finite");
  Tensor out = Tensor::empty_like(x);
  act(x).clamp(out.data(), x.data(), x.dtype(), x.numel(), -bound, bound);
  if (any_requires_grad({&x})) {
    auto n = std::make_shared<ClampNode>();
    n->x = x;
    n->bound = bound;
    record_node(out, n, {&x});
  }
  return out;
}

struct SiluNode final : Node {
  Tensor x;
  std::vector<Tensor> backward(const Tensor& grad) override {
    const Tensor g = grad_as(grad, x);
    Tensor dx = Tensor::empty_like(x);
    act(x).silu_backward(dx.data(), g.data(), x.data(), x.dtype(), x.numel());
    return {dx};
  }
  const char* name() const override { return "silu"; }
};

Tensor silu(const Tensor& x) {
  check_floating("silu", x);
  Tensor out = Tensor::empty_like(x);
  act(x).silu(out.data(), x.data(), x.dtype(), x.numel());
  if (any_requires_grad({&x})) {
    auto n = std::make_shared<SiluNode>();
    n->x = x;
    record_node(out, n, {&x});
  }
  return out;
}

struct SwigluNode final : Node {
  Tensor gate, up;
  std::vector<Tensor> backward(const Tensor& grad) override {
    const Tensor g = grad_as(grad, gate);
    Tensor dgate, dup;
    if (needs_grad(0)) dgate = Tensor::empty_like(gate);
    if (needs_grad(1)) dup = Tensor::empty_like(up);
    if (dgate.defined() || dup.defined())
      act(gate).swiglu_backward(dgate.defined() ? dgate.data() : nullptr,
                                dup.defined() ? dup.data() : nullptr, g.data(), gate.data(),
                                up.data(), gate.dtype(), gate.numel());
    return {dgate, dup};
  }
  const char* name() const override { return "swiglu"; }
};

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  check_operands("swiglu", gate, up);
  check_floating("swiglu", gate);
  KEEL_CHECK(gate.shape() == up.shape(),
             "swiglu: gate " + shape_str(gate.shape()) + " and up " + shape_str(up.shape()) +
                 " must have the same shape (the two halves of the MLP's input projection)");
  Tensor out = Tensor::empty_like(gate);
  act(gate).swiglu(out.data(), gate.data(), up.data(), gate.dtype(), gate.numel());
  if (any_requires_grad({&gate, &up})) {
    auto n = std::make_shared<SwigluNode>();
    n->gate = gate;
    n->up = up;
    record_node(out, n, {&gate, &up});
  }
  return out;
}

}  // namespace keel::ops
