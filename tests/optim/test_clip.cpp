// Global gradient norm and clipping: parity with torch.nn.utils.clip_grad_norm_, an f64
// reference, non-finite propagation, every dtype, determinism across thread counts.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>

#include "keel/optim/clip.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using optim::clip_grads;
using optim::global_grad_norm;
using test::expect_bitwise_equal;
using test::expect_close;
using test::randn;

// Reference: sqrt of the f64 sum of squares of the stored values.
double norm_ref(const std::vector<Tensor>& gs) {
  double s = 0;
  for (const Tensor& g : gs)
    if (g.defined())
      for (float x : g.to_floats()) s += double(x) * x;
  return std::sqrt(s);
}

TEST(Clip, MatchesTorchClipGradNorm) {
  const auto& fx = test::fixture("optim");
  for (const std::string c : {"clip", "noclip"}) {
    std::vector<Tensor> gs;
    for (int i = 0; i < 3; ++i) gs.push_back(fx.at(c + ".in" + std::to_string(i)).clone());
    const double max_norm = fx.at(c + ".max_norm").to_floats()[0];
    const double torch_norm = fx.at(c + ".total_norm").to_floats()[0];
    const double norm = global_grad_norm(gs);
    EXPECT_NEAR(norm, torch_norm, torch_norm * 1e-6) << c;
    EXPECT_NEAR(norm, norm_ref(gs), norm_ref(gs) * 1e-6) << c;
    std::vector<Tensor> before;
    for (auto& g : gs) before.push_back(g.clone());
    const bool clipped = clip_grads(gs, max_norm, norm);
    EXPECT_EQ(clipped, c == "clip");
    for (int i = 0; i < 3; ++i) {
      if (clipped) {
        expect_close(gs[i], fx.at(c + ".out" + std::to_string(i)), 1e-7, 2e-6, c);
      } else {
        expect_bitwise_equal(gs[i], before[i], c + ": unchanged");
      }
    }
    if (clipped) {
      EXPECT_NEAR(global_grad_norm(gs), max_norm, 1e-5);
    }
  }
}

TEST(Clip, NormInEveryDtypeMatchesF64Reference) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    // Several 4096-element blocks and a tail; an undefined grad is skipped.
    std::vector<Tensor> gs = {randn({3, 5000}, 1, 0.1f, dt), Tensor(), randn({77}, 2, 2.f, dt)};
    const double ref = norm_ref(gs);
    // f32 accumulation within blocks of 4096 values: relative error ~ 4096 * 2^-24 at worst.
    EXPECT_NEAR(global_grad_norm(gs), ref, ref * 1e-5) << dtype_name(dt);
    std::vector<Tensor> cl = gs;
    for (auto& g : cl)
      if (g.defined()) g = g.clone();
    ASSERT_TRUE(clip_grads(cl, 0.5, ref));
    const double coef = 0.5 / (ref + 1e-6);
    for (size_t i = 0; i < gs.size(); ++i) {
      if (!gs[i].defined()) continue;
      std::vector<float> expect;
      for (float x : gs[i].to_floats())
        expect.push_back(round_to(dt, x * static_cast<float>(coef)));
      EXPECT_EQ(cl[i].to_floats(), expect) << dtype_name(dt);
      EXPECT_EQ(cl[i].dtype(), dt);
    }
  }
}

TEST(Clip, NonFiniteNormPropagatesAndClipRefusesIt) {
  std::vector<Tensor> gs = {randn({10000}, 1), randn({10}, 2)};
  auto set = [&](float v) {
    auto x = gs[0].to_floats();
    x[9000] = v;
    gs[0] = Tensor::from_floats(x, {10000});
  };
  set(INFINITY);
  EXPECT_EQ(global_grad_norm(gs), INFINITY);
  set(-INFINITY);
  EXPECT_EQ(global_grad_norm(gs), INFINITY);
  set(NAN);
  EXPECT_TRUE(std::isnan(global_grad_norm(gs)));
  EXPECT_THROW(clip_grads(gs, 1.0, global_grad_norm(gs)), Error);
  EXPECT_THROW(clip_grads(gs, 1.0, INFINITY), Error);
  EXPECT_THROW(clip_grads(gs, 0.0, 1.0), Error);
  // bf16 inf is found too.
  std::vector<Tensor> b = {Tensor::from_floats({1.f, INFINITY, 2.f}, {3}, DType::BF16)};
  EXPECT_EQ(global_grad_norm(b), INFINITY);
  EXPECT_EQ(global_grad_norm({}), 0.0);
}

TEST(Clip, NormIsBitIdenticalAcrossRunsAndThreadCounts) {
  std::vector<Tensor> gs = {randn({100000}, 5), randn({333}, 6)};
  const int prev = omp_get_max_threads();
  omp_set_num_threads(2);
  const double a = global_grad_norm(gs), b = global_grad_norm(gs);
  omp_set_num_threads(1);
  const double c = global_grad_norm(gs);
  omp_set_num_threads(prev);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
}

}  // namespace
}  // namespace keel
