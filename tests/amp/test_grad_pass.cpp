// amp::grad_pass, the one pass over a step's gradients: its sums are the ones every reader used to
// compute on its own (global norm, per-layer norms), its unscale is GradScaler's, and it never
// hides a non-finite value.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "keel/amp/grad_pass.h"
#include "keel/amp/grad_scaler.h"
#include "keel/backend/elementwise.h"
#include "tests/support/check.h"

namespace keel {
namespace {

std::vector<Tensor> some_grads() {
  std::vector<Tensor> g;
  for (int64_t n : {5000, 17, 8192, 3}) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[i] = std::sin(0.37f * static_cast<float>(i + n)) * 3.f;
    g.push_back(Tensor::from_floats(v, {n}));
  }
  g.push_back(Tensor());  // a parameter without a gradient
  g.push_back(g[1].to_dtype(DType::BF16));
  return g;
}

TEST(GradPass, SumsArePerGradientInOrderAndAddUpToTheTotalBitForBit) {
  const std::vector<Tensor> g = some_grads();
  const amp::GradPass p = amp::grad_pass(g);
  ASSERT_EQ(p.sum_squares_of.size(), g.size());
  double total = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double own = g[i].defined() ? elementwise_kernels(g[i].device())
                                            .sum_squares(g[i].data(), g[i].dtype(), g[i].numel())
                                      : 0.0;
    EXPECT_EQ(p.sum_squares_of[i], own) << i;
    EXPECT_EQ(amp::grad_sum_squares(p, g, i), own) << i;
    total += own;
  }
  EXPECT_EQ(p.sum_squares, total);
  EXPECT_EQ(p.norm(), std::sqrt(total));
  EXPECT_TRUE(p.finite());
}

TEST(GradPass, UnscalesInPlaceAndCountsNonFiniteValues) {
  std::vector<Tensor> g = some_grads();
  const std::vector<float> before = g[0].to_floats();
  g[0].data_as<float>()[7] = std::numeric_limits<float>::infinity();
  g[2].data_as<float>()[1] = std::nanf("");
  const amp::GradPass p = amp::grad_pass(g, 0.25f);
  EXPECT_EQ(p.nonfinite, 2);
  EXPECT_FALSE(p.finite());
  EXPECT_EQ(g[0].to_floats()[3], before[3] * 0.25f);
  // Without a scale nothing is written; the non-finite value still shows.
  const amp::GradPass q = amp::grad_pass(g);
  EXPECT_FALSE(q.finite());
  EXPECT_TRUE(std::isnan(q.sum_squares));
}

TEST(GradPass, AnOverflowingSumOfFiniteValuesIsNotFinite) {
  std::vector<Tensor> g = {Tensor::full({4}, 3e19f)};  // each square ~9e38 > f32 max
  const amp::GradPass p = amp::grad_pass(g);
  EXPECT_EQ(p.nonfinite, 0);
  EXPECT_FALSE(p.finite());
}

TEST(GradPass, TheScalersPassIsTheSamePassWithItsInverse) {
  std::vector<Tensor> a = some_grads(), b = some_grads();
  GradScalerOptions o;
  o.init_scale = 1024;
  GradScaler s(o);
  const amp::GradPass via_scaler = s.unscale_pass(a);
  const amp::GradPass direct = amp::grad_pass(b, 1.f / 1024.f);
  EXPECT_EQ(via_scaler.sum_squares, direct.sum_squares);
  EXPECT_EQ(via_scaler.sum_squares_of, direct.sum_squares_of);
  EXPECT_EQ(a[0].to_floats(), b[0].to_floats());
  EXPECT_CONTAINS(test::error_of([&] { s.unscale_pass(a); }), "already been called");
}

TEST(GradPass, AScalerAtScaleOneStillFindsANonFiniteGradient) {
  // inv_scale == 1 writes nothing and counts nothing on the CPU; the sum must carry the NaN.
  GradScalerOptions o;
  o.init_scale = 1;
  GradScaler s(o);
  std::vector<Tensor> g = some_grads();
  g[3].data_as<float>()[0] = std::nanf("");
  EXPECT_TRUE(s.unscale(g));
}

}  // namespace
}  // namespace keel
