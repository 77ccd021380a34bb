// embedding: an f64 reference of forward and backward, gradcheck, PyTorch parity, errors and
// determinism (the scatter-add must not depend on the thread count).
//
// The embedding kernels are one plain implementation (gathers/copies, no per-ISA variants), so
// there is no cross-ISA comparison here.
#include <gtest/gtest.h>
#include <omp.h>

#include "keel/autograd/node.h"
#include "keel/ops/embedding.h"
#include "keel/ops/linear.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::expect_close;
using test::randn;
using test::ThreadsGuard;

// Reference forward: out[i, :] = w[ids[i], :].   ids [N], w [V, D] -> [N, D]
std::vector<float> embedding_ref(const std::vector<int64_t>& ids, const std::vector<float>& w,
                                 int64_t d) {
  std::vector<float> out;
  for (int64_t id : ids)
    for (int64_t j = 0; j < d; ++j) out.push_back(w[id * d + j]);
  return out;
}

// Reference backward: dw[r, :] = sum of g[i, :] over ids[i] == r, in f64.   -> [V, D]
std::vector<float> embedding_grad_ref(const std::vector<int64_t>& ids, const std::vector<float>& g,
                                      int64_t v, int64_t d) {
  std::vector<double> acc(v * d, 0.0);
  for (size_t i = 0; i < ids.size(); ++i)
    for (int64_t j = 0; j < d; ++j) acc[ids[i] * d + j] += g[i * d + j];
  return std::vector<float>(acc.begin(), acc.end());
}

TEST(Embedding, ForwardAndBackwardMatchReferenceInEveryDtype) {
  const int64_t v = 37, d = 70;
  std::vector<int64_t> idv;
  for (int i = 0; i < 60; ++i) idv.push_back((i * 7 + i / 5) % 23);  // repeats; rows >= 23 unused
  for (DType id_dt : {DType::I64, DType::I32})
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      const std::string what = std::string(dtype_name(dt)) + "/" + dtype_name(id_dt);
      Tensor ids = Tensor::from_ints(idv, {3, 20}, id_dt);
      Tensor w = randn({v, d}, 1, 1.f, dt).set_requires_grad(true);
      Tensor y = ops::embedding(ids, w);
      EXPECT_EQ(y.shape(), (Shape{3, 20, d}));
      EXPECT_EQ(y.dtype(), dt);
      // A gather copies stored values: exact.
      expect_close(y.to_floats(), embedding_ref(idv, w.to_floats(), d), 0, 0, "forward " + what);
      Tensor g = randn(y.shape(), 2, 1.f, dt);
      backward(y, g);
      ASSERT_EQ(w.grad().dtype(), dt);
      // f32 accumulation of at most 3 terms, one rounding into dt.
      const auto ref = embedding_grad_ref(idv, g.to_floats(), v, d);
      expect_close(w.grad().to_floats(), ref, 1e-6, 2 * test::eps_of(dt), "grad " + what);
      // Rows no id names are exactly zero.
      const auto gw = w.grad().to_floats();
      for (int64_t r = 23; r < v; ++r)
        for (int64_t j = 0; j < d; ++j) ASSERT_EQ(gw[r * d + j], 0.f) << what << " row " << r;
    }
}

TEST(Embedding, Gradcheck) {
  Tensor ids = Tensor::from_ints({1, 4, 1, 0, 4, 4}, {2, 3});
  test::GradcheckOptions opt;
  opt.check = {1};
  test::expect_gradcheck([](const std::vector<Tensor>& in) { return ops::embedding(in[0], in[1]); },
                         {ids, randn({5, 4}, 3)}, opt, "embedding");
}

TEST(Embedding, OutOfRangeIdIsAnErrorNamingIdPositionAndVocab) {
  Tensor w = randn({10, 4}, 4);
  for (DType id_dt : {DType::I64, DType::I32}) {
    for (int64_t bad : {10, -1}) {
      Tensor ids = Tensor::from_ints({1, 2, 3, 4, bad, 5}, {2, 3}, id_dt);
      try {
        ops::embedding(ids, w);
        ADD_FAILURE() << "no error for id " << bad;
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("id " + std::to_string(bad)), std::string::npos) << msg;
        EXPECT_NE(msg.find("position 4"), std::string::npos) << msg;
        EXPECT_NE(msg.find("[1, 1]"), std::string::npos) << msg;
        EXPECT_NE(msg.find("[0, 10)"), std::string::npos) << msg;
      }
    }
  }
  EXPECT_THROW(ops::embedding(Tensor::from_floats({1.f}, {1}), w), Error);           // float ids
  EXPECT_THROW(ops::embedding(Tensor::from_ints({1}, {1}), randn({10}, 5)), Error);  // 1-d table
}

TEST(Embedding, BackwardIsBitIdenticalAcrossRunsAndThreadCounts) {
  // Many repeats of few ids: every row of dW sums dozens of terms.
  std::vector<int64_t> idv;
  for (int i = 0; i < 4096; ++i) idv.push_back((i * 2654435761ull >> 7) % 97);
  auto run = [&](int threads) {
    ThreadsGuard guard(threads);
    Tensor w = randn({97, 64}, 6, 1.f, DType::BF16).set_requires_grad(true);
    Tensor y = ops::embedding(Tensor::from_ints(idv, {4096}), w);
    backward(y, randn(y.shape(), 7, 1.f, DType::BF16));
    return std::vector<Tensor>{y, w.grad()};
  };
  auto a = run(2), b = run(2), c = run(1), e = run(3);
  for (size_t i = 0; i < a.size(); ++i) {
    test::expect_bitwise_equal(a[i], b[i], "two runs");
    test::expect_bitwise_equal(a[i], c[i], "2 vs 1 threads");
    test::expect_bitwise_equal(a[i], e[i], "2 vs 3 threads");
  }
}

// A tied table (embedding in, linear head out): the engine lets the embedding add its rows into
// the head's pending gradient instead of a zero-filled [V, D] tensor plus a dense add. With a
// post-hook attached (the tracer) it takes the dense path; both must give the same bits.
TEST(Embedding, TiedGradientAddedInPlaceHasTheBitsOfTheDenseSum) {
  for (DType dt : {DType::F32, DType::BF16}) {
    std::vector<int64_t> idv;
    for (int i = 0; i < 48; ++i) idv.push_back((i * 7) % 13);  // repeats; rows 13..40 untouched
    auto run = [&](bool hook) {
      int handle = 0;
      if (hook)
        handle = add_node_post_hook([](const Node&, const Tensor&, const std::vector<Tensor>&) {});
      Tensor w = randn({41, 16}, 8, 1.f, dt).set_requires_grad(true);
      Tensor h = ops::embedding(Tensor::from_ints(idv, {48}), w);
      Tensor logits = ops::linear(h, w);  // [48, 41]
      backward(logits, randn(logits.shape(), 9, 1.f, dt));
      if (hook) remove_node_post_hook(handle);
      return w.grad();
    };
    const Tensor dense = run(true), in_place = run(false);
    test::expect_bitwise_equal(in_place, dense, std::string("tied grad ") + dtype_name(dt));
    // and both are the head's gradient plus the scattered rows
    Tensor w = randn({41, 16}, 8, 1.f, dt), g = randn({48, 41}, 9, 1.f, dt);
    const auto wv = w.to_floats(), gv = g.to_floats();
    std::vector<float> rows(48 * 16, 0.f), ref(41 * 16, 0.f);
    for (int i = 0; i < 48; ++i)  // h = w[ids]; head dW = gᵀ·h; embedding dW[ids[i]] += g·w
      for (int j = 0; j < 16; ++j) {
        double s = 0;
        for (int r = 0; r < 41; ++r) s += double(gv[i * 41 + r]) * wv[r * 16 + j];
        rows[i * 16 + j] = float(s);
      }
    for (int r = 0; r < 41; ++r)
      for (int j = 0; j < 16; ++j) {
        double s = 0;
        for (int i = 0; i < 48; ++i) s += double(gv[i * 41 + r]) * wv[idv[i] * 16 + j];
        ref[r * 16 + j] = float(s);
      }
    for (int i = 0; i < 48; ++i)
      for (int j = 0; j < 16; ++j) ref[idv[i] * 16 + j] += rows[i * 16 + j];
    expect_close(in_place.to_floats(), ref, dt == DType::F32 ? 1e-4 : 0.1,
                 dt == DType::F32 ? 1e-4 : 0.05, std::string("tied grad vs f64 ") + dtype_name(dt));
  }
}

TEST(Embedding, ParityWithPyTorch) {
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    test::expect_parity("embedding", "embedding." + d,
                        [](auto& in) { return ops::embedding(in[0], in[1]); });
    test::expect_parity("embedding", "embedding_i32." + d,
                        [](auto& in) { return ops::embedding(in[0], in[1]); });
  }
}

}  // namespace
}  // namespace keel
