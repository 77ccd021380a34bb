// Global gradient norm and clipping: parity with torch.nn.utils.clip_grad_norm_, an f64
// reference, non-finite propagation, every dtype, determinism across thread counts.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <memory>

#include "keel/optim/adamw.h"
#include "keel/optim/clip.h"
#include "keel/optim/sgd.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using optim::clip_coefficient;
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

// The Trainer hands clip_coefficient to Optimizer::step instead of calling clip_grads: AdamW folds
// the multiply into its one pass (leaving .grad as it was), SGD scales in place first. Both must
// give the bits of clip_grads followed by a plain step, in every parameter dtype.
TEST(Clip, CoefficientPassedToTheOptimizerMatchesClipThenStepBitForBit) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (bool adamw : {true, false}) {
      auto make = [&](Tensor& w, Tensor& b) -> std::unique_ptr<optim::Optimizer> {
        w = randn({37, 19}, 1, 1.f, dt), b = randn({19}, 2, 1.f, dt);
        w.set_requires_grad(true), b.set_requires_grad(true);
        optim::ParamGroup g;
        g.params = {w, b};
        g.names = {"w", "b"};
        g.weight_decay = 0.1;
        if (adamw) return std::make_unique<optim::AdamW>(std::vector<optim::ParamGroup>{g});
        optim::SGDOptions o;
        o.momentum = 0.9;
        return std::make_unique<optim::SGD>(std::vector<optim::ParamGroup>{g}, o);
      };
      Tensor w1, b1, w2, b2;
      auto separate = make(w1, b1), fused = make(w2, b2);
      const std::string what = std::string(adamw ? "adamw " : "sgd ") + dtype_name(dt);
      for (int step = 0; step < 3; ++step) {
        const Tensor gw = randn({37, 19}, 10 + step, 3.f, dt), gb = randn({19}, 20 + step, 3.f, dt);
        w1.set_grad(gw.clone()), b1.set_grad(gb.clone());
        w2.set_grad(gw.clone()), b2.set_grad(gb.clone());
        const double norm = global_grad_norm({gw, gb});
        std::vector<Tensor> g1{w1.grad(), b1.grad()};
        EXPECT_TRUE(clip_grads(g1, 1.0, norm)) << what;
        separate->step(1e-2);
        const float coef = clip_coefficient(1.0, norm);
        ASSERT_LT(coef, 1.f);
        fused->step(1e-2, coef);
        expect_bitwise_equal(w2, w1, what + " w");
        expect_bitwise_equal(b2, b1, what + " b");
        if (adamw) expect_bitwise_equal(w2.grad(), gw, what + ": AdamW leaves .grad unclipped");
      }
    }
  }
  EXPECT_EQ(clip_coefficient(1.0, 0.5), 1.f) << "no clipping below max_norm";
}

}  // namespace
}  // namespace keel
