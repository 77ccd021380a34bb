// Shape ops: index-arithmetic references, gradchecks, PyTorch parity, views vs copies, errors.
//
// The shape kernels are one plain implementation (bitwise copies, no per-ISA variants), so there is
// no cross-ISA comparison here; they are exact, so references compare bitwise.
#include <gtest/gtest.h>

#include <cmath>

#include "keel/autograd/node.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/shape.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::randn;

std::vector<int64_t> unravel(int64_t flat, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (size_t k = s.size(); k-- > 0;) {
    idx[k] = flat % s[k];
    flat /= s[k];
  }
  return idx;
}
int64_t ravel(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t flat = 0;
  for (size_t k = 0; k < s.size(); ++k) flat = flat * s[k] + idx[k];
  return flat;
}

// Reference transpose: out[idx] = x[idx with d0, d1 exchanged].
std::vector<float> transpose_ref(const Tensor& x, int64_t d0, int64_t d1) {
  const auto xv = x.to_floats();
  Shape os = x.shape();
  std::swap(os[d0], os[d1]);
  std::vector<float> out(xv.size());
  for (int64_t i = 0; i < x.numel(); ++i) {
    auto idx = unravel(i, os);
    std::swap(idx[d0], idx[d1]);
    out[i] = xv[ravel(idx, x.shape())];
  }
  return out;
}

void expect_equal_values(const Tensor& got, const std::vector<float>& ref,
                         const std::string& what) {
  test::expect_close(got.to_floats(), ref, 0, 0, what);
}

TEST(Shape, TransposeMatchesReference) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::I64}) {
    Tensor x = dt == DType::I64 ? Tensor::from_ints(std::vector<int64_t>(120, 0), {2, 3, 4, 5}, dt)
                                : randn({2, 3, 4, 5}, 1, 1.f, dt);
    if (dt == DType::I64)
      for (int64_t i = 0; i < 120; ++i) x.data_as<int64_t>()[i] = i * 31 - 7;
    const std::string what = dtype_name(dt);
    for (auto [a, b] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 3}, {0, 3}, {2, 3}}) {
      Tensor y = ops::transpose(x, a, b);
      Shape s = x.shape();
      std::swap(s[a], s[b]);
      EXPECT_EQ(y.shape(), s);
      EXPECT_EQ(y.dtype(), dt);
      expect_equal_values(y, transpose_ref(x, a, b), what);
      // Negative dims count from the end; the order of the two dims does not matter.
      test::expect_bitwise_equal(ops::transpose(x, b - 4, a), y, what + " negative dims");
    }
    test::expect_bitwise_equal(ops::transpose(x, 2, -2), x, what + " same dim");
  }
}

TEST(Shape, SplitAndMergeHeadsMatchReference) {
  const int64_t b = 2, t = 5, h = 3, d = 4;
  Tensor x = randn({b, t, h * d}, 2);
  Tensor s = ops::split_heads(x, h);
  ASSERT_EQ(s.shape(), (Shape{b, h, t, d}));
  const auto xv = x.to_floats(), sv = s.to_floats();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < h; ++hi)
      for (int64_t ti = 0; ti < t; ++ti)
        for (int64_t di = 0; di < d; ++di)
          ASSERT_EQ(sv[((bi * h + hi) * t + ti) * d + di], xv[(bi * t + ti) * h * d + hi * d + di]);
  Tensor m = ops::merge_heads(s);
  ASSERT_EQ(m.shape(), x.shape());
  test::expect_bitwise_equal(m, x, "merge_heads(split_heads(x))");
}

TEST(Shape, SplitLastMatchesReference) {
  Tensor x = randn({2, 3, 10}, 3, 1.f, DType::BF16);
  const auto pieces = ops::split_last(x, {2, 0, 5, 3});
  ASSERT_EQ(pieces.size(), 4u);
  const auto xv = x.to_floats();
  int64_t begin = 0;
  for (const Tensor& p : pieces) {
    const int64_t w = p.size(-1);
    EXPECT_EQ(p.shape(), (Shape{2, 3, w}));
    EXPECT_EQ(p.dtype(), DType::BF16);
    const auto pv = p.to_floats();
    for (int64_t r = 0; r < 6; ++r)
      for (int64_t j = 0; j < w; ++j) ASSERT_EQ(pv[r * w + j], xv[r * 10 + begin + j]);
    begin += w;
  }
}

TEST(Shape, ReshapeIsAViewAndItsGradientIsReshapedBack) {
  Tensor x = randn({2, 3, 4}, 4).set_requires_grad(true);
  Tensor y = ops::reshape(x, {-1, 4});
  EXPECT_EQ(y.shape(), (Shape{6, 4}));
  EXPECT_TRUE(y.shares_storage(x));
  backward(y, randn({6, 4}, 5));
  EXPECT_EQ(x.grad().shape(), x.shape());
  test::expect_close(x.grad().to_floats(), randn({6, 4}, 5).to_floats(), 0, 0, "grad");
}

TEST(Shape, Gradchecks) {
  using V = std::vector<Tensor>;
  test::expect_gradcheck(
      [](const V& in) {
        return ops::reshape(in[0], {3, -1});
      },
      {randn({2, 3, 2}, 1)}, {}, "reshape");
  test::expect_gradcheck([](const V& in) { return ops::transpose(in[0], 0, 2); },
                         {randn({2, 3, 4}, 2)}, {}, "transpose 0 2");
  test::expect_gradcheck([](const V& in) { return ops::transpose(in[0], -1, 1); },
                         {randn({2, 3, 4, 2}, 3)}, {}, "transpose -1 1");
  test::expect_gradcheck([](const V& in) { return ops::transpose(in[0], 1, 1); },
                         {randn({2, 3}, 4)}, {}, "transpose 1 1");
  test::expect_gradcheck([](const V& in) { return ops::split_heads(in[0], 2); },
                         {randn({2, 3, 6}, 5)}, {}, "split_heads");
  test::expect_gradcheck([](const V& in) { return ops::merge_heads(in[0]); },
                         {randn({2, 3, 2, 2}, 6)}, {}, "merge_heads");
  // Every piece used, and x used again after the split (its gradients add up).
  test::expect_gradcheck(
      [](const V& in) {
        auto p = ops::split_last(in[0], {3, 3, 3});
        Tensor later = ops::split_last(ops::scale(in[0], 2.f), {6, 3})[1];
        return ops::add(ops::mul(p[0], p[2]), ops::mul(p[1], later));
      },
      {randn({2, 9}, 7)}, {}, "split_last all pieces");
  // Only the middle piece used: the other columns get zero gradient.
  test::expect_gradcheck(
      [](const V& in) {
        return ops::split_last(in[0], {2, 3, 4})[1];
      },
      {randn({3, 9}, 8)}, {}, "split_last one piece");
  // concat_last: both inputs' gradients, and split_last's inverse bit for bit.
  test::expect_gradcheck([](const V& in) { return ops::concat_last(in[0], in[1]); },
                         {randn({2, 3, 4}, 11), randn({2, 3, 2}, 12)}, {}, "concat_last");
  const Tensor x = randn({3, 2, 7}, 13);
  const auto halves = ops::split_last(x, {5, 2});
  test::expect_bitwise_equal(ops::concat_last(halves[0], halves[1]), x, "concat_last(split_last)");
  EXPECT_THROW(ops::concat_last(randn({2, 3}, 1), randn({3, 3}, 2)), Error);
  EXPECT_THROW(ops::concat_last(randn({2, 3}, 1), randn({2, 3}, 2, 1.f, DType::BF16)), Error);
  // Of several parts (StableLM's per-head norm weights): each part's gradient, and split_last's
  // inverse bit for bit.
  test::expect_gradcheck(
      [](const V& in) {
        return ops::concat_last(std::vector<Tensor>{in[0], in[1], in[2]});
      },
      {randn({2, 3}, 14), randn({2, 1}, 15), randn({2, 4}, 16)}, {}, "concat_last of three");
  const auto thirds = ops::split_last(x, {1, 4, 2});
  test::expect_bitwise_equal(ops::concat_last(thirds), x, "concat_last(split_last) of three");
  EXPECT_THROW(ops::concat_last(std::vector<Tensor>{}), Error);
}

TEST(Shape, SplitLastGradientOfUnusedPiecesIsZeroAndGraphsCanBeReused) {
  Tensor x = randn({2, 6}, 9).set_requires_grad(true);
  auto p = ops::split_last(x, {2, 4});
  Tensor g = randn({2, 4}, 10);
  backward(p[1], g);
  const auto gv = g.to_floats();
  auto check = [&](float k) {
    const auto xg = x.grad().to_floats();
    for (int64_t r = 0; r < 2; ++r) {
      for (int64_t j = 0; j < 2; ++j) EXPECT_EQ(xg[r * 6 + j], 0.f);
      for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(xg[r * 6 + 2 + j], k * gv[r * 4 + j]);
    }
  };
  check(1.f);
  // A second backward over the same pieces accumulates again.
  backward(p[1], g);
  check(2.f);
}

// Columns of pieces that got no gradient are zero even when the gradient buffer reuses a dirty
// block: freeing a NaN-filled tensor of the buffer's size first hands that block to the buffer
// (block cache, >= 64 KiB). The buffer is zero-filled when the first piece arrives; leaving that
// fill to the join instead (which would zero only the unwritten columns) would show the tracer,
// which checks every node's output, a half-written buffer with NaN in it.
TEST(Shape, SplitLastZeroesUnwrittenColumnsOfAReusedBlock) {
  const int64_t rows = 64, cols = 300;  // 76.8 KB of f32
  for (int round = 0; round < 2; ++round) {
    { Tensor dirty = Tensor::full({rows, cols}, std::nanf("")); }
    Tensor x = randn({rows, cols}, 14).set_requires_grad(true);
    auto p = ops::split_last(x, {100, 150, 50});
    Tensor y = ops::add(p[0], p[0]);  // only piece 0 gets a gradient
    backward(y, Tensor::full({rows, 100}, 1.f));
    const auto xg = x.grad().to_floats();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j)
        ASSERT_EQ(xg[r * cols + j], j < 100 ? 2.f : 0.f) << "row " << r << " column " << j;
  }
}

TEST(Shape, BackwardIsDeterministic) {
  auto run = [] {
    Tensor x = randn({4, 16, 96}, 11, 1.f, DType::BF16).set_requires_grad(true);
    auto p = ops::split_last(x, {32, 32, 32});
    Tensor y = ops::merge_heads(ops::transpose(ops::split_heads(p[2], 4), -1, -2));
    backward(y, randn(y.shape(), 12, 1.f, DType::BF16));
    return std::vector<Tensor>{y, x.grad()};
  };
  const auto a = run(), b = run();
  for (size_t i = 0; i < a.size(); ++i) test::expect_bitwise_equal(a[i], b[i], "rerun");
}

TEST(Shape, RejectsBadArguments) {
  Tensor x = randn({2, 3, 4}, 13);
  EXPECT_THROW(ops::reshape(x, {5, -1}), Error);
  EXPECT_THROW(ops::reshape(x, {-1, -1}), Error);
  EXPECT_THROW(ops::reshape(x, {-2, -12}), Error);
  EXPECT_THROW(ops::reshape(x, {25}), Error);
  EXPECT_THROW(ops::transpose(x, 0, 3), Error);
  EXPECT_THROW(ops::transpose(x, -4, 1), Error);
  EXPECT_THROW(ops::split_heads(x, 3), Error);  // 4 not divisible by 3
  EXPECT_THROW(ops::split_heads(randn({2, 4}, 1), 2), Error);
  EXPECT_THROW(ops::merge_heads(x), Error);          // not 4-d
  EXPECT_THROW(ops::split_last(x, {1, 2}), Error);   // sums to 3, not 4
  EXPECT_THROW(ops::split_last(x, {5, -1}), Error);  // negative size
}

TEST(Shape, ParityWithPyTorch) {
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    test::expect_parity("shape", "transpose13." + d,
                        [](auto& in) { return ops::transpose(in[0], 1, 3); });
    test::expect_parity("shape", "transpose_neg." + d,
                        [](auto& in) { return ops::transpose(in[0], -1, -2); });
    test::expect_parity("shape", "transpose02." + d,
                        [](auto& in) { return ops::transpose(in[0], 0, 2); });
    test::expect_parity("shape", "split_heads." + d,
                        [](auto& in) { return ops::split_heads(in[0], 3); });
    test::expect_parity("shape", "merge_heads." + d,
                        [](auto& in) { return ops::merge_heads(in[0]); });
    test::expect_parity("shape", "reshape." + d, [](auto& in) {
      return ops::reshape(in[0], {6, -1});
    });
    for (int i = 0; i < 3; ++i)
      test::expect_parity("shape", "split" + std::to_string(i) + "." + d, [i](auto& in) {
        return ops::split_last(in[0], {4, 8, 4})[i];
      });
  }
}

}  // namespace
}  // namespace keel
