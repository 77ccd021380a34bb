#include "keel/ops/softmax.h"

#include "keel/backend/softmax.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {
const SoftmaxKernels& sk(const Tensor& t) { return softmax_kernels(t.device()); }

void check_input(const char* op, const Tensor& x) {
  check_floating(op, x);
  KEEL_CHECK(x.dim() >= 1, std::string(op) + ": needs at least 1 dimension, got a scalar " +
                               "(reduce over the last dimension of a [..., C] tensor)");
}
}  // namespace

// Both backward formulas read only the forward output y: dx = y (dy - <dy, y>) for softmax,
// dx = dy - exp(y) sum(dy) for log_softmax.
struct SoftmaxNode final : Node {
  Tensor y;
  bool log = false;
  std::vector<Tensor> backward(const Tensor& grad) override {
    KEEL_CHECK(grad.numel() == y.numel(), std::string(name()) + " backward: gradient " +
                                              shape_str(grad.shape()) + " for an output of " +
                                              shape_str(y.shape()));
    const Tensor g = grad.dtype() == y.dtype() ? grad : grad.to_dtype(y.dtype());
    Tensor dx = Tensor::empty_like(y);
    const int64_t cols = y.size(-1), rows = cols ? y.numel() / cols : 0;
    if (log)
      sk(y).log_softmax_backward(dx.data(), g.data(), y.data(), y.dtype(), rows, cols);
    else
      sk(y).softmax_backward(dx.data(), g.data(), y.data(), y.dtype(), rows, cols);
    return {dx};
  }
  const char* name() const override { return log ? "log_softmax" : "softmax"; }
};

static Tensor softmax_impl(const Tensor& x, bool log) {
  check_input(log ? "log_softmax" : "softmax", x);
  Tensor y = Tensor::empty_like(x);
  const int64_t cols = x.size(-1), rows = cols ? x.numel() / cols : 0;  // x [rows, cols]
  if (log)
    sk(x).log_softmax(y.data(), x.data(), x.dtype(), rows, cols);
  else
    sk(x).softmax(y.data(), x.data(), x.dtype(), rows, cols);
  if (any_requires_grad({&x})) {
    auto n = std::make_shared<SoftmaxNode>();
    n->y = y.view(y.shape());  // a new handle on the same storage: no y -> node -> y cycle
    n->log = log;
    record_node(y, n, {&x});
  }
  return y;
}

Tensor softmax(const Tensor& x) { return softmax_impl(x, false); }
Tensor log_softmax(const Tensor& x) { return softmax_impl(x, true); }

}  // namespace keel::ops
