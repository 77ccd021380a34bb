// Gemma-2's soft caps: ops::softcap (its final_logit_softcapping) and the attention's
// (attn_logit_softcapping, with its query_pre_attn_scalar scale), in every backend against an f64
// reference, forward and gradients; a cap far above the scores changes nothing beyond rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "keel/autograd/node.h"
#include "keel/ops/activation.h"
#include "keel/ops/attention.h"
#include "tests/support/attention_ref.h"
#include "tests/support/check.h"

namespace keel::softcap_test {

using ops::AttentionBackend;
using test::randn;

constexpr AttentionBackend kBackends[] = {AttentionBackend::kEager, AttentionBackend::kMath,
                                          AttentionBackend::kFlash};

TEST(Softcap, CapTimesTanhOfXOverCapInEveryDtype) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    Tensor x = randn({3, 70}, 5, 4.f, dt).set_requires_grad(true);
    Tensor y = ops::softcap(x, 2.5f);
    ASSERT_EQ(y.dtype(), dt);
    const std::vector<float> xv = x.to_floats(), yv = y.to_floats();
    const double tol = dt == DType::F32 ? 1e-6 : test::eps_of(dt);
    double worst = 0;
    for (size_t i = 0; i < xv.size(); ++i) {
      const double want = 2.5 * std::tanh(xv[i] / 2.5);
      worst = std::max(worst, std::fabs(yv[i] - want) / (1e-6 + std::fabs(want)));
      EXPECT_LE(std::fabs(yv[i]), 2.5f);
    }
    EXPECT_LT(worst, 2 * tol) << dtype_name(dt);
    const Tensor g = randn({3, 70}, 6, 1.f, dt);
    backward(y, g);
    const std::vector<float> gv = g.to_floats(), dx = x.grad().to_floats();
    for (size_t i = 0; i < xv.size(); ++i) {
      const double th = std::tanh(xv[i] / 2.5), want = gv[i] * (1 - th * th);
      EXPECT_NEAR(dx[i], want, 2 * tol * (1e-3 + std::fabs(want))) << dtype_name(dt) << " " << i;
    }
  }
  test::expect_gradcheck([](const std::vector<Tensor>& in) { return ops::softcap(in[0], 1.5f); },
                         {randn({4, 9}, 7, 3.f)}, {}, "softcap");
  EXPECT_THROW(ops::softcap(randn({2}, 1), 0.f), Error);
}

TEST(SoftcapAttention, ScoresAreCappedBeforeTheSoftmaxInEveryBackend) {
  const int64_t t = 70, dd = 8;  // across flash's 32-row and 64-key tiles
  // Scores of several units: a cap of 2 bends most of them.
  const Tensor q = randn({2, 4, t, dd}, 81, 1.5f), k = randn({2, 2, t, dd}, 82, 1.5f),
               v = randn({2, 2, t, dd}, 83);
  const ops::AttentionScores scores{0.4f, 2.f};
  const std::vector<double> ref = test::attention_ref(q, k, v, {}, 0.4, 2.0);
  const std::vector<double> uncapped = test::attention_ref(q, k, v, {}, 0.4);
  double moved = 0;
  for (size_t x = 0; x < ref.size(); ++x) moved = std::max(moved, std::fabs(ref[x] - uncapped[x]));
  ASSERT_GT(moved, 0.1) << "the cap must bend these scores";
  for (AttentionBackend be : kBackends) {
    const std::vector<float> got = ops::attention(q, k, v, {}, be, scores).to_floats();
    double worst = 0;
    for (size_t x = 0; x < got.size(); ++x) worst = std::max(worst, std::fabs(got[x] - ref[x]));
    EXPECT_LT(worst, 2e-5) << ops::attention_backend_name(be);
    // bf16: within the backend's roundings of the scores (eager), probabilities and output.
    const std::vector<float> lp = ops::attention(q.to_dtype(DType::BF16), k.to_dtype(DType::BF16),
                                                 v.to_dtype(DType::BF16), {}, be, scores)
                                      .to_floats();
    worst = 0;
    for (size_t x = 0; x < lp.size(); ++x) worst = std::max(worst, std::fabs(lp[x] - ref[x]));
    EXPECT_LT(worst, 0.08) << ops::attention_backend_name(be) << " bf16";
  }
  // A cap far above every score is no cap, to rounding; the scale alone is a plain scale.
  for (AttentionBackend be : kBackends) {
    const Tensor far = ops::attention(q, k, v, {}, be, {0.4f, 1e6f});
    const Tensor none = ops::attention(q, k, v, {}, be, {0.4f, 0.f});
    test::expect_close(far, none, 1e-5, 1e-5, ops::attention_backend_name(be));
  }
  // Within a packed row's examples and a sliding window (Gemma-2's sliding layers): the cap
  // applies to the scores each query sees.
  std::vector<int64_t> pos;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < t; ++i) pos.push_back(b == 0 && i >= 40 ? i - 40 : i);
  ops::AttentionMask packed(Tensor(), Tensor::from_ints(pos, {2, t}));
  packed.window = 25;
  const std::vector<double> bounded = test::attention_ref(
      q, k, v,
      [&](int64_t b, int64_t i) {
        return std::max(i - pos[static_cast<size_t>(b * t + i)], i - 24);
      },
      0.4, 2.0);
  for (AttentionBackend be : kBackends) {
    const std::vector<float> got = ops::attention(q, k, v, packed, be, scores).to_floats();
    double worst = 0;
    for (size_t x = 0; x < got.size(); ++x) worst = std::max(worst, std::fabs(got[x] - bounded[x]));
    EXPECT_LT(worst, 2e-5) << ops::attention_backend_name(be) << " packed, window 25";
  }
  const Tensor by_default = ops::attention(q, k, v, {}, AttentionBackend::kMath);
  const Tensor by_scale = ops::attention(q, k, v, {}, AttentionBackend::kMath,
                                         {static_cast<float>(1 / std::sqrt(8.0)), 0.f});
  test::expect_bitwise_equal(by_default, by_scale, "the default scale is 1/sqrt(D)");
}

TEST(SoftcapAttention, GradientsMatchFiniteDifferences) {
  // A padded row's first key hidden, or a window: the capped softmax's backward keeps to the keys
  // each query sees.
  for (AttentionBackend be : kBackends)
    for (const auto& [bound, mask] : test::attention_bounds_of_9())
      test::expect_gradcheck(
          [&](const std::vector<Tensor>& in) {
            return ops::attention(in[0], in[1], in[2], mask, be, {0.6f, 1.5f});
          },
          {randn({1, 2, 9, 4}, 91, 1.5f), randn({1, 1, 9, 4}, 92, 1.5f), randn({1, 1, 9, 4}, 93)},
          {}, std::string("softcap ") + ops::attention_backend_name(be) + bound);
}

}  // namespace keel::softcap_test
