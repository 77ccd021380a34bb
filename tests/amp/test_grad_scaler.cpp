// GradScaler: the scripted f16 overflow trajectory, growth after exactly growth_interval clean
// steps, never growing to inf, hysteresis and min/max scale, state round trips, PyTorch's error
// texts, the unscale arithmetic (bit for bit, every ISA, every thread count) and the scale
// sequences of PyTorch's algorithm on scripted found_inf flags (tests/fixtures/gen_optim.py).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>

#include "keel/amp/grad_scaler.h"
#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::error_of;
using test::expect_bitwise_equal;
using test::randn;

// The f16 backward of a loss whose true gradient is `g`: grad * scale rounded to f16, then
// converted (exactly) to the f32 master gradient.
Tensor f16_backward_grad(float g, double scale, int64_t n = 8) {
  return Tensor::full({n}, round_to(DType::F16, static_cast<float>(g * scale)));
}

// A true gradient of 2.0: 2 * 65536 and 2 * 32768 overflow f16 (max 65504), 2 * 16384 does not.
TEST(GradScaler, ScriptedF16OverflowTrajectory) {
  GradScaler s;
  EXPECT_EQ(s.get_scale(), 65536.0);
  const double expect_before[] = {65536, 32768, 16384};
  const bool expect_inf[] = {true, true, false};
  for (int step = 0; step < 3; ++step) {
    std::vector<Tensor> grads = {f16_backward_grad(2.f, s.get_scale())};
    const bool found_inf = s.unscale(grads);
    EXPECT_EQ(found_inf, expect_inf[step]) << "step " << step;
    const ScalerUpdate r = s.update(found_inf);
    EXPECT_EQ(r.scale_before, expect_before[step]);
    EXPECT_EQ(r.found_inf, expect_inf[step]);
    EXPECT_EQ(r.applied, !expect_inf[step]);
    if (!found_inf) {
      for (float x : grads[0].to_floats()) EXPECT_EQ(x, 2.f) << "unscaled exactly";
      EXPECT_EQ(r.scale_after, 16384.0);  // one clean step: no growth yet
    } else {
      EXPECT_EQ(r.scale_after, expect_before[step] / 2);
    }
  }
  EXPECT_EQ(s.growth_tracker(), 1);
}

TEST(GradScaler, GrowsAfterExactly2000CleanSteps) {
  GradScaler s;
  for (int i = 0; i < 1999; ++i) ASSERT_EQ(s.update(false).scale_after, 65536.0) << i;
  EXPECT_EQ(s.growth_tracker(), 1999);
  const ScalerUpdate r = s.update(false);
  EXPECT_EQ(r.scale_before, 65536.0);
  EXPECT_EQ(r.scale_after, 131072.0);
  EXPECT_EQ(s.growth_tracker(), 0);
  // An overflow resets the count: 1000 clean, inf, then 1999 clean do not grow; the 2000th does.
  for (int i = 0; i < 1000; ++i) s.update(false);
  EXPECT_EQ(s.update(true).scale_after, 65536.0);
  EXPECT_EQ(s.growth_tracker(), 0);
  for (int i = 0; i < 1999; ++i) ASSERT_EQ(s.update(false).scale_after, 65536.0);
  EXPECT_EQ(s.update(false).scale_after, 131072.0);
}

TEST(GradScaler, NeverGrowsToInf) {
  GradScalerOptions o;
  o.init_scale = std::ldexp(1.0, 127);  // *2 = 2^128: inf in f32
  o.growth_interval = 1;
  GradScaler s(o);
  for (int i = 0; i < 3; ++i) {
    const ScalerUpdate r = s.update(false);
    EXPECT_EQ(r.scale_after, std::ldexp(1.0, 127));
    EXPECT_EQ(s.growth_tracker(), 0) << "the tracker resets even when growth is skipped";
  }
  // 1.5 * 2^126 grows by 1.5 twice (to 1.6875 * 2^127 < f32 max); the next product,
  // 2.53 * 2^127, is finite in double but not in f32: skipped from then on.
  o.init_scale = 1.5 * std::ldexp(1.0, 126);
  o.growth_factor = 1.5;
  GradScaler t(o);
  const double top = 1.5 * 1.5 * 1.5 * std::ldexp(1.0, 126);
  EXPECT_EQ(t.update(false).scale_after, 1.5 * 1.5 * std::ldexp(1.0, 126));
  EXPECT_EQ(t.update(false).scale_after, top);
  EXPECT_EQ(t.update(false).scale_after, top);
  EXPECT_EQ(t.update(false).scale_after, top);
}

// PyTorch's algorithm on scripted found_inf flags (gen_optim.py derives the sequences from
// AmpKernels.cu: torch 1.13 has no CPU kernel for _amp_update_scale_).
TEST(GradScaler, MatchesPyTorchScaleSequences) {
  const auto& fx = test::fixture("optim");
  for (const std::string c : {"scaler.pow2", "scaler.odd", "scaler.toinf"}) {
    const auto flags = fx.at(c + ".flags").to_ints();
    const auto prm = fx.at(c + ".params").to_floats();
    const auto scales = fx.at(c + ".scales").to_floats();
    GradScalerOptions o;
    o.init_scale = prm[0];
    o.growth_factor = prm[1];  // f32 values, used as such by the generator
    o.backoff_factor = prm[2];
    o.growth_interval = static_cast<int64_t>(prm[3]);
    GradScaler s(o);
    for (size_t i = 0; i < flags.size(); ++i) {
      const ScalerUpdate r = s.update(flags[i] != 0);
      ASSERT_EQ(static_cast<float>(r.scale_after), scales[i]) << c << " step " << i;
    }
  }
}

TEST(GradScaler, HysteresisDelaysBackoff) {
  GradScalerOptions o;
  o.init_scale = 1024;
  o.hysteresis = 2;
  o.growth_interval = 3;
  GradScaler s(o);
  ScalerUpdate r = s.update(true);  // first overflow: spent one, no back-off, step still skipped
  EXPECT_EQ(r.scale_after, 1024.0);
  EXPECT_FALSE(r.applied);
  EXPECT_EQ(s.hysteresis_tracker(), 1);
  EXPECT_EQ(s.update(true).scale_after, 512.0);  // spent: back off
  EXPECT_EQ(s.update(false).scale_after, 512.0);
  EXPECT_EQ(s.update(true).scale_after, 256.0) << "not refilled by a clean step (Megatron)";
  for (int i = 0; i < 3; ++i) s.update(false);  // growth refills
  EXPECT_EQ(s.get_scale(), 512.0);
  EXPECT_EQ(s.hysteresis_tracker(), 2);
  EXPECT_EQ(s.update(true).scale_after, 512.0);
  // consecutive_hysteresis: any clean step refills (DeepSpeed consecutive_hysteresis=True).
  o.consecutive_hysteresis = true;
  GradScaler c(o);
  EXPECT_EQ(c.update(true).scale_after, 1024.0);
  EXPECT_EQ(c.update(false).scale_after, 1024.0);
  EXPECT_EQ(c.update(true).scale_after, 1024.0);
  EXPECT_EQ(c.update(true).scale_after, 512.0);
}

TEST(GradScaler, MinAndMaxScaleClamp) {
  GradScalerOptions o;
  o.init_scale = 4;
  o.min_scale = 1;
  GradScaler s(o);
  EXPECT_EQ(s.update(true).scale_after, 2.0);
  ScalerUpdate r = s.update(true);
  EXPECT_EQ(r.scale_after, 1.0);
  EXPECT_FALSE(r.at_min_scale);
  r = s.update(true);
  EXPECT_EQ(r.scale_after, 1.0);
  EXPECT_TRUE(r.at_min_scale) << "already at min_scale: the trainer acts on on_nonfinite";
  GradScalerOptions m;
  m.init_scale = 4;
  m.max_scale = 6;
  m.growth_interval = 1;
  GradScaler t(m);
  EXPECT_EQ(t.update(false).scale_after, 6.0);
  EXPECT_EQ(t.update(false).scale_after, 6.0);
  // Off by default: PyTorch's scaler falls below 1 freely.
  GradScalerOptions d;
  d.init_scale = 1;
  GradScaler u(d);
  EXPECT_EQ(u.update(true).scale_after, 0.5);
}

TEST(GradScaler, StateDictKeysAndRoundTrip) {
  GradScalerOptions o;
  o.init_scale = 1000;
  o.growth_factor = 1.7;
  o.backoff_factor = 0.3;
  o.growth_interval = 4;
  GradScaler a(o);
  for (bool f : {false, true, false, false}) a.update(f);
  const auto st = a.state_dict();
  std::vector<std::string> keys;
  for (auto& [k, v] : st) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"_growth_tracker", "backoff_factor", "growth_factor",
                                            "growth_interval", "scale"}));
  EXPECT_EQ(st.at("scale"), static_cast<double>(static_cast<float>(1000 * 0.3)));
  EXPECT_EQ(st.at("_growth_tracker"), 2);
  GradScaler b;  // defaults, overwritten by the state
  b.load_state_dict(st);
  EXPECT_EQ(b.get_scale(), a.get_scale());
  EXPECT_EQ(b.options().growth_interval, 4);
  for (bool f : {false, false, true, false, false, false, false}) {
    const ScalerUpdate ra = a.update(f), rb = b.update(f);
    EXPECT_EQ(ra.scale_after, rb.scale_after);
    EXPECT_EQ(a.growth_tracker(), b.growth_tracker());
  }
  // Hysteresis state travels in one more key.
  GradScalerOptions h;
  h.hysteresis = 3;
  GradScaler c(h);
  c.update(true);
  EXPECT_EQ(c.state_dict().at("_hysteresis_tracker"), 2);
  GradScaler d(h);
  d.load_state_dict(c.state_dict());
  EXPECT_EQ(d.hysteresis_tracker(), 2);
  // Disabled: empty; loading empty into an enabled scaler fails with PyTorch's message.
  GradScalerOptions off;
  off.enabled = false;
  EXPECT_TRUE(GradScaler(off).state_dict().empty());
  EXPECT_NE(error_of([&] { b.load_state_dict({}); })
                .find("The source state dict is empty, possibly because it was saved from a "
                      "disabled instance of GradScaler."),
            std::string::npos);
  auto missing = st;
  missing.erase("_growth_tracker");
  EXPECT_NE(error_of([&] { b.load_state_dict(missing); }).find("'_growth_tracker'"),
            std::string::npos);
}

TEST(GradScaler, PyTorchErrorTexts) {
  GradScaler s;
  std::vector<Tensor> f16 = {Tensor::zeros({4}, DType::F16)};
  EXPECT_NE(error_of([&] { s.unscale(f16); }).find("Attempting to unscale FP16 gradients."),
            std::string::npos);
  std::vector<Tensor> g = {Tensor::zeros({4})};
  s.unscale(g);
  EXPECT_TRUE(s.unscaled());
  EXPECT_NE(error_of([&] { s.unscale(g); })
                .find("unscale_() has already been called on this optimizer since the last "
                      "update()."),
            std::string::npos);
  s.update(false);
  EXPECT_FALSE(s.unscaled());
  EXPECT_FALSE(s.unscale(g));  // allowed again after update()
  GradScalerOptions o;
  o.growth_factor = 1.0;
  EXPECT_NE(error_of([&] { GradScaler x(o); }).find("The growth factor must be > 1.0."),
            std::string::npos);
  o = {};
  o.backoff_factor = 1.0;
  EXPECT_NE(error_of([&] { GradScaler x(o); }).find("The backoff factor must be < 1.0."),
            std::string::npos);
  // Scales are f32: 1e-300 rounded to 0 (every step skipped, exit 0), 1e300 to inf.
  o = {};
  o.init_scale = 1e-300;
  EXPECT_CONTAINS(error_of([&] { GradScaler x(o); }),
                  "scaler.init_scale must be a positive finite f32 value");
  o = {};
  o.min_scale = 1e300;
  EXPECT_CONTAINS(error_of([&] { GradScaler x(o); }), "f32 values from 1.2e-38 to 3.4e38");
  o = {};
  o.max_scale = 1e-300;
  EXPECT_CONTAINS(error_of([&] { GradScaler x(o); }), "f32 values from 1.2e-38 to 3.4e38");
  o = {};
  o.init_scale = 1e-30;  // small but normal: allowed
  GradScaler small(o);
  EXPECT_EQ(small.get_scale(), static_cast<double>(1e-30f));
}

TEST(GradScaler, DisabledIsANoOpWithScaleOne) {
  GradScalerOptions o;
  o.enabled = false;
  o.growth_factor = 0.1;  // not validated when disabled (as PyTorch)
  GradScaler s(o);
  EXPECT_EQ(s.get_scale(), 1.0);
  Tensor loss = Tensor::from_floats({3.f}, {1});
  EXPECT_EQ(s.scale(loss).impl(), loss.impl());
  std::vector<Tensor> g = {Tensor::from_floats({INFINITY, 2.f}, {2}),
                           Tensor::zeros({2}, DType::F16)};
  const auto before = g[0].to_floats();
  EXPECT_FALSE(s.unscale(g));
  EXPECT_FALSE(s.unscale(g)) << "no state machine when disabled";
  EXPECT_EQ(g[0].to_floats(), before);
  const ScalerUpdate r = s.update(true);
  EXPECT_EQ(r.scale_before, 1.0);
  EXPECT_EQ(r.scale_after, 1.0);
  EXPECT_TRUE(r.found_inf);
  EXPECT_FALSE(r.applied);
}

// scale(loss) is differentiable: backward of loss * s gives s times the gradient.
TEST(GradScaler, ScaleMultipliesLossAndItsGradient) {
  GradScalerOptions o;
  o.init_scale = 1024;
  GradScaler s(o);
  Tensor x = Tensor::from_floats({0.75f}, {1});
  x.set_requires_grad(true);
  Tensor y = s.scale(x);
  EXPECT_EQ(y.to_floats()[0], 768.f);
  backward(y);
  EXPECT_EQ(x.grad().to_floats()[0], 1024.f);
}

// g * (float)(1 / (double)scale) in f32, rounded once to the gradient's dtype, non-finite values
// counted in the same pass, on every ISA and thread count, with undefined grads skipped.
TEST(GradScaler, UnscaleIsBitExactEverywhere) {
  GradScalerOptions o;
  o.init_scale = 3000.0;  // 1/3000 is not exact in f32: the double reciprocal matters
  const float inv = static_cast<float>(1.0 / 3000.0);
  const CpuIsa best = cpu_isa();
  const int prev = omp_get_max_threads();
  for (DType dt : {DType::F32, DType::BF16})
    for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512})
      for (int threads : {1, 2}) {
        if (static_cast<int>(isa) > static_cast<int>(best)) continue;
        set_cpu_isa(isa);
        omp_set_num_threads(threads);
        const std::string what = std::string(dtype_name(dt)) + " " + cpu_isa_name(isa) + " " +
                                 std::to_string(threads) + " threads";
        Tensor a = randn({20000}, 1, 5000.f, dt), b = randn({33}, 2, 5000.f, dt);
        std::vector<Tensor> grads = {a.clone(), Tensor(), b.clone()};
        GradScaler s(o);
        EXPECT_FALSE(s.unscale(grads)) << what;
        for (int i : {0, 2}) {
          std::vector<float> expect;
          for (float x : (i == 0 ? a : b).to_floats()) expect.push_back(round_to(dt, x * inv));
          EXPECT_EQ(grads[i].to_floats(), expect) << what;
          EXPECT_EQ(grads[i].dtype(), dt);
        }
        // One inf deep in the last block, or one NaN in the tail: found.
        for (float bad : {INFINITY, NAN}) {
          auto v = a.to_floats();
          v[bad == INFINITY ? 19999 : 4097] = bad;
          std::vector<Tensor> gs = {Tensor::from_floats(v, {20000}, dt)};
          GradScaler t(o);
          EXPECT_TRUE(t.unscale(gs)) << what;
        }
      }
  omp_set_num_threads(prev);
  set_cpu_isa(best);
}

TEST(GradScaler, UnscaleIsDeterministic) {
  GradScalerOptions o;
  o.init_scale = 777.0;
  std::vector<Tensor> a = {randn({70000}, 3, 100.f)}, b = {a[0].clone()};
  GradScaler s(o), t(o);
  s.unscale(a);
  t.unscale(b);
  expect_bitwise_equal(a[0], b[0], "unscale twice");
}

}  // namespace
}  // namespace keel
