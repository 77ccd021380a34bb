// softmax / log_softmax over the last dimension: f64 references, masked and all -inf rows, huge
// logits, NaN propagation, gradient checks, PyTorch parity, determinism and ISA agreement.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "keel/ops/softmax.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::eps_of;
using test::expect_close;
using test::expect_gradcheck;
using test::randn;

using test::kDtypes;
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- f64 references --------------------------------------------------------------------------

// Row-wise over the last dimension of the stored values; an all -inf row gives 0 / -inf.
std::vector<float> softmax_ref(const Tensor& x, bool log) {
  const auto v = x.to_floats();
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  std::vector<float> y(v.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = v.data() + r * cols;
    double m = -INFINITY;
    for (int64_t c = 0; c < cols; ++c) m = std::max(m, double(xr[c]));
    if (m == -INFINITY) {
      for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = log ? -kInf : 0.f;
      continue;
    }
    double s = 0;
    for (int64_t c = 0; c < cols; ++c) s += std::exp(xr[c] - m);
    for (int64_t c = 0; c < cols; ++c)
      y[r * cols + c] =
          static_cast<float>(log ? (xr[c] - m) - std::log(s) : std::exp(xr[c] - m) / s);
  }
  return y;
}

// The backward formulas in f64 on the stored forward output y (what the kernel reads):
// softmax dx = y (dy - sum dy y); log_softmax dx = dy - exp(y) sum dy.
std::vector<float> softmax_backward_ref(const Tensor& y, const Tensor& dy, bool log) {
  const auto yv = y.to_floats(), gv = dy.to_floats();
  const int64_t cols = y.size(-1), rows = y.numel() / cols;
  std::vector<float> dx(yv.size());
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t c = 0; c < cols; ++c)
      s += log ? double(gv[r * cols + c]) : double(gv[r * cols + c]) * yv[r * cols + c];
    for (int64_t c = 0; c < cols; ++c) {
      const double yy = yv[r * cols + c], g = gv[r * cols + c];
      dx[r * cols + c] = static_cast<float>(log ? g - std::exp(yy) * s : yy * (g - s));
    }
  }
  return dx;
}

// f32 work rounded once into dt. The f32 part: exp within 2 ulp, x - max rounded (relative error
// |x - max| * 2^-24, up to ~2e-6 for the spreads used here), sums over rows in f32.
double softmax_rtol(DType dt) { return std::max(eps_of(dt), 4e-6); }

TEST(Softmax, ForwardAndBackwardMatchF64ReferenceInEveryDtype) {
  for (DType dt : kDtypes) {
    for (bool log : {false, true}) {
      const std::string what = std::string(log ? "log_softmax " : "softmax ") + dtype_name(dt);
      // [3, 4, 1100]: rows longer than a 512-element block, with a tail.
      Tensor x = randn({3, 4, 1100}, 1, 4.0f, dt).set_requires_grad(true);
      Tensor y = log ? ops::log_softmax(x) : ops::softmax(x);
      EXPECT_EQ(y.dtype(), dt);
      EXPECT_EQ(y.shape(), x.shape());
      expect_close(y.to_floats(), softmax_ref(x, log), 1e-7, softmax_rtol(dt), what);
      Tensor gout = randn(y.shape(), 2, 1.0f, dt);
      backward(y, gout);
      EXPECT_EQ(x.grad().dtype(), dt);
      // |sum dy| reaches ~40 here: the f32 cancellation in dy - exp(y) * sum dy is ~1e-5.
      expect_close(x.grad().to_floats(), softmax_backward_ref(y, gout, log), 2e-5, softmax_rtol(dt),
                   what + " grad");
    }
  }
}

TEST(Softmax, Gradcheck) {
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::softmax(in[0]); },
                   {randn({3, 6}, 1, 2.0f)}, {}, "softmax");
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::log_softmax(in[0]); },
                   {randn({2, 3, 5}, 2, 2.0f)}, {}, "log_softmax");
  // One column: softmax is constant 1, the gradient exactly 0.
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::softmax(in[0]); },
                   {randn({4, 1}, 3)}, {}, "softmax of one column");
}

TEST(Softmax, MaskedAndFullyMaskedRows) {
  // Row 0: some -inf entries (a causal/padding mask). Row 1: all -inf (a fully masked row).
  const std::vector<float> v = {0.5f, -kInf, 2.f, -kInf, -1.f, -kInf, -kInf, -kInf, -kInf, -kInf};
  for (DType dt : kDtypes) {
    const std::string dn = dtype_name(dt);
    Tensor x = Tensor::from_floats(v, {2, 5}, dt).set_requires_grad(true);
    Tensor p = ops::softmax(x);
    const auto pv = p.to_floats();
    expect_close(pv, softmax_ref(x, false), 1e-7, softmax_rtol(dt), "masked softmax " + dn);
    for (int c : {1, 3}) EXPECT_EQ(pv[c], 0.f) << dn;
    for (int c = 5; c < 10; ++c) EXPECT_EQ(pv[c], 0.f) << "fully masked row gives zeros, " << dn;
    Tensor g = Tensor::from_floats({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {2, 5}, dt);
    backward(p, g);
    const auto dx = x.grad().to_floats();
    for (float d : dx) EXPECT_TRUE(std::isfinite(d)) << dn;
    for (int c : {1, 3, 5, 6, 7, 8, 9}) EXPECT_EQ(dx[c], 0.f) << "masked entries get no gradient";

    Tensor xl = Tensor::from_floats(v, {2, 5}, dt).set_requires_grad(true);
    Tensor lp = ops::log_softmax(xl);
    const auto lv = lp.to_floats();
    expect_close(lv, softmax_ref(xl, true), 1e-7, softmax_rtol(dt), "masked log_softmax " + dn);
    for (int c = 5; c < 10; ++c) EXPECT_EQ(lv[c], -kInf) << "fully masked row gives -inf, " << dn;
    backward(lp, g);
    const auto dl = xl.grad().to_floats();
    for (float d : dl) EXPECT_TRUE(std::isfinite(d)) << dn;
    // dx = dy - exp(y) sum dy with exp(-inf) = 0: masked entries pass dy through.
    EXPECT_EQ(dl[1], 2.f);
    for (int c = 5; c < 10; ++c) EXPECT_EQ(dl[c], float(c + 1)) << dn;
  }
}

TEST(Softmax, HugeLogitsStayFinite) {
  const std::vector<float> v = {1e4f, 1e4f - 1.f, -1e4f, 0.f, 3e4f, -3e4f, 3e4f, 2.5e4f};
  for (DType dt : kDtypes) {
    Tensor x = Tensor::from_floats(v, {2, 4}, dt);
    const auto lv = ops::log_softmax(x).to_floats(), pv = ops::softmax(x).to_floats();
    for (float y : lv) EXPECT_TRUE(std::isfinite(y)) << dtype_name(dt);
    for (float y : pv) EXPECT_TRUE(std::isfinite(y)) << dtype_name(dt);
    expect_close(lv, softmax_ref(x, true), 1e-6, softmax_rtol(dt),
                 std::string("log_softmax huge ") + dtype_name(dt));
    expect_close(pv, softmax_ref(x, false), 1e-7, softmax_rtol(dt),
                 std::string("softmax huge ") + dtype_name(dt));
  }
}

TEST(Softmax, NonFiniteInputsPropagate) {
  const float nan = std::nanf("");
  // Row 0: a NaN among finite values. Row 1: a NaN among -inf (must not read as fully masked).
  // Row 2: +inf (inf - inf is NaN, as in PyTorch).
  Tensor x = Tensor::from_floats({1.f, nan, 2.f, -kInf, nan, -kInf, 1.f, kInf, 0.f}, {3, 3});
  for (bool log : {false, true}) {
    const auto y = (log ? ops::log_softmax(x) : ops::softmax(x)).to_floats();
    for (float v : y) EXPECT_TRUE(std::isnan(v)) << (log ? "log_softmax" : "softmax");
  }
}

TEST(Softmax, RejectsBadInput) {
  EXPECT_THROW(ops::softmax(Tensor::from_ints({1, 2}, {2})), Error);
  EXPECT_THROW(ops::log_softmax(Tensor::from_floats({1.f}, {})), Error);
}

TEST(Parity, SoftmaxMatchesPyTorch) {
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    test::expect_parity("softmax", "softmax." + d, [](auto& in) { return ops::softmax(in[0]); });
    test::expect_parity("softmax", "log_softmax." + d,
                        [](auto& in) { return ops::log_softmax(in[0]); });
    test::expect_parity("softmax", "softmax_long." + d,
                        [](auto& in) { return ops::softmax(in[0]); });
    test::expect_parity("softmax", "log_softmax_long." + d,
                        [](auto& in) { return ops::log_softmax(in[0]); });
  }
  test::expect_parity("softmax", "softmax_masked.f32",
                      [](auto& in) { return ops::softmax(in[0]); });
  test::expect_parity("softmax", "log_softmax_masked.f32",
                      [](auto& in) { return ops::log_softmax(in[0]); });
}

// ---- determinism and ISA agreement -------------------------------------------------------------

std::vector<Tensor> run_all_softmaxes(DType dt) {
  std::vector<Tensor> out;
  for (bool log : {false, true}) {
    Tensor x = randn({33, 700}, 5, 3.0f, dt).set_requires_grad(true);
    Tensor y = log ? ops::log_softmax(x) : ops::softmax(x);
    backward(y, randn(y.shape(), 6, 1.0f, dt));
    out.push_back(y);
    out.push_back(x.grad());
  }
  return out;
}

TEST(Determinism, SoftmaxBitIdenticalAcrossRunsThreadCountsAndIsas) {
  for (DType dt : kDtypes)
    test::expect_deterministic_across_threads_and_isas([&] { return run_all_softmaxes(dt); },
                                                       dtype_name(dt));
}

}  // namespace
}  // namespace keel
