// dropout: the mask against its specification (an independent splitmix64 here), an f64 reference
// of forward and backward with that mask, the drop rate, reproducibility across runs, thread
// counts and ISAs, gradcheck, errors, and PyTorch applying the same mask.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>

#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "keel/ops/dropout.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/op_util.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::expect_close;
using test::IsaRestore;
using test::randn;
using test::ThreadsGuard;

// The mask of backend/dropout.h: element i survives when the top 32 bits of the i-th splitmix64
// output keyed by seed are >= floor(p * 2^32).
uint64_t splitmix_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
std::vector<bool> mask_ref(int64_t n, float p, uint64_t seed) {
  const uint64_t gamma = 0x9E3779B97F4A7C15ull, key = splitmix_mix(seed + gamma);
  const uint64_t threshold = static_cast<uint64_t>(std::ldexp(static_cast<double>(p), 32));
  std::vector<bool> keep(n);
  for (int64_t i = 0; i < n; ++i)
    keep[i] = (splitmix_mix(key + gamma * static_cast<uint64_t>(i + 1)) >> 32) >= threshold;
  return keep;
}
// out = x * keep / (1 - p) in f64 (x * 0 for a dropped element: NaN stays NaN).
std::vector<float> dropout_ref(const std::vector<float>& x, float p, uint64_t seed) {
  const auto keep = mask_ref(static_cast<int64_t>(x.size()), p, seed);
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    out[i] = static_cast<float>(x[i] * (keep[i] ? 1.0 / (1.0 - p) : 0.0));
  return out;
}

TEST(Dropout, ForwardAndBackwardMatchReferenceInEveryDtype) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (float p : {0.1f, 0.5f, 0.9f}) {
      const std::string what = std::string(dtype_name(dt)) + " p=" + std::to_string(p);
      Tensor x = randn({3, 1000}, 1, 1.f, dt).set_requires_grad(true);
      Tensor y = ops::dropout(x, p, 42);
      EXPECT_EQ(y.dtype(), dt);
      EXPECT_EQ(y.shape(), x.shape());
      // f32 scale and one rounding into dt vs the exact value.
      const double tol = 2 * test::eps_of(dt);
      expect_close(y.to_floats(), dropout_ref(x.to_floats(), p, 42), 0, tol, "forward " + what);
      // The gradient is g * mask * scale, with the forward's mask.
      Tensor g = randn(x.shape(), 2, 1.f, dt);
      backward(y, g);
      ASSERT_EQ(x.grad().dtype(), dt);
      expect_close(x.grad().to_floats(), dropout_ref(g.to_floats(), p, 42), 0, tol,
                   "backward " + what);
    }
}

TEST(Dropout, DropRateIsP) {
  const int64_t n = 1 << 20;
  Tensor ones = Tensor::full({n}, 1.f);
  for (float p : {0.1f, 0.5f, 0.9f}) {
    const auto y = ops::dropout(ones, p, 7).to_floats();
    int64_t dropped = 0;
    for (float v : y) dropped += v == 0.f;
    // 6 standard deviations of a binomial(n, p) rate: sqrt(p(1-p)/n) <= 5e-4.
    EXPECT_NEAR(static_cast<double>(dropped) / n, p, 3e-3) << "p = " << p;
    for (float v : y) ASSERT_TRUE(v == 0.f || v == static_cast<float>(1.0 / (1.0 - p)));
  }
}

TEST(Dropout, MaskIsReproducibleAcrossRunsThreadsAndIsas) {
  IsaRestore restore;
  Tensor x = randn({1 << 16}, 3, 1.f, DType::BF16);  // large enough to split across threads
  const Tensor ref = ops::dropout(x, 0.3f, 1234);
  test::expect_bitwise_equal(ops::dropout(x, 0.3f, 1234), ref, "rerun");
  for (int threads : {1, 3}) {
    ThreadsGuard guard(threads);
    test::expect_bitwise_equal(ops::dropout(x, 0.3f, 1234), ref, std::to_string(threads) + " thr");
  }
  for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512}) {
    if (static_cast<int>(isa) > static_cast<int>(restore.saved)) continue;
    set_cpu_isa(isa);
    test::expect_bitwise_equal(ops::dropout(x, 0.3f, 1234), ref, cpu_isa_name(isa));
  }
  set_cpu_isa(restore.saved);
  // Another seed, another mask.
  const auto a = ref.to_floats(), b = ops::dropout(x, 0.3f, 1235).to_floats();
  int64_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += (a[i] == 0.f) != (b[i] == 0.f);
  EXPECT_GT(differ, static_cast<int64_t>(a.size()) / 4);
}

// dropout_cast keeps its mask as bits for the backward (packed per 512-element block by each ISA's
// kernel, on every thread): the gradient is the hashed mask's, bit for bit, whatever the thread
// count and ISA of the forward and the backward, at a length that ends inside a byte.
TEST(Dropout, CastsKeptMaskIsTheHashedOneAcrossThreadsAndIsas) {
  IsaRestore restore;
  const int64_t n = (1 << 16) + 5;
  const Tensor x0 = randn({n}, 5, 1.f), g = randn({n}, 6, 1.f);
  auto grad_of = [&](bool fused) {
    Tensor x = x0.clone().set_requires_grad(true);
    backward(fused ? ops::dropout_cast(x, 0.3f, 99, DType::BF16)
                   : ops::cast(ops::dropout(x, 0.3f, 99), DType::BF16),
             g.to_dtype(DType::BF16));
    return x.grad();
  };
  const Tensor ref = grad_of(false);
  for (int threads : {1, 3}) {
    ThreadsGuard guard(threads);
    test::expect_bitwise_equal(grad_of(true), ref, std::to_string(threads) + " threads");
  }
  for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512}) {
    if (static_cast<int>(isa) > static_cast<int>(restore.saved)) continue;
    set_cpu_isa(isa);
    test::expect_bitwise_equal(grad_of(true), ref, cpu_isa_name(isa));
  }
  set_cpu_isa(restore.saved);
}

TEST(Dropout, ZeroPReturnsTheInputItself) {
  Tensor x = randn({4, 5}, 4).set_requires_grad(true);
  Tensor y = ops::dropout(x, 0.f, 1);
  EXPECT_EQ(y.impl(), x.impl());
}

TEST(Dropout, RejectsPOutsideZeroOne) {
  Tensor x = randn({4}, 5);
  for (float p : {-0.1f, 1.f, 1.5f, std::numeric_limits<float>::quiet_NaN()})
    EXPECT_THROW(ops::dropout(x, p, 1), Error) << p;
  EXPECT_THROW(ops::dropout(Tensor::from_ints({1, 2}, {2}), 0.5f, 1), Error);
}

// Dropping multiplies by 0, as PyTorch does: a non-finite input is never hidden (NaN * 0 = NaN).
TEST(Dropout, NonFiniteValuesPropagate) {
  const float inf = std::numeric_limits<float>::infinity();
  Tensor x = Tensor::full({64}, std::numeric_limits<float>::quiet_NaN());
  x.data_as<float>()[1] = inf;
  const auto keep = mask_ref(64, 0.5f, 3);
  const auto y = ops::dropout(x, 0.5f, 3).to_floats();
  for (int i = 0; i < 64; ++i) {
    if (keep[i] && i == 1)
      EXPECT_EQ(y[i], inf);
    else
      EXPECT_TRUE(std::isnan(y[i])) << i;
  }
}

// dropout_cast stands for cast(dropout(cast(x, f32)), out) (LoRA's input path under autocast,
// x in f32 after a norm or in 16 bits after swiglu): the same bits forward, a gradient asked for
// in f32 by the consumer's product, and the same bits backward for an f32 and for a 16-bit
// incoming gradient. Values include huge ones that overflow once scaled or rounded, subnormals,
// signed zero, NaN and inf.
TEST(Dropout, CastIsTheCastDropoutCastChainBitForBit) {
  const float inf = std::numeric_limits<float>::infinity();
  for (DType out : {DType::BF16, DType::F16})
    for (DType xdt : {DType::F32, out})
      for (float p : {0.f, 0.05f, 0.5f}) {
        const std::string what = std::string("x ") + dtype_name(xdt) + " out " + dtype_name(out) +
                                 " p=" + std::to_string(p);
        std::vector<float> v = randn({4099}, 11, 3.f).to_floats();
        v[0] = std::numeric_limits<float>::quiet_NaN();
        v[1] = inf;
        v[2] = -inf;
        v[3] = 1e-40f;
        v[4] = 3.3e38f;
        v[5] = 65519.f;
        v[6] = -0.f;
        v[7] = 1.00390625f;  // a bf16 tie
        Tensor x0 = Tensor::from_floats(v, {4099}).to_dtype(xdt);
        Tensor xa = x0.clone().set_requires_grad(true), xb = x0.clone().set_requires_grad(true);
        auto chain = [&](const Tensor& x) {
          return ops::cast(ops::dropout(ops::cast(x, DType::F32), p, 77), out);
        };
        Tensor fused = ops::dropout_cast(xb, p, 77, out);
        ASSERT_EQ(fused.dtype(), out) << what;
        test::expect_bitwise_equal(chain(xa), fused, "forward " + what);
        EXPECT_EQ(ops::grad_dtype_for(fused), DType::F32) << what;
        for (DType gdt : {DType::F32, out}) {
          std::vector<float> gv = randn({4099}, 12, 2.f).to_floats();
          gv[7] = std::numeric_limits<float>::quiet_NaN();
          gv[8] = 1e30f;
          Tensor g = Tensor::from_floats(gv, {4099}).to_dtype(gdt);
          xa.set_grad(Tensor());
          xb.set_grad(Tensor());
          backward(chain(xa), g);
          backward(ops::dropout_cast(xb, p, 77, out), g);
          ASSERT_EQ(xb.grad().dtype(), xdt) << what;
          test::expect_bitwise_equal(xa.grad(), xb.grad(),
                                     "backward " + what + ", gradient in " + dtype_name(gdt));
        }
      }
  Tensor x32 = randn({4}, 1);
  EXPECT_THROW(ops::dropout_cast(x32, 0.5f, 1, DType::F32), Error);  // nothing to round into
  EXPECT_THROW(ops::dropout_cast(x32, 1.f, 1, DType::BF16), Error);
}

TEST(Dropout, Gradcheck) {
  test::expect_gradcheck([](const std::vector<Tensor>& in) { return ops::dropout(in[0], 0.4f, 9); },
                         {randn({3, 7}, 6)}, {}, "dropout");
}

TEST(Dropout, ParityWithPyTorchApplyingTheSameMask) {
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    test::expect_parity("dropout", "dropout." + d,
                        [](auto& in) { return ops::dropout(in[0], 0.1f, 1234); });
    test::expect_parity("dropout", "dropout_half." + d,
                        [](auto& in) { return ops::dropout(in[0], 0.5f, 99); });
  }
}

}  // namespace
}  // namespace keel
