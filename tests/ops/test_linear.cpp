// matmul / linear: gradient checks, an f64 reference in every dtype, and determinism.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>

#include "keel/autograd/node.h"
#include "keel/backend/elementwise.h"
#include "keel/backend/matmul.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::expect_close;
using test::expect_gradcheck;
using test::randn;

// Reference: y[m, n] = sum_k x[m, k] w[n, k] + b[n], f64 accumulation of the stored values.
std::vector<float> linear_ref(const Tensor& x, const Tensor& w, const Tensor& b) {
  const auto xv = x.to_floats(), wv = w.to_floats();
  const int64_t k = w.size(1), n = w.size(0), m = x.numel() / k;
  std::vector<float> bv = b.defined() ? b.to_floats() : std::vector<float>(n, 0.f);
  std::vector<float> y(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = bv[j];
      for (int64_t p = 0; p < k; ++p) s += double(xv[i * k + p]) * wv[j * k + p];
      y[i * n + j] = static_cast<float>(s);
    }
  return y;
}

TEST(Linear, ForwardMatchesReferenceInEveryDtype) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    Tensor x = randn({3, 5, 64}, 1, 1.0f, dt), w = randn({48, 64}, 2, 0.2f, dt);
    Tensor b = randn({48}, 3, 0.5f, dt);
    Tensor y = ops::linear(x, w, b);
    EXPECT_EQ(y.dtype(), dt);
    EXPECT_EQ(y.shape(), (Shape{3, 5, 48}));
    // One rounding of the f32-accumulated result: atol covers f32 accumulation over k = 64.
    expect_close(y.to_floats(), linear_ref(x, w, b), 1e-4, test::eps_of(dt),
                 std::string("linear ") + dtype_name(dt));
  }
}

// The bias rides in oneDNN's epilogue on the CPU; with no input features the output is the bias.
TEST(Linear, ZeroInputFeaturesGiveTheBias) {
  for (DType dt : {DType::F32, DType::BF16}) {
    const Tensor b = randn({3}, 7, 1.f, dt);
    const Tensor y = ops::linear(Tensor::empty({2, 0}, dt), Tensor::empty({3, 0}, dt), b);
    const auto bv = b.to_floats();
    EXPECT_EQ(y.to_floats(), (std::vector<float>{bv[0], bv[1], bv[2], bv[0], bv[1], bv[2]}));
  }
}

TEST(Linear, Gradcheck) {
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::linear(in[0], in[1], in[2]); },
                   {randn({2, 3, 4}, 1), randn({5, 4}, 2), randn({5}, 3)}, {}, "linear");
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::linear(in[0], in[1]); },
                   {randn({6, 4}, 4), randn({3, 4}, 5)}, {}, "linear no bias");
}

TEST(Matmul, GradcheckAllTransposes) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      Tensor a = ta ? randn({2, 4, 3}, 1) : randn({2, 3, 4}, 1);  // logical [2, 3, 4]
      Tensor b = tb ? randn({2, 5, 4}, 2) : randn({2, 4, 5}, 2);  // logical [2, 4, 5]
      expect_gradcheck(
          [=](const std::vector<Tensor>& in) { return ops::matmul(in[0], in[1], ta, tb); }, {a, b},
          {}, "matmul ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
    }
  // A 2-D right operand shared by every batch.
  for (bool tb : {false, true})
    expect_gradcheck(
        [=](const std::vector<Tensor>& in) { return ops::matmul(in[0], in[1], false, tb); },
        {randn({2, 3, 4}, 3), tb ? randn({5, 4}, 4) : randn({4, 5}, 4)}, {}, "matmul shared b");
}

// C (+)= op(A)·B through the CPU matmul kernel, A [m, k] (stored [k, m] when trans_a), B [k, n].
void cpu_product(Tensor& out, const Tensor& a, const Tensor& b, int64_t m, int64_t k, int64_t n,
                 bool trans_a, bool accumulate) {
  MatmulArgs args;
  args.c = out.data();
  args.a = a.data();
  args.b = b.data();
  args.in_dt = a.dtype();
  args.m = m;
  args.n = n;
  args.k = k;
  args.trans_a = trans_a;
  args.accumulate = accumulate;
  matmul_kernels(Device::cpu()).matmul(args);
}

// The CPU backend rearranges some f32 products for oneDNN's faster layouts (a transposed copy of
// B, or Cᵀ = Bᵀ·Aᵀ transposed back; backend/cpu/matmul_dnnl.cpp). Shapes that take each route,
// plain and accumulating, against an f64 reference of C (+)= op(A)·B.
TEST(Matmul, RearrangedF32ProductsMatchTheReference) {
  struct Case {
    int64_t m, k, n;
    bool trans_a;
    const char* route;
  };
  const Case cases[] = {{8, 200, 4, false, "C^T, long K (vocabulary head dX)"},
                        {80, 1024, 4, true, "C^T, tall C (vocabulary head dW)"},
                        {64, 24, 2048, true, "B transposed (wide dW)"},
                        {8, 512, 2048, false, "C^T, wide N (mlp.c_proj dX)"},
                        {16, 24, 20, true, "direct TN"},
                        {16, 24, 20, false, "direct NN"}};
  for (const Case& c : cases)
    for (bool accumulate : {false, true}) {
      const Tensor a = c.trans_a ? randn({c.k, c.m}, 11, 0.5f) : randn({c.m, c.k}, 11, 0.5f);
      const Tensor b = randn({c.k, c.n}, 12, 0.5f);
      Tensor out = randn({c.m, c.n}, 13);
      const auto av = a.to_floats(), bv = b.to_floats(), c0 = out.to_floats();
      std::vector<float> ref(c.m * c.n);
      for (int64_t i = 0; i < c.m; ++i)
        for (int64_t j = 0; j < c.n; ++j) {
          double s = accumulate ? c0[i * c.n + j] : 0.0;
          for (int64_t p = 0; p < c.k; ++p)
            s += double(c.trans_a ? av[p * c.m + i] : av[i * c.k + p]) * bv[p * c.n + j];
          ref[i * c.n + j] = static_cast<float>(s);
        }
      cpu_product(out, a, b, c.m, c.k, c.n, c.trans_a, accumulate);
      expect_close(out.to_floats(), ref, 1e-5, 1e-5,
                   std::string(c.route) + (accumulate ? ", accumulate" : ""));
    }
}

// MatmulArgs::alpha scales the f32 accumulator before the one rounding: the eager attention's
// scores come out of the product as round(scale * (q·kᵀ)) in bf16, which must be the bits of the
// f32 product scaled and rounded afterwards (what the softmax kernel did with raw f32 scores).
TEST(Matmul, AlphaScalesTheAccumulatorBeforeTheOneRounding) {
  const int64_t batch = 3, m = 70, n = 70, k = 24;
  const float alpha = static_cast<float>(1.0 / std::sqrt(24.0));  // not a power of 2
  for (DType dt : {DType::BF16, DType::F16, DType::F32}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor a = randn({batch, m, k}, 21, 2.f, dt), b = randn({batch, n, k}, 22, 2.f, dt);
    Tensor raw = Tensor::empty({batch, m, n}, DType::F32),
           scaled = Tensor::empty({batch, m, n}, dt);
    MatmulArgs args;
    args.a = a.data();
    args.b = b.data();
    args.in_dt = dt;
    args.batch = batch;
    args.m = m;
    args.n = n;
    args.k = k;
    args.trans_b = true;
    args.c = raw.data();
    args.out_dt = DType::F32;
    matmul_kernels(Device::cpu()).matmul(args);
    args.c = scaled.data();
    args.out_dt = dt;
    args.alpha = alpha;
    matmul_kernels(Device::cpu()).matmul(args);
    std::vector<float> want = raw.to_floats();
    for (float& v : want) v = alpha * v;
    test::expect_bitwise_equal(scaled, Tensor::from_floats(want, raw.shape(), dt), "alpha product");
  }
}

// The vocabulary head's backward products run in 4096-wide pieces of the vocabulary side
// (backend/cpu/matmul_dnnl.cpp, vocab_pieces): dX with K in pieces added up, dW in row panels.
// Every shape below takes that route, with a ragged last piece. Sampled entries (every row panel,
// the ragged one included; each dX entry sums over every piece) must equal the f64 sum of the same
// products within f32 rounding, also when accumulating into C.
TEST(Matmul, VocabularyProductsInPiecesMatchTheF64Sum) {
  struct Case {
    DType dt;
    int64_t m, k, n;
    bool trans_a;
    const char* route;
  };
  const Case cases[] = {{DType::BF16, 512, 4 * 4096 + 16, 512, false, "bf16 head dX, K in pieces"},
                        {DType::BF16, 2 * 4096 + 8, 2048, 512, true, "bf16 head dW, M in panels"},
                        {DType::F32, 64, 2 * 4096 + 24, 256, false, "f32 head dX, K in pieces"},
                        {DType::F32, 2 * 4096 + 40, 256, 256, true, "f32 head dW, M in panels"}};
  // Uniform values from a linear congruential generator: randn's Box-Muller on 34M values would
  // take most of this test's time.
  auto uniform = [](const Shape& shape, uint64_t seed, DType dt) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(n);
    for (float& x : v) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      x = static_cast<float>(seed >> 40) * 0x1p-24f - 0.5f;
    }
    return ops::cast(Tensor::from_floats(v, shape), dt);
  };
  for (const Case& c : cases) {
    const Tensor a = c.trans_a ? uniform({c.k, c.m}, 21, c.dt) : uniform({c.m, c.k}, 21, c.dt);
    const Tensor b = uniform({c.k, c.n}, 22, c.dt);
    const Tensor c0 = randn({c.m, c.n}, 23);
    const auto av = a.to_floats(), bv = b.to_floats(), c0v = c0.to_floats();
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < c.m; i += 1021) rows.push_back(i);
    for (int64_t i = c.m - 9; i < c.m; ++i) rows.push_back(i);
    for (bool accumulate : {false, true}) {
      Tensor out = c0.clone();
      cpu_product(out, a, b, c.m, c.k, c.n, c.trans_a, accumulate);
      const auto got = out.to_floats();
      std::vector<float> sampled, ref;
      for (int64_t i : rows)
        for (int64_t j : {int64_t{0}, c.n / 3, c.n - 1}) {
          double sum = accumulate ? c0v[i * c.n + j] : 0.0;
          for (int64_t p = 0; p < c.k; ++p)
            sum += double(c.trans_a ? av[p * c.m + i] : av[i * c.k + p]) * bv[p * c.n + j];
          sampled.push_back(got[i * c.n + j]);
          ref.push_back(static_cast<float>(sum));
        }
      expect_close(sampled, ref, 1e-3, 1e-4,
                   std::string(c.route) + (accumulate ? ", accumulate" : ""));
    }
  }
}

TEST(Matmul, RejectsMismatchedShapes) {
  EXPECT_THROW(ops::matmul(randn({2, 3}, 1), randn({4, 5}, 2)), Error);
  EXPECT_THROW(ops::linear(randn({2, 3}, 1), randn({4, 5}, 2)), Error);
  EXPECT_THROW(ops::linear(randn({2, 4}, 1), randn({3, 4}, 2, 1.f, DType::BF16)), Error);
}

TEST(Elementwise, Gradchecks) {
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::add(in[0], in[1]); },
                   {randn({3, 4}, 1), randn({3, 4}, 2)}, {}, "add");
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::add(in[0], in[1]); },
                   {randn({2, 3, 4}, 1), randn({4}, 2)}, {}, "add row broadcast");
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::mul(in[0], in[1]); },
                   {randn({3, 4}, 3), randn({3, 4}, 4)}, {}, "mul");
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::mul(in[0], in[1]); },
                   {randn({2, 3, 4}, 3), randn({3, 4}, 4)}, {}, "mul broadcast");
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::scale(in[0], -2.5f); },
                   {randn({7}, 5)}, {}, "scale");
  expect_gradcheck(
      [](const std::vector<Tensor>& in) { return ops::add_scaled(in[0], in[1], 0.37f); },
      {randn({3, 5}, 7), randn({3, 5}, 8)}, {}, "add_scaled");
  // A tensor used twice: gradients from both uses add up.
  expect_gradcheck([](const std::vector<Tensor>& in) { return ops::mul(in[0], in[0]); },
                   {randn({5}, 6)}, {}, "x*x");
}

// LoRA's tail in one pass must be the two ops it replaces, bit for bit, forward and backward: the
// scaled update is rounded into the dtype before the sum (no fused multiply-add in f32 either).
TEST(Elementwise, AddScaledHasTheBitsOfAddAfterScale) {
  auto bits = [](const Tensor& t) {
    const Tensor c = t.to_dtype(DType::F32);  // exact from every floating dtype
    std::vector<uint32_t> out(c.numel());
    std::memcpy(out.data(), c.data(), out.size() * 4);
    return out;
  };
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Shape shape{3, 701};  // blocks of 512 and a tail, on each thread
    const float s = 2.f / 3.f;  // inexact: s * b rounds
    Tensor a1 = randn(shape, 11, 3.f, dt).set_requires_grad(true);
    Tensor b1 = randn(shape, 12, 3.f, dt).set_requires_grad(true);
    Tensor a2 = a1.clone().set_requires_grad(true), b2 = b1.clone().set_requires_grad(true);
    Tensor g = randn(shape, 13, 1.f, dt);
    Tensor fused = ops::add_scaled(a1, b1, s);
    Tensor pair = ops::add(a2, ops::scale(b2, s));
    EXPECT_EQ(bits(fused), bits(pair));
    backward(fused, g);
    backward(pair, g);
    EXPECT_EQ(bits(a1.grad()), bits(a2.grad()));
    EXPECT_EQ(bits(b1.grad()), bits(b2.grad()));
  }
  EXPECT_THROW(ops::add_scaled(randn({2, 3}, 1), randn({3}, 2), 1.f), Error);
}

TEST(Elementwise, CastRoundsAndBackwardCastsBack) {
  Tensor x = Tensor::from_floats({1.0f + 1.0f / 512, 70000.f}, {2}).set_requires_grad(true);
  Tensor h = ops::cast(x, DType::F16);
  EXPECT_EQ(h.dtype(), DType::F16);
  auto hv = h.to_floats();
  EXPECT_EQ(hv[0], 1.0f + 1.0f / 512);
  EXPECT_TRUE(std::isinf(hv[1]));
  Tensor bf = ops::cast(x, DType::BF16);
  EXPECT_EQ(bf.to_floats()[0], 1.0f);
  backward(ops::cast(bf, DType::F32), Tensor::from_floats({3.f, 4.f}, {2}));
  EXPECT_EQ(x.grad().dtype(), DType::F32);
  EXPECT_EQ(x.grad().to_floats(), (std::vector<float>{3.f, 4.f}));
}

TEST(Elementwise, RowSumsAreTheRowOrderSumAtAnyThreadCount) {
  // The bias gradient's row sums split columns over the threads in chunks of 128: each column is
  // still one f32 sum in row order, rounded once to the dtype, whatever the thread count. 389
  // columns leave a ragged chunk. The product sums (sum_rows_mul) may fuse each multiply-add on
  // FMA CPUs, so they are checked against themselves across thread counts and near the plain sum.
  const int64_t rows = 37, cols = 389;
  const auto& ew = elementwise_kernels(Device::cpu());
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor a = randn({rows, cols}, 71, 1.f, dt), b = randn({rows, cols}, 72, 1.f, dt);
    const auto av = a.to_floats(), bv = b.to_floats();
    std::vector<float> sum(cols, 0.f), dot(cols, 0.f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        sum[c] += av[r * cols + c];
        dot[c] += av[r * cols + c] * bv[r * cols + c];
      }
    const Tensor want_sum = ops::cast(Tensor::from_floats(sum, {cols}), dt);
    const int saved = omp_get_max_threads();
    Tensor first_dot;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      Tensor got_sum = Tensor::empty({cols}, dt), got_dot = Tensor::empty({cols}, dt);
      ew.sum_rows(got_sum.data(), a.data(), dt, rows, cols);
      ew.sum_rows_mul(got_dot.data(), a.data(), b.data(), dt, rows, cols);
      const std::string what =
          std::string(dtype_name(dt)) + ", " + std::to_string(threads) + " threads";
      test::expect_bitwise_equal(got_sum, want_sum, "sum_rows " + what);
      expect_close(got_dot.to_floats(), dot, 1e-5, 2 * test::eps_of(dt), "sum_rows_mul " + what);
      if (threads == 1)
        first_dot = got_dot;
      else
        test::expect_bitwise_equal(got_dot, first_dot, "sum_rows_mul " + what + " vs 1 thread");
    }
    omp_set_num_threads(saved);
  }
}

TEST(Determinism, LinearBackwardIsBitIdenticalAcrossRuns) {
  auto run = [] {
    Tensor x = randn({16, 96}, 1), w = randn({80, 96}, 2, 0.1f), b = randn({80}, 3);
    w.set_requires_grad(true);
    b.set_requires_grad(true);
    Tensor y = ops::linear(x, w, b);
    backward(y, randn(y.shape(), 4));
    return std::vector<Tensor>{y, w.grad(), b.grad()};
  };
  auto r1 = run(), r2 = run();
  for (size_t i = 0; i < r1.size(); ++i) test::expect_bitwise_equal(r1[i], r2[i], "run");
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

TEST(Parity, LinearMatmulAndElementwiseMatchPyTorch) {
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    test::expect_parity("linear", "linear." + d,
                        [](auto& in) { return ops::linear(in[0], in[1], in[2]); });
    test::expect_parity("linear", "matmul." + d,
                        [](auto& in) { return ops::matmul(in[0], in[1]); });
    test::expect_parity("linear", "matmul_tb." + d,
                        [](auto& in) { return ops::matmul(in[0], in[1], false, true); });
    test::expect_parity("linear", "add." + d, [](auto& in) { return ops::add(in[0], in[1]); });
    test::expect_parity("linear", "mul." + d, [](auto& in) { return ops::mul(in[0], in[1]); });
    test::expect_parity("linear", "scale." + d, [](auto& in) { return ops::scale(in[0], 0.37f); });
  }
}

}  // namespace
}  // namespace keel
