#include "keel/ops/elementwise.h"

#include "keel/backend/elementwise.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {
const ElementwiseKernels& ew(const Tensor& t) { return elementwise_kernels(t.device()); }

// g summed down to `shape` (a suffix of g's shape).
Tensor reduce_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  Tensor out = Tensor::empty(shape, g.dtype(), g.device());
  const int64_t cols = out.numel();
  ew(g).sum_rows(out.data(), g.data(), g.dtype(), g.numel() / cols, cols);
  return out;
}
}  // namespace

struct AddNode final : Node {
  Shape a_shape, b_shape;
  std::vector<Tensor> backward(const Tensor& g) override {
    return {g, needs_grad(1) ? reduce_to(g, b_shape) : Tensor()};
  }
  const char* name() const override { return "add"; }
};

Tensor add(const Tensor& a, const Tensor& b) {
  check_operands("add", a, b);
  check_floating("add", a);
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  if (a.shape() == b.shape()) {
    ew(a).add(out.data(), a.data(), b.data(), a.dtype(), a.numel());
  } else {
    KEEL_CHECK(is_suffix_shape(a.shape(), b.shape()) && b.numel() > 0,
               "add: cannot broadcast " + shape_str(b.shape()) + " to " + shape_str(a.shape()));
    ew(a).add_row(out.data(), a.data(), b.data(), a.dtype(), a.numel() / b.numel(), b.numel());
  }
  if (any_requires_grad({&a, &b})) {
    auto n = std::make_shared<AddNode>();
    n->a_shape = a.shape();
    n->b_shape = b.shape();
    record_node(out, n, {&a, &b});
  }
  return out;
}

struct MulNode final : Node {
  Tensor a, b;
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor ga, gb;
    if (needs_grad(0)) {
      ga = Tensor::empty_like(a);
      if (a.shape() == b.shape())
        ew(g).mul(ga.data(), g.data(), b.data(), g.dtype(), g.numel());
      else
        ew(g).mul_row(ga.data(), g.data(), b.data(), g.dtype(), g.numel() / b.numel(), b.numel());
    }
    if (needs_grad(1)) {
      if (a.shape() == b.shape()) {
        gb = Tensor::empty_like(b);
        ew(g).mul(gb.data(), g.data(), a.data(), g.dtype(), g.numel());
      } else {
        gb = Tensor::empty_like(b);
        ew(g).sum_rows_mul(gb.data(), g.data(), a.data(), g.dtype(), g.numel() / b.numel(),
                           b.numel());
      }
    }
    return {ga, gb};
  }
  const char* name() const override { return "mul"; }
};

Tensor mul(const Tensor& a, const Tensor& b) {
  check_operands("mul", a, b);
  check_floating("mul", a);
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  if (a.shape() == b.shape()) {
    ew(a).mul(out.data(), a.data(), b.data(), a.dtype(), a.numel());
  } else {
    KEEL_CHECK(is_suffix_shape(a.shape(), b.shape()) && b.numel() > 0,
               "mul: cannot broadcast " + shape_str(b.shape()) + " to " + shape_str(a.shape()));
    ew(a).mul_row(out.data(), a.data(), b.data(), a.dtype(), a.numel() / b.numel(), b.numel());
  }
  if (any_requires_grad({&a, &b})) {
    auto n = std::make_shared<MulNode>();
    n->a = a;
    n->b = b;
    record_node(out, n, {&a, &b});
  }
  return out;
}

struct ScaleNode final : Node {
  float s;
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor ga = Tensor::empty_like(g);
    ew(g).axpby(ga.data(), s, g.data(), 0.f, nullptr, g.dtype(), g.numel());
    return {ga};
  }
  const char* name() const override { return "scale"; }
};

Tensor scale(const Tensor& a, float s) {
  check_floating("scale", a);
  Tensor out = Tensor::empty_like(a);
  ew(a).axpby(out.data(), s, a.data(), 0.f, nullptr, a.dtype(), a.numel());
  if (any_requires_grad({&a})) {
    auto n = std::make_shared<ScaleNode>();
    n->s = s;
    record_node(out, n, {&a});
  }
  return out;
}

// The graph of add(a, scale(b, s)) in one node: a's gradient is g, b's is scale's of g.
struct AddScaledNode final : Node {
  float s;
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor gb;
    if (needs_grad(1)) {
      gb = Tensor::empty_like(g);
      ew(g).axpby(gb.data(), s, g.data(), 0.f, nullptr, g.dtype(), g.numel());
    }
    return {g, gb};
  }
  const char* name() const override { return "add_scaled"; }
};

Tensor add_scaled(const Tensor& a, const Tensor& b, float s) {
  check_operands("add_scaled", a, b);
  check_floating("add_scaled", a);
  KEEL_CHECK(a.shape() == b.shape(),
             "add_scaled: shapes differ: " + shape_str(a.shape()) + " and " + shape_str(b.shape()));
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  ew(a).add_scaled(out.data(), a.data(), s, b.data(), a.dtype(), a.numel());
  if (any_requires_grad({&a, &b})) {
    auto n = std::make_shared<AddScaledNode>();
    n->s = s;
    record_node(out, n, {&a, &b});
  }
  return out;
}

std::vector<Tensor> CastNode::backward(const Tensor& g) {
  if (g.dtype() == from) return {g};
  Tensor ga = Tensor::empty(g.shape(), from, g.device());
  ew(g).convert(ga.data(), from, g.data(), g.dtype(), g.numel());
  return {ga};
}

namespace {
// `out` (a's values rounded to out's dtype) as the cast of `a` in the graph.
Tensor as_cast_of(Tensor out, const Tensor& a) {
  if (any_requires_grad({&a})) {
    auto n = std::make_shared<CastNode>();
    n->from = a.dtype();
    record_node(out, n, {&a});
  }
  return out;
}
}  // namespace

Tensor cast(const Tensor& a, DType dt) {
  check_floating("cast", a);
  KEEL_CHECK(dtype_is_floating(dt),
             std::string("cast: target must be floating, got ") + dtype_name(dt));
  if (a.dtype() == dt) return a;
  Tensor out = Tensor::empty(a.shape(), dt, a.device());
  ew(a).convert(out.data(), dt, a.data(), a.dtype(), a.numel());
  return as_cast_of(std::move(out), a);
}

Tensor cast_precomputed(const Tensor& a, const Tensor& rounded) {
  KEEL_CHECK(rounded.numel() == a.numel() && rounded.device() == a.device() &&
                 dtype_is_floating(rounded.dtype()) && rounded.dtype() != a.dtype(),
             "cast_precomputed: " + shape_str(rounded.shape()) + " " + dtype_name(rounded.dtype()) +
                 " cannot stand for a cast of " + shape_str(a.shape()) + " " +
                 dtype_name(a.dtype()));
  return as_cast_of(rounded.view(a.shape()), a);  // a fresh handle: this step's graph node
}

double sum_squares(const Tensor& a) {
  check_floating("sum_squares", a);
  return ew(a).sum_squares(a.data(), a.dtype(), a.numel());
}

}  // namespace keel::ops
