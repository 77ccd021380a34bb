// layer_norm / rms_norm: f64 references (forward and backward), constant and zero rows, optional
// affine parameters, gradient checks, PyTorch parity, determinism and ISA agreement.
#include <gtest/gtest.h>

#include <cmath>

#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "keel/ops/norm.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::eps_of;
using test::expect_close;
using test::expect_gradcheck;
using test::randn;

using test::kDtypes;

// ---- f64 reference (llm.c's layernorm_forward / layernorm_backward, in double) ----------------

struct NormRef {
  std::vector<float> y, dx, dw, db;
};

// center = true: LayerNorm; false: RMSNorm (no mean, no bias). w and b may be undefined.
NormRef norm_ref(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy, float eps,
                 bool center) {
  const auto xv = x.to_floats(), gv = dy.to_floats();
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  const std::vector<float> wv = w.defined() ? w.to_floats() : std::vector<float>(cols, 1.f);
  const std::vector<float> bv = b.defined() ? b.to_floats() : std::vector<float>(cols, 0.f);
  NormRef r;
  r.y.resize(xv.size());
  r.dx.resize(xv.size());
  std::vector<double> dw(cols, 0.0), db(cols, 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = xv.data() + i * cols;
    const float* gr = gv.data() + i * cols;
    double mean = 0, var = 0;
    if (center) {
      for (int64_t c = 0; c < cols; ++c) mean += xr[c];
      mean /= cols;
    }
    for (int64_t c = 0; c < cols; ++c) var += (xr[c] - mean) * (xr[c] - mean);
    var /= cols;
    const double rstd = 1 / std::sqrt(var + double(eps));
    double mean_g = 0, mean_gx = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double xhat = (xr[c] - mean) * rstd, g = double(gr[c]) * wv[c];
      r.y[i * cols + c] = static_cast<float>(xhat * wv[c] + bv[c]);
      mean_g += g;
      mean_gx += g * xhat;
      dw[c] += double(gr[c]) * xhat;
      db[c] += gr[c];
    }
    mean_g /= cols;
    mean_gx /= cols;
    if (!center) mean_g = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double xhat = (xr[c] - mean) * rstd, g = double(gr[c]) * wv[c];
      r.dx[i * cols + c] = static_cast<float>(rstd * (g - mean_g - xhat * mean_gx));
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    r.dw.push_back(static_cast<float>(dw[c]));
    r.db.push_back(static_cast<float>(db[c]));
  }
  return r;
}

// f32 statistics and arithmetic, rounded once into dt. The f32 part is ~1e-6 relative to the
// terms (x - mean, g - mean(g) cancel), hence the absolute floor.
double norm_rtol(DType dt) { return std::max(eps_of(dt), 1e-5); }
constexpr double kNormAtol = 2e-5;

void check_against_ref(DType dt, bool center, bool affine, const Shape& shape, float mean_shift) {
  const std::string what = std::string(center ? "layer_norm " : "rms_norm ") + dtype_name(dt) +
                           (affine ? "" : " no affine") + " " + shape_str(shape);
  const int64_t cols = shape.back();
  Tensor x0 = randn(shape, 1, 1.0f, DType::F32);
  {  // Shift every row away from zero (the case two-pass statistics exist for).
    auto v = x0.to_floats();
    for (auto& e : v) e += mean_shift;
    x0 = Tensor::from_floats(v, shape, dt);
  }
  Tensor x = x0.clone().set_requires_grad(true);
  Tensor w, b;
  if (affine) {
    w = randn({cols}, 2, 0.5f, dt);
    auto wv = w.to_floats();
    for (auto& e : wv) e += 1.f;
    w = Tensor::from_floats(wv, {cols}, dt).set_requires_grad(true);
    if (center) b = randn({cols}, 3, 1.0f, dt).set_requires_grad(true);
  }
  const float eps = center ? 1e-5f : 1e-6f;
  Tensor y = center ? ops::layer_norm(x, w, b, eps) : ops::rms_norm(x, w, eps);
  EXPECT_EQ(y.dtype(), dt);
  EXPECT_EQ(y.shape(), x.shape());
  Tensor gout = randn(shape, 4, 1.0f, dt);
  const NormRef ref = norm_ref(x0, w, b, gout, eps, center);
  expect_close(y.to_floats(), ref.y, kNormAtol, norm_rtol(dt), what);
  backward(y, gout);
  EXPECT_EQ(x.grad().dtype(), dt);
  expect_close(x.grad().to_floats(), ref.dx, kNormAtol, norm_rtol(dt), what + " dx");
  if (affine) {
    // Row sums in f32 over up to 35 rows: ~1e-6 relative to the sum of magnitudes.
    expect_close(w.grad().to_floats(), ref.dw, 1e-4, norm_rtol(dt), what + " dw");
    EXPECT_EQ(w.grad().dtype(), dt);
    if (center) expect_close(b.grad().to_floats(), ref.db, 1e-4, norm_rtol(dt), what + " db");
  }
}

TEST(Norm, ForwardAndBackwardMatchF64ReferenceInEveryDtype) {
  for (DType dt : kDtypes)
    for (bool center : {true, false}) {
      check_against_ref(dt, center, true, {3, 5, 64}, 0.f);
      // Rows of several 512-element blocks, several 128-column gradient tiles, mean 8.
      check_against_ref(dt, center, true, {7, 1100}, center ? 8.f : 0.f);
      check_against_ref(dt, center, false, {4, 96}, 0.f);
    }
}

TEST(Norm, Gradcheck) {
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return ops::layer_norm(in[0], in[1], in[2]); },
      {randn({2, 3, 8}, 1), randn({8}, 2), randn({8}, 3)}, {}, "layer_norm");
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::rms_norm(in[0], in[1]); },
                   {randn({2, 3, 8}, 4), randn({8}, 5)}, {}, "rms_norm");
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return ops::layer_norm(in[0], Tensor(), Tensor()); },
      {randn({3, 6}, 6)}, {}, "layer_norm without affine");
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return ops::layer_norm(in[0], in[1], Tensor()); },
      {randn({3, 6}, 7), randn({6}, 8)}, {}, "layer_norm without bias");
}

TEST(Norm, ConstantAndZeroRowsStayFinite) {
  for (DType dt : kDtypes) {
    const std::string dn = dtype_name(dt);
    // Row 0: constant 3 (mean exact, var 0). Row 1: constant 0.1 (mean inexact, var ~0).
    std::vector<float> v(2 * 64, 3.f);
    for (int c = 64; c < 128; ++c) v[c] = 0.1f;
    Tensor x = Tensor::from_floats(v, {2, 64}, dt).set_requires_grad(true);
    Tensor w = randn({64}, 1, 1.0f, dt).set_requires_grad(true);
    Tensor b = randn({64}, 2, 1.0f, dt).set_requires_grad(true);
    Tensor y = ops::layer_norm(x, w, b);
    const auto yv = y.to_floats(), bv = b.to_floats();
    for (float e : yv) EXPECT_TRUE(std::isfinite(e)) << dn;
    for (int c = 0; c < 64; ++c) EXPECT_EQ(yv[c], bv[c]) << "x - mean is exactly 0, " << dn;
    backward(y, randn({2, 64}, 3, 1.0f, dt));
    for (const Tensor* g : {&x.grad(), &w.grad(), &b.grad()})
      for (float e : g->to_floats()) EXPECT_TRUE(std::isfinite(e)) << dn;

    Tensor z = Tensor::zeros({2, 32}, dt).set_requires_grad(true);
    Tensor wz = randn({32}, 4, 1.0f, dt).set_requires_grad(true);
    Tensor yz = ops::rms_norm(z, wz);
    for (float e : yz.to_floats()) EXPECT_EQ(e, 0.f) << dn;
    backward(yz, randn({2, 32}, 5, 1.0f, dt));
    for (const Tensor* g : {&z.grad(), &wz.grad()})
      for (float e : g->to_floats()) EXPECT_TRUE(std::isfinite(e)) << dn;
  }
}

TEST(Norm, NanPropagates) {
  Tensor x = Tensor::from_floats({1.f, std::nanf(""), 2.f, 3.f, 4.f, 5.f}, {2, 3});
  const auto y = ops::layer_norm(x, Tensor(), Tensor()).to_floats();
  for (int c = 0; c < 3; ++c) EXPECT_TRUE(std::isnan(y[c]));
  for (int c = 3; c < 6; ++c) EXPECT_TRUE(std::isfinite(y[c]));
  const auto r = ops::rms_norm(x, Tensor()).to_floats();
  for (int c = 0; c < 3; ++c) EXPECT_TRUE(std::isnan(r[c]));
}

TEST(Norm, RejectsBadInput) {
  Tensor x = randn({2, 8}, 1);
  EXPECT_THROW(ops::layer_norm(x, randn({7}, 2), randn({8}, 3)), Error);
  EXPECT_THROW(ops::layer_norm(x, randn({8}, 2), randn({2, 4}, 3)), Error);
  EXPECT_THROW(ops::rms_norm(x, randn({8}, 2, 1.f, DType::BF16)), Error);
  EXPECT_THROW(ops::rms_norm(Tensor::from_ints({1, 2}, {2}), Tensor()), Error);
  EXPECT_THROW(ops::layer_norm(x, Tensor(), Tensor(), -1.f), Error);
}

TEST(Parity, NormsMatchPyTorch) {
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    for (const char* c : {"layer_norm.", "layer_norm_long."})
      test::expect_parity("norm", c + d,
                          [](auto& in) { return ops::layer_norm(in[0], in[1], in[2], 1e-5f); });
    for (const char* c : {"rms_norm.", "rms_norm_long."})
      test::expect_parity("norm", c + d,
                          [](auto& in) { return ops::rms_norm(in[0], in[1], 1e-6f); });
  }
}

// ---- determinism and ISA agreement -------------------------------------------------------------

std::vector<Tensor> run_all_norms(DType dt) {
  std::vector<Tensor> out;
  for (bool center : {true, false}) {
    Tensor x = randn({37, 700}, 7, 2.0f, dt).set_requires_grad(true);
    Tensor w = randn({700}, 8, 1.0f, dt).set_requires_grad(true);
    Tensor b = randn({700}, 9, 1.0f, dt).set_requires_grad(true);
    Tensor y = center ? ops::layer_norm(x, w, b) : ops::rms_norm(x, w);
    backward(y, randn(y.shape(), 10, 1.0f, dt));
    out.push_back(y);
    out.push_back(x.grad());
    out.push_back(w.grad());
    if (center) out.push_back(b.grad());
  }
  return out;
}

TEST(Determinism, NormsBitIdenticalAcrossRunsThreadCountsAndIsas) {
  for (DType dt : kDtypes)
    test::expect_deterministic_across_threads_and_isas([&] { return run_all_norms(dt); },
                                                       dtype_name(dt));
}

}  // namespace
}  // namespace keel
