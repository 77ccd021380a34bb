#include "keel/ops/linear.h"

#include "keel/backend/elementwise.h"
#include "keel/backend/matmul.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {

// C = op(A)·op(B) (+ bias, where the kernels fuse it) over `batch` matrices; out_dt F32 or A's
// dtype.
void mm(void* c, DType out_dt, const Tensor& a, const Tensor& b, int64_t batch, int64_t m,
        int64_t n, int64_t k, bool ta, bool tb, bool acc = false, const Tensor& bias = Tensor()) {
  MatmulArgs args;
  args.c = c;
  args.a = a.data();
  args.b = b.data();
  args.in_dt = a.dtype();
  args.out_dt = out_dt;
  args.batch = batch;
  args.m = m;
  args.n = n;
  args.k = k;
  args.trans_a = ta;
  args.trans_b = tb;
  args.accumulate = acc;
  if (bias.defined()) {
    args.bias = bias.data();
    args.bias_dt = bias.dtype();
  }
  matmul_kernels(a.device()).matmul(args);
}

// y[M, N] = x[M, K]·w[N, K]ᵀ (+ bias), rounded once into y's dtype.
void linear_forward(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias, int64_t m,
                    int64_t n, int64_t k) {
  const auto& ew = elementwise_kernels(x.device());
  if (!bias.defined()) return mm(y.data(), y.dtype(), x, w, 1, m, n, k, false, true);
  // The bias in the product's epilogue (oneDNN's post-op, cuBLASLt's EPILOGUE_BIAS): one pass
  // over y instead of three.
  if (matmul_kernels(x.device()).fuses_bias(bias.data(), bias.dtype(), y.dtype()))
    return mm(y.data(), y.dtype(), x, w, 1, m, n, k, false, true, false, bias);
  if (y.dtype() == DType::F32) {
    mm(y.data(), DType::F32, x, w, 1, m, n, k, false, true);
    ew.add_row(y.data(), y.data(), bias.data(), DType::F32, m, n);
    return;
  }
  Tensor acc = Tensor::empty({m, n}, DType::F32, x.device());
  Tensor bias32 = bias.to_dtype(DType::F32);
  mm(acc.data(), DType::F32, x, w, 1, m, n, k, false, true);
  ew.add_row(acc.data(), acc.data(), bias32.data(), DType::F32, m, n);
  ew.convert(y.data(), y.dtype(), acc.data(), DType::F32, m * n);
}

}  // namespace

struct LinearNode final : Node {
  Tensor x, w;
  bool has_bias = false;
  int64_t m, n, k;
  DType gx_dtype, gw_dtype;  // f32 when x or w is a cast of an f32 tensor (grad_dtype_for)
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor gx, gw, gb;
    if (needs_grad(0)) {  // dx[M, K] = g[M, N]·w[N, K]
      gx = Tensor::empty(x.shape(), gx_dtype, x.device());
      mm(gx.data(), gx.dtype(), g, w, 1, m, k, n, false, false);
    }
    if (needs_grad(1)) {                                     // dw[N, K] = g[M, N]ᵀ·x[M, K]
      gw = grad_buffer(1, w.shape(), gw_dtype, w.device());  // a flat home: written in place
      mm(gw.data(), gw.dtype(), g, x, 1, n, k, m, true, false);
    }
    if (has_bias && needs_grad(2)) {  // db[N] = sum over rows of g
      gb = grad_buffer(2, {n}, g.dtype(), g.device());
      elementwise_kernels(g.device()).sum_rows(gb.data(), g.data(), g.dtype(), m, n);
    }
    return {gx, gw, gb};
  }
  const char* name() const override { return "linear"; }
};

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  check_operands("linear", x, w);
  check_floating("linear", x);
  KEEL_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1),
             "linear: input " + shape_str(x.shape()) + " does not match weight " +
                 shape_str(w.shape()) + " (weight is [out_features, in_features])");
  const int64_t k = w.size(1), n = w.size(0);
  int64_t m = 1;  // rows: every dim but the last (x.numel() / k fails for k = 0)
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);
  if (b.defined()) {
    check_operands("linear", x, b);
    KEEL_CHECK(b.numel() == n,
               "linear: bias " + shape_str(b.shape()) + " for " + std::to_string(n) + " outputs");
  }
  Shape out_shape = x.shape();
  out_shape.back() = n;
  Tensor y = Tensor::empty(out_shape, x.dtype(), x.device());
  linear_forward(y, x, w, b, m, n, k);
  if (any_requires_grad({&x, &w, &b})) {
    auto node = std::make_shared<LinearNode>();
    node->x = x;
    node->w = w;
    node->has_bias = b.defined();
    node->gx_dtype = grad_dtype_for(x);
    node->gw_dtype = grad_dtype_for(w);
    node->m = m;
    node->n = n;
    node->k = k;
    record_node(y, node, {&x, &w, &b});
  }
  return y;
}

struct MatmulNode final : Node {
  Tensor a, b;
  bool ta, tb, b_shared;
  int64_t batch, m, n, k;
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor ga, gb;
    // C = A·B with A = op(a), B = op(b):  dA = dC·Bᵀ, dB = Aᵀ·dC; then undo the op on each.
    if (needs_grad(0)) {
      ga = grad_buffer(0, a.shape(), a.dtype(), a.device());
      if (!ta)  // da[M, K] = g[M, N]·op(b)ᵀ
        mm(ga.data(), ga.dtype(), g, b, b_shared ? 1 : batch, b_shared ? batch * m : m, k, n, false,
           !tb);
      else  // da[K, M] = op(b)·gᵀ, per batch
        mm(ga.data(), ga.dtype(), b, g, batch, k, m, n, tb, true);
    }
    if (needs_grad(1)) {
      gb = grad_buffer(1, b.shape(), b.dtype(), b.device());
      const int64_t bb = b_shared ? 1 : batch, mm_rows = b_shared ? batch * m : m;
      if (!tb)  // db[K, N] = op(a)ᵀ·g
        mm(gb.data(), gb.dtype(), a, g, bb, k, n, mm_rows, !ta, false);
      else  // db[N, K] = gᵀ·op(a)
        mm(gb.data(), gb.dtype(), g, a, bb, n, k, mm_rows, true, ta);
    }
    return {ga, gb};
  }
  const char* name() const override { return "matmul"; }
};

Tensor matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  check_operands("matmul", a, b);
  check_floating("matmul", a);
  KEEL_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul: need at least 2-D operands, got " +
                                               shape_str(a.shape()) + " and " +
                                               shape_str(b.shape()));
  const int64_t m = ta ? a.size(-1) : a.size(-2), k = ta ? a.size(-2) : a.size(-1);
  const int64_t kb = tb ? b.size(-1) : b.size(-2), n = tb ? b.size(-2) : b.size(-1);
  const int64_t batch = a.numel() / std::max<int64_t>(m * k, 1);
  const bool b_shared = b.dim() == 2;
  KEEL_CHECK(k == kb, "matmul: inner dimensions differ: " + shape_str(a.shape()) + " and " +
                          shape_str(b.shape()));
  KEEL_CHECK(b_shared || (b.dim() == a.dim() &&
                          std::equal(a.shape().begin(), a.shape().end() - 2, b.shape().begin())),
             "matmul: batch dims differ: " + shape_str(a.shape()) + " and " + shape_str(b.shape()));
  KEEL_CHECK(!(b_shared && ta && batch > 1), "matmul: trans_a with a shared 2-D b is unsupported");
  Shape out_shape(a.shape().begin(), a.shape().end() - 2);
  out_shape.push_back(m);
  out_shape.push_back(n);
  Tensor c = Tensor::empty(out_shape, a.dtype(), a.device());
  if (b_shared && !ta)
    mm(c.data(), c.dtype(), a, b, 1, batch * m, n, k, false, tb);
  else
    mm(c.data(), c.dtype(), a, b, batch, m, n, k, ta, tb);
  if (any_requires_grad({&a, &b})) {
    auto node = std::make_shared<MatmulNode>();
    node->a = a;
    node->b = b;
    node->ta = ta;
    node->tb = tb;
    node->b_shared = b_shared;
    node->batch = batch;
    node->m = m;
    node->n = n;
    node->k = k;
    record_node(c, node, {&a, &b});
  }
  return c;
}

}  // namespace keel::ops
