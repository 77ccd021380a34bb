// LoRA, DoRA and LoKr (keel/nn/adapters): PyTorch parity on PEFT's formulas written out in
// tests/fixtures/gen_adapters.py (f32, bf16 and f16 bases, bf16 autocast), an f64 scalar reference
// of each forward kept here, finite-difference gradients, determinism, initialization, PEFT names,
// merging, frozen-base dtypes and error messages.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/nn/adapters/dora.h"
#include "keel/nn/adapters/lokr.h"
#include "keel/nn/adapters/lora.h"
#include "keel/ops/elementwise.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using nn::DoraAdapter;
using nn::Linear;
using nn::LokrAdapter;
using nn::LoraAdapter;

constexpr int64_t kIn = 32, kOut = 24, kR = 4;
constexpr double kAlpha = 8;

// ---- f64 references (plain loops, "obviously correct")
// ------------------------------------------- Every adapter is, mathematically, a linear layer with
// an adapted weight W' [out, in]:
//   LoRA  W' = W + s·B·A
//   DoRA  W' = m / ||W + s·B·A||_row * (W + s·B·A)
//   LoKr  W' = W + s·kron(w1, w2)
// so the reference forward is y[n, o] = Σ_i W'[o, i] x[n, i] + b[o].

std::vector<double> linear_ref(const std::vector<float>& x, const std::vector<double>& w,
                               const std::vector<float>& b, int64_t N, int64_t in, int64_t out) {
  std::vector<double> y(static_cast<size_t>(N * out));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.empty() ? 0.0 : b[o];
      for (int64_t i = 0; i < in; ++i) acc += w[o * in + i] * x[n * in + i];
      y[n * out + o] = acc;
    }
  return y;
}

std::vector<double> lora_weight_ref(const std::vector<float>& W, const std::vector<float>& A,
                                    const std::vector<float>& B, double s, int64_t in, int64_t out,
                                    int64_t r) {
  std::vector<double> w(W.begin(), W.end());
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double ba = 0;
      for (int64_t k = 0; k < r; ++k) ba += static_cast<double>(B[o * r + k]) * A[k * in + i];
      w[o * in + i] += s * ba;
    }
  return w;
}

std::vector<double> dora_weight_ref(const std::vector<float>& W, const std::vector<float>& A,
                                    const std::vector<float>& B, const std::vector<float>& m,
                                    double s, int64_t in, int64_t out, int64_t r) {
  std::vector<double> w = lora_weight_ref(W, A, B, s, in, out, r);
  for (int64_t o = 0; o < out; ++o) {
    double sq = 0;
    for (int64_t i = 0; i < in; ++i) sq += w[o * in + i] * w[o * in + i];
    const double f = m[o] / std::sqrt(sq);
    for (int64_t i = 0; i < in; ++i) w[o * in + i] *= f;
  }
  return w;
}

// w1 [out / P, in / Q], w2 [P, Q].
std::vector<double> lokr_weight_ref(const std::vector<float>& W, const std::vector<float>& w1,
                                    const std::vector<float>& w2, int64_t P, int64_t Q, double s,
                                    int64_t in, int64_t out) {
  std::vector<double> w(W.begin(), W.end());
  const int64_t cols1 = in / Q;
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i)
      w[o * in + i] +=
          s * static_cast<double>(w1[(o / P) * cols1 + i / Q]) * w2[(o % P) * Q + i % Q];
  return w;
}

// [P, r]·[r, Q] in f64, rounded to f32 (the low-rank w2 of LoKr).
std::vector<float> matmul_ref(const std::vector<float>& a, const std::vector<float>& b, int64_t P,
                              int64_t r, int64_t Q) {
  std::vector<float> c(static_cast<size_t>(P * Q));
  for (int64_t p = 0; p < P; ++p)
    for (int64_t q = 0; q < Q; ++q) {
      double acc = 0;
      for (int64_t k = 0; k < r; ++k) acc += static_cast<double>(a[p * r + k]) * b[k * Q + q];
      c[p * Q + q] = static_cast<float>(acc);
    }
  return c;
}

Tensor to_tensor(const std::vector<double>& v, const Shape& shape) {
  return Tensor::from_floats(std::vector<float>(v.begin(), v.end()), shape);
}

// ---- an adapted Linear with the fixture's tensors
// ------------------------------------------------

struct Adapted {
  std::unique_ptr<Linear> lin;
  std::vector<std::pair<std::string, Tensor>> params;  // fixture name -> adapter parameter
};

// A Linear [kOut, kIn] with bias in `base_dt` and a `kind` adapter (parameters from `src` when
// given, else the adapter's own initialization).
Adapted make_adapted(const std::string& kind, DType base_dt, const io::Safetensors* src = nullptr,
                     const std::string& prefix = "") {
  Adapted a;
  a.lin = std::make_unique<Linear>(kIn, kOut, true, base_dt);
  if (src) {
    a.lin->weight.copy_from(src->at(prefix + ".W"));
    a.lin->bias.copy_from(src->at(prefix + ".b"));
  } else {
    a.lin->weight.copy_from(test::randn({kOut, kIn}, 11, 0.2f));
    a.lin->bias.copy_from(test::randn({kOut}, 12, 0.1f));
  }
  a.lin->weight.set_requires_grad(false);
  a.lin->bias.set_requires_grad(false);
  Linear& L = *a.lin;
  if (kind == "lora") {
    auto ad = std::make_shared<LoraAdapter>(L, kR, kAlpha, 0.0, 1);
    a.params = {{"A", ad->lora_A->weight}, {"B", ad->lora_B->weight}};
    L.adapter = ad;
  } else if (kind == "dora") {
    auto ad = std::make_shared<DoraAdapter>(L, kR, kAlpha, 0.0, 1);
    a.params = {{"A", ad->lora_A->weight}, {"B", ad->lora_B->weight}, {"m", ad->magnitude}};
    L.adapter = ad;
  } else if (kind == "lokr") {
    auto ad = std::make_shared<LokrAdapter>(L, kR, kAlpha, 1);
    EXPECT_TRUE(ad->w2.defined()) << "r = 4 >= max(6, 8) / 2: full w2";
    a.params = {{"w1", ad->w1}, {"w2", ad->w2}};
    L.adapter = ad;
  } else {
    auto ad = std::make_shared<LokrAdapter>(L, 2, kAlpha, 1);
    EXPECT_FALSE(ad->w2.defined()) << "r = 2 < max(6, 8) / 2: low-rank w2";
    a.params = {{"w1", ad->w1}, {"w2_a", ad->w2_a}, {"w2_b", ad->w2_b}};
    L.adapter = ad;
  }
  if (src)
    for (auto& [name, p] : a.params) {
      Tensor dst = p;
      dst.copy_from(src->at(prefix + "." + name));
    }
  else if (kind == "lora" || kind == "dora") {
    // A trained adapter: a nonzero B.
    Tensor B = a.params[1].second;
    B.copy_from(test::randn({kOut, kR}, 13, 0.1f));
  } else {
    Tensor w1 = a.params[0].second;
    w1.copy_from(test::randn(w1.shape(), 14, 0.1f));
  }
  L.assign_paths();
  return a;
}

DType base_dtype_of(const std::string& mode) {
  return mode == "bf16" ? DType::BF16 : mode == "f16" ? DType::F16 : DType::F32;
}

// Tolerance for comparing a tensor of dtype `dt` computed in `mode`: f32 paths agree to f32
// rounding; a value that passed through bf16/f16 roundings may differ by a couple of units of the
// last rounding (the order of f32 accumulation decides ties).
std::pair<double, double> tolerance(const std::string& mode, DType dt) {
  if (mode == "f32") return {2e-5, 2e-5};
  const double eps = test::eps_of(mode == "f16" ? DType::F16 : DType::BF16);
  if (dt == DType::F32 && mode != "mixed") return {1e-4, 1e-4};  // f32 adapter path, rounded input
  return {2 * eps, 2 * eps};
}

// ---- PyTorch parity -----------------------------------------------------------------------------

class AdapterParity : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(AdapterParity, ForwardAndBackwardMatchPyTorch) {
  const auto& [kind, mode] = GetParam();
  const std::string prefix = kind + "." + mode;
  const io::Safetensors& fx = test::fixture("adapters");
  Adapted a = make_adapted(kind, base_dtype_of(mode), &fx, prefix);
  Tensor x = fx.at(prefix + ".x").clone();
  x.set_requires_grad(true);
  amp::AutocastGuard autocast(mode == "mixed", DType::BF16);
  Tensor y = a.lin->forward(x);
  const Tensor& want = fx.at(prefix + ".out");
  ASSERT_EQ(y.dtype(), want.dtype()) << prefix << ": output dtype";
  auto [atol, rtol] = tolerance(mode, want.dtype());
  test::expect_close(y, want, atol, rtol, prefix + " out");
  backward(y, fx.at(prefix + ".gout"));
  const Tensor& gx = fx.at(prefix + ".grad.x");
  ASSERT_EQ(x.grad().dtype(), gx.dtype()) << prefix << ": grad dtype follows the input";
  std::tie(atol, rtol) = tolerance(mode, gx.dtype());
  test::expect_close(x.grad(), gx, atol, rtol, prefix + " grad x");
  for (auto& [name, p] : a.params) {
    ASSERT_EQ(p.dtype(), DType::F32) << "adapter parameters are f32 whatever the base dtype";
    ASSERT_TRUE(p.grad().defined()) << prefix << ": " << name << " got no gradient";
    const Tensor& g = fx.at(prefix + ".grad." + name);
    std::tie(atol, rtol) = tolerance(mode, DType::F32);
    if (mode == "mixed") std::tie(atol, rtol) = tolerance(mode, DType::BF16);
    test::expect_close(p.grad(), g, atol, rtol, prefix + " grad " + name);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Adapters, AdapterParity,
    ::testing::Combine(::testing::Values("lora", "dora", "lokr", "lokr_lowrank"),
                       ::testing::Values("f32", "bf16", "f16", "mixed")),
    [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// ---- f64 reference
// -------------------------------------------------------------------------------

std::vector<double> adapted_weight_ref(const std::string& kind, Adapted& a) {
  const std::vector<float> W = a.lin->weight.to_floats();
  auto get = [&](const std::string& n) {
    for (auto& [name, p] : a.params)
      if (name == n) return p.to_floats();
    return std::vector<float>();
  };
  const double s = a.lin->adapter->scaling;
  if (kind == "lora") return lora_weight_ref(W, get("A"), get("B"), s, kIn, kOut, kR);
  if (kind == "dora") return dora_weight_ref(W, get("A"), get("B"), get("m"), s, kIn, kOut, kR);
  // factorization(24) = (4, 6), factorization(32) = (4, 8): w2 is [6, 8].
  std::vector<float> w2 =
      kind == "lokr" ? get("w2") : matmul_ref(get("w2_a"), get("w2_b"), 6, 2, 8);
  return lokr_weight_ref(W, get("w1"), w2, 6, 8, s, kIn, kOut);
}

class AdapterReference : public ::testing::TestWithParam<std::string> {};

TEST_P(AdapterReference, ForwardMatchesF64Reference) {
  const std::string kind = GetParam();
  Adapted a = make_adapted(kind, DType::F32);
  Tensor x = test::randn({5, kIn}, 21);
  Tensor y = a.lin->forward(x);  // [5, kOut]
  const auto ref =
      linear_ref(x.to_floats(), adapted_weight_ref(kind, a), a.lin->bias.to_floats(), 5, kIn, kOut);
  test::expect_close(y, to_tensor(ref, {5, kOut}), 1e-5, 1e-5, kind + " vs f64 reference");
}

TEST_P(AdapterReference, MergedWeightIsBasePlusScaledUpdate) {
  const std::string kind = GetParam();
  for (DType dt : {DType::F32, DType::BF16}) {
    Adapted a = make_adapted(kind, dt);
    const auto ref = adapted_weight_ref(kind, a);
    Tensor x = test::randn({4, kIn}, 22).to_dtype(dt);
    Tensor before = a.lin->forward(x);
    ASSERT_EQ(nn::merge_adapters(*a.lin), 1);
    ASSERT_TRUE(a.lin->adapter->merged);
    // The merged weight is the f64 adapted weight rounded once into the base dtype.
    const double eps = dt == DType::F32 ? 2e-6 : test::eps_of(DType::BF16);
    test::expect_close(a.lin->weight.to_dtype(DType::F32),
                       to_tensor(ref, {kOut, kIn}).to_dtype(dt).to_dtype(DType::F32), 1e-6, eps,
                       kind + " merged weight");
    Tensor after = a.lin->forward(x);
    const double tol = dt == DType::F32 ? 1e-5 : 4 * test::eps_of(DType::BF16);
    test::expect_close(after.to_dtype(DType::F32), before.to_dtype(DType::F32), tol, tol,
                       kind + " output after merge");
    EXPECT_EQ(nn::merge_adapters(*a.lin), 0) << "merging twice is a no-op";
  }
}

INSTANTIATE_TEST_SUITE_P(Adapters, AdapterReference,
                         ::testing::Values("lora", "dora", "lokr", "lokr_lowrank"));

// ---- finite differences
// --------------------------------------------------------------------------

TEST(AdapterGradcheck, LoraAllInputs) {
  Adapted a = make_adapted("lora", DType::F32);
  auto* ad = static_cast<LoraAdapter*>(a.lin->adapter.get());
  auto f = [&](const std::vector<Tensor>& in) {
    ad->lora_A->weight = in[1];
    ad->lora_B->weight = in[2];
    return a.lin->forward(in[0]);
  };
  test::expect_gradcheck(
      f, {test::randn({3, kIn}, 31), ad->lora_A->weight.clone(), ad->lora_B->weight.clone()}, {},
      "lora");
}

TEST(AdapterGradcheck, DoraInputAndMagnitude) {
  // The row norm is detached (PEFT, paper §4.3), so d/dA and d/dB are not the derivative of the
  // forward and cannot be finite-differenced; x and m are exact (the parity test covers A and B).
  Adapted a = make_adapted("dora", DType::F32);
  auto* ad = static_cast<DoraAdapter*>(a.lin->adapter.get());
  auto f = [&](const std::vector<Tensor>& in) {
    ad->magnitude = in[1];
    return a.lin->forward(in[0]);
  };
  test::expect_gradcheck(f, {test::randn({3, kIn}, 32), ad->magnitude.clone()}, {}, "dora");
}

TEST(AdapterGradcheck, LokrFullAndLowRank) {
  Adapted a = make_adapted("lokr", DType::F32);
  auto* ad = static_cast<LokrAdapter*>(a.lin->adapter.get());
  auto f = [&](const std::vector<Tensor>& in) {
    ad->w1 = in[1];
    ad->w2 = in[2];
    return a.lin->forward(in[0]);
  };
  test::expect_gradcheck(f, {test::randn({3, kIn}, 33), ad->w1.clone(), ad->w2.clone()}, {},
                         "lokr");
  Adapted b = make_adapted("lokr_lowrank", DType::F32);
  auto* bd = static_cast<LokrAdapter*>(b.lin->adapter.get());
  auto g = [&](const std::vector<Tensor>& in) {
    bd->w1 = in[1];
    bd->w2_a = in[2];
    bd->w2_b = in[3];
    return b.lin->forward(in[0]);
  };
  test::expect_gradcheck(
      g, {test::randn({3, kIn}, 34), bd->w1.clone(), bd->w2_a.clone(), bd->w2_b.clone()}, {},
      "lokr low-rank");
}

TEST(AdapterGradcheck, KronBothFactors) {
  auto f = [](const std::vector<Tensor>& in) { return nn::kron(in[0], in[1]); };
  test::expect_gradcheck(f, {test::randn({2, 3}, 35), test::randn({4, 2}, 36)}, {}, "kron");
}

// ---- determinism
// ---------------------------------------------------------------------------------

// DoRA's ||W + s·B·A||_row, taken every forward in one threaded pass (no [out, in] copies), is
// torch's formula bit for bit: W.to(f32) + (s·lora_weight rounded in lora_weight's dtype), summed
// per row in column order in f64; for every pair of dtypes and any thread count. 97 x 1024 is
// past the size at which the rows go to threads.
TEST(Adapters, DoraWeightNormIsTorchsFormulaBitForBitAtAnyThreadCount) {
  const int64_t out = 97, in = 1024;  // an odd row count: the rows split unevenly over threads
  const double s = 2.5;
  for (DType wdt : {DType::F32, DType::BF16, DType::F16})
    for (DType ldt : {DType::F32, DType::BF16, DType::F16}) {
      const Tensor w = test::randn({out, in}, 90, 0.05f).to_dtype(wdt);
      const Tensor l = test::randn({out, in}, 91, 0.01f).to_dtype(ldt);
      const std::vector<float> wv = w.to_floats();
      const std::vector<float> lv = ops::scale(l, static_cast<float>(s)).to_floats();
      std::vector<float> want(static_cast<size_t>(out));
      for (int64_t o = 0; o < out; ++o) {
        double acc = 0;
        for (int64_t i = 0; i < in; ++i) {
          const float v = wv[o * in + i] + lv[o * in + i];
          acc += static_cast<double>(v) * v;
        }
        want[o] = static_cast<float>(std::sqrt(acc));
      }
      const std::string what =
          std::string(dtype_name(wdt)) + " weight, " + dtype_name(ldt) + " B·A";
      for (int threads : {1, 3}) {
        test::ThreadsGuard t(threads);
        test::expect_bitwise_equal(DoraAdapter::weight_norm(w, l, s),
                                   Tensor::from_floats(want, {out}),
                                   what + ", " + std::to_string(threads) + " threads");
      }
    }
}

// The GPU's path (weight_norm_by_ops: ops on the weight's device, no copy of W to the host), run
// here on the CPU: within f32 rounding of the f64 formula above, for every pair of dtypes, and
// without a lora_weight (the initial magnitude).
TEST(Adapters, DoraWeightNormThroughOpsAgreesWithTheFormula) {
  const int64_t out = 97, in = 1024;
  for (DType wdt : {DType::F32, DType::BF16, DType::F16})
    for (DType ldt : {DType::F32, DType::BF16, DType::F16}) {
      const Tensor w = test::randn({out, in}, 90, 0.05f).to_dtype(wdt);
      const Tensor l = test::randn({out, in}, 91, 0.01f).to_dtype(ldt);
      const std::string what =
          std::string(dtype_name(wdt)) + " weight, " + dtype_name(ldt) + " B·A";
      test::expect_close(DoraAdapter::weight_norm_by_ops(w, l, 2.5),
                         DoraAdapter::weight_norm(w, l, 2.5), 0, 2e-6, what);
      test::expect_close(DoraAdapter::weight_norm_by_ops(w, Tensor(), 1.0),
                         DoraAdapter::weight_norm(w, Tensor::zeros({out, in}), 1.0), 0, 2e-6,
                         what + ", no B·A");
    }
}

TEST(Adapters, BitIdenticalAcrossRuns) {
  for (const std::string kind : {"lora", "dora", "lokr", "lokr_lowrank"})
    for (bool mixed : {false, true}) {
      std::vector<Tensor> outs, grads;
      for (int run = 0; run < 2; ++run) {
        Adapted a = make_adapted(kind, DType::F32);
        Tensor x = test::randn({2, 7, kIn}, 41);
        x.set_requires_grad(true);
        amp::AutocastGuard autocast(mixed, DType::BF16);
        Tensor y = a.lin->forward(x);
        backward(y, test::randn(y.shape(), 42).to_dtype(y.dtype()));
        outs.push_back(y);
        grads.push_back(x.grad());
        for (auto& [n, p] : a.params) grads.push_back(p.grad());
      }
      test::expect_bitwise_equal(outs[0], outs[1], kind + " output");
      const size_t half = grads.size() / 2;
      for (size_t i = 0; i < half; ++i)
        test::expect_bitwise_equal(grads[i], grads[half + i], kind + " grad " + std::to_string(i));
    }
}

// ---- initialization
// ------------------------------------------------------------------------------

TEST(Adapters, PeftInitializationLeavesTheLayerUnchanged) {
  for (DType dt : {DType::F32, DType::BF16}) {
    Linear lin(kIn, kOut, true, dt);
    lin.weight.copy_from(test::randn({kOut, kIn}, 51, 0.2f));
    Tensor x = test::randn({3, kIn}, 52).to_dtype(dt);
    Tensor base = lin.forward(x);
    auto lora = std::make_shared<LoraAdapter>(lin, kR, kAlpha, 0.0, 7);
    lin.adapter = lora;
    // A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_, a = sqrt(5)), B = 0, scaling alpha / r.
    const float bound = 1.0f / std::sqrt(static_cast<float>(kIn));
    float lo = 1, hi = -1;
    for (float v : lora->lora_A->weight.to_floats()) lo = std::min(lo, v), hi = std::max(hi, v);
    EXPECT_GE(lo, -bound);
    EXPECT_LE(hi, bound);
    EXPECT_LT(lo, -0.8f * bound) << "A should fill its range";
    EXPECT_GT(hi, 0.8f * bound);
    for (float v : lora->lora_B->weight.to_floats()) ASSERT_EQ(v, 0.0f);
    EXPECT_DOUBLE_EQ(lora->scaling, kAlpha / kR);
    test::expect_bitwise_equal(lin.forward(x), base, "untrained LoRA");
  }
  // DoRA: m = ||W||_row; the layer starts equal to the base (up to m·(1/n) rounding).
  Linear lin(kIn, kOut, false);
  lin.weight.copy_from(test::randn({kOut, kIn}, 53, 0.2f));
  Tensor x = test::randn({3, kIn}, 54);
  Tensor base = lin.forward(x);
  auto dora = std::make_shared<DoraAdapter>(lin, kR, kAlpha, 0.0, 7);
  lin.adapter = dora;
  const auto w = lin.weight.to_floats();
  const auto m = dora->magnitude.to_floats();
  for (int64_t o = 0; o < kOut; ++o) {
    double sq = 0;
    for (int64_t i = 0; i < kIn; ++i) sq += static_cast<double>(w[o * kIn + i]) * w[o * kIn + i];
    EXPECT_NEAR(m[o], std::sqrt(sq), 1e-6 * std::sqrt(sq));
  }
  test::expect_close(lin.forward(x), base, 1e-6, 1e-6, "untrained DoRA");
  // LoKr: w1 = 0, w2 Kaiming-uniform: the update starts at exactly 0.
  Linear lk(kIn, kOut, false);
  lk.weight.copy_from(test::randn({kOut, kIn}, 55, 0.2f));
  Tensor lbase = lk.forward(x);
  auto lokr = std::make_shared<LokrAdapter>(lk, kR, kAlpha, 7);
  lk.adapter = lokr;
  for (float v : lokr->w1.to_floats()) ASSERT_EQ(v, 0.0f);
  for (float v : lokr->w2.to_floats()) ASSERT_LE(std::abs(v), 1.0f / std::sqrt(8.0f));
  test::expect_bitwise_equal(lk.forward(x), lbase, "untrained LoKr");
}

TEST(Adapters, LokrFactorizationIsLycoris) {
  using P = std::pair<int64_t, int64_t>;
  // The examples of PEFT's docstring, and the shapes of a Llama-7B projection.
  EXPECT_EQ(nn::lokr_factorization(256), P(16, 16));
  EXPECT_EQ(nn::lokr_factorization(128), P(8, 16));
  EXPECT_EQ(nn::lokr_factorization(127), P(1, 127));
  EXPECT_EQ(nn::lokr_factorization(128, 4), P(4, 32));
  EXPECT_EQ(nn::lokr_factorization(24), P(4, 6));
  EXPECT_EQ(nn::lokr_factorization(4096), P(64, 64));
  EXPECT_EQ(nn::lokr_factorization(11008), P(86, 128));
}

// ---- a model-shaped tree: names, freezing, errors, training
// ---------------------------------------

struct ToyNode : nn::Module {
  explicit ToyNode(std::string t) : nn::Module(std::move(t)) {}
  Linear* linear(const std::string& name, int64_t in = 16, int64_t out = 16) {
    return register_module(name, std::make_unique<Linear>(in, out, false));
  }
  ToyNode* child(const std::string& name, const std::string& type) {
    return register_module(name, std::make_unique<ToyNode>(type));
  }
};

// Llama's module paths on a toy: model.layers.{0,1}.self_attn.{q,k,v,o}_proj,
// model.layers.{0,1}.mlp.{up,down}_proj, lm_head.
struct Toy {
  std::unique_ptr<ToyNode> root = std::make_unique<ToyNode>("ToyForCausalLM");
  struct Block {
    Linear *q, *k, *v, *o, *up, *down;
  };
  std::vector<Block> blocks;
  Linear* lm_head;

  explicit Toy(DType dt = DType::F32) {
    ToyNode* model = root->child("model", "ToyModel");
    for (int i = 0; i < 2; ++i) {
      ToyNode* layer = model->child("layers." + std::to_string(i), "ToyLayer");
      ToyNode* attn = layer->child("self_attn", "ToyAttention");
      ToyNode* mlp = layer->child("mlp", "ToyMLP");
      Block b;
      b.q = attn->linear("q_proj");
      b.k = attn->linear("k_proj");
      b.v = attn->linear("v_proj");
      b.o = attn->linear("o_proj");
      b.up = mlp->linear("up_proj");
      b.down = mlp->linear("down_proj");
      blocks.push_back(b);
    }
    lm_head = root->linear("lm_head", 16, 8);
    root->assign_paths();
    uint64_t seed = 60;
    for (auto& [name, p] : root->named_parameters()) {
      Tensor t = p;
      t.copy_from(test::randn(t.shape(), seed++, 0.25f));
    }
    if (dt != DType::F32) nn::cast_frozen_parameters(*root, dt);
  }
  static Tensor add(const Tensor& a, const Tensor& b) {  // residual-style add with promotion
    auto [x, y] = amp::promote(a, b);
    return ops::add(x, y);
  }
  Tensor forward(const Tensor& x) {  // [N, 16] -> [N, 8]
    Tensor h = x;
    for (auto& b : blocks) {
      h = add(h, b.o->forward(add(add(b.q->forward(h), b.k->forward(h)), b.v->forward(h))));
      h = add(h, b.down->forward(b.up->forward(h)));
    }
    return lm_head->forward(h);
  }
};

nn::AdapterOptions options(const std::string& kind, std::vector<std::string> targets) {
  nn::AdapterOptions o;
  o.kind = kind;
  o.r = 4;
  o.alpha = 8;
  o.target_modules = std::move(targets);
  o.seed = 3;
  return o;
}

TEST(ApplyAdapters, PeftNamesFreezingAndTreeOrder) {
  Toy toy;
  // Targets in any order; modules come out in tree order.
  auto paths = nn::apply_adapters(*toy.root, options("lora", {"v_proj", "q_proj"}));
  EXPECT_EQ(paths, (std::vector<std::string>{
                       "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                       "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"}));
  std::vector<std::string> names;
  for (auto& [n, t] : nn::peft_state_dict(*toy.root)) {
    names.push_back(n);
    EXPECT_EQ(t.dtype(), DType::F32);
  }
  EXPECT_EQ(names.front(), "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(names[1], "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_EQ(names.back(), "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight");
  EXPECT_EQ(names.size(), 8u);
  // Only adapter parameters train; the base keeps its HF names.
  std::vector<std::string> trainable;
  for (auto& [n, t] : toy.root->named_parameters(true)) trainable.push_back(n);
  EXPECT_EQ(trainable.size(), 8u);
  EXPECT_EQ(trainable.front(), "model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_TRUE(toy.root->find_parameter("model.layers.0.self_attn.q_proj.weight").defined());
  EXPECT_FALSE(toy.root->find_parameter("model.layers.0.self_attn.q_proj.weight").requires_grad());
  // Suffix rule: "self_attn.o_proj" names o_proj only; DoRA adds lora_magnitude_vector; LoKr's
  // 16 = 4 x 4 factors give full lokr_w1 and lokr_w2 (r = 4 >= 4 / 2).
  Toy d;
  nn::apply_adapters(*d.root, options("dora", {"self_attn.o_proj"}));
  auto dn = nn::peft_state_dict(*d.root);
  ASSERT_EQ(dn.size(), 6u);
  EXPECT_EQ(dn[2].first, "base_model.model.model.layers.0.self_attn.o_proj.lora_magnitude_vector");
  EXPECT_EQ(dn[2].second.shape(), (Shape{16}));
  Toy k;
  nn::apply_adapters(*k.root, options("lokr", {"up_proj", "down_proj"}));
  auto kn = nn::peft_state_dict(*k.root);
  ASSERT_EQ(kn.size(), 8u);
  EXPECT_EQ(kn[0].first, "base_model.model.model.layers.0.mlp.up_proj.lokr_w1");
  EXPECT_EQ(kn[1].first, "base_model.model.model.layers.0.mlp.up_proj.lokr_w2");
  EXPECT_EQ(kn[0].second.shape(), (Shape{4, 4}));
}

TEST(ApplyAdapters, ErrorsNameTheProblemAndTheFix) {
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind, Error::kUsage);
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  Toy toy;
  std::string m = message([&] {
    nn::apply_adapters(*toy.root, options("lora", {"q_proj", "qkv"}));
  });
  EXPECT_NE(m.find("'qkv'"), std::string::npos) << m;
  EXPECT_NE(m.find("q_proj, k_proj, v_proj, o_proj, up_proj, down_proj, lm_head"),
            std::string::npos)
      << m;
  EXPECT_TRUE(nn::adapted_linears(*toy.root).empty()) << "a failed apply changes nothing";
  m = message([&] { nn::apply_adapters(*toy.root, options("lora", {"proj"})); });
  EXPECT_NE(m.find("'proj'"), std::string::npos) << "a suffix must be a whole name component";
  m = message([&] { nn::apply_adapters(*toy.root, options("loha", {"q_proj"})); });
  EXPECT_NE(m.find("lora, dora or lokr"), std::string::npos) << m;
  auto bad_r = options("lora", {"q_proj"});
  bad_r.r = 0;
  m = message([&] { nn::apply_adapters(*toy.root, bad_r); });
  EXPECT_NE(m.find("r = 0"), std::string::npos) << m;
  auto lokr_drop = options("lokr", {"q_proj"});
  lokr_drop.dropout = 0.1;
  m = message([&] { nn::apply_adapters(*toy.root, lokr_drop); });
  EXPECT_NE(m.find("model.adapter.dropout = 0"), std::string::npos) << m;
  nn::apply_adapters(*toy.root, options("lora", {"q_proj"}));
  m = message([&] { nn::apply_adapters(*toy.root, options("dora", {"q_proj"})); });
  EXPECT_NE(m.find("already has a lora adapter"), std::string::npos) << m;
}

TEST(ApplyAdapters, BaseDtypeBf16KeepsAdaptersF32) {
  for (const std::string kind : {"lora", "dora", "lokr"}) {
    Toy toy;
    nn::apply_adapters(*toy.root, options(kind, {"q_proj", "v_proj", "up_proj"}));
    for (auto& [n, t] : nn::peft_state_dict(*toy.root)) {
      Tensor p = t;
      p.copy_from(test::randn(p.shape(), 70, 0.1f));  // a trained adapter
    }
    Tensor x = test::randn({3, 16}, 71);
    Tensor ref = toy.forward(x);  // f32 base
    nn::cast_frozen_parameters(*toy.root, DType::BF16);
    EXPECT_EQ(toy.blocks[0].q->weight.dtype(), DType::BF16);
    EXPECT_EQ(toy.root->find_parameter("model.layers.0.self_attn.q_proj.weight").dtype(),
              DType::BF16)
        << "the registry shares the rewritten handle";
    for (auto& [n, t] : nn::peft_state_dict(*toy.root)) EXPECT_EQ(t.dtype(), DType::F32) << n;
    for (bool mixed : {false, true}) {
      amp::AutocastGuard autocast(mixed, DType::BF16);
      Tensor xb = mixed ? x : x.to_dtype(DType::BF16);  // a bf16 model takes bf16 activations
      Tensor y = toy.forward(xb);
      EXPECT_EQ(y.dtype(), DType::BF16);
      test::expect_close(y.to_dtype(DType::F32), ref, 0.05, 0.05, kind + " bf16 base");
      backward(ops::cast(y, DType::F32), Tensor::full(y.shape(), 1.0f));
      for (auto& [n, t] : nn::peft_state_dict(*toy.root)) {
        ASSERT_TRUE(t.grad().defined()) << n << (mixed ? " (autocast)" : " (no autocast)");
        EXPECT_EQ(t.grad().dtype(), DType::F32) << n;
        Tensor g = t;
        g.set_grad(Tensor());
      }
    }
  }
}

// Under bf16 autocast, LoRA's input path (cast to f32, dropout, autocast's bf16 copy for lora_A)
// runs fused (ops::dropout_cast) unless a hook watches the dropout or lora_A: both ways give the
// same output, input gradient (q, k, v share their input, so its gradient sums six consumers) and
// adapter gradients, bit for bit.
TEST(ApplyAdapters, LoraFusedInputPathIsBitIdenticalToTheUnfusedOne) {
  Toy toy(DType::BF16);
  nn::AdapterOptions o = options("lora", {"q_proj", "k_proj", "v_proj", "up_proj", "down_proj"});
  o.dropout = 0.25;
  nn::apply_adapters(*toy.root, o);
  for (auto& [n, t] : nn::peft_state_dict(*toy.root)) {
    Tensor p = t;
    p.copy_from(test::randn(p.shape(), 80, 0.1f));  // lora_B nonzero: the update counts
  }
  // A bf16 input (LoRA after a bf16 op, as down_proj after swiglu) and an f32 one (after an f32
  // norm, as q, k, v and up_proj).
  for (DType xdt : {DType::BF16, DType::F32}) {
    const Tensor x0 = test::randn({5, 16}, 81).to_dtype(xdt);
    auto run = [&] {
      std::vector<Tensor> out;
      Tensor x = x0.clone().set_requires_grad(true);
      nn::Dropout::set_step_seed(9);
      {
        amp::AutocastGuard autocast(true, DType::BF16);
        Tensor y = toy.forward(x);
        out.push_back(y);
        backward(ops::cast(y, DType::F32), test::randn(y.shape(), 82));
      }
      out.push_back(x.grad());
      for (auto& [n, t] : nn::peft_state_dict(*toy.root)) {
        out.push_back(t.grad());
        Tensor g = t;
        g.set_grad(Tensor());
      }
      return out;
    };
    {
      amp::AutocastGuard autocast(true, DType::BF16);
      auto* q = dynamic_cast<LoraAdapter*>(toy.blocks[0].q->adapter.get());
      Tensor h = q->dropped_input(x0.clone().set_requires_grad(true));
      EXPECT_EQ(h.dtype(), DType::BF16);
      EXPECT_STREQ(h.grad_fn()->name(), "dropout_cast");
    }
    const auto fused = run();
    int hooked = 0;
    std::vector<std::pair<nn::Module*, int>> hooks;
    for (Linear* l : nn::adapted_linears(*toy.root)) {
      auto* lora = dynamic_cast<LoraAdapter*>(l->adapter.get());
      ASSERT_TRUE(lora && lora->lora_dropout);
      hooks.emplace_back(lora->lora_dropout, 0);
      hooks.back().second = lora->lora_dropout->add_forward_post_hook(
          [&](nn::Module&, const std::vector<Tensor>& in, Tensor& out) {
            EXPECT_EQ(in[0].dtype(), DType::F32);  // the unfused path: the dropout runs in f32
            EXPECT_EQ(out.dtype(), DType::F32);
            ++hooked;
          });
    }
    const auto unfused = run();
    EXPECT_EQ(hooked, 10);  // five adapted projections in each of two blocks
    ASSERT_EQ(fused.size(), unfused.size());
    for (size_t i = 0; i < fused.size(); ++i) {
      ASSERT_TRUE(fused[i].defined() && unfused[i].defined()) << i;
      test::expect_bitwise_equal(fused[i], unfused[i],
                                 std::string(dtype_name(xdt)) + " tensor " + std::to_string(i));
    }
    for (auto& [m, h] : hooks) m->remove_hook(h);
  }
}

TEST(ApplyAdapters, TrainingMovesOnlyTheAdapter) {
  // Plain SGD on a regression target: the loss falls and every base weight stays bit-identical.
  for (const std::string kind : {"lora", "dora", "lokr"}) {
    Toy toy;
    std::vector<std::pair<std::string, Tensor>> base;
    for (auto& [n, p] : toy.root->named_parameters()) base.emplace_back(n, p.clone());
    nn::apply_adapters(*toy.root, options(kind, {"q_proj", "v_proj", "down_proj"}));
    Tensor x = test::randn({8, 16}, 80);
    Tensor target = test::randn({8, 8}, 81);
    auto loss_of = [&] {  // per-element squared error / 64: the mean's gradient
      Tensor d = ops::add(toy.forward(x), ops::scale(target, -1.0f));
      return ops::scale(ops::mul(d, d), 1.0f / 64);
    };
    double first = 0, last = 0;
    for (int step = 0; step < 30; ++step) {
      Tensor l = loss_of();
      double s = 0;
      for (float v : l.to_floats()) s += v;
      if (step == 0) first = s;
      last = s;
      backward(l, Tensor::full(l.shape(), 1.0f));
      NoGradGuard no_grad;
      for (auto& [n, p] : toy.root->named_parameters(true)) {
        Tensor w = p;
        w.copy_from(ops::add(w, ops::scale(p.grad(), -0.002f)));
        w.bump_version();
        w.set_grad(Tensor());
      }
    }
    EXPECT_LT(last, 0.9 * first) << kind << ": the adapter should learn";
    for (auto& [n, p] : base)
      test::expect_bitwise_equal(toy.root->find_parameter(n), p, kind + " base " + n);
  }
}

}  // namespace
}  // namespace keel
