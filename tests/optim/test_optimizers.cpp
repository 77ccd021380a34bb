// AdamW and SGD: parity with torch.optim over 5 steps (two groups, a skipped parameter), an f64
// scalar reference of one update, a closed-form case (ggml test-opt style), stochastic rounding,
// every ISA variant bit for bit, determinism, state round trips and the HF decay grouping.
// (Optimizers have no gradient of their own: the finite-difference check does not apply.)
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <memory>

#include "keel/backend/cpu/isa.h"
#include "keel/backend/optim.h"
#include "keel/io/safetensors.h"
#include "keel/optim/adamw.h"
#include "keel/optim/sgd.h"
#include "tests/support/check.h"
#include "tests/support/standard_safetensors.h"

namespace keel {
namespace {

using optim::AdamW;
using optim::AdamWOptions;
using optim::NamedTensors;
using optim::Optimizer;
using optim::ParamGroup;
using optim::SGD;
using optim::SGDOptions;
using test::eps_of;
using test::expect_bitwise_equal;
using test::expect_close;
using test::randn;

const io::Safetensors& fx() { return test::fixture("optim"); }
Tensor fxt(const std::string& k) { return fx().at(k).clone(); }

Tensor find_state(const Optimizer& opt, const std::string& key) {
  for (auto& [k, t] : opt.state())
    if (k == key) return t;
  return Tensor();
}

// ---- f64 scalar references (obviously correct, llm.c style) ----------------------------------

// One torch.optim.AdamW update of stored values, in f64.
void adamw_ref(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& m,
               std::vector<double>& v, double lr, double b1, double b2, double eps, double wd,
               int64_t t) {
  const double bc1 = 1 - std::pow(b1, double(t)), bc2 = 1 - std::pow(b2, double(t));
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] *= 1 - lr * wd;
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + eps;
    p[i] -= lr / bc1 * m[i] / denom;
  }
}

// One torch.optim.SGD update, in f64.
void sgd_ref(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& buf,
             double lr, double mom, double damp, double wd, bool nesterov, bool first) {
  for (size_t i = 0; i < p.size(); ++i) {
    double d = g[i] + wd * p[i];
    if (mom != 0) {
      buf[i] = first ? d : mom * buf[i] + (1 - damp) * d;
      d = nesterov ? d + mom * buf[i] : buf[i];
    }
    p[i] -= lr * d;
  }
}

std::vector<double> as_f64(const Tensor& t) {
  auto f = t.to_floats();
  return std::vector<double>(f.begin(), f.end());
}
std::vector<float> rounded(const std::vector<double>& v, DType dt) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = round_to(dt, static_cast<float>(v[i]));
  return out;
}

// ---- PyTorch parity --------------------------------------------------------------------------

using MakeOpt = std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup>,
                                                         const std::vector<float>& hyper)>;

void expect_torch_parity(const std::string& c, DType dt, const MakeOpt& make,
                         const std::vector<std::string>& kinds) {
  const auto hyper = fx().at(c + ".hyper").to_floats();
  const auto lrs = fx().at(c + ".lr").to_floats();
  std::vector<Tensor> ps;
  for (int k = 0; k < 3; ++k) {
    ps.push_back(fxt(c + ".init.p" + std::to_string(k)));
    ASSERT_EQ(ps.back().dtype(), dt);
    ps.back().set_requires_grad(true);
  }
  std::vector<ParamGroup> groups(2);
  groups[0] = {{ps[0], ps[2]}, {"p0", "p2"}, hyper[3], 1.0};
  groups[1] = {{ps[1]}, {"p1"}, hyper[4], hyper[5]};
  auto opt = make(groups, hyper);
  // f32: PyTorch fuses some multiply-adds (vec::fmadd) where keel rounds each op, so a few ulps.
  // bf16/f16: the emulated fixture rounds once per step like keel; one ulp for a tie flip.
  const double rtol = dt == DType::F32 ? 1e-5 : eps_of(dt);
  const double atol = dt == DType::F32 ? 1e-7 : eps_of(dt) * 1e-3;
  for (int s = 1; s <= 5; ++s) {
    for (int k = 0; k < 3; ++k) {
      const std::string key = c + ".s" + std::to_string(s) + ".grad.p" + std::to_string(k);
      ps[k].set_grad(fx().find(key) ? fxt(key) : Tensor());
    }
    opt->step(lrs[s - 1]);
    for (int k = 0; k < 3; ++k) {
      const std::string sk = c + ".s" + std::to_string(s);
      const std::string pk = ".p" + std::to_string(k);
      expect_close(ps[k], fx().at(sk + pk), atol, rtol, sk + pk);
      for (const auto& kind : kinds)
        expect_close(find_state(*opt, "p" + std::to_string(k) + "." + kind),
                     fx().at(sk + "." + kind + pk), atol, rtol, sk + "." + kind + pk);
    }
  }
  // Parameter 2 had no gradient at step 3: its own count lags (bias corrections use it).
  EXPECT_EQ(find_state(*opt, "p2.step").to_ints()[0], 4);
  EXPECT_EQ(find_state(*opt, "p0.step").to_ints()[0], 5);
  EXPECT_EQ(opt->step_count(), 5);
}

TEST(AdamW, MatchesTorchOverFiveStepsInEveryDtype) {
  for (auto [dn, dt] : {std::pair{"f32", DType::F32}, {"bf16", DType::BF16}, {"f16", DType::F16}}) {
    SCOPED_TRACE(dn);
    expect_torch_parity(std::string("adamw.") + dn, dt,
                        [](std::vector<ParamGroup> g, const std::vector<float>& h) {
                          AdamWOptions o;
                          o.beta1 = h[0];
                          o.beta2 = h[1];
                          o.eps = h[2];
                          return std::make_unique<AdamW>(std::move(g), o);
                        },
                        {"exp_avg", "exp_avg_sq"});
  }
}

TEST(SGD, MatchesTorchOverFiveStepsInEveryDtype) {
  for (auto [dn, dt] : {std::pair{"f32", DType::F32}, {"bf16", DType::BF16}, {"f16", DType::F16}}) {
    SCOPED_TRACE(dn);
    expect_torch_parity(std::string("sgd.") + dn, dt,
                        [](std::vector<ParamGroup> g, const std::vector<float>& h) {
                          SGDOptions o;
                          o.momentum = h[0];
                          o.dampening = h[1];
                          return std::make_unique<SGD>(std::move(g), o);
                        },
                        {"momentum_buffer"});
  }
  expect_torch_parity("sgd_nesterov.f32", DType::F32,
                      [](std::vector<ParamGroup> g, const std::vector<float>& h) {
                        SGDOptions o;
                        o.momentum = h[0];
                        o.nesterov = true;
                        return std::make_unique<SGD>(std::move(g), o);
                      },
                      {"momentum_buffer"});
}

// ---- f64 reference ---------------------------------------------------------------------------

TEST(AdamW, KernelMatchesF64ReferenceInEveryDtype) {
  const int64_t n = 3001;  // vector body and tail
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    Tensor p = randn({n}, 1, 1.0f, dt), m = Tensor::zeros({n}, dt), v = Tensor::zeros({n}, dt);
    AdamWStep s;
    s.lr = 3e-2;
    s.beta1 = 0.9;
    s.beta2 = 0.99;
    s.eps = 1e-6;
    s.weight_decay = 0.1;
    for (int64_t t = 1; t <= 4; ++t) {  // build up non-trivial state first
      Tensor g = randn({n}, 10 + t, 0.5f, dt);
      s.step = t;
      optim_kernels(Device::cpu()).adamw(p.data(), g.data(), m.data(), v.data(), dt, n, s);
    }
    // One update from the stored values, f64 throughout in the reference.
    Tensor g = randn({n}, 99, 0.5f, dt);
    std::vector<double> p0 = as_f64(p), m0 = as_f64(m), v0 = as_f64(v), g0 = as_f64(g);
    s.step = 5;
    optim_kernels(Device::cpu()).adamw(p.data(), g.data(), m.data(), v.data(), dt, n, s);
    adamw_ref(p0, g0, m0, v0, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step);
    // One rounding to dt of an f32 computation: atol + |ref| * eps(dt) (f32: a few ulps).
    const double rtol = dt == DType::F32 ? 8 * eps_of(dt) : eps_of(dt);
    const std::string what = std::string("adamw vs f64 ") + dtype_name(dt);
    expect_close(p.to_floats(), rounded(p0, dt), 1e-7, rtol, what + " p");
    expect_close(m.to_floats(), rounded(m0, dt), 1e-7, rtol, what + " m");
    expect_close(v.to_floats(), rounded(v0, dt), 1e-9, rtol, what + " v");
  }
}

TEST(SGD, KernelMatchesF64ReferenceInEveryDtype) {
  const int64_t n = 2049;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (bool nesterov : {false, true}) {
      Tensor p = randn({n}, 3, 1.0f, dt), buf = Tensor::zeros({n}, dt);
      for (int t = 1; t <= 3; ++t) {
        Tensor g = randn({n}, 20 + t, 1.0f, dt);
        std::vector<double> p0 = as_f64(p), b0 = as_f64(buf), g0 = as_f64(g);
        SgdStep s;
        s.lr = 0.05;
        s.momentum = 0.9;
        s.dampening = nesterov ? 0.0 : 0.25;
        s.weight_decay = 0.01;
        s.nesterov = nesterov;
        s.first = t == 1;
        optim_kernels(Device::cpu()).sgd(p.data(), g.data(), buf.data(), dt, n, s);
        sgd_ref(p0, g0, b0, s.lr, s.momentum, s.dampening, s.weight_decay, nesterov, s.first);
        // momentum*buf + (1-dampening)*d cancels: f32 rounding of O(1) operands gives an
        // absolute error of a few 2^-24, hence atol 1e-6 in f32.
        const double rtol = dt == DType::F32 ? 8 * eps_of(dt) : eps_of(dt);
        const double atol = dt == DType::F32 ? 1e-6 : 1e-7;
        const std::string what = std::string("sgd vs f64 ") + dtype_name(dt) + " step " +
                                 std::to_string(t) + (nesterov ? " nesterov" : "");
        expect_close(p.to_floats(), rounded(p0, dt), atol, rtol, what + " p");
        expect_close(buf.to_floats(), rounded(b0, dt), atol, rtol, what + " buf");
      }
    }
}

// ---- closed form (ggml test-opt) -------------------------------------------------------------

// lr = 1, beta1 = beta2 = eps = 0: m = g, v = g^2, no bias correction (1 - 0^t = 1), so
// p <- p * (1 - wd) - g / |g| = p * (1 - wd) - sign(g), exactly, in every dtype.
TEST(AdamW, ClosedFormWithZeroBetas) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (double wd : {0.0, 0.5}) {
      Tensor p = Tensor::from_floats({3.f, -2.f, 0.5f, 10.f}, {2, 2}, dt);
      p.set_requires_grad(true);
      AdamWOptions o;
      o.beta1 = 0;
      o.beta2 = 0;
      o.eps = 0;
      AdamW opt({{{p}, {"w"}, wd, 1.0}}, o);
      std::vector<float> expect = {3.f, -2.f, 0.5f, 10.f};
      const std::vector<std::vector<float>> grads = {{2.f, -0.25f, 4.f, -1e-3f},
                                                     {-8.f, 0.5f, 1.f, 3.f}};
      for (const auto& gv : grads) {
        p.set_grad(Tensor::from_floats(gv, {2, 2}, dt));
        opt.step(1.0);
        for (size_t i = 0; i < 4; ++i)
          expect[i] = static_cast<float>(expect[i] * (1 - wd) - (gv[i] > 0 ? 1 : -1));
        EXPECT_EQ(p.to_floats(), expect) << dtype_name(dt) << " wd " << wd;
      }
      // m = g and v = g^2 of the last step, exactly.
      EXPECT_EQ(find_state(opt, "w.exp_avg").to_floats(),
                Tensor::from_floats(grads[1], {2, 2}, dt).to_floats());
      EXPECT_EQ(find_state(opt, "w.exp_avg_sq").to_floats(),
                (std::vector<float>{64.f, 0.25f, 1.f, 9.f}));
    }
}

// lr = 0.5, momentum 0.5, powers of two: every value is exact.
TEST(SGD, ClosedFormMomentum) {
  Tensor p = Tensor::from_floats({1.f, -1.f}, {2});
  p.set_requires_grad(true);
  SGDOptions o;
  o.momentum = 0.5;
  SGD opt({{{p}, {"w"}, 0.0, 1.0}}, o);
  p.set_grad(Tensor::from_floats({2.f, 4.f}, {2}));
  opt.step(0.5);  // buf = g = [2, 4]; p = [1 - 1, -1 - 2]
  EXPECT_EQ(p.to_floats(), (std::vector<float>{0.f, -3.f}));
  opt.step(0.5);  // buf = 0.5*[2, 4] + [2, 4] = [3, 6]; p = [0 - 1.5, -3 - 3]
  EXPECT_EQ(p.to_floats(), (std::vector<float>{-1.5f, -6.f}));
  EXPECT_EQ(find_state(opt, "w.momentum_buffer").to_floats(), (std::vector<float>{3.f, 6.f}));
}

// ---- stochastic rounding ---------------------------------------------------------------------

// 1 - 2^-10 lies a quarter of the way from 1 down to the next bf16 below (1 - 2^-8): nearest-even
// always keeps 1; stochastic rounding goes down a quarter of the time, so the mean is exact.
TEST(SGD, StochasticRoundingIsUnbiasedForBf16) {
  const int64_t n = 1 << 16;
  for (bool sr : {false, true}) {
    Tensor p = Tensor::full({n}, 1.f, DType::BF16);
    p.set_requires_grad(true);
    p.set_grad(Tensor::full({n}, std::ldexp(1.f, -10), DType::BF16));
    SGDOptions o;
    o.stochastic_rounding = sr;
    o.seed = 5;
    SGD opt({{{p}, {"w"}, 0.0, 1.0}}, o);
    opt.step(1.0);
    double sum = 0;
    for (float x : p.to_floats()) {
      ASSERT_TRUE(x == 1.f || x == 1.f - std::ldexp(1.f, -8)) << x;
      sum += x;
    }
    const double mean = sum / n, exact = 1.0 - std::ldexp(1.0, -10);
    if (sr)
      EXPECT_NEAR(mean, exact, 5e-5);  // std of the mean: 2^-8 * sqrt(3/16 / n) = 6.6e-6
    else
      EXPECT_EQ(mean, 1.0);
  }
}

// Each stochastically rounded value is one of the two bf16 neighbours of the f32 result, the
// pattern depends on the seed only (not on threads), and the f16 request is refused.
TEST(AdamW, StochasticRoundingBracketsTheF32Result) {
  const int64_t n = 10007;
  Tensor p32 = randn({n}, 4, 1.0f, DType::BF16).to_dtype(DType::F32);
  Tensor g32 = randn({n}, 5, 1.0f, DType::BF16).to_dtype(DType::F32);
  Tensor m32 = Tensor::zeros({n}), v32 = Tensor::zeros({n});
  AdamWStep s;
  s.lr = 1e-3;
  s.step = 1;
  optim_kernels(Device::cpu())
      .adamw(p32.data(), g32.data(), m32.data(), v32.data(), DType::F32, n, s);
  auto run = [&](uint64_t seed, int threads) {
    Tensor p = randn({n}, 4, 1.0f, DType::BF16), g = randn({n}, 5, 1.0f, DType::BF16);
    Tensor m = Tensor::zeros({n}, DType::BF16), v = Tensor::zeros({n}, DType::BF16);
    AdamWStep k = s;
    k.stochastic_rounding = true;
    k.seed = seed;
    const int prev = omp_get_max_threads();
    omp_set_num_threads(threads);
    optim_kernels(Device::cpu()).adamw(p.data(), g.data(), m.data(), v.data(), DType::BF16, n, k);
    omp_set_num_threads(prev);
    return p;
  };
  Tensor a = run(1, 2), b = run(1, 1), c = run(2, 2);
  expect_bitwise_equal(a, b, "stochastic rounding vs thread count");
  const auto av = a.to_floats(), cv = c.to_floats(), ref = p32.to_floats();
  int differ = 0, up = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float lo = bf16_bits_to_f32(static_cast<uint16_t>(f32_bits(ref[i]) >> 16));
    const float hi = bf16_bits_to_f32(static_cast<uint16_t>((f32_bits(ref[i]) >> 16) + 1));
    ASSERT_TRUE(av[i] == lo || av[i] == hi || av[i] == ref[i]) << i << ": " << av[i];
    differ += av[i] != cv[i];
    up += av[i] == hi && hi != ref[i];
  }
  EXPECT_GT(differ, n / 10) << "another seed gives another pattern";
  EXPECT_GT(up, n / 10);
  EXPECT_LT(up, n * 9 / 10);

  Tensor h = Tensor::zeros({2, 2}, DType::F16);
  h.set_requires_grad(true);
  AdamWOptions o;
  o.stochastic_rounding = true;
  EXPECT_THROW(AdamW({{{h}, {"h"}, 0.0, 1.0}}, o), Error);
}

// ---- ISA variants, determinism ---------------------------------------------------------------

TEST(OptimKernels, EveryIsaComputesTheSameBits) {
  const int64_t n = 70001;  // several parallel chunks, vector tails
  const CpuIsa best = cpu_isa();
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    Tensor p0 = randn({n}, 7, 1.0f, dt), g = randn({n}, 8, 1e-2f, dt);
    Tensor m0 = randn({n}, 9, 1e-3f, dt), v0 = randn({n}, 10, 1e-3f, dt);
    // v must be non-negative: square it.
    {
      auto vv = v0.to_floats();
      for (auto& x : vv) x = x * x;
      v0 = Tensor::from_floats(vv, {n}, dt);
    }
    Tensor ref_adamw, ref_m, ref_v, ref_sgd, ref_buf, ref_sr, ref_unscale;
    int64_t ref_bad = -1;
    for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512}) {
      if (static_cast<int>(isa) > static_cast<int>(best)) continue;
      set_cpu_isa(isa);
      const auto& k = optim_kernels(Device::cpu());
      Tensor p = p0.clone(), m = m0.clone(), v = v0.clone();
      AdamWStep s;
      s.lr = 1e-2;
      s.weight_decay = 0.1;
      s.step = 3;
      k.adamw(p.data(), g.data(), m.data(), v.data(), dt, n, s);
      Tensor q = p0.clone(), buf = m0.clone();
      SgdStep t;
      t.lr = 0.1;
      t.momentum = 0.9;
      t.dampening = 0.1;
      t.weight_decay = 0.01;
      k.sgd(q.data(), g.data(), buf.data(), dt, n, t);
      Tensor r = p0.clone(), rm = m0.clone(), rv = v0.clone();
      s.stochastic_rounding = dt == DType::BF16;
      s.seed = 42;
      k.adamw(r.data(), g.data(), rm.data(), rv.data(), dt, n, s);
      Tensor u = g.clone();
      auto uv = u.to_floats();
      uv[5] = INFINITY;
      uv[n - 1] = NAN;
      u = Tensor::from_floats(uv, {n}, dt);
      const int64_t bad = k.unscale(u.data(), dt, n, 1.f / 3.f);
      const std::string what = std::string(cpu_isa_name(isa)) + " " + dtype_name(dt);
      if (!ref_adamw.defined()) {
        ref_adamw = p, ref_m = m, ref_v = v, ref_sgd = q, ref_buf = buf, ref_sr = r;
        ref_unscale = u, ref_bad = bad;
        continue;
      }
      expect_bitwise_equal(p, ref_adamw, what + " adamw p");
      expect_bitwise_equal(m, ref_m, what + " adamw m");
      expect_bitwise_equal(v, ref_v, what + " adamw v");
      expect_bitwise_equal(q, ref_sgd, what + " sgd p");
      expect_bitwise_equal(buf, ref_buf, what + " sgd buf");
      expect_bitwise_equal(r, ref_sr, what + " adamw stochastic");
      expect_bitwise_equal(u, ref_unscale, what + " unscale");
      EXPECT_EQ(bad, ref_bad) << what;
    }
    EXPECT_EQ(ref_bad, 2);
  }
  set_cpu_isa(best);
}

TEST(OptimKernels, DeterministicAcrossRunsAndThreadCounts) {
  const int64_t n = 50000;
  auto run = [&](int threads) {
    Tensor p = randn({n}, 1), g = randn({n}, 2), m = Tensor::zeros({n}), v = Tensor::zeros({n});
    p.set_requires_grad(true);
    const int prev = omp_get_max_threads();
    omp_set_num_threads(threads);
    AdamW opt({{{p}, {"w"}, 0.1, 1.0}});
    for (int s = 0; s < 3; ++s) {
      p.set_grad(randn({n}, 10 + s));
      opt.step(1e-2);
    }
    omp_set_num_threads(prev);
    return std::pair{p, find_state(opt, "w.exp_avg_sq")};
  };
  auto [a, va] = run(2);
  auto [b, vb] = run(2);
  auto [c, vc] = run(1);
  expect_bitwise_equal(a, b, "adamw run twice");
  expect_bitwise_equal(va, vb, "adamw state run twice");
  expect_bitwise_equal(a, c, "adamw 1 vs 2 threads");
  expect_bitwise_equal(va, vc, "adamw state 1 vs 2 threads");
}

// ---- optimizer mechanics ---------------------------------------------------------------------

TEST(Optimizer, ZeroGradBumpVersionAndSkippedParams) {
  Tensor a = randn({3, 4}, 1), b = randn({4}, 2);
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  AdamW opt({{{a, b}, {"a", "b"}, 0.0, 1.0}});
  Tensor ga = randn({3, 4}, 3);
  a.set_grad(ga);
  const auto b_before = b.to_floats();
  const uint64_t va = a.version(), vb = b.version();
  opt.step(1e-2);
  EXPECT_EQ(a.version(), va + 1);
  EXPECT_EQ(b.version(), vb) << "no gradient: untouched";
  EXPECT_EQ(b.to_floats(), b_before);
  EXPECT_EQ(find_state(opt, "b.step").to_ints()[0], 0);
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined()) << "dropped (set_to_none), not filled with zeros";
  EXPECT_FALSE(b.grad().defined());
  // A gradient of another dtype or shape is refused with the parameter's name.
  a.set_grad(randn({3, 4}, 4, 1.f, DType::BF16));
  try {
    opt.step(1e-2);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'a'"), std::string::npos) << e.what();
  }
}

// The state of all parameters of one dtype is one buffer (bench/bench_adamw_layout): each slot a
// 64-byte aligned view, in order, none overlapping; and the views hold exactly what an optimizer
// of that parameter alone holds after the same steps (no slot writes into its neighbour).
TEST(Optimizer, StateOfEachDtypeIsOneBufferOfAlignedViews) {
  const std::vector<Shape> shapes = {{3, 5}, {7}, {4, 4}, {33}, {2, 9}};
  const std::vector<DType> dtypes = {DType::F32, DType::F32, DType::BF16, DType::F32, DType::BF16};
  auto params = [&] {
    std::vector<Tensor> ps;
    for (size_t i = 0; i < shapes.size(); ++i) {
      ps.push_back(randn(shapes[i], 10 + i, 1.f, dtypes[i]));
      ps.back().set_requires_grad(true);
    }
    return ps;
  };
  const std::vector<std::string> names = {"a", "b", "c", "d", "e"};
  std::vector<Tensor> ps = params();
  AdamW opt(
      {{{ps[0], ps[1], ps[2]}, {"a", "b", "c"}, 0.1, 1.0}, {{ps[3], ps[4]}, {"d", "e"}, 0.0, 1.0}});
  for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
    const char* end[2] = {nullptr, nullptr};  // per dtype: where the previous view ended
    for (size_t i = 0; i < names.size(); ++i) {
      const Tensor m = find_state(opt, names[i] + "." + kind);
      const auto* at = static_cast<const char*>(m.data());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(at) % 64, 0u) << names[i] << "." << kind;
      const int d = dtypes[i] == DType::F32 ? 0 : 1;
      if (end[d]) {
        EXPECT_GE(at, end[d]) << names[i] << " overlaps the view before it";
        EXPECT_LT(at, end[d] + 64)
            << names[i] << " is not in the same buffer as the view before it";
      }
      end[d] = at + m.numel() * dtype_size(m.dtype());
      EXPECT_EQ(m.shape(), shapes[i]);
      EXPECT_EQ(m.dtype(), dtypes[i]);
    }
  }
  // Five single-parameter optimizers on copies, fed the same gradients: the same bits.
  std::vector<Tensor> alone = params();
  std::vector<std::unique_ptr<AdamW>> ones;
  for (size_t i = 0; i < alone.size(); ++i)
    ones.push_back(std::make_unique<AdamW>(
        std::vector<ParamGroup>{{{alone[i]}, {names[i]}, i < 3 ? 0.1 : 0.0, 1.0}}));
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < ps.size(); ++i) {
      ps[i].set_grad(randn(shapes[i], 100 * step + i, 1.f, dtypes[i]));
      alone[i].set_grad(ps[i].grad().clone());
      ones[i]->step(1e-2);
    }
    opt.step(1e-2);
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    expect_bitwise_equal(ps[i], alone[i], names[i]);
    for (const char* kind : {"exp_avg", "exp_avg_sq"})
      expect_bitwise_equal(find_state(opt, names[i] + "." + kind),
                           find_state(*ones[i], names[i] + "." + kind), names[i] + "." + kind);
  }
}

// Save after 2 steps (through a safetensors file), load into a fresh optimizer on copies of the
// parameters, continue 3 steps on both: identical bits.
TEST(Optimizer, StateRoundTripContinuesIdentically) {
  for (bool adam : {true, false}) {
    auto make = [&](std::vector<Tensor> ps) -> std::unique_ptr<Optimizer> {
      std::vector<ParamGroup> g = {{{ps[0]}, {"w"}, 0.1, 1.0}, {{ps[1]}, {"b"}, 0.0, 0.5}};
      if (adam) return std::make_unique<AdamW>(g);
      SGDOptions o;
      o.momentum = 0.9;
      o.dampening = 0.1;
      return std::make_unique<SGD>(g, o);
    };
    std::vector<Tensor> pa = {randn({5, 3}, 1), randn({3}, 2)};
    for (auto& p : pa) p.set_requires_grad(true);
    auto a = make(pa);
    auto grads = [](int s) {
      return std::vector<Tensor>{randn({5, 3}, 50 + s), randn({3}, 70 + s)};
    };
    for (int s = 0; s < 2; ++s) {
      auto g = grads(s);
      pa[0].set_grad(g[0]);
      pa[1].set_grad(g[1]);
      a->step(1e-2);
    }
    const std::string path = test::temp_dir("optim_state") + "/optimizer.safetensors";
    io::write_safetensors(path, a->state());
    const io::Safetensors loaded = io::read_safetensors(path);
    std::vector<Tensor> pb = {pa[0].clone(), pa[1].clone()};
    for (auto& p : pb) p.set_requires_grad(true);
    auto b = make(pb);
    b->load_state(loaded.tensors);
    EXPECT_EQ(b->step_count(), 2);
    for (int s = 2; s < 5; ++s) {
      auto g = grads(s);
      pa[0].set_grad(g[0]);
      pa[1].set_grad(g[1]);
      pb[0].set_grad(g[0].clone());
      pb[1].set_grad(g[1].clone());
      a->step(1e-2);
      b->step(1e-2);
    }
    expect_bitwise_equal(pa[0], pb[0], "w after resume");
    expect_bitwise_equal(pa[1], pb[1], "b after resume");
    const auto sa = a->state(), sb = b->state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sa[i].first, sb[i].first);
      expect_bitwise_equal(sa[i].second, sb[i].second, sa[i].first);
    }
  }
}

// A checkpoint writes the flat state in whole blocks (io::write_safetensors): each kind's buffer
// of each dtype goes out in one write per stretch between alignment gaps, the step counts in one,
// to a standard safetensors file; a fresh optimizer of the same parameters reads it straight into
// its own buffers with one read per block and continues with the same bits.
TEST(Optimizer, FlatStateGoesOutInWholeBlocksAndComesBackIntoTheBuffers) {
  // f32 slots of 15, 7 and 33 elements: gaps after the first two (16-element alignment); bf16
  // slots of 16 and 18: a gap after the first (32-element alignment). Then the same without gaps.
  struct Case {
    std::vector<Shape> shapes;
    std::vector<DType> dtypes;
    size_t runs;  // per kind: 3 f32 stretches + 2 bf16 ones; + 1 for the counts
  };
  const DType f = DType::F32, b = DType::BF16;
  for (const Case& c : {Case{{{3, 5}, {7}, {4, 4}, {33}, {2, 9}}, {f, f, b, b, f}, 2 * 5 + 1},
                        Case{{{4, 4}, {32}, {2, 32}, {16, 3}}, {f, f, b, b}, 2 * 2 + 1}}) {
    auto params = [&] {
      std::vector<Tensor> ps;
      for (size_t i = 0; i < c.shapes.size(); ++i) {
        ps.push_back(randn(c.shapes[i], 10 + i, 1.f, c.dtypes[i]));
        ps.back().set_requires_grad(true);
      }
      return ps;
    };
    auto grads = [&](int step) {
      std::vector<Tensor> g;
      for (size_t i = 0; i < c.shapes.size(); ++i)
        g.push_back(randn(c.shapes[i], 100 * step + i, 1.f, c.dtypes[i]));
      return g;
    };
    std::vector<Tensor> pa = params();
    AdamW a({{pa, {}, 0.1, 1.0}});
    for (int step = 0; step < 2; ++step) {
      auto g = grads(step);
      for (size_t i = 0; i < pa.size(); ++i) pa[i].set_grad(g[i]);
      a.step(1e-2);
    }
    const std::string path = test::temp_dir("optim_blocks") + "/optimizer.safetensors";
    const io::SafetensorsWrite w = io::write_safetensors(path, a.state());
    EXPECT_EQ(w.runs, c.runs);
    EXPECT_EQ(w.write_calls, c.runs + 1);
    test::expect_standard_safetensors(path);

    std::vector<Tensor> pb;
    for (const Tensor& p : pa) pb.push_back(p.clone().set_requires_grad(true));
    AdamW bo({{pb, {}, 0.1, 1.0}});
    const NamedTensors live = bo.state();
    ASSERT_TRUE(io::holds_exactly(io::read_safetensors_header(path), live));
    EXPECT_EQ(io::read_safetensors_into(path, live), c.runs);
    bo.load_state(live);
    EXPECT_EQ(bo.step_count(), 2);
    for (int step = 2; step < 4; ++step) {
      auto g = grads(step);
      for (size_t i = 0; i < pa.size(); ++i) pa[i].set_grad(g[i]), pb[i].set_grad(g[i].clone());
      a.step(1e-2);
      bo.step(1e-2);
    }
    for (size_t i = 0; i < pa.size(); ++i) expect_bitwise_equal(pa[i], pb[i], "parameter");
    const NamedTensors sa = a.state(), sb = bo.state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i)
      expect_bitwise_equal(sa[i].second, sb[i].second, sa[i].first);
  }
}

TEST(Optimizer, LoadStateErrorsNameTheEntryAndChangeNothing) {
  Tensor w = randn({2, 3}, 1);
  w.set_requires_grad(true);
  AdamW opt({{{w}, {"layer.w"}, 0.0, 1.0}});
  w.set_grad(randn({2, 3}, 2));
  opt.step(1e-2);
  const NamedTensors good = opt.state();
  const auto m_before = find_state(opt, "layer.w.exp_avg").to_floats();
  auto expect_error = [&](NamedTensors s, const std::string& needle) {
    try {
      opt.load_state(s);
      ADD_FAILURE() << "expected an Error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(find_state(opt, "layer.w.exp_avg").to_floats(), m_before);
    EXPECT_EQ(opt.step_count(), 1);
  };
  auto with = [&](const std::string& key, Tensor t) {
    NamedTensors s;
    for (auto& [k, v] : good) s.emplace_back(k, k == key ? t : v.clone());
    return s;
  };
  NamedTensors missing;
  for (auto& [k, v] : good)
    if (k != "layer.w.exp_avg_sq") missing.emplace_back(k, v.clone());
  expect_error(missing, "missing entry 'layer.w.exp_avg_sq'");
  expect_error(with("layer.w.exp_avg", Tensor::zeros({3, 2})), "'layer.w.exp_avg'");
  expect_error(with("step", Tensor::zeros({1})), "'step'");
  NamedTensors extra = with("", Tensor());
  extra.emplace_back("other.exp_avg", Tensor::zeros({2, 3}));
  expect_error(extra, "unexpected entry 'other.exp_avg'");
  // SGD without momentum has no buffers; AdamW state is not an SGD state.
  Tensor q = randn({2, 3}, 3);
  q.set_requires_grad(true);
  SGDOptions o;
  o.momentum = 0.9;
  SGD sgd({{{q}, {"layer.w"}, 0.0, 1.0}}, o);
  EXPECT_THROW(sgd.load_state(good), Error);
}

TEST(Optimizer, RejectsBadConstruction) {
  Tensor a = randn({2}, 1), b = randn({2}, 2);
  EXPECT_THROW(AdamW({{{a, b}, {"x", "x"}, 0.0, 1.0}}), Error);  // duplicate names
  EXPECT_THROW(AdamW({{{a, b}, {"x"}, 0.0, 1.0}}), Error);       // one name for two params
  AdamWOptions o;
  o.beta1 = 1.0;
  EXPECT_THROW(AdamW({{{a}, {"a"}, 0.0, 1.0}}, o), Error);
  SGDOptions s;
  s.nesterov = true;
  EXPECT_THROW(SGD({{{a}, {"a"}, 0.0, 1.0}}, s), Error);  // nesterov without momentum
  EXPECT_THROW(AdamW({{{Tensor::from_ints({1}, {1}, DType::I64)}, {"i"}, 0.0, 1.0}}), Error);
}

// HF Trainer's grouping: "bias", "norm", "ln_" or fewer than 2 dims -> no weight decay.
TEST(Optimizer, MakeParamGroupsFollowsHfRule) {
  auto p = [](Shape s, bool rg = true) {
    Tensor t = Tensor::zeros(s);
    t.set_requires_grad(rg);
    return t;
  };
  NamedTensors named = {
      {"transformer.h.0.attn.c_attn.weight", p({8, 4})},
      {"transformer.h.0.attn.c_attn.bias", p({8})},
      {"transformer.h.0.ln_1.weight", p({4})},
      {"model.layers.0.input_layernorm.weight", p({4})},
      {"model.norm_proj.weight", p({4, 4})},  // 2-D but named "norm"
      {"lm_head.weight", p({16, 4})},
      {"scale", p({4})},                                 // 1-D
      {"model.embed_tokens.weight", p({16, 4}, false)},  // frozen: left out
  };
  auto groups = optim::make_param_groups(named, 0.1);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].weight_decay, 0.1);
  EXPECT_EQ(groups[1].weight_decay, 0.0);
  EXPECT_EQ(groups[0].names,
            (std::vector<std::string>{"transformer.h.0.attn.c_attn.weight", "lm_head.weight"}));
  EXPECT_EQ(groups[1].names,
            (std::vector<std::string>{
                "transformer.h.0.attn.c_attn.bias", "transformer.h.0.ln_1.weight",
                "model.layers.0.input_layernorm.weight", "model.norm_proj.weight", "scale"}));
  EXPECT_TRUE(groups[0].params[1].shares_storage(named[5].second));
  // The groups drive a real optimizer: decay applies to the first group only.
  for (auto& [n, t] : named) {
    t.fill(1.f);
    t.set_grad(Tensor::zeros(t.shape()));
  }
  SGD opt(groups);
  opt.step(1.0);  // p -= lr * wd * p
  EXPECT_FLOAT_EQ(named[0].second.to_floats()[0], 0.9f);
  EXPECT_FLOAT_EQ(named[1].second.to_floats()[0], 1.0f);
  EXPECT_FLOAT_EQ(named[7].second.to_floats()[0], 1.0f);
}

}  // namespace
}  // namespace keel
