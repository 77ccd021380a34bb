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
  const amp::GradPass direct = amp::grad_pass(b, 1.f / 1024.f, DType::F16);
  EXPECT_EQ(via_scaler.sum_squares, direct.sum_squares);
  EXPECT_EQ(via_scaler.sum_squares_of, direct.sum_squares_of);
  EXPECT_EQ(via_scaler.zero_of, direct.zero_of);
  EXPECT_EQ(via_scaler.below_normal_of, direct.below_normal_of);
  EXPECT_EQ(a[0].to_floats(), b[0].to_floats());
  EXPECT_CONTAINS(test::error_of([&] { s.unscale_pass(a); }), "already been called");
}

// The zero and subnormal counts of each gradient, judged in the compute format as it carried the
// values: under a scale of 1024, a value is "below f16's smallest normal" when it was below 2^-14
// while scaled, i.e. below 2^-24 once unscaled. The sums are those of the pass without the format.
TEST(GradPass, CountsZerosAndSubnormalsOfTheComputeFormatBeforeUnscaling) {
  const float tiny = std::ldexp(1.f, -16);  // f16-subnormal at scale 1, normal at scale 1024
  auto grads = [&] {
    std::vector<Tensor> g = {Tensor::from_floats({0.f, tiny, -tiny, 1.f, 0.f, 3e-9f}, {6}),
                             Tensor(), Tensor::from_floats({0.5f, 0.f}, {2}, DType::BF16)};
    return g;
  };
  std::vector<Tensor> a = grads(), b = grads(), c = grads();
  const amp::GradPass f16 = amp::grad_pass(a, 1.f, DType::F16);
  EXPECT_EQ(f16.zero_of, (std::vector<int64_t>{2, 0, 1}));
  EXPECT_EQ(f16.below_normal_of, (std::vector<int64_t>{3, 0, 0}));  // tiny, -tiny, 3e-9
  // As f16 carried them at scale 1024: tiny * 1024 is normal, 3e-9 * 1024 is not.
  auto times1024 = [](const Tensor& t) {
    std::vector<float> v = t.to_floats();
    for (float& x : v) x *= 1024.f;
    return Tensor::from_floats(v, t.shape(), t.dtype());
  };
  std::vector<Tensor> scaled = {times1024(grads()[0]), Tensor(), times1024(grads()[2])};
  const amp::GradPass s = amp::grad_pass(scaled, 1.f / 1024, DType::F16);
  EXPECT_EQ(s.zero_of, (std::vector<int64_t>{2, 0, 1}));
  EXPECT_EQ(s.below_normal_of, (std::vector<int64_t>{1, 0, 0}));
  // bf16 and f32 reach 1e-38: only the zeros count.
  const amp::GradPass bf = amp::grad_pass(b, 1.f, DType::BF16);
  EXPECT_EQ(bf.zero_of, (std::vector<int64_t>{2, 0, 1}));
  EXPECT_EQ(bf.below_normal_of, (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(bf.sum_squares_of, amp::grad_pass(c).sum_squares_of);
  EXPECT_EQ(bf.sum_squares, f16.sum_squares);
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
