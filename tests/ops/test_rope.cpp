// rope: an f64 reference (angles, cos/sin and rotation in f64), gradcheck, PyTorch parity against
// HF's apply_rotary_pos_emb, determinism and the per-ISA kernels against each other.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "keel/ops/rope.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::expect_close;
using test::IsaRestore;
using test::randn;

// Reference: for x [B, H, T, D], pair (i, i + D/2) at position t + offset rotates by
// (t + offset) * theta^(-2i/D); everything in f64.
std::vector<float> rope_ref(const Tensor& x, double theta, int64_t offset, bool inverse = false,
                            const std::vector<double>& inv_freq = {}) {
  const auto xv = x.to_floats();
  const int64_t t = x.size(2), d = x.size(3), h = d / 2, rows = x.size(0) * x.size(1);
  std::vector<float> out(xv.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < t; ++p)
      for (int64_t i = 0; i < h; ++i) {
        const double f = inv_freq.empty() ? std::pow(theta, -2.0 * i / d) : inv_freq[i];
        const double angle = (p + offset) * f * (inverse ? -1 : 1);
        const int64_t base = (r * t + p) * d;
        const double a = xv[base + i], b = xv[base + i + h];
        out[base + i] = static_cast<float>(a * std::cos(angle) - b * std::sin(angle));
        out[base + i + h] = static_cast<float>(b * std::cos(angle) + a * std::sin(angle));
      }
  return out;
}

// The ISA levels this CPU runs (up to the detected one).
std::vector<CpuIsa> runnable_isas() {
  std::vector<CpuIsa> v;
  for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512})
    if (static_cast<int>(isa) <= static_cast<int>(cpu_isa())) v.push_back(isa);
  return v;
}

TEST(Rope, ForwardAndBackwardMatchReferenceInEveryDtype) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const std::string what = dtype_name(dt);
    // D/2 = 600 spans two of the kernel's 512-element chunks.
    for (const Shape& s : {Shape{2, 3, 7, 16}, Shape{1, 1, 3, 1200}}) {
      Tensor x = randn(s, 1, 1.f, dt).set_requires_grad(true);
      Tensor y = ops::rope(x, 10000.f, 3);
      EXPECT_EQ(y.dtype(), dt);
      EXPECT_EQ(y.shape(), s);
      // f32: cos/sin rounded to f32 and two f32 products; others: one rounding into dt.
      const double tol = dt == DType::F32 ? 1e-6 : test::eps_of(dt);
      expect_close(y.to_floats(), rope_ref(x, 10000.0, 3), 1e-6, tol, "forward " + what);
      Tensor g = randn(s, 2, 1.f, dt);
      backward(y, g);
      ASSERT_EQ(x.grad().dtype(), dt);
      // The gradient of an orthogonal map is the inverse rotation of g.
      expect_close(x.grad().to_floats(), rope_ref(g, 10000.0, 3, /*inverse=*/true), 1e-6, tol,
                   "backward " + what);
    }
  }
}

TEST(Rope, AnglesAreExactAtLongPositions) {
  // At position 1e5 an f32 angle is off by ~1e5 * 2^-24 = 6e-3 rad; keel computes it in f64.
  Tensor x = randn({1, 2, 4, 8}, 3);
  expect_close(ops::rope(x, 10000.f, 100000).to_floats(), rope_ref(x, 10000.0, 100000), 1e-6, 1e-6,
               "rope at position 1e5");
  // Position 0 is the identity.
  EXPECT_EQ(ops::rope(x, 10000.f, 0).to_floats()[3], x.to_floats()[3]);
}

TEST(Rope, Gradcheck) {
  test::expect_gradcheck([](const std::vector<Tensor>& in) { return ops::rope(in[0], 10000.f, 2); },
                         {randn({2, 2, 3, 6}, 4)}, {}, "rope");
  test::expect_gradcheck(
      [](const std::vector<Tensor>& in) { return ops::rope(in[0], 500000.f, 9); },
      {randn({1, 3, 4, 8}, 5)}, {}, "rope llama3 theta");
}

// Llama 3.1's rope_scaling, restated from its definition: wavelengths 2*pi/f longer than
// old_ctx/low are stretched by `factor`, shorter than old_ctx/high kept, and in between the
// frequency is the blend (1-s) f/factor + s f with s = (old_ctx/wavelen - low) / (high - low).
std::vector<double> llama3_ref(double theta, int64_t d, double factor, double low, double high,
                               double old_ctx) {
  std::vector<double> out;
  for (int64_t i = 0; i < d / 2; ++i) {
    const double f = 1.0 / std::pow(theta, 2.0 * i / d);
    const double wavelen = 2 * M_PI / f;
    if (wavelen < old_ctx / high) {
      out.push_back(f);
    } else if (wavelen > old_ctx / low) {
      out.push_back(f / factor);
    } else {
      const double s = (old_ctx / wavelen - low) / (high - low);
      out.push_back((1 - s) * f / factor + s * f);
    }
  }
  return out;
}

ops::RopeScaling llama31_scaling(int64_t original_max_position = 8192) {
  ops::RopeScaling s;
  s.kind = ops::RopeScaling::Kind::kLlama3;
  s.factor = 8;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_max_position = original_max_position;
  return s;
}

TEST(Rope, Llama3ScalingMatchesItsDefinition) {
  // Llama 3.1 8B: head dim 128, theta 500000, original context 8192.
  const auto got = ops::rope_inv_freq(500000.0, 128, llama31_scaling());
  const auto ref = llama3_ref(500000.0, 128, 8, 1, 4, 8192);
  ASSERT_EQ(got.size(), 64u);
  int kept = 0, stretched = 0, blended = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], ref[i], 1e-15 * ref[i]) << "inv_freq[" << i << "]";
    const double f = 1.0 / std::pow(500000.0, 2.0 * i / 128);
    if (got[i] == f)
      ++kept;
    else if (std::abs(got[i] - f / 8) <= 1e-15 * f)
      ++stretched;
    else
      ++blended;
  }
  // All three bands are populated for this model.
  EXPECT_GT(kept, 0);
  EXPECT_GT(stretched, 0);
  EXPECT_GT(blended, 0);
  // Linear scaling divides every frequency.
  ops::RopeScaling lin;
  lin.kind = ops::RopeScaling::Kind::kLinear;
  lin.factor = 4;
  const auto plain = ops::rope_inv_freq(10000.0, 16);
  const auto scaled = ops::rope_inv_freq(10000.0, 16, lin);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_DOUBLE_EQ(scaled[i], plain[i] / 4);
  // The rotation uses the scaled frequencies, forward and backward.
  Tensor x = randn({1, 2, 5, 32}, 8).set_requires_grad(true);
  const auto sc = llama31_scaling(64);
  const auto f64 = llama3_ref(500000.0, 32, 8, 1, 4, 64);
  Tensor y = ops::rope(x, 500000.f, 3000, sc);
  expect_close(y.to_floats(), rope_ref(x, 500000.0, 3000, false, f64), 1e-6, 1e-6, "llama3 fwd");
  Tensor g = randn(y.shape(), 9);
  backward(y, g);
  expect_close(x.grad().to_floats(), rope_ref(g, 500000.0, 3000, true, f64), 1e-6, 1e-6,
               "llama3 bwd");
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& in) { return ops::rope(in[0], 500000.f, 40, sc); },
      {randn({1, 2, 3, 32}, 10)}, {}, "rope llama3 scaling");
  // Bad parameters are refused.
  ops::RopeScaling bad = sc;
  bad.high_freq_factor = 0.5;
  EXPECT_THROW(ops::rope(x, 500000.f, 0, bad), Error);
  bad = sc;
  bad.factor = 0;
  EXPECT_THROW(ops::rope_inv_freq(500000.0, 32, bad), Error);
}

// Phi-3-128k's longrope, restated: inv_freq[i] = 1 / (ext[i] * theta^(2i/D)), ext the short
// factors while a forward's positions stay within the original context (its longest + 1 at most
// that), the long ones past it; the rotation scaled by attention_factor. Its backward is the
// scaled inverse rotation (the transpose), checked numerically.
TEST(Rope, LongRopeSwitchesFactorsPastTheOriginalContext) {
  ops::RopeScaling lr;
  lr.kind = ops::RopeScaling::Kind::kLongRope;
  lr.short_factor = {1.0, 1.25, 2.0, 3.0};
  lr.long_factor = {1.5, 4.0, 9.0, 40.0};
  lr.original_max_position = 6;
  lr.attention_factor = 1.19;
  auto ref = [&](const Tensor& x, int64_t offset, const std::vector<double>& ext) {
    std::vector<double> inv;
    for (int64_t i = 0; i < 4; ++i) inv.push_back(1.0 / (ext[i] * std::pow(10000.0, i / 4.0)));
    std::vector<float> out = rope_ref(x, 10000.0, offset, false, inv);
    for (float& v : out) v = static_cast<float>(v * lr.attention_factor);
    return out;
  };
  Tensor x = randn({2, 3, 3, 8}, 6);
  // Positions 0..2 and 3..5: within 6, the short factors; 4..6 reach 7, the long ones.
  expect_close(ops::rope(x, 10000.f, 0, lr).to_floats(), ref(x, 0, lr.short_factor), 1e-6, 1e-6,
               "longrope at 0..2");
  expect_close(ops::rope(x, 10000.f, 3, lr).to_floats(), ref(x, 3, lr.short_factor), 1e-6, 1e-6,
               "longrope at 3..5");
  expect_close(ops::rope(x, 10000.f, 4, lr).to_floats(), ref(x, 4, lr.long_factor), 1e-6, 1e-6,
               "longrope at 4..6");
  // Given positions (a packed row's): the batch's longest decides, as HF's max(position_ids) + 1.
  Tensor pos = Tensor::from_ints({0, 1, 2, 0, 1, 2}, {2, 3});
  expect_close(ops::rope(x, 10000.f, pos, lr).to_floats(), ref(x, 0, lr.short_factor), 1e-6, 1e-6,
               "longrope at given positions");
  EXPECT_EQ(ops::rope_inv_freq(10000.0, 8, lr, 6)[3], 1.0 / (3.0 * std::pow(10000.0, 0.75)));
  EXPECT_EQ(ops::rope_inv_freq(10000.0, 8, lr, 7)[3], 1.0 / (40.0 * std::pow(10000.0, 0.75)));
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& in) { return ops::rope(in[0], 1e4f, 4, lr); },
      {randn({1, 2, 3, 8}, 7)}, {}, "rope longrope");
  // Factors that do not cover the head's pairs are refused.
  lr.long_factor.pop_back();
  EXPECT_THROW(ops::rope(x, 10000.f, 4, lr), Error);
}

// Dynamic NTK (HF's _compute_dynamic_ntk_parameters): within the original context the unscaled
// frequencies bit for bit; a forward reaching L past it turns by the base
// theta * (factor * L / original - (factor - 1))^(D / (D - 2)), decided by its longest position.
TEST(Rope, DynamicNtkGrowsTheBasePastTheOriginalContext) {
  ops::RopeScaling dy;
  dy.kind = ops::RopeScaling::Kind::kDynamic;
  dy.factor = 2;
  dy.original_max_position = 6;
  Tensor x = randn({2, 3, 3, 8}, 26);
  // Positions 3..5 stay within 6: the same bits as no scaling.
  test::expect_bitwise_equal(ops::rope(x, 10000.f, 3, dy), ops::rope(x, 10000.f, 3),
                             "dynamic within its context");
  EXPECT_EQ(ops::rope_inv_freq(10000.0, 8, dy, 6), ops::rope_inv_freq(10000.0, 8, {}, 6));
  // Positions 5..7 reach 8: base 1e4 * (2 * 8 / 6 - 1)^(8 / 6).
  const double base = 10000.0 * std::pow(2.0 * 8 / 6 - 1, 8.0 / 6);
  std::vector<double> inv;
  for (int64_t i = 0; i < 4; ++i) inv.push_back(1.0 / std::pow(base, i / 4.0));
  const std::vector<double> got = ops::rope_inv_freq(10000.0, 8, dy, 8);
  for (int64_t i = 0; i < 4; ++i) EXPECT_NEAR(got[i], inv[i], 1e-15 * inv[0]) << i;
  expect_close(ops::rope(x, 10000.f, 5, dy).to_floats(), rope_ref(x, 10000.0, 5, false, inv), 1e-6,
               1e-6, "dynamic at 5..7");
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& in) { return ops::rope(in[0], 1e4f, 5, dy); },
      {randn({1, 2, 3, 8}, 27)}, {}, "rope dynamic");
}

// Phi-4-mini's partial rotary (HF's partial_rotary_factor 0.75: 96 of 128 channels): the first R
// channels turn as a head of R would (pairs (i, i + R/2), inv_freq theta^(-2i/R)), the other D - R
// pass bit for bit, forward and backward, at an offset, at given positions and with longrope
// factors of R/2 values.
TEST(Rope, APartialRotaryTurnsTheFirstChannelsAndPassesTheRest) {
  const int64_t D = 10, R = 6;
  // x's first R channels as a head of their own, and its last D - R.
  auto channels = [&](const std::vector<float>& v, int64_t from, int64_t to) {
    std::vector<float> out;
    for (size_t at = 0; at < v.size(); at += D)
      out.insert(out.end(), v.begin() + at + from, v.begin() + at + to);
    return out;
  };
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const std::string what = dtype_name(dt);
    Tensor x = randn({2, 3, 5, D}, 11, 1.f, dt).set_requires_grad(true);
    const Tensor y = ops::rope(x, 10000.f, 3, {}, R);
    const Tensor turned = Tensor::from_floats(channels(x.to_floats(), 0, R), {2, 3, 5, R});
    const double tol = dt == DType::F32 ? 1e-6 : test::eps_of(dt);
    expect_close(channels(y.to_floats(), 0, R), rope_ref(turned, 10000.0, 3), 1e-6, tol,
                 "partial forward " + what);
    EXPECT_EQ(channels(y.to_floats(), R, D), channels(x.to_floats(), R, D)) << what;
    const Tensor g = randn(y.shape(), 12, 1.f, dt);
    backward(y, g);
    const Tensor g_turned = Tensor::from_floats(channels(g.to_floats(), 0, R), {2, 3, 5, R});
    expect_close(channels(x.grad().to_floats(), 0, R),
                 rope_ref(g_turned, 10000.0, 3, /*inverse=*/true), 1e-6, tol,
                 "partial backward " + what);
    EXPECT_EQ(channels(x.grad().to_floats(), R, D), channels(g.to_floats(), R, D)) << what;
  }
  // Given positions (a packed row's, a decode's rows) and longrope's R/2 factors.
  ops::RopeScaling lr;
  lr.kind = ops::RopeScaling::Kind::kLongRope;
  lr.short_factor = {1.0, 1.5, 2.0};
  lr.long_factor = {2.0, 5.0, 9.0};
  lr.original_max_position = 4;
  lr.attention_factor = 1.3;
  const Tensor x = randn({2, 2, 3, D}, 13);
  const Tensor pos = Tensor::from_ints({0, 1, 2, 3, 4, 5}, {2, 3});  // row 1 reaches 6: long
  const Tensor y = ops::rope(x, 10000.f, pos, lr, R);
  const Tensor turned = Tensor::from_floats(channels(x.to_floats(), 0, R), {2, 2, 3, R});
  EXPECT_EQ(channels(y.to_floats(), 0, R), ops::rope(turned, 10000.f, pos, lr).to_floats());
  EXPECT_EQ(channels(y.to_floats(), R, D), channels(x.to_floats(), R, D));
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& in) { return ops::rope(in[0], 1e4f, 2, lr, R); },
      {randn({1, 2, 3, D}, 14)}, {}, "rope partial longrope");
  // Odd, or wider than the head; factors of D/2 values where R/2 turn.
  EXPECT_THROW(ops::rope(x, 10000.f, 0, {}, 5), Error);
  EXPECT_THROW(ops::rope(x, 10000.f, 0, {}, 12), Error);
  lr.short_factor.push_back(1);
  lr.long_factor.push_back(1);
  EXPECT_THROW(ops::rope(x, 10000.f, 0, lr, R), Error);
}

// YaRN, restated from its definition (transformers' _compute_yarn_parameters): with d = D and
// c(t) = d ln(orig / (2 pi t)) / (2 ln theta), the ramp runs from floor(c(beta_fast)) to
// ceil(c(beta_slow)) (within [0, d - 1]); pair i keeps its frequency where the ramp is 0 and takes
// frequency / factor where it is 1, blended between; the rotation scaled by attention_factor.
TEST(Rope, YarnBlendsEachFrequencyBetweenKeptAndInterpolated) {
  ops::RopeScaling y;
  y.kind = ops::RopeScaling::Kind::kYarn;
  y.factor = 8;
  y.original_max_position = 4096;
  y.attention_factor = 0.1 * std::log(8.0) + 1;
  const int64_t D = 64;
  auto ref = [&](bool truncate) {
    auto c = [&](double t) { return D * std::log(4096 / (t * 2 * M_PI)) / (2 * std::log(1e4)); };
    double low = c(32), high = c(1);
    if (truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0), high = std::min(high, D - 1.0);
    std::vector<double> out;
    for (int64_t i = 0; i < D / 2; ++i) {
      const double f = 1 / std::pow(1e4, 2.0 * i / D);
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      out.push_back(f / 8 * ramp + f * (1 - ramp));
    }
    return out;
  };
  for (const bool truncate : {true, false}) {
    y.truncate = truncate;
    const auto got = ops::rope_inv_freq(1e4, D, y), want = ref(truncate);
    ASSERT_EQ(got.size(), want.size());
    int kept = 0, interpolated = 0, blended = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-15 * want[i]) << "inv_freq[" << i << "]";
      const double f = 1 / std::pow(1e4, 2.0 * i / D);
      if (std::abs(got[i] - f) <= 1e-15 * f)
        ++kept;
      else if (std::abs(got[i] - f / 8) <= 1e-15 * f)
        ++interpolated;
      else
        ++blended;
    }
    EXPECT_GT(kept, 0);
    EXPECT_GT(interpolated, 0);
    EXPECT_GT(blended, 0);
  }
  // The rotation is by those frequencies, scaled by the attention factor, forward and backward.
  y.truncate = true;
  Tensor x = randn({1, 2, 5, D}, 15).set_requires_grad(true);
  std::vector<float> want = rope_ref(x, 1e4, 300, false, ref(true));
  for (float& v : want) v = static_cast<float>(v * y.attention_factor);
  expect_close(ops::rope(x, 1e4f, 300, y).to_floats(), want, 1e-6, 1e-6, "yarn forward");
  test::expect_gradcheck(
      [&](const std::vector<Tensor>& in) { return ops::rope(in[0], 1e4f, 40, y); },
      {randn({1, 2, 3, 8}, 16)}, {}, "rope yarn");
  // An original context of none is refused.
  y.original_max_position = 0;
  EXPECT_THROW(ops::rope(x, 1e4f, 0, y), Error);
}

TEST(Rope, RejectsBadShapes) {
  EXPECT_THROW(ops::rope(randn({2, 3, 4, 5}, 1)), Error);  // odd head dim
  EXPECT_THROW(ops::rope(randn({3, 4, 8}, 1)), Error);     // not [B, H, T, D]
  EXPECT_THROW(ops::rope(randn({1, 1, 2, 4}, 1), 0.f), Error);
}

TEST(Rope, DeterministicAndSameOnEveryIsa) {
  IsaRestore restore;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    auto run = [&] {
      Tensor x = randn({2, 4, 33, 64}, 6, 1.f, dt).set_requires_grad(true);
      Tensor y = ops::rope(x, 10000.f, 5);
      backward(y, randn(y.shape(), 7, 1.f, dt));
      // A partial rotary's (Phi-4-mini's 3/4), out of place and as a backward.
      Tensor xp = randn({2, 4, 33, 64}, 8, 1.f, dt).set_requires_grad(true);
      Tensor yp = ops::rope(xp, 10000.f, 5, {}, 48);
      backward(yp, randn(yp.shape(), 9, 1.f, dt));
      return std::vector<Tensor>{y, x.grad(), yp, xp.grad()};
    };
    auto ref = run();
    const auto again = run();
    for (size_t i = 0; i < ref.size(); ++i) test::expect_bitwise_equal(ref[i], again[i], "rerun");
    // rope.inc is compiled without FMA contraction: every ISA computes the same bits.
    for (CpuIsa isa : runnable_isas()) {
      set_cpu_isa(isa);
      const auto got = run();
      for (size_t i = 0; i < ref.size(); ++i)
        test::expect_bitwise_equal(
            got[i], ref[i], std::string("rope ") + dtype_name(dt) + " on " + cpu_isa_name(isa));
    }
    set_cpu_isa(restore.saved);
  }
}

TEST(Rope, ParityWithHuggingFace) {
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    test::expect_parity("rope", "rope." + d, [](auto& in) { return ops::rope(in[0], 10000.f, 0); });
    test::expect_parity("rope", "rope_offset." + d,
                        [](auto& in) { return ops::rope(in[0], 500000.f, 7); });
    test::expect_parity("rope", "rope_llama3." + d, [](auto& in) {
      return ops::rope(in[0], 500000.f, 3000, llama31_scaling(64));
    });
  }
}

}  // namespace
}  // namespace keel
