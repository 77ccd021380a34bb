// Packed rows (data.pack with JSONL): several examples one after another in a row, told apart by
// positions that restart at 0 on each example's first token. Each example must compute what it
// computes alone — attention in every backend and dtype, forward and gradients, and RoPE at its
// own positions — and positions that do not describe examples are refused. And Mistral's sliding
// window, the other bound on the keys a query sees, alone and within packed examples.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "keel/autograd/node.h"
#include "keel/ops/attention.h"
#include "keel/ops/rope.h"
#include "tests/support/attention_ref.h"
#include "tests/support/check.h"

namespace keel::packed_attention_test {

using ops::AttentionBackend;
using test::randn;

constexpr AttentionBackend kBackends[] = {AttentionBackend::kEager, AttentionBackend::kMath,
                                          AttentionBackend::kFlash};

// Positions [B, T] of rows made of examples of the given lengths (then padding, counting on).
Tensor positions_of(const std::vector<std::vector<int64_t>>& rows, int64_t t) {
  std::vector<int64_t> pos;
  for (const auto& lengths : rows) {
    int64_t p = 0, left = 0;
    size_t k = 0;
    for (int64_t i = 0; i < t; ++i) {
      if (left == 0 && k < lengths.size()) left = lengths[k++], p = 0;
      pos.push_back(p++);
      if (left > 0) --left;
    }
  }
  return Tensor::from_ints(pos, {static_cast<int64_t>(rows.size()), t});
}

// x[b, :, t0 : t0 + n, :] of x [B, H, T, D], as [1, H, n, D] in x's dtype.
Tensor span_of(const Tensor& x, int64_t b, int64_t t0, int64_t n) {
  const int64_t h = x.size(1), t = x.size(2), d = x.size(3);
  const std::vector<float> v = x.to_floats();
  std::vector<float> out;
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t i = t0; i < t0 + n; ++i)
      for (int64_t dd = 0; dd < d; ++dd) out.push_back(v[((b * h + hh) * t + i) * d + dd]);
  return Tensor::from_floats(out, {1, h, n, d}).to_dtype(x.dtype());
}

// Zeroes rows [t0, T) of batch row b of g [B, H, T, D] (padding: no loss reaches them).
void zero_from(Tensor& g, int64_t b, int64_t t0) {
  const int64_t h = g.size(1), t = g.size(2), d = g.size(3);
  std::vector<float> v = g.to_floats();
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t i = t0; i < t; ++i)
      for (int64_t dd = 0; dd < d; ++dd) v[((b * h + hh) * t + i) * d + dd] = 0.f;
  g = Tensor::from_floats(v, g.shape()).to_dtype(g.dtype());
}

struct Grads {
  Tensor out, dq, dk, dv;
};
Grads run(const Tensor& q0, const Tensor& k0, const Tensor& v0, const ops::AttentionMask& mask,
          AttentionBackend be, const Tensor& gout) {
  Tensor q = q0.clone().set_requires_grad(true), k = k0.clone().set_requires_grad(true),
         v = v0.clone().set_requires_grad(true);
  Tensor out = ops::attention(q, k, v, mask, be);
  backward(out, gout);
  return {out, q.grad(), k.grad(), v.grad()};
}

TEST(PackedAttention, EachExampleComputesWhatItComputesAlone) {
  // T = 70 crosses a flash key tile (64) and two query tiles (32): examples that start inside a
  // tile, one that spans two, and a row that ends in padding.
  const int64_t t = 70, hq = 4, hkv = 2, dd = 16;
  const std::vector<std::vector<int64_t>> rows = {{20, 45, 5}, {30, 20}};
  const Tensor pos = positions_of(rows, t);
  std::vector<int64_t> real(2 * t, 1);
  for (int64_t i = 50; i < t; ++i) real[t + i] = 0;  // row 1: padding after 50 tokens
  const Tensor key_padding = Tensor::from_ints(real, {2, t}, DType::U8);
  for (DType dt : {DType::F32, DType::BF16}) {
    const Tensor q = randn({2, hq, t, dd}, 11, 1.f, dt), k = randn({2, hkv, t, dd}, 12, 1.f, dt),
                 v = randn({2, hkv, t, dd}, 13, 1.f, dt);
    Tensor gout = randn(q.shape(), 14, 1.f, dt);
    zero_from(gout, 1, 50);
    // f32: the products sum the same terms in another order (the packed row's keys of other
    // examples add exact zeros); bf16: that, rounded, is an ulp now and then.
    const double tol = dt == DType::F32 ? 2e-5 : 1.0 / 64;
    for (AttentionBackend be : kBackends) {
      const Grads packed = run(q, k, v, ops::AttentionMask(key_padding, pos), be, gout);
      for (int64_t b = 0; b < 2; ++b) {
        int64_t t0 = 0;
        for (int64_t n : rows[static_cast<size_t>(b)]) {
          const std::string what = std::string(dtype_name(dt)) + " " +
                                   ops::attention_backend_name(be) + " row " + std::to_string(b) +
                                   " example at " + std::to_string(t0);
          const Grads alone = run(span_of(q, b, t0, n), span_of(k, b, t0, n), span_of(v, b, t0, n),
                                  ops::AttentionMask(), be, span_of(gout, b, t0, n));
          test::expect_close(span_of(packed.out, b, t0, n), alone.out, tol, tol, what + " out");
          test::expect_close(span_of(packed.dq, b, t0, n), alone.dq, tol, tol, what + " dq");
          test::expect_close(span_of(packed.dk, b, t0, n), alone.dk, tol, tol, what + " dk");
          test::expect_close(span_of(packed.dv, b, t0, n), alone.dv, tol, tol, what + " dv");
          t0 += n;
        }
      }
    }
  }
}

// A query's softmax runs over its example's keys as over a row of its own: in f32 the eager and
// math probabilities, and so a one-example row's outputs, are the bits of the unpacked row.
TEST(PackedAttention, OneExampleARowIsTheUnpackedRowBitForBit) {
  const int64_t t = 40;
  const Tensor q = randn({2, 2, t, 8}, 21), k = randn({2, 2, t, 8}, 22),
               v = randn({2, 2, t, 8}, 23);
  const Tensor gout = randn(q.shape(), 24);
  const Tensor pos = positions_of({{t}, {t}}, t);
  for (AttentionBackend be : kBackends) {
    const Grads packed = run(q, k, v, ops::AttentionMask(Tensor(), pos), be, gout);
    const Grads plain = run(q, k, v, ops::AttentionMask(), be, gout);
    const std::string what = ops::attention_backend_name(be);
    test::expect_bitwise_equal(packed.out, plain.out, what + " out");
    test::expect_bitwise_equal(packed.dq, plain.dq, what + " dq");
    test::expect_bitwise_equal(packed.dk, plain.dk, what + " dk");
    test::expect_bitwise_equal(packed.dv, plain.dv, what + " dv");
  }
}

TEST(PackedAttention, GradientsMatchFiniteDifferences) {
  const Tensor pos = positions_of({{4, 5}}, 9);
  for (AttentionBackend be : kBackends)
    test::expect_gradcheck(
        [&](const std::vector<Tensor>& in) {
          return ops::attention(in[0], in[1], in[2], ops::AttentionMask(Tensor(), pos), be);
        },
        {randn({1, 2, 9, 4}, 31), randn({1, 1, 9, 4}, 32), randn({1, 1, 9, 4}, 33)}, {},
        std::string("packed ") + ops::attention_backend_name(be));
}

TEST(PackedAttention, PositionsThatDescribeNoExamplesAreRefused) {
  const Tensor q = randn({1, 1, 4, 4}, 41);
  auto error_of = [&](const Tensor& pos) {
    try {
      ops::attention(q, q, q, ops::AttentionMask(Tensor(), pos));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_CONTAINS(error_of(Tensor::from_ints({0, 1, 3, 4}, {1, 4})),
                  "attention: positions[0, 2] = 3 neither starts an example (0) nor follows the "
                  "position before it by one");
  EXPECT_CONTAINS(error_of(Tensor::from_ints({1, 2, 3, 4}, {1, 4})), "positions[0, 0] = 1");
  EXPECT_CONTAINS(error_of(Tensor::from_ints({0, 1, 2}, {1, 3})),
                  "attention: positions must be i64 [B, T] = [1, 4], got i64 [1, 3]");
  EXPECT_CONTAINS(error_of(Tensor::from_ints({0, 1, 2, 3}, {1, 4}, DType::I32)), "got i32 [1, 4]");
  // Every token an example of its own is a valid packing: each query sees only itself.
  EXPECT_EQ(error_of(Tensor::from_ints({0, 0, 0, 0}, {1, 4})), "no error");
}

// Mistral's sliding window (HF: kv_idx > q_idx - sliding_window): query i sees keys i - W + 1 .. i,
// alone and inside a packed row's examples, in every backend, forward and gradients.
TEST(SlidingWindow, AQuerySeesTheLastWindowKeys) {
  const int64_t t = 100, dd = 16;  // windows across flash's 32-row and 64-key tiles
  const Tensor q = randn({2, 4, t, dd}, 61), k = randn({2, 2, t, dd}, 62),
               v = randn({2, 2, t, dd}, 63);
  const Tensor pos = positions_of({{70, 30}, {100}}, t);
  const std::vector<int64_t> pv = pos.to_ints();
  for (int64_t window : {1, 5, 40, 64, 99})
    for (bool packed : {false, true})
      for (AttentionBackend be : kBackends) {
        ops::AttentionMask mask(Tensor(), packed ? pos : Tensor());
        mask.window = window;
        const std::vector<double> ref = test::attention_ref(q, k, v, [&](int64_t b, int64_t i) {
          const int64_t example = packed ? i - pv[b * t + i] : 0;
          return std::max(example, i - window + 1);
        });
        const std::vector<float> got = ops::attention(q, k, v, mask, be).to_floats();
        double worst = 0;
        for (size_t x = 0; x < got.size(); ++x) worst = std::max(worst, std::fabs(got[x] - ref[x]));
        EXPECT_LT(worst, 2e-5) << ops::attention_backend_name(be) << " window " << window
                               << (packed ? " packed" : "");
      }
  // A window as long as the row is no window: the bits of plain causal attention.
  const Tensor gout = randn(q.shape(), 64);
  for (AttentionBackend be : kBackends) {
    ops::AttentionMask whole;
    whole.window = t;
    const Grads w = run(q, k, v, whole, be, gout),
                plain = run(q, k, v, ops::AttentionMask(), be, gout);
    test::expect_bitwise_equal(w.out, plain.out, ops::attention_backend_name(be));
    test::expect_bitwise_equal(w.dk, plain.dk, ops::attention_backend_name(be));
  }
}

TEST(SlidingWindow, GradientsMatchFiniteDifferences) {
  const Tensor pos = positions_of({{6, 5}}, 11);
  for (bool packed : {false, true})
    for (AttentionBackend be : kBackends)
      test::expect_gradcheck(
          [&](const std::vector<Tensor>& in) {
            ops::AttentionMask mask(Tensor(), packed ? pos : Tensor());
            mask.window = 3;
            return ops::attention(in[0], in[1], in[2], mask, be);
          },
          {randn({1, 2, 11, 4}, 71), randn({1, 1, 11, 4}, 72), randn({1, 1, 11, 4}, 73)}, {},
          std::string("window 3 ") + ops::attention_backend_name(be) + (packed ? " packed" : ""));
}

TEST(PackedRope, EachExampleRotatesFromPositionZero) {
  const std::vector<std::vector<int64_t>> rows = {{3, 6, 1}, {10}};
  const Tensor pos = positions_of(rows, 10);
  ops::RopeScaling llama3;
  llama3.kind = ops::RopeScaling::Kind::kLlama3;
  llama3.factor = 8;
  for (const ops::RopeScaling& sc : {ops::RopeScaling(), llama3}) {
    const Tensor x = randn({2, 3, 10, 8}, 51, 1.f, DType::BF16);
    Tensor xg = x.clone().set_requires_grad(true);
    const Tensor gout = randn(x.shape(), 52, 1.f, DType::BF16);
    const Tensor packed = ops::rope(xg, 10000.f, pos, sc);
    backward(packed, gout);
    for (int64_t b = 0; b < 2; ++b) {
      int64_t t0 = 0;
      for (int64_t n : rows[static_cast<size_t>(b)]) {
        Tensor xa = span_of(x, b, t0, n).set_requires_grad(true);
        const Tensor alone = ops::rope(xa, 10000.f, 0, sc);
        backward(alone, span_of(gout, b, t0, n));
        const std::string what = "row " + std::to_string(b) + " example at " + std::to_string(t0);
        test::expect_bitwise_equal(span_of(packed, b, t0, n), alone, what);
        test::expect_bitwise_equal(span_of(xg.grad(), b, t0, n), xa.grad(), what + " grad");
        t0 += n;
      }
    }
  }
  // Positions as a plain offset: rope(x, p0) is rope at positions p0, p0 + 1, ...
  const Tensor x = randn({1, 2, 5, 4}, 53);
  test::expect_bitwise_equal(ops::rope(x, 500.f, Tensor::from_ints({3, 4, 5, 6, 7}, {1, 5})),
                             ops::rope(x, 500.f, 3), "offset");
}

}  // namespace keel::packed_attention_test
