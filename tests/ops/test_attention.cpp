// attention (eager, math, flash): an f64 reference, rounding models of the low-precision backends,
// gradient checks, cross-backend agreement, PyTorch parity, masking, determinism and ISA variants.
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <limits>

#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "keel/ops/attention.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using ops::AttentionBackend;
using test::expect_close;
using test::IsaRestore;
using test::randn;

constexpr AttentionBackend kBackends[] = {AttentionBackend::kEager, AttentionBackend::kMath,
                                          AttentionBackend::kFlash};

std::string bname(AttentionBackend b) { return ops::attention_backend_name(b); }

Tensor mask_of(const std::vector<int64_t>& v, int64_t b, int64_t t) {
  return Tensor::from_ints(v, {b, t}, DType::U8);
}

// How the reference rounds: not at all (exact), or like one backend in a low-precision dtype.
enum class Model { kExact, kEager, kFlashOneTile };

// Reference attention, scalar loops in f64 over the stored values of q, k, v.
//   kExact:  o = sum_j softmax_j(scale * q·k_j) v_j over visible keys; 0 when none is visible.
//   kEager:  scores, probabilities and output rounded to dt where the eager backend stores them.
//   kFlashOneTile: the flash backend when every key fits one tile (T <= 64): p = exp(s - max)
//            rounded to dt for P·V, normalized by the sum of the unrounded p, output rounded.
std::vector<float> attention_ref(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& mask, Model model = Model::kExact) {
  const int64_t nb = q.size(0), hq = q.size(1), hkv = k.size(1), t = q.size(2), dd = q.size(3);
  const DType dt = model == Model::kExact ? DType::F32 : q.dtype();
  const auto qv = q.to_floats(), kv = k.to_floats(), vv = v.to_floats();
  const std::vector<int64_t> mv = mask.defined() ? mask.to_ints() : std::vector<int64_t>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(dd));
  auto rnd = [&](double x) { return static_cast<double>(round_to(dt, static_cast<float>(x))); };
  std::vector<float> o(q.numel(), 0.f);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kh = h / (hq / hkv);
      for (int64_t i = 0; i < t; ++i) {
        const float* qi = &qv[((b * hq + h) * t + i) * dd];
        std::vector<double> s(t), p(t, 0.0);
        std::vector<bool> vis(t, false);
        bool any = false;
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          vis[j] = mv.empty() || mv[b * t + j] != 0;
          if (!vis[j]) continue;
          const float* kj = &kv[((b * hkv + kh) * t + j) * dd];
          double dot = 0;
          for (int64_t d = 0; d < dd; ++d) dot += double(qi[d]) * kj[d];
          s[j] = model == Model::kEager ? rnd(scale * dot) : scale * dot;
          mx = std::max(mx, s[j]);
          any = true;
        }
        if (!any) continue;  // fully masked row: 0
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j)
          if (vis[j]) sum += (p[j] = std::exp(s[j] - mx));
        for (int64_t j = 0; j <= i; ++j) {
          if (model == Model::kExact) p[j] /= sum;
          if (model == Model::kEager) p[j] = rnd(p[j] / sum);
          if (model == Model::kFlashOneTile) p[j] = rnd(p[j]);
        }
        for (int64_t d = 0; d < dd; ++d) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j)
            if (vis[j]) acc += p[j] * vv[((b * hkv + kh) * t + j) * dd + d];
          if (model == Model::kFlashOneTile) acc /= sum;
          o[((b * hq + h) * t + i) * dd + d] =
              static_cast<float>(model == Model::kExact ? acc : rnd(acc));
        }
      }
    }
  return o;
}

struct Case {
  Tensor q, k, v, mask;
};
Case make_case(int64_t nb, int64_t hq, int64_t hkv, int64_t t, int64_t dd, uint64_t seed,
               Tensor mask = Tensor(), DType dt = DType::F32) {
  return {randn({nb, hq, t, dd}, seed, 1.f, dt), randn({nb, hkv, t, dd}, seed + 1, 1.f, dt),
          randn({nb, hkv, t, dd}, seed + 2, 1.f, dt), mask};
}

// Forward and every gradient for a given upstream gradient: {out, dq, dk, dv}.
std::vector<Tensor> run_with_grads(const Case& c, AttentionBackend be, const Tensor& gout,
                                   DType dt) {
  Tensor q = c.q.to_dtype(dt).set_requires_grad(true), k = c.k.to_dtype(dt).set_requires_grad(true),
         v = c.v.to_dtype(dt).set_requires_grad(true);
  Tensor out = ops::attention(q, k, v, c.mask, be);
  backward(out, gout.to_dtype(dt));
  return {out, q.grad(), k.grad(), v.grad()};
}

// A mask exercising every kind of row: left padding (rows that see no key), holes, and a batch row
// of padding only.
Tensor padding_mask_3x(int64_t t) {
  std::vector<int64_t> m(3 * t);
  for (int64_t j = 0; j < t; ++j) {
    m[j] = j >= 2;          // left padding: rows 0 and 1 see no key
    m[t + j] = j % 3 != 1;  // holes
    m[2 * t + j] = 0;       // nothing real
  }
  return mask_of(m, 3, t);
}

TEST(Attention, ExactReferenceIsSoftmaxWeightedValues) {
  // One head, T = 2, D = 1: row 0 sees only key 0 (output v0); row 1 mixes v0, v1 by softmax.
  Tensor q = Tensor::from_floats({0.f, 2.f}, {1, 1, 2, 1}),
         k = Tensor::from_floats({1.f, 3.f}, {1, 1, 2, 1});
  Tensor v = Tensor::from_floats({10.f, 20.f}, {1, 1, 2, 1});
  const auto o = attention_ref(q, k, v, Tensor());
  const double w1 = 1.0 / (1.0 + std::exp(2.0 - 6.0));  // softmax of (2*1, 2*3) at key 1
  EXPECT_FLOAT_EQ(o[0], 10.f);
  EXPECT_FLOAT_EQ(o[1], static_cast<float>(10 * (1 - w1) + 20 * w1));
}

TEST(Attention, ForwardMatchesReferenceInF32) {
  for (AttentionBackend be : kBackends) {
    // 130 keys: three flash key tiles and five query tiles; GQA with padding.
    Case a = make_case(1, 2, 2, 130, 64, 11);
    Case b = make_case(3, 4, 2, 80, 16, 21, padding_mask_3x(80));
    for (const Case* c : {&a, &b})
      expect_close(ops::attention(c->q, c->k, c->v, c->mask, be).to_floats(),
                   attention_ref(c->q, c->k, c->v, c->mask), 1e-5, 1e-5, "f32 " + bname(be));
  }
}

TEST(Attention, BackendsAgreeInF32ForwardAndBackward) {
  Case c = make_case(3, 4, 2, 80, 16, 31, padding_mask_3x(80));
  Tensor gout = randn(c.q.shape(), 34);
  const auto ref = run_with_grads(c, AttentionBackend::kMath, gout, DType::F32);
  const char* what[] = {"out", "dq", "dk", "dv"};
  for (AttentionBackend be : {AttentionBackend::kEager, AttentionBackend::kFlash}) {
    const auto got = run_with_grads(c, be, gout, DType::F32);
    for (int i = 0; i < 4; ++i)
      expect_close(got[i], ref[i], 1e-5, 1e-5, bname(be) + " vs math " + what[i]);
  }
}

// ---- gradient checks (f32, finite differences) --------------------------------------------------

void gradcheck_all(const Case& c, const std::string& what) {
  for (AttentionBackend be : kBackends)
    test::expect_gradcheck(
        [&](const std::vector<Tensor>& in) {
          return ops::attention(in[0], in[1], in[2], c.mask, be);
        },
        {c.q.clone(), c.k.clone(), c.v.clone()}, {}, what + " " + bname(be));
}

TEST(Attention, GradcheckMultiHead) { gradcheck_all(make_case(1, 2, 2, 5, 4, 41), "mha"); }

TEST(Attention, GradcheckGroupedQuery) { gradcheck_all(make_case(2, 4, 2, 6, 4, 51), "gqa"); }

TEST(Attention, GradcheckPaddingMask) {
  // Left padding, holes, and a batch row whose keys are all padding; two query heads per kv head.
  gradcheck_all(make_case(3, 2, 1, 5, 4, 61, padding_mask_3x(5)), "padding");
}

// ---- low precision ------------------------------------------------------------------------------

// Every backend within the dtype's tolerance of the exact reference, on rounded inputs. Errors
// come from rounding the probabilities (and, eager, the scores: |Δs| <= |s| eps/2 with |s| up to ~4
// here) and the output: atol 4 eps, rtol 2 eps.
TEST(Attention, LowPrecisionWithinDtypeToleranceOfReference) {
  for (DType dt : {DType::BF16, DType::F16})
    for (AttentionBackend be : kBackends) {
      Case c = make_case(3, 4, 2, 48, 16, 71, padding_mask_3x(48), dt);
      Tensor o = ops::attention(c.q, c.k, c.v, c.mask, be);
      EXPECT_EQ(o.dtype(), dt);
      const double e = test::eps_of(dt);
      expect_close(o.to_floats(), attention_ref(c.q, c.k, c.v, c.mask), 4 * e, 2 * e,
                   std::string(dtype_name(dt)) + " " + bname(be) + " vs exact");
    }
}

// eager and flash round at different points; each matches the model of its own rounding (up to
// rare one-ulp flips from f32 vs f64 accumulation before a rounding), and they differ from each
// other by more than that.
TEST(Attention, EagerAndFlashDifferAsTheirRoundingSays) {
  for (DType dt : {DType::BF16, DType::F16}) {
    Case c = make_case(2, 2, 2, 48, 16, 81, Tensor(), dt);  // 48 keys: one flash key tile
    const auto eager = ops::attention(c.q, c.k, c.v, c.mask, AttentionBackend::kEager).to_floats();
    const auto flash = ops::attention(c.q, c.k, c.v, c.mask, AttentionBackend::kFlash).to_floats();
    const auto eager_model = attention_ref(c.q, c.k, c.v, c.mask, Model::kEager);
    const auto flash_model = attention_ref(c.q, c.k, c.v, c.mask, Model::kFlashOneTile);
    auto ulps_off = [&](const std::vector<float>& a, const std::vector<float>& m) {
      int64_t n = 0;  // elements more than one ulp of dt away
      for (size_t i = 0; i < a.size(); ++i)
        n += std::fabs(a[i] - m[i]) > std::fabs(m[i]) * test::eps_of(dt) + 1e-6;
      return n;
    };
    const int64_t total = static_cast<int64_t>(eager.size());
    const std::string d = dtype_name(dt);
    EXPECT_LE(ulps_off(eager, eager_model), total / 100) << d << ": eager vs its rounding model";
    EXPECT_LE(ulps_off(flash, flash_model), total / 100) << d << ": flash vs its rounding model";
    EXPECT_GE(ulps_off(eager, flash_model), total / 20) << d << ": eager should not fit flash's";
    EXPECT_GE(ulps_off(flash, eager_model), total / 20) << d << ": flash should not fit eager's";
  }
}

// Low-precision gradients against f32 math gradients on the same rounded inputs.
TEST(Attention, LowPrecisionGradientsTrackF32) {
  for (DType dt : {DType::BF16, DType::F16}) {
    Case c = make_case(3, 4, 2, 40, 16, 91, padding_mask_3x(40), dt);
    Tensor gout = randn(c.q.shape(), 94, 1.f, dt);
    const auto ref = run_with_grads(c, AttentionBackend::kMath, gout, DType::F32);
    const char* what[] = {"out", "dq", "dk", "dv"};
    const double e = test::eps_of(dt);
    for (AttentionBackend be : kBackends) {
      const auto got = run_with_grads(c, be, gout, dt);
      for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(got[i].dtype(), dt);
        // Gradients sum ~T rounded terms of size ~1 (measured worst: about 1 eps).
        expect_close(got[i], ref[i], 4 * e, 2 * e,
                     std::string(dtype_name(dt)) + " " + bname(be) + " " + what[i]);
      }
    }
  }
}

// ---- PyTorch parity -----------------------------------------------------------------------------

Tensor call(const std::vector<Tensor>& in, AttentionBackend be) {
  return ops::attention(in[0], in[1], in[2], in.size() > 3 ? in[3] : Tensor(), be);
}

TEST(Attention, ParityWithPyTorch) {
  for (const char* dn : {"f32", "bf16", "f16"})
    for (const char* cs : {"", "_gqa_pad"}) {
      const std::string suffix = std::string(cs) + "." + dn;
      // eager and math compute what their fixtures model, rounding at the same points: they may
      // differ by one ulp where f32 sums in another order straddle a rounding boundary.
      // flash against the f32-intermediate fixture: its P (and dS in backward) is rounded to the
      // dtype, an error of eps/2 per probability, so about an eps of absolute tolerance.
      test::ParityTolerance same, flash;
      if (std::string(dn) != "f32") {
        const double e = std::string(dn) == "bf16" ? 1.0 / 128 : 1.0 / 1024;
        same = {e / 64, e, e / 64, e};
        flash = {e, e, 2 * e, e};
      }
      test::expect_parity(
          "attention", "eager" + suffix,
          [](auto& in) { return call(in, AttentionBackend::kEager); }, same);
      test::expect_parity(
          "attention", "math" + suffix, [](auto& in) { return call(in, AttentionBackend::kMath); },
          same);
      test::expect_parity(
          "attention", "math" + suffix, [](auto& in) { return call(in, AttentionBackend::kFlash); },
          flash);
    }
}

// ---- masking ------------------------------------------------------------------------------------

TEST(Attention, FullyMaskedRowsAreZeroWithZeroFiniteGradients) {
  const int64_t t = 7;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (AttentionBackend be : kBackends) {
      Case c = make_case(3, 2, 1, t, 8, 101, padding_mask_3x(t));
      // Large upstream gradients: masked scores must not turn into inf or NaN anywhere.
      Tensor gout = randn(c.q.shape(), 104, 100.f);
      const auto r = run_with_grads(c, be, gout, dt);
      const std::string what = std::string(dtype_name(dt)) + " " + bname(be);
      const auto o = r[0].to_floats(), dq = r[1].to_floats(), dk = r[2].to_floats(),
                 dv = r[3].to_floats();
      for (const auto* g : {&o, &dq, &dk, &dv})
        for (float x : *g) ASSERT_TRUE(std::isfinite(x)) << what;
      const int64_t dd = 8, hq = 2;
      for (int64_t h = 0; h < hq; ++h) {
        for (int64_t i = 0; i < 2; ++i)  // batch 0, rows 0-1: left padding
          for (int64_t d = 0; d < dd; ++d) {
            EXPECT_EQ(o[((0 * hq + h) * t + i) * dd + d], 0.f) << what;
            EXPECT_EQ(dq[((0 * hq + h) * t + i) * dd + d], 0.f) << what;
          }
        for (int64_t x = 0; x < t * dd; ++x) {  // batch 2: padding only
          EXPECT_EQ(o[(2 * hq + h) * t * dd + x], 0.f) << what;
          EXPECT_EQ(dq[(2 * hq + h) * t * dd + x], 0.f) << what;
        }
      }
      for (int64_t x = 0; x < t * dd; ++x) {  // batch 2's keys and values get nothing
        EXPECT_EQ(dk[2 * t * dd + x], 0.f) << what;
        EXPECT_EQ(dv[2 * t * dd + x], 0.f) << what;
      }
      for (int64_t d = 0; d < dd; ++d)  // padding keys 0-1 of batch 0 get nothing
        for (int64_t j = 0; j < 2; ++j) {
          EXPECT_EQ(dk[j * dd + d], 0.f) << what;
          EXPECT_EQ(dv[j * dd + d], 0.f) << what;
        }
    }
}

TEST(Attention, PaddingKeysDoNotInfluenceAnything) {
  // Huge k and v at a padding key: its scores and dO·v overflow to inf, but a masked key must
  // change no output and no gradient (dK, dV of the padding key are 0).
  const int64_t t = 6, dd = 4;
  Tensor mask = mask_of({1, 1, 0, 1, 1, 1}, 1, t);
  Tensor ones = Tensor::full({1, 2, t, dd}, 1.f);
  for (AttentionBackend be : kBackends) {
    Case a = make_case(1, 2, 1, t, dd, 111, mask);
    Case b = a;
    b.k = a.k.clone();
    b.v = a.v.clone();
    for (int64_t d = 0; d < dd; ++d) {  // key 2 is padding
      b.k.data_as<float>()[2 * dd + d] = 3e38f;
      b.v.data_as<float>()[2 * dd + d] = 3e38f;
    }
    const auto ra = run_with_grads(a, be, ones, DType::F32);
    const auto rb = run_with_grads(b, be, ones, DType::F32);
    for (int i = 0; i < 4; ++i) test::expect_bitwise_equal(ra[i], rb[i], bname(be));
    for (int i = 2; i < 4; ++i)
      for (int64_t d = 0; d < dd; ++d) EXPECT_EQ(rb[i].to_floats()[2 * dd + d], 0.f) << bname(be);
  }
}

TEST(Attention, MaskedAndUnmaskedSoftmaxRowsHaveTheSameBits) {
  // The eager and math softmax run vectorized loops for a batch whose mask hides nothing, and the
  // masked loops otherwise; both sum in the same 16 lanes. Hiding only the last key of batch 0
  // sends it down the masked loops while its rows 0..t-2 see exactly the keys they saw without a
  // mask: their outputs and dQ must keep every bit. 70 keys: four full lanes and a tail.
  const int64_t nb = 2, hq = 4, t = 70, dd = 16;
  std::vector<int64_t> m(nb * t, 1);
  m[t - 1] = 0;
  for (DType dt : {DType::F32, DType::BF16})
    for (AttentionBackend be : kBackends) {
      Case plain = make_case(nb, hq, 2, t, dd, 161);
      Case masked = plain;
      masked.mask = mask_of(m, nb, t);
      Tensor gout = randn(plain.q.shape(), 164);
      const auto a = run_with_grads(plain, be, gout, dt), b = run_with_grads(masked, be, gout, dt);
      const std::string what = std::string(dtype_name(dt)) + " " + bname(be);
      for (int i : {0, 1}) {  // out, dq: [nb, hq, t, dd]
        const auto fa = a[i].to_floats(), fb = b[i].to_floats();
        for (int64_t h = 0; h < nb * hq; ++h)
          for (int64_t r = 0; r < t - 1; ++r)
            for (int64_t d = 0; d < dd; ++d) {
              const int64_t at = (h * t + r) * dd + d;
              ASSERT_EQ(std::bit_cast<uint32_t>(fa[at]), std::bit_cast<uint32_t>(fb[at]))
                  << what << " output " << i << " head " << h << " row " << r;
            }
      }
    }
}

TEST(Attention, NaNInAVisibleKeyPropagates) {
  for (AttentionBackend be : kBackends) {
    Case c = make_case(1, 1, 1, 4, 4, 121);
    c.k.data_as<float>()[1 * 4] = std::numeric_limits<float>::quiet_NaN();  // key 1
    const auto o = ops::attention(c.q, c.k, c.v, c.mask, be).to_floats();
    for (int64_t d = 0; d < 4; ++d) {
      EXPECT_FALSE(std::isnan(o[d])) << bname(be) << ": row 0 does not see key 1";
      for (int64_t i = 1; i < 4; ++i) EXPECT_TRUE(std::isnan(o[i * 4 + d])) << bname(be);
    }
  }
}

// ---- determinism and ISA variants ---------------------------------------------------------------

TEST(Attention, BitIdenticalAcrossRuns) {
  Case c = make_case(2, 4, 2, 70, 16, 131, padding_mask_3x(70).slice_rows(0, 2));
  for (DType dt : {DType::F32, DType::BF16})
    for (AttentionBackend be : kBackends) {
      Tensor gout = randn(c.q.shape(), 134);
      const auto r1 = run_with_grads(c, be, gout, dt), r2 = run_with_grads(c, be, gout, dt);
      for (int i = 0; i < 4; ++i)
        test::expect_bitwise_equal(r1[i], r2[i], std::string(dtype_name(dt)) + " " + bname(be));
    }
}

// dV's operand P in the compute dtype comes from the softmax backward when dq or dk is wanted too,
// and from a conversion of its own when only dv is: the same bits either way.
TEST(Attention, ValueGradientIsTheSameWithOrWithoutTheOthers) {
  Case c = make_case(2, 4, 2, 70, 16, 141, padding_mask_3x(70).slice_rows(0, 2));
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (AttentionBackend be : {AttentionBackend::kEager, AttentionBackend::kMath}) {
      const Tensor gout = randn(c.q.shape(), 144).to_dtype(dt);
      const Tensor all = run_with_grads(c, be, gout, dt)[3];
      Tensor q = c.q.to_dtype(dt), k = c.k.to_dtype(dt);
      Tensor v = c.v.to_dtype(dt).set_requires_grad(true);
      backward(ops::attention(q, k, v, c.mask, be), gout);
      test::expect_bitwise_equal(v.grad(), all, std::string(dtype_name(dt)) + " " + bname(be));
    }
}

TEST(Attention, FlashIsBitIdenticalAcrossThreadCounts) {
  // Big enough that every flash pass splits its work items across threads.
  Case c = make_case(2, 4, 2, 100, 32, 141, padding_mask_3x(100).slice_rows(0, 2));
  Tensor gout = randn(c.q.shape(), 144);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = run_with_grads(c, AttentionBackend::kFlash, gout, DType::BF16);
  omp_set_num_threads(3);
  const auto three = run_with_grads(c, AttentionBackend::kFlash, gout, DType::BF16);
  omp_set_num_threads(saved);
  for (int i = 0; i < 4; ++i) test::expect_bitwise_equal(one[i], three[i], "1 vs 3 threads");
}

// The generic, AVX2 and AVX-512 builds of the kernels agree. Not bitwise: the AVX builds contract
// a*b+c into FMA, so scores can differ in the last f32 bit (and, rarely, a rounding to the
// low-precision dtype flips by one ulp).
TEST(Attention, IsaVariantsAgree) {
  IsaRestore restore;
  Case c = make_case(3, 4, 2, 70, 16, 151, padding_mask_3x(70));
  Tensor gout = randn(c.q.shape(), 154);
  for (DType dt : {DType::F32, DType::BF16})
    for (AttentionBackend be : kBackends) {
      set_cpu_isa(CpuIsa::Generic);
      const auto ref = run_with_grads(c, be, gout, dt);
      for (CpuIsa isa : {CpuIsa::Avx2, CpuIsa::Avx512}) {
        if (static_cast<int>(isa) > static_cast<int>(restore.saved)) continue;
        set_cpu_isa(isa);
        const auto got = run_with_grads(c, be, gout, dt);
        const double e = test::eps_of(dt);
        for (int i = 0; i < 4; ++i)
          expect_close(got[i], ref[i], dt == DType::F32 ? 2e-6 : 2 * e, dt == DType::F32 ? 2e-6 : e,
                       std::string(cpu_isa_name(isa)) + " vs generic " + dtype_name(dt) + " " +
                           bname(be) + " #" + std::to_string(i));
      }
    }
}

// ---- names and errors ---------------------------------------------------------------------------

TEST(Attention, BackendNames) {
  for (AttentionBackend be : kBackends)
    EXPECT_EQ(ops::attention_backend_from_name(ops::attention_backend_name(be)), be);
  try {
    ops::attention_backend_from_name("sdpa");
    FAIL() << "expected an Error";
  } catch (const Error& err) {
    const std::string m = err.what();
    for (const char* w : {"sdpa", "eager", "math", "flash"})
      EXPECT_NE(m.find(w), std::string::npos) << m;
  }
}

TEST(Attention, EmptySequenceGivesEmptyOutputAndGradients) {
  for (AttentionBackend be : kBackends) {
    // (zeros, not randn/from_ints: those memcpy from an empty vector's null data())
    Case c{Tensor::zeros({2, 2, 0, 4}), Tensor::zeros({2, 1, 0, 4}), Tensor::zeros({2, 1, 0, 4}),
           Tensor::zeros({2, 0}, DType::U8)};
    const auto r = run_with_grads(c, be, Tensor::zeros({2, 2, 0, 4}), DType::F32);
    EXPECT_EQ(r[0].shape(), (Shape{2, 2, 0, 4})) << bname(be);
    EXPECT_EQ(r[2].shape(), (Shape{2, 1, 0, 4})) << bname(be);
  }
}

TEST(Attention, RejectsBadInputs) {
  Case c = make_case(2, 4, 2, 5, 4, 161);
  auto attn = [](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& m = Tensor()) {
    return ops::attention(q, k, v, m);
  };
  EXPECT_THROW(attn(c.q, c.k, c.v.to_dtype(DType::BF16)), Error);                  // mixed dtypes
  EXPECT_THROW(attn(c.q, randn({2, 3, 5, 4}, 1), randn({2, 3, 5, 4}, 2)), Error);  // 4 % 3
  EXPECT_THROW(attn(c.q, c.k, randn({2, 2, 6, 4}, 3)), Error);               // k, v shapes differ
  EXPECT_THROW(attn(c.q.view({8, 5, 4}), c.k, c.v), Error);                  // not 4-D
  EXPECT_THROW(attn(c.q, c.k, c.v, mask_of({1, 1, 1, 1, 1}, 1, 5)), Error);  // mask [1, T]
  EXPECT_THROW(attn(c.q, c.k, c.v, Tensor::from_ints(std::vector<int64_t>(10, 1), {2, 5})),
               Error);  // i64 mask
  std::vector<int64_t> two(10, 1);
  two[3] = 2;
  try {
    attn(c.q, c.k, c.v, mask_of(two, 2, 5));
    FAIL() << "expected an Error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("[0, 3]"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace keel
