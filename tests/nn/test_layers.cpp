// nn layers beyond the ops they call: Gemma's RMSNorm (unit_offset), which scales by 1 + weight
// and, as HF's GemmaRMSNorm, computes in f32 whatever the dtypes and casts back once.
#include <gtest/gtest.h>

#include <cmath>

#include "keel/autograd/node.h"
#include "keel/nn/layers.h"
#include "tests/support/check.h"

namespace keel::layers_test {

// rms(x) * (1 + w) per row of x [rows, n], in f64.
std::vector<double> gemma_norm_ref(const std::vector<float>& x, const std::vector<float>& w,
                                   int64_t n, double eps) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size() / n; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < n; ++j) ss += double(x[r * n + j]) * x[r * n + j];
    const double inv = 1 / std::sqrt(ss / n + eps);
    for (int64_t j = 0; j < n; ++j) y[r * n + j] = x[r * n + j] * inv * (1.0 + w[j]);
  }
  return y;
}

TEST(RmsNorm, UnitOffsetScalesByOnePlusWeightInF32) {
  nn::RMSNorm plain(8, 1e-6), gemma(8, 1e-6, DType::F32, /*unit_offset=*/true);
  EXPECT_EQ(plain.weight.to_floats()[0], 1.f);  // each starts as the identity scale
  EXPECT_EQ(gemma.weight.to_floats()[0], 0.f);
  const Tensor x = test::randn({3, 8}, 1);
  test::expect_bitwise_equal(plain.forward(x), gemma.forward(x), "1 + 0 is 1");
  Tensor w = gemma.weight;
  w.copy_from(test::randn({8}, 2, 0.5f));
  const std::vector<double> ref = gemma_norm_ref(x.to_floats(), w.to_floats(), 8, 1e-6);
  const std::vector<float> y = gemma.forward(x).to_floats();
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(y[i], ref[i], 1e-6 * (1 + std::fabs(ref[i])));
  // bf16 weights and input (bf16-true): 1 + w and the norm in f32, one rounding into bf16 at the
  // end (in bf16, 1 + w would round first: w = 0.00390625 would vanish).
  nn::RMSNorm low(8, 1e-6, DType::BF16, true);
  Tensor lw = low.weight;
  lw.copy_from(Tensor::full({8}, 0.00390625f));
  const Tensor xb = test::randn({3, 8}, 3, 1.f, DType::BF16);
  const Tensor yb = low.forward(xb);
  EXPECT_EQ(yb.dtype(), DType::BF16);
  const std::vector<double> want =
      gemma_norm_ref(xb.to_floats(), std::vector<float>(8, 0.00390625f), 8, 1e-6);
  const std::vector<float> got = yb.to_floats();
  for (size_t i = 0; i < want.size(); ++i) {
    const float rounded = Tensor::full({}, static_cast<float>(want[i]), DType::BF16).item();
    EXPECT_NEAR(got[i], rounded, 1e-6 * (1 + std::fabs(rounded))) << i;
  }
  // Its gradient reaches the weight as the offset's.
  Tensor wg = test::randn({8}, 4, 0.3f).set_requires_grad(true);
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& in) {
        nn::RMSNorm n(8, 1e-6, DType::F32, true);
        n.weight = in[1];
        return n.forward(in[0]);
      },
      {test::randn({2, 8}, 5), wg}, {}, "gemma rms norm");
}

}  // namespace keel::layers_test
