// gelu (exact, tanh), silu, swiglu, clamp and the vec_math.inc functions they use: f64 references,
// gradient checks, PyTorch parity, special values, determinism, and every ISA against the others.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "keel/autograd/node.h"
#include "keel/backend/activation.h"
#include "keel/backend/cpu/isa.h"
#include "keel/ops/activation.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::eps_of;
using test::expect_close;
using test::expect_gradcheck;
using test::randn;

using test::kDtypes;

// ---- f64 references: the formulas, evaluated on the stored input values ------------------------

double gelu_ref(double x, bool tanh_approx) {
  if (tanh_approx)
    return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
  return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
}
double gelu_grad_ref(double x, bool tanh_approx) {
  if (tanh_approx) {
    const double k = std::sqrt(2 / M_PI), t = std::tanh(k * (x + 0.044715 * x * x * x));
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
  }
  return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) +
         x * std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
}
double sigmoid_ref(double x) { return 1 / (1 + std::exp(-x)); }
double silu_ref(double x) { return x * sigmoid_ref(x); }
double silu_grad_ref(double x) {
  const double s = sigmoid_ref(x);
  return s * (1 + x * (1 - s));
}

std::vector<float> map_ref(const Tensor& t, const std::function<double(double)>& f) {
  std::vector<float> out;
  for (float v : t.to_floats()) out.push_back(static_cast<float>(f(v)));
  return out;
}

// Tolerance of an f32 computation rounded once into dt: |err| <= atol + |ref| * eps(dt). The atol
// covers f32 cancellation where the result is much smaller than its terms (gelu's 1 + erf(x) for
// x << 0, computed as PyTorch does).
constexpr double kActAtol = 2e-6;

TEST(Activation, ForwardAndBackwardMatchF64ReferenceInEveryDtype) {
  for (DType dt : kDtypes) {
    const std::string dn = dtype_name(dt);
    // [6, 333]: several blocks and a vector tail; scale 3 reaches the saturated tails.
    Tensor x = randn({6, 333}, 1, 3.0f, dt), up = randn({6, 333}, 2, 1.0f, dt);
    Tensor gout = randn({6, 333}, 3, 1.0f, dt);
    const auto xv = x.to_floats(), uv = up.to_floats(), gv = gout.to_floats();
    for (bool tanh_approx : {false, true}) {
      const std::string what = "gelu" + std::string(tanh_approx ? "_tanh " : " ") + dn;
      Tensor xi = x.clone().set_requires_grad(true);
      Tensor y = ops::gelu(xi, tanh_approx ? ops::GeluApprox::Tanh : ops::GeluApprox::None);
      EXPECT_EQ(y.dtype(), dt);
      expect_close(y.to_floats(), map_ref(x, [=](double v) { return gelu_ref(v, tanh_approx); }),
                   kActAtol, eps_of(dt), what);
      backward(y, gout);
      EXPECT_EQ(xi.grad().dtype(), dt);
      std::vector<float> ref(xv.size());
      for (size_t i = 0; i < xv.size(); ++i)
        ref[i] = static_cast<float>(double(gv[i]) * gelu_grad_ref(xv[i], tanh_approx));
      expect_close(xi.grad().to_floats(), ref, kActAtol, eps_of(dt), what + " grad");
    }
    {
      Tensor xi = x.clone().set_requires_grad(true);
      Tensor y = ops::silu(xi);
      expect_close(y.to_floats(), map_ref(x, silu_ref), kActAtol, eps_of(dt), "silu " + dn);
      backward(y, gout);
      std::vector<float> ref(xv.size());
      for (size_t i = 0; i < xv.size(); ++i)
        ref[i] = static_cast<float>(double(gv[i]) * silu_grad_ref(xv[i]));
      expect_close(xi.grad().to_floats(), ref, kActAtol, eps_of(dt), "silu grad " + dn);
    }
    {
      Tensor g = x.clone().set_requires_grad(true), u = up.clone().set_requires_grad(true);
      Tensor y = ops::swiglu(g, u);
      std::vector<float> ref(xv.size()), dg(xv.size()), du(xv.size());
      for (size_t i = 0; i < xv.size(); ++i) {
        ref[i] = static_cast<float>(silu_ref(xv[i]) * uv[i]);
        dg[i] = static_cast<float>(double(gv[i]) * uv[i] * silu_grad_ref(xv[i]));
        du[i] = static_cast<float>(double(gv[i]) * silu_ref(xv[i]));
      }
      expect_close(y.to_floats(), ref, kActAtol, eps_of(dt), "swiglu " + dn);
      backward(y, gout);
      expect_close(g.grad().to_floats(), dg, kActAtol, eps_of(dt), "swiglu dgate " + dn);
      expect_close(u.grad().to_floats(), du, kActAtol, eps_of(dt), "swiglu dup " + dn);
    }
  }
}

TEST(Activation, Gradcheck) {
  // Step 1e-3 on values of order 1: the second-order error is ~1e-6, well inside the defaults.
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return ops::gelu(in[0], ops::GeluApprox::None); },
      {randn({3, 7}, 1, 2.0f)}, {}, "gelu");
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return ops::gelu(in[0], ops::GeluApprox::Tanh); },
      {randn({3, 7}, 2, 2.0f)}, {}, "gelu tanh");
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::silu(in[0]); },
                   {randn({3, 7}, 3, 2.0f)}, {}, "silu");
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::swiglu(in[0], in[1]); },
                   {randn({2, 3, 5}, 4, 2.0f), randn({2, 3, 5}, 5)}, {}, "swiglu");
  // Only one input requiring grad: the other gradient is skipped, this one still right.
  test::GradcheckOptions only_up;
  only_up.check = {1};
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::swiglu(in[0], in[1]); },
                   {randn({4, 6}, 6), randn({4, 6}, 7)}, only_up, "swiglu d/dup only");
}

// GELU's tanh form for x << 0 is x times a tiny factor. Written as 0.5 x (1 + tanh u) (PyTorch's
// formula) it cancels: tanh u rounds to -1 in f32 below x ~ -4.5 and the result is 0. keel
// evaluates the equal x sigmoid(2u), whose error is what rounding u to f32 costs any f32 evaluation
// (e^2u's condition number is |2u|): a few ulp plus |2u| ulp, down to where the value underflows.
TEST(Activation, GeluTanhKeepsItsNegativeTail) {
  const std::vector<float> xs = {-3.f, -4.5f, -5.f, -6.f, -7.f, -8.f, -9.f, -10.f};
  Tensor x = Tensor::from_floats(xs, {static_cast<int64_t>(xs.size())}).set_requires_grad(true);
  Tensor y = ops::gelu(x, ops::GeluApprox::Tanh);
  backward(y, Tensor::full({static_cast<int64_t>(xs.size())}, 1.f));
  const auto yv = y.to_floats(), gv = x.grad().to_floats();
  for (size_t i = 0; i < xs.size(); ++i) {
    // The same function in f64 without the cancellation (f64's 1 + tanh u cancels below x ~ -7).
    const double v = xs[i], u = std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v);
    const double e = std::exp(-2 * u), sg = 1 / (1 + e);
    const double ref = v * sg;
    const double gref =
        sg + v * sg * (e * sg) * 2 * std::sqrt(2 / M_PI) * (1 + 3 * 0.044715 * v * v);
    ASSERT_NE(ref, 0.0);
    const double ulps = 8 + 4 * std::fabs(u);
    EXPECT_LE(std::fabs(yv[i] - ref), ulps * std::fabs(ref) * 0x1p-24)
        << "gelu_tanh(" << xs[i] << ")";
    EXPECT_LE(std::fabs(gv[i] - gref), 2 * ulps * std::fabs(gref) * 0x1p-24) << "grad at " << xs[i];
  }
}

TEST(Activation, SpecialValuesPropagateAsInPyTorch) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  Tensor x = Tensor::from_floats({nan, inf, -inf, 0.f, -30.f, 30.f}, {6});
  auto is_nan = [](float v) { return std::isnan(v); };
  for (bool t : {false, true}) {
    auto y = ops::gelu(x, t ? ops::GeluApprox::Tanh : ops::GeluApprox::None).to_floats();
    EXPECT_TRUE(is_nan(y[0]));
    EXPECT_EQ(y[1], inf);
    EXPECT_TRUE(is_nan(y[2]));  // -inf * 0, as torch.nn.functional.gelu
    EXPECT_EQ(y[3], 0.f);
    EXPECT_EQ(y[4], 0.f);
    EXPECT_EQ(y[5], 30.f);
  }
  auto s = ops::silu(x).to_floats();
  EXPECT_TRUE(is_nan(s[0]));
  EXPECT_EQ(s[1], inf);
  EXPECT_TRUE(is_nan(s[2]));  // -inf / (1 + inf), as torch's silu
  EXPECT_EQ(s[3], 0.f);
  EXPECT_LE(std::fabs(s[4]), 1e-11f);
  EXPECT_EQ(s[5], 30.f);
}

// OLMo's clip_qkv: torch.clamp(x, -b, b) in every dtype, its gradient passing where -b <= x <= b
// (the bounds included, as torch's), a NaN kept with no gradient, an infinity clamped.
TEST(Activation, ClampBoundsValuesAndPassesTheGradientInsideThem) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const std::vector<float> xs = {-3.f, -1.f, -0.5f, 0.f, 0.75f, 1.f, 2.5f, nan, inf, -inf};
    Tensor x = Tensor::from_floats(xs, {10}).to_dtype(dt).set_requires_grad(true);
    Tensor y = ops::clamp(x, 1.f);
    ASSERT_EQ(y.dtype(), dt);
    backward(y, Tensor::full({10}, 2.f, dt));
    const std::vector<float> yv = y.to_floats(), gv = x.grad().to_floats();
    const std::vector<float> want = {-1.f, -1.f, -0.5f, 0.f, 0.75f, 1.f, 1.f, nan, 1.f, -1.f};
    const std::vector<float> want_grad = {0.f, 2.f, 2.f, 2.f, 2.f, 2.f, 0.f, 0.f, 0.f, 0.f};
    for (size_t i = 0; i < xs.size(); ++i) {
      if (std::isnan(want[i]))
        EXPECT_TRUE(std::isnan(yv[i])) << dtype_name(dt);
      else
        EXPECT_EQ(yv[i], want[i]) << dtype_name(dt) << " clamp(" << xs[i] << ")";
      EXPECT_EQ(gv[i], want_grad[i]) << dtype_name(dt) << " grad at " << xs[i];
    }
  }
  // Away from the bounds (a step of 1e-3 never crosses one here): the finite differences agree.
  Tensor x = Tensor::from_floats({-2.f, -0.4f, 0.1f, 0.6f, 1.7f, -0.9f}, {2, 3});
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::clamp(in[0], 1.f); }, {x}, {},
                   "clamp");
  EXPECT_THROW(ops::clamp(randn({2}, 1), 0.f), Error);
  EXPECT_THROW(ops::clamp(randn({2}, 1), inf), Error);
}

TEST(Activation, RejectsBadInput) {
  EXPECT_THROW(ops::gelu(Tensor::from_ints({1, 2}, {2})), Error);
  EXPECT_THROW(ops::swiglu(randn({2, 3}, 1), randn({3, 2}, 2)), Error);
  EXPECT_THROW(ops::swiglu(randn({2, 3}, 1), randn({2, 3}, 2, 1.f, DType::BF16)), Error);
}

// ---- vec_math.inc accuracy, through the exp/tanh/erf kernels of every ISA ----------------------

// |got - ref| in units of the f32 spacing at ref (subnormal results: the subnormal step).
double ulp_error(float got, double ref) {
  const float rf = static_cast<float>(ref);
  if (std::isnan(ref) || std::isnan(got)) return std::isnan(ref) && std::isnan(got) ? 0 : 1e30;
  if (std::isinf(rf) || std::isinf(got)) return got == rf ? 0 : 1e30;
  int e;
  std::frexp(ref, &e);
  return std::fabs(got - ref) / std::ldexp(1.0, std::max(e - 24, -149));
}

TEST(VecMath, WithinTwoUlpOverTheWholeFloatRange) {
  // Every 4099th bit pattern (1M floats, all exponents, both signs) plus the edges.
  std::vector<float> xs;
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
    float f;
    const uint32_t b = static_cast<uint32_t>(u);
    std::memcpy(&f, &b, 4);
    xs.push_back(f);
  }
  for (float f : {88.7228f, 88.72284f, 88.7229f, -87.33655f, -103.2789f, -103.9721f, -104.f, -150.f,
                  1e-30f, -1e-30f, 0.625f, -0.625f, 1.f, -1.f, 3.92f, 0.f, -0.f})
    xs.push_back(f);
  const int64_t n = static_cast<int64_t>(xs.size());
  Tensor x = Tensor::from_floats(xs, {n});
  test::for_each_cpu_isa([&](CpuIsa isa) {
    const auto& k = activation_kernels(Device::cpu());
    Tensor ye = Tensor::empty({n}), yt = Tensor::empty({n}), yf = Tensor::empty({n});
    k.exp(ye.data(), x.data(), DType::F32, n);
    k.tanh(yt.data(), x.data(), DType::F32, n);
    k.erf(yf.data(), x.data(), DType::F32, n);
    const float* e = ye.data_as<float>();
    const float* t = yt.data_as<float>();
    const float* f = yf.data_as<float>();
    double we = 0, wt = 0, wf = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double v = xs[i];
      we = std::max(we, ulp_error(e[i], std::exp(v)));
      wt = std::max(wt, ulp_error(t[i], std::tanh(v)));
      wf = std::max(wf, ulp_error(f[i], std::erf(v)));
      if (v == 0) {  // signed zeros kept
        EXPECT_EQ(std::signbit(t[i]), std::signbit(v));
        EXPECT_EQ(std::signbit(f[i]), std::signbit(v));
      }
    }
    EXPECT_LE(we, 2.0) << "exp, " << cpu_isa_name(isa);
    EXPECT_LE(wt, 2.0) << "tanh, " << cpu_isa_name(isa);
    EXPECT_LE(wf, 2.0) << "erf, " << cpu_isa_name(isa);
  });
}

TEST(VecMath, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  Tensor x = Tensor::from_floats({-inf, inf, nan, 100.f, 89.f, 88.8f, -200.f, -1e30f, 1e30f}, {9});
  test::for_each_cpu_isa([&](CpuIsa isa) {
    const auto& k = activation_kernels(Device::cpu());
    Tensor e = Tensor::empty({9}), t = Tensor::empty({9}), f = Tensor::empty({9});
    k.exp(e.data(), x.data(), DType::F32, 9);
    k.tanh(t.data(), x.data(), DType::F32, 9);
    k.erf(f.data(), x.data(), DType::F32, 9);
    const auto ev = e.to_floats(), tv = t.to_floats(), fv = f.to_floats();
    const std::string what = cpu_isa_name(isa);
    EXPECT_EQ(ev[0], 0.f) << what;
    EXPECT_EQ(ev[1], inf) << what;
    EXPECT_TRUE(std::isnan(ev[2])) << what;
    for (int i : {3, 4, 5, 8}) EXPECT_EQ(ev[i], inf) << what << " exp(" << x.to_floats()[i] << ")";
    for (int i : {6, 7}) EXPECT_EQ(ev[i], 0.f) << what;
    EXPECT_EQ(tv[0], -1.f);
    EXPECT_EQ(tv[1], 1.f);
    EXPECT_TRUE(std::isnan(tv[2]));
    EXPECT_EQ(tv[7], -1.f);
    EXPECT_EQ(tv[8], 1.f);
    EXPECT_EQ(fv[0], -1.f);
    EXPECT_EQ(fv[1], 1.f);
    EXPECT_TRUE(std::isnan(fv[2]));
    EXPECT_EQ(fv[7], -1.f);
  });
}

// ---- PyTorch parity
// ------------------------------------------------------------------------------

TEST(Parity, ActivationsMatchPyTorch) {
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    test::expect_parity("activation", "gelu." + d,
                        [](auto& in) { return ops::gelu(in[0], ops::GeluApprox::None); });
    test::expect_parity("activation", "gelu_tanh." + d,
                        [](auto& in) { return ops::gelu(in[0], ops::GeluApprox::Tanh); });
    test::expect_parity("activation", "silu." + d, [](auto& in) { return ops::silu(in[0]); });
    test::expect_parity("activation", "swiglu." + d,
                        [](auto& in) { return ops::swiglu(in[0], in[1]); });
    test::expect_parity("activation", "gelu_long." + d,
                        [](auto& in) { return ops::gelu(in[0], ops::GeluApprox::None); });
  }
}

// ---- determinism and ISA agreement -------------------------------------------------------------

// Forward outputs and input gradients of every activation on fixed inputs.
std::vector<Tensor> run_all_activations(DType dt) {
  Tensor x = randn({7, 1000}, 11, 3.0f, dt).set_requires_grad(true);
  Tensor up = randn({7, 1000}, 12, 1.0f, dt).set_requires_grad(true);
  Tensor g = randn({7, 1000}, 13, 1.0f, dt);
  std::vector<Tensor> out;
  for (int op = 0; op < 4; ++op) {
    x.set_grad(Tensor());
    up.set_grad(Tensor());
    Tensor y = op == 0   ? ops::gelu(x, ops::GeluApprox::None)
               : op == 1 ? ops::gelu(x, ops::GeluApprox::Tanh)
               : op == 2 ? ops::silu(x)
                         : ops::swiglu(x, up);
    backward(y, g);
    out.push_back(y);
    out.push_back(x.grad());
    if (op == 3) out.push_back(up.grad());
  }
  return out;
}

TEST(Determinism, ActivationsBitIdenticalAcrossRunsThreadCountsAndIsas) {
  for (DType dt : kDtypes)
    test::expect_deterministic_across_threads_and_isas([&] { return run_all_activations(dt); },
                                                       dtype_name(dt));
}

}  // namespace
}  // namespace keel
