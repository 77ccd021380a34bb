// Dropout on the attention probabilities (ops::AttentionDropout: HF's attn_pdrop and
// attention_dropout): every backend drops the mask ops::dropout draws for a [B, Hq, T, T] tensor,
// against an f64 reference and against PyTorch applying the same mask, forward and gradients; flash
// (tiles, packed rows, windows, padding) agrees with the materialized backends; p == 0 is no
// dropout bit for bit; the mask does not depend on threads or the ISA.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "keel/ops/attention.h"
#include "keel/ops/dropout.h"
#include "tests/support/attention_ref.h"
#include "tests/support/check.h"

namespace keel::attention_dropout_test {

using ops::AttentionBackend;
using test::randn;

constexpr AttentionBackend kBackends[] = {AttentionBackend::kEager, AttentionBackend::kMath,
                                          AttentionBackend::kFlash};
const char* bname(AttentionBackend b) { return ops::attention_backend_name(b); }

// keep · 1/(1-p) of every probability of [B, Hq, T, T]: ops::dropout of ones, the mask the
// attention promises to draw.
std::vector<float> drop_factors(int64_t b, int64_t hq, int64_t t, const ops::AttentionDropout& d) {
  return ops::dropout(Tensor::full({b, hq, t, t}, 1.f), d.p, d.seed).to_floats();
}

// Output and the three input gradients of attention under `drop` for upstream gradient g.
std::vector<Tensor> run(const Tensor& q0, const Tensor& k0, const Tensor& v0,
                        const ops::AttentionMask& mask, AttentionBackend be,
                        const ops::AttentionDropout& drop, const Tensor& g, DType dt,
                        const ops::AttentionScores& scores = {}) {
  Tensor q = q0.to_dtype(dt).set_requires_grad(true), k = k0.to_dtype(dt).set_requires_grad(true),
         v = v0.to_dtype(dt).set_requires_grad(true);
  Tensor o = ops::attention(q, k, v, mask, be, scores, drop);
  backward(o, g.to_dtype(dt));
  return {o, q.grad(), k.grad(), v.grad()};
}

TEST(AttentionDropout, EveryBackendDropsTheMaskOfADropoutOverTheProbabilities) {
  const int64_t nb = 2, hq = 4, t = 70, dd = 8;  // across flash's 32-row and 64-key tiles
  const Tensor q = randn({nb, hq, t, dd}, 11), k = randn({nb, 2, t, dd}, 12),
               v = randn({nb, 2, t, dd}, 13);
  const ops::AttentionDropout drop{0.3f, 4242};
  const std::vector<float> factors = drop_factors(nb, hq, t, drop);
  int64_t dropped = 0;
  for (float f : factors) dropped += f == 0.f;
  EXPECT_NEAR(static_cast<double>(dropped) / factors.size(), 0.3, 0.02);
  // Plain rows; then packed examples within a window (the keys a query sees start past 0, so
  // flash's tiles begin mid-row) with a padded batch row.
  std::vector<int64_t> pos;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t i = 0; i < t; ++i) pos.push_back(b == 0 && i >= 40 ? i - 40 : i);
  ops::AttentionMask bounded(Tensor(), Tensor::from_ints(pos, {nb, t}));
  bounded.window = 25;
  const std::function<int64_t(int64_t, int64_t)> first = [&](int64_t b, int64_t i) {
    return std::max(i - pos[static_cast<size_t>(b * t + i)], i - 24);
  };
  const std::function<int64_t(int64_t, int64_t)> from_0;
  for (bool packed : {false, true}) {
    const ops::AttentionMask mask = packed ? bounded : ops::AttentionMask{};
    const std::vector<double> ref =
        test::attention_ref(q, k, v, packed ? first : from_0, 0, 0, factors);
    const std::vector<double> undropped = test::attention_ref(q, k, v, packed ? first : from_0);
    double moved = 0;
    for (size_t x = 0; x < ref.size(); ++x)
      moved = std::max(moved, std::fabs(ref[x] - undropped[x]));
    ASSERT_GT(moved, 0.1) << "the dropout must change these outputs";
    for (AttentionBackend be : kBackends) {
      const std::string what = std::string(bname(be)) + (packed ? " packed, window 25" : "");
      const std::vector<float> got = ops::attention(q, k, v, mask, be, {}, drop).to_floats();
      double worst = 0;
      for (size_t x = 0; x < got.size(); ++x) worst = std::max(worst, std::fabs(got[x] - ref[x]));
      EXPECT_LT(worst, 2e-5) << what;
      // bf16: within the backend's roundings of the probabilities and output.
      const std::vector<float> lp = ops::attention(q.to_dtype(DType::BF16), k.to_dtype(DType::BF16),
                                                   v.to_dtype(DType::BF16), mask, be, {}, drop)
                                        .to_floats();
      worst = 0;
      for (size_t x = 0; x < lp.size(); ++x) worst = std::max(worst, std::fabs(lp[x] - ref[x]));
      EXPECT_LT(worst, 0.08) << what << " bf16";
    }
  }
}

TEST(AttentionDropout, FlashGradientsAgreeWithTheMaterializedBackends) {
  // Flash recomputes each mask element from its index in both backward passes; math holds the
  // whole [B, Hq, T, T] mask: in f32 they agree to summation order. A padded batch row, GQA, and
  // packed rows in a window; and under Gemma-2's soft cap, whose flash backward drops dP before
  // the cap's derivative.
  const int64_t nb = 2, t = 100, dd = 16;
  const Tensor q = randn({nb, 4, t, dd}, 21), k = randn({nb, 2, t, dd}, 22),
               v = randn({nb, 2, t, dd}, 23), g = randn({nb, 4, t, dd}, 24);
  std::vector<int64_t> pad(nb * t, 1), pos;
  for (int64_t j = 0; j < 7; ++j) pad[t + j] = 0;  // batch row 1: left padding
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t i = 0; i < t; ++i) pos.push_back(b == 0 && i >= 61 ? i - 61 : i);
  ops::AttentionMask padded(Tensor::from_ints(pad, {nb, t}, DType::U8));
  ops::AttentionMask packed(Tensor(), Tensor::from_ints(pos, {nb, t}));
  packed.window = 50;
  const ops::AttentionDropout drop{0.2f, 99};
  for (const ops::AttentionScores scores :
       {ops::AttentionScores{}, ops::AttentionScores{0.4f, 2.f}})
    for (const ops::AttentionMask* mask : {&padded, &packed}) {
      const auto math = run(q, k, v, *mask, AttentionBackend::kMath, drop, g, DType::F32, scores);
      const auto undropped =
          run(q, k, v, *mask, AttentionBackend::kMath, {}, g, DType::F32, scores);
      for (AttentionBackend be : {AttentionBackend::kEager, AttentionBackend::kFlash}) {
        const auto got = run(q, k, v, *mask, be, drop, g, DType::F32, scores);
        for (int i = 0; i < 4; ++i) {
          const std::string what = std::string(bname(be)) +
                                   (mask == &packed ? " packed" : " padded") +
                                   (scores.softcap > 0 ? " capped" : "") + " #" + std::to_string(i);
          test::expect_close(got[i], math[i], 2e-5, 2e-5, what);
          // ... and the dropout is seen by every gradient (else a pass ignored the mask).
          const auto a = math[i].to_floats(), b = undropped[i].to_floats();
          double moved = 0;
          for (size_t x = 0; x < a.size(); ++x)
            moved = std::max(moved, double(std::fabs(a[x] - b[x])));
          EXPECT_GT(moved, 1e-2) << what;
        }
      }
    }
}

TEST(AttentionDropout, GradientsMatchFiniteDifferences) {
  for (AttentionBackend be : kBackends)
    for (const auto& [bound, mask] : test::attention_bounds_of_9())
      test::expect_gradcheck(
          [&](const std::vector<Tensor>& in) {
            return ops::attention(in[0], in[1], in[2], mask, be, {}, {0.4f, 17});
          },
          {randn({1, 2, 9, 4}, 31), randn({1, 1, 9, 4}, 32), randn({1, 1, 9, 4}, 33)}, {},
          std::string("attention dropout ") + bname(be) + bound);
}

TEST(AttentionDropout, ParityWithPyTorchApplyingTheSameMask) {
  // gen_attention.py's *_dropout cases: the padded grouped-query case with p = 0.25, seed 77,
  // keel's mask recomputed in Python and applied as HF's eager attention applies F.dropout.
  const auto call = [](const std::vector<Tensor>& in, AttentionBackend be) {
    return ops::attention(in[0], in[1], in[2], in[3], be, {}, {0.25f, 77});
  };
  for (const char* dn : {"f32", "bf16", "f16"}) {
    test::ParityTolerance same, flash;
    if (std::string(dn) != "f32") {  // as Attention.ParityWithPyTorch's, but for dQ and dK:
      // a dS whose f32 row sum, taken in another order, straddles a rounding boundary is one ulp
      // off, and moves dQ by that ulp times a key (measured: 2 ulps of f16 in 10 of 1728 dQ
      // elements; none in bf16, whose output and dV match bit for bit, as f16's do).
      const double e = std::string(dn) == "bf16" ? 1.0 / 128 : 1.0 / 1024;
      same = {e / 64, e, e / 2, e};
      flash = {e, e, 2 * e, e};
    }
    const std::string suffix = std::string("_dropout.") + dn;
    test::expect_parity(
        "attention", "eager" + suffix, [&](auto& in) { return call(in, AttentionBackend::kEager); },
        same);
    test::expect_parity(
        "attention", "math" + suffix, [&](auto& in) { return call(in, AttentionBackend::kMath); },
        same);
    test::expect_parity(
        "attention", "math" + suffix, [&](auto& in) { return call(in, AttentionBackend::kFlash); },
        flash);
  }
}

TEST(AttentionDropout, ZeroPIsNoDropoutBitForBitAndOtherSeedsDropOtherwise) {
  const Tensor q = randn({2, 2, 40, 8}, 41), k = randn({2, 2, 40, 8}, 42),
               v = randn({2, 2, 40, 8}, 43), g = randn({2, 2, 40, 8}, 44);
  for (DType dt : {DType::F32, DType::BF16})
    for (AttentionBackend be : kBackends) {
      const std::string what = std::string(dtype_name(dt)) + " " + bname(be);
      const auto none = run(q, k, v, {}, be, {}, g, dt);
      const auto zero = run(q, k, v, {}, be, {0.f, 123}, g, dt);
      for (int i = 0; i < 4; ++i) test::expect_bitwise_equal(zero[i], none[i], what);
      const auto a = run(q, k, v, {}, be, {0.1f, 1}, g, dt)[0].to_floats();
      const auto again = run(q, k, v, {}, be, {0.1f, 1}, g, dt)[0].to_floats();
      const auto b = run(q, k, v, {}, be, {0.1f, 2}, g, dt)[0].to_floats();
      EXPECT_EQ(a, again) << what << ": one seed, one mask";
      EXPECT_NE(a, b) << what << ": another seed, another mask";
    }
}

TEST(AttentionDropout, FlashIsBitIdenticalAcrossThreadCountsAndTheMaskAcrossIsas) {
  const Tensor q = randn({2, 4, 100, 32}, 51), k = randn({2, 2, 100, 32}, 52),
               v = randn({2, 2, 100, 32}, 53), g = randn({2, 4, 100, 32}, 54);
  const ops::AttentionDropout drop{0.15f, 5};
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = run(q, k, v, {}, AttentionBackend::kFlash, drop, g, DType::BF16);
  omp_set_num_threads(3);
  const auto three = run(q, k, v, {}, AttentionBackend::kFlash, drop, g, DType::BF16);
  omp_set_num_threads(saved);
  for (int i = 0; i < 4; ++i) test::expect_bitwise_equal(one[i], three[i], "1 vs 3 threads");
  // The generic, AVX2 and AVX-512 kernels draw one mask (their f32 sums may differ in the last
  // bit, as Attention.IsaVariantsAgree says; a mask element drawn otherwise would move an output
  // by a whole probability's worth).
  test::IsaRestore restore;
  set_cpu_isa(CpuIsa::Generic);
  const auto ref = run(q, k, v, {}, AttentionBackend::kFlash, drop, g, DType::F32);
  for (CpuIsa isa : {CpuIsa::Avx2, CpuIsa::Avx512}) {
    if (static_cast<int>(isa) > static_cast<int>(restore.saved)) continue;
    set_cpu_isa(isa);
    const auto got = run(q, k, v, {}, AttentionBackend::kFlash, drop, g, DType::F32);
    for (int i = 0; i < 4; ++i)
      test::expect_close(got[i], ref[i], 2e-6, 2e-6,
                         std::string(cpu_isa_name(isa)) + " vs generic #" + std::to_string(i));
  }
}

TEST(AttentionDropout, FullyMaskedRowsStayZero) {
  const int64_t t = 7;
  const Tensor q = randn({2, 2, t, 8}, 61), k = randn({2, 1, t, 8}, 62),
               v = randn({2, 1, t, 8}, 63);
  // Batch row 0: the first two keys are padding (rows 0-1 see nothing); batch row 1: padding only.
  std::vector<int64_t> pad = {0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0};
  const ops::AttentionMask mask(Tensor::from_ints(pad, {2, t}, DType::U8));
  for (AttentionBackend be : kBackends) {
    const auto r = run(q, k, v, mask, be, {0.5f, 3}, randn({2, 2, t, 8}, 64, 100.f), DType::F32);
    const auto o = r[0].to_floats(), dq = r[1].to_floats(), dk = r[2].to_floats(),
               dv = r[3].to_floats();
    for (const auto* x : {&o, &dq, &dk, &dv})
      for (float f : *x) ASSERT_TRUE(std::isfinite(f)) << bname(be);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t d = 0; d < 8; ++d) {
        for (int64_t i = 0; i < 2; ++i) {
          EXPECT_EQ(o[(h * t + i) * 8 + d], 0.f) << bname(be);
          EXPECT_EQ(dq[(h * t + i) * 8 + d], 0.f) << bname(be);
        }
        for (int64_t i = 0; i < t; ++i) {
          EXPECT_EQ(o[((2 + h) * t + i) * 8 + d], 0.f) << bname(be);
          EXPECT_EQ(dq[((2 + h) * t + i) * 8 + d], 0.f) << bname(be);
        }
      }
    // Padding keys (batch row 0's first two, all of batch row 1's) get no gradient.
    for (int64_t d = 0; d < 8; ++d) {
      for (int64_t j = 0; j < 2; ++j) {
        EXPECT_EQ(dk[j * 8 + d], 0.f) << bname(be);
        EXPECT_EQ(dv[j * 8 + d], 0.f) << bname(be);
      }
      for (int64_t j = 0; j < t; ++j) {
        EXPECT_EQ(dk[(t + j) * 8 + d], 0.f) << bname(be);
        EXPECT_EQ(dv[(t + j) * 8 + d], 0.f) << bname(be);
      }
    }
  }
}

TEST(AttentionDropout, RejectsAProbabilityOutsideZeroOne) {
  const Tensor q = randn({1, 1, 4, 4}, 71);
  for (float p : {-0.1f, 1.f, std::nanf("")})
    EXPECT_CONTAINS(test::error_of([&] {
                      ops::attention(q, q, q, {}, {}, {}, {p, 1});
                    }),
                    "outside [0, 1)");
}

}  // namespace keel::attention_dropout_test
