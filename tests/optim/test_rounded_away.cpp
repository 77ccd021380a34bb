// Updates that round away (issue 21 item 4): the optimizer kernels count, in their own pass, the
// elements whose update was non-zero but left the stored value's bits unchanged. The counts match
// a reference taken from the weights before and after, on every ISA and thread count, without
// changing a bit of the update; bf16 at a small learning rate loses most updates, f32 masters keep
// them, and stochastic rounding (seeded from the run seed, the step and the parameter) makes them
// land on average, reproducibly.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>

#include "keel/backend/cpu/isa.h"
#include "keel/backend/optim.h"
#include "keel/optim/adamw.h"
#include "keel/optim/sgd.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using optim::AdamW;
using optim::AdamWOptions;
using optim::SGD;
using optim::SGDOptions;
using test::expect_bitwise_equal;
using test::randn;

struct Threads {
  int prev = omp_get_max_threads();
  explicit Threads(int n) { omp_set_num_threads(n); }
  ~Threads() { omp_set_num_threads(prev); }
};

// Elements whose stored bits did not change although their gradient (hence their update: step 1
// of AdamW from zero moments is -lr * g / (|g| + eps), SGD's is -lr * g) was non-zero.
int64_t unchanged_with_gradient(const Tensor& before, const Tensor& after, const Tensor& g) {
  const auto gv = g.to_floats();
  const size_t bytes = dtype_size(before.dtype());
  const auto* b = static_cast<const unsigned char*>(before.data());
  const auto* a = static_cast<const unsigned char*>(after.data());
  int64_t n = 0;
  for (size_t i = 0; i < gv.size(); ++i)
    n += gv[i] != 0.f && std::memcmp(b + i * bytes, a + i * bytes, bytes) == 0;
  return n;
}

// AdamW's and SGD's counts equal the reference in f32, bf16 and f16, with and without stochastic
// rounding, on every ISA and for 1 and 3 threads; the weights are the bits of an uncounted update.
TEST(RoundedAway, KernelCountsMatchTheWeightsBeforeAndAfter) {
  const CpuIsa best = cpu_isa();
  const int64_t n = 70001;  // several blocks and thread chunks, a ragged tail
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (double lr : {1e-3, 1e-9})
      for (bool sr : {false, true}) {
        if (sr && dt != DType::BF16) continue;
        Tensor p0 = randn({n}, 7, 1.f, dt), g = randn({n}, 8, 1.f, dt);
        Tensor gz = g.to_dtype(DType::F32);
        for (int64_t i = 0; i < n; i += 11) gz.data_as<float>()[i] = 0.f;  // no update asked
        g = gz.to_dtype(dt);
        for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512}) {
          if (static_cast<int>(isa) > static_cast<int>(best)) continue;
          set_cpu_isa(isa);
          for (int threads : {1, 3}) {
            Threads t(threads);
            const std::string what = std::string(dtype_name(dt)) + " lr " + std::to_string(lr) +
                                     (sr ? " sr " : " ") + cpu_isa_name(isa) + " " +
                                     std::to_string(threads) + " threads";
            // AdamW
            Tensor p = p0.clone(), m = Tensor::zeros({n}, dt), v = Tensor::zeros({n}, dt);
            Tensor pu = p0.clone(), mu = Tensor::zeros({n}, dt), vu = Tensor::zeros({n}, dt);
            AdamWStep s;
            s.lr = lr;
            s.stochastic_rounding = sr;
            s.seed = 99;
            optim_kernels(Device::cpu()).adamw(pu.data(), g.data(), mu.data(), vu.data(), dt, n, s);
            int64_t away = 0;
            s.rounded_away = &away;
            optim_kernels(Device::cpu()).adamw(p.data(), g.data(), m.data(), v.data(), dt, n, s);
            expect_bitwise_equal(p, pu, what + ": counting changed the update");
            EXPECT_EQ(away, unchanged_with_gradient(p0, p, g)) << "adamw " << what;
            if (lr == 1e-9) {
              EXPECT_GT(away, n / 2) << "adamw " << what;
            }
            if (lr == 1e-3 && dt == DType::F32) {
              EXPECT_EQ(away, 0) << what;
            }
            // SGD
            Tensor q = p0.clone();
            SgdStep k;
            k.lr = lr;
            k.stochastic_rounding = sr;
            k.seed = 99;
            int64_t sgd_away = 0;
            k.rounded_away = &sgd_away;
            optim_kernels(Device::cpu()).sgd(q.data(), g.data(), nullptr, dt, n, k);
            // SGD's increment -lr * g is itself 0 where lr * g underflows f32: no update asked.
            int64_t ref = 0;
            const auto gv = g.to_floats();
            for (int64_t i = 0; i < n; ++i)
              ref += static_cast<float>(-lr) * gv[i] != 0.f &&
                     std::memcmp(static_cast<const char*>(p0.data()) + i * dtype_size(dt),
                                 static_cast<const char*>(q.data()) + i * dtype_size(dt),
                                 dtype_size(dt)) == 0;
            EXPECT_EQ(sgd_away, ref) << "sgd " << what;
          }
        }
      }
  set_cpu_isa(best);
}

// bf16 weights at a small learning rate: most updates round away step after step and the weights
// stay put; f32 weights take every one; stochastic rounding makes the bf16 updates land on
// average (the weights drift as the f32 ones do), and the share of unchanged values drops.
TEST(RoundedAway, Bf16LosesSmallUpdatesAndStochasticRoundingLandsThem) {
  const int64_t n = 20000;
  const double lr = 1e-4;  // a weight of ~1 has a bf16 ulp of 2^-7 (0.0078): 1e-4 is far below
  struct Run {
    Tensor p, p0;
    double share = 0;  // mean rounded-away share over the steps
  };
  auto run = [&](DType dt, bool sr, uint64_t seed) {
    Run r;
    r.p0 = randn({n}, 21, 1.f, DType::BF16).to_dtype(dt);  // the same starting values
    r.p = r.p0.clone();
    r.p.set_requires_grad(true);
    AdamWOptions o;
    o.stochastic_rounding = sr;
    o.seed = seed;
    AdamW opt({{{r.p}, {"w"}, 0.0, 1.0}}, o);
    const int steps = 20;
    for (int s = 0; s < steps; ++s) {
      // The same gradient direction each step (a steady signal), as f32 and as the weight dtype.
      r.p.set_grad(randn({n}, 30, 1.f, DType::BF16).to_dtype(dt));
      opt.step(lr);
      EXPECT_EQ(opt.last_update().elements, n);
      r.share += opt.last_update().rounded_away_share() / steps;
    }
    return r;
  };
  auto moved = [](const Run& r) {
    const auto a = r.p0.to_floats(), b = r.p.to_floats();
    int64_t k = 0;
    for (size_t i = 0; i < a.size(); ++i) k += a[i] != b[i];
    return static_cast<double>(k) / static_cast<double>(a.size());
  };
  const Run f32 = run(DType::F32, false, 0), nearest = run(DType::BF16, false, 0),
            sr = run(DType::BF16, true, 7), sr_again = run(DType::BF16, true, 7),
            sr_other = run(DType::BF16, true, 8);
  EXPECT_EQ(f32.share, 0.0);
  EXPECT_EQ(moved(f32), 1.0);
  EXPECT_GT(nearest.share, 0.9) << "bf16 rounds nearly every update away";
  EXPECT_LT(moved(nearest), 0.2);
  EXPECT_LT(sr.share, nearest.share) << "stochastic rounding lands some updates each step";
  EXPECT_GT(moved(sr), 3 * moved(nearest)) << "and the weights move";
  // On average they move as far as the f32 weights: 20 steps of ~lr each.
  const auto a = f32.p.to_floats(), b = sr.p.to_floats(), c = nearest.p.to_floats(),
             z = f32.p0.to_floats();
  double drift_f32 = 0, drift_sr = 0, drift_nearest = 0;
  for (int64_t i = 0; i < n; ++i) {
    drift_f32 += std::fabs(a[i] - z[i]);
    drift_sr += (a[i] - z[i] > 0 ? 1 : -1) * (b[i] - z[i]);
    drift_nearest += (a[i] - z[i] > 0 ? 1 : -1) * (c[i] - z[i]);
  }
  EXPECT_NEAR(drift_sr / drift_f32, 1.0, 0.15) << "unbiased: the f32 drift on average";
  EXPECT_LT(drift_nearest / drift_f32, 0.5) << "nearest rounding loses most of it";
  // Seeded: the same seed gives the same bits and counts, another seed other bits.
  expect_bitwise_equal(sr.p, sr_again.p, "stochastic rounding, same seed");
  EXPECT_EQ(sr.share, sr_again.share);
  EXPECT_FALSE(sr.p.to_floats() == sr_other.p.to_floats());
}

// The per-step seed mixes the run seed, the parameter (slot) and its step: distinct streams, and
// the same triple always the same seed (what replay and resume rely on).
TEST(RoundedAway, RoundingSeedsDependOnSeedParameterAndStep) {
  const uint64_t s = optim::rounding_seed(1, 0, 1);
  EXPECT_EQ(s, optim::rounding_seed(1, 0, 1));
  EXPECT_NE(s, optim::rounding_seed(2, 0, 1));
  EXPECT_NE(s, optim::rounding_seed(1, 1, 1));
  EXPECT_NE(s, optim::rounding_seed(1, 0, 2));
}

// Optimizer::last_update counts only the parameters it updated; SGD's counts too.
TEST(RoundedAway, LastUpdateCountsTheUpdatedParametersOnly) {
  Tensor a = randn({300}, 1, 1.f, DType::BF16), b = randn({50}, 2, 1.f, DType::BF16);
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  a.set_grad(randn({300}, 3, 1.f, DType::BF16));  // b has no gradient: skipped
  SGD opt({{{a, b}, {"a", "b"}, 0.0, 1.0}}, SGDOptions{});
  const Tensor a0 = a.clone();
  opt.step(1e-6);
  EXPECT_EQ(opt.last_update().elements, 300);
  EXPECT_EQ(opt.last_update().rounded_away, unchanged_with_gradient(a0, a, a.grad()));
  EXPECT_GT(opt.last_update().rounded_away, 250);
  opt.step(0.5);  // large steps land
  EXPECT_LT(opt.last_update().rounded_away, 30);
}

}  // namespace
}  // namespace keel
