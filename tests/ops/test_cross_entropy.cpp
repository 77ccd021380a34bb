// cross_entropy: an f64 reference of loss and gradient, gradcheck, PyTorch parity, ignore_index and
// the no-target case, errors, numerical stability, a GPT-2-sized vocabulary, determinism across
// runs and thread counts, and the per-ISA kernels against each other.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>

#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/elementwise.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using ops::Reduction;
using test::expect_close;
using test::IsaRestore;
using test::randn;
using test::ThreadsGuard;

struct CeRef {
  double loss = 0;
  std::vector<float> grad;  // [N, V] for an upstream gradient of 1
};
// Reference: loss_r = log sum_j exp(x_rj) - x_r,t (f64, max-subtracted); mean over counted rows;
// grad = (softmax - onehot) / count (or / 1 for a sum), zero on ignored rows.
CeRef ce_ref(const Tensor& logits, const std::vector<int64_t>& t, int64_t ignore, Reduction red) {
  const auto x = logits.to_floats();
  const int64_t n = logits.size(0), v = logits.size(1);
  int64_t count = 0;
  for (int64_t r = 0; r < n; ++r) count += t[r] != ignore;
  const double denom = red == Reduction::kMean ? static_cast<double>(count) : 1.0;
  CeRef ref;
  ref.grad.assign(n * v, 0.f);
  for (int64_t r = 0; r < n; ++r) {
    if (t[r] == ignore) continue;
    const float* row = x.data() + r * v;
    double m = row[0], s = 0;
    for (int64_t j = 0; j < v; ++j) m = std::max(m, static_cast<double>(row[j]));
    for (int64_t j = 0; j < v; ++j) s += std::exp(row[j] - m);
    const double lse = m + std::log(s);
    ref.loss += lse - row[t[r]];
    for (int64_t j = 0; j < v; ++j)
      ref.grad[r * v + j] = static_cast<float>((std::exp(row[j] - lse) - (j == t[r])) / denom);
  }
  if (red == Reduction::kMean) ref.loss = count ? ref.loss / count : 0.0;
  return ref;
}

// Small gradients (softmax / count over large V) are f16 subnormals, spaced 2^-24 apart.
double subnormal_step(DType dt) { return dt == DType::F16 ? 5.9604644775390625e-08 : 1e-9; }

// Targets for n rows of v classes, every fifth row ignored.
std::vector<int64_t> make_targets(int64_t n, int64_t v) {
  std::vector<int64_t> t(n);
  for (int64_t r = 0; r < n; ++r) t[r] = r % 5 == 3 ? -100 : (r * 7919 + 13) % v;
  return t;
}

TEST(CrossEntropy, LossAndGradMatchReferenceInEveryDtype) {
  const int64_t n = 9, v = 1300;  // v spans three 512-element blocks
  const auto tv = make_targets(n, v);
  for (Reduction red : {Reduction::kMean, Reduction::kSum})
    for (DType tdt : {DType::I64, DType::I32})
      for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
        const std::string what = std::string(dtype_name(dt)) + "/" + dtype_name(tdt) +
                                 (red == Reduction::kMean ? " mean" : " sum");
        Tensor logits = randn({n, v}, 1, 3.f, dt).set_requires_grad(true);
        Tensor loss = ops::cross_entropy(logits, Tensor::from_ints(tv, {n}, tdt), -100, red);
        EXPECT_EQ(loss.dtype(), DType::F32);
        EXPECT_EQ(loss.dim(), 0);
        const CeRef ref = ce_ref(logits, tv, -100, red);
        // Logits are read exactly; f32 log-sum-exp over 1300 terms.
        EXPECT_NEAR(loss.item(), ref.loss, 1e-5 * std::fabs(ref.loss) + 1e-6) << what;
        backward(loss);
        ASSERT_EQ(logits.grad().dtype(), dt);
        expect_close(logits.grad().to_floats(), ref.grad, subnormal_step(dt),
                     2 * test::eps_of(dt) + 1e-5, "grad " + what);
      }
}

// Autocast hands cross_entropy 16-bit logits as they are (amp's kFp32Inside): the kernel's f32
// math on them must give exactly what casting them to f32 first gave, the loss and the gradient
// after the cast's backward rounds it back to the logits' dtype.
TEST(CrossEntropy, SixteenBitLogitsGiveTheBitsOfCastingToF32First) {
  for (DType dt : {DType::BF16, DType::F16}) {
    const int64_t n = 37, v = 1031;
    std::vector<int64_t> t(n);
    for (int64_t i = 0; i < n; ++i) t[i] = (i * 97) % v;
    t[3] = -100;
    const Tensor targets = Tensor::from_ints(t, {n});
    auto run = [&](bool cast_first, Tensor* grad) {
      Tensor x = randn({n, v}, 5, 3.f, dt);
      x.set_requires_grad(true);
      const Tensor in = cast_first ? ops::cast(x, DType::F32) : x;
      Tensor loss = ops::cross_entropy(in, targets, -100, Reduction::kSum);
      backward(loss, Tensor::full({}, 1024.f, DType::F32));  // a loss scale, as under 16-mixed
      *grad = x.grad();
      return loss.item();
    };
    Tensor g_direct, g_cast;
    const double l_direct = run(false, &g_direct), l_cast = run(true, &g_cast);
    EXPECT_EQ(l_direct, l_cast) << dtype_name(dt);
    test::expect_bitwise_equal(g_direct, g_cast, dtype_name(dt));
  }
}

TEST(CrossEntropy, UpstreamGradientScales) {
  Tensor logits = randn({4, 6}, 2).set_requires_grad(true);
  const std::vector<int64_t> tv = {1, 5, -100, 0};
  backward(ops::cross_entropy(logits, Tensor::from_ints(tv, {4})), Tensor::full({}, -2.5f));
  auto ref = ce_ref(logits, tv, -100, Reduction::kMean).grad;
  for (auto& g : ref) g *= -2.5f;
  expect_close(logits.grad().to_floats(), ref, 1e-7, 1e-5, "grad * -2.5");
}

TEST(CrossEntropy, Gradcheck) {
  for (Reduction red : {Reduction::kMean, Reduction::kSum}) {
    Tensor t = Tensor::from_ints({2, -100, 0, 6, 6}, {5});
    test::GradcheckOptions opt;
    opt.check = {0};
    test::expect_gradcheck(
        [=](const std::vector<Tensor>& in) { return ops::cross_entropy(in[0], in[1], -100, red); },
        {randn({5, 7}, 3), t}, opt, red == Reduction::kMean ? "ce mean" : "ce sum");
  }
  // Another ignore_index (0 is a real class elsewhere; here it marks padding).
  test::GradcheckOptions opt;
  opt.check = {0};
  test::expect_gradcheck(
      [](const std::vector<Tensor>& in) { return ops::cross_entropy(in[0], in[1], 0); },
      {randn({3, 4}, 4), Tensor::from_ints({0, 3, 1}, {3}, DType::I32)}, opt, "ce ignore 0");
}

TEST(CrossEntropy, NoCountedTargetGivesZeroLossAndZeroGrad) {
  // PyTorch returns NaN for a mean over no targets; keel returns 0 (documented in the header).
  for (Reduction red : {Reduction::kMean, Reduction::kSum}) {
    Tensor logits = randn({3, 5}, 5).set_requires_grad(true);
    Tensor t = Tensor::from_ints({-100, -100, -100}, {3});
    EXPECT_EQ(ops::count_targets(t), 0);
    Tensor loss = ops::cross_entropy(logits, t, -100, red);
    EXPECT_EQ(loss.item(), 0.f);
    backward(loss);
    for (float g : logits.grad().to_floats()) EXPECT_EQ(g, 0.f);
  }
}

TEST(CrossEntropy, CountTargets) {
  EXPECT_EQ(ops::count_targets(Tensor::from_ints({1, -100, 3, -100, 0}, {5})), 3);
  EXPECT_EQ(ops::count_targets(Tensor::from_ints({1, -100, 3}, {3}, DType::I32)), 2);
  EXPECT_EQ(ops::count_targets(Tensor::from_ints({1, 7, 7}, {3}), 7), 1);
  EXPECT_EQ(ops::count_targets(Tensor::from_ints({5, 6}, {1, 2})), 2);  // any shape
  EXPECT_THROW(ops::count_targets(Tensor::from_floats({1.f}, {1})), Error);
}

TEST(CrossEntropy, TargetOutOfRangeIsAnErrorNamingRowAndValue) {
  Tensor logits = randn({4, 10}, 6);
  for (int64_t bad : {10, -1, 12345}) {
    try {
      ops::cross_entropy(logits, Tensor::from_ints({0, -100, bad, 3}, {4}));
      ADD_FAILURE() << "no error for target " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("target " + std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("row 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0, 10)"), std::string::npos) << msg;
    }
  }
  EXPECT_THROW(ops::cross_entropy(logits, Tensor::from_ints({0, 1, 2}, {3})), Error);  // N differs
  EXPECT_THROW(ops::cross_entropy(randn({2, 3, 4}, 1), Tensor::from_ints({0, 1}, {2})), Error);
  EXPECT_THROW(ops::cross_entropy(logits, randn({4}, 1)), Error);  // float targets
}

TEST(CrossEntropy, StableForLargeLogitsAndPropagatesNaN) {
  // exp(1e4) overflows without the max subtraction.
  Tensor logits = Tensor::from_floats({1e4f, 0.f, -1e4f, 3e4f, 3e4f, 3e4f}, {2, 3});
  Tensor loss = ops::cross_entropy(logits, Tensor::from_ints({1, 0}, {2}), -100, Reduction::kSum);
  EXPECT_NEAR(loss.item(), 1e4 + std::log(3.0), 1e-2);
  // A NaN logit in a counted row reaches the loss; in an ignored row it does not.
  Tensor bad = randn({2, 4}, 7);
  bad.data_as<float>()[5] = std::numeric_limits<float>::quiet_NaN();  // row 1
  EXPECT_TRUE(std::isnan(ops::cross_entropy(bad, Tensor::from_ints({0, 2}, {2})).item()));
  EXPECT_TRUE(std::isfinite(ops::cross_entropy(bad, Tensor::from_ints({0, -100}, {2})).item()));
}

TEST(CrossEntropy, Gpt2VocabularyRows) {
  const int64_t n = 6, v = 50257;
  const auto tv = make_targets(n, v);
  Tensor logits = randn({n, v}, 8, 2.f, DType::BF16).set_requires_grad(true);
  Tensor loss = ops::cross_entropy(logits, Tensor::from_ints(tv, {n}));
  const CeRef ref = ce_ref(logits, tv, -100, Reduction::kMean);
  EXPECT_NEAR(loss.item(), ref.loss, 1e-5 * ref.loss);
  backward(loss);
  expect_close(logits.grad().to_floats(), ref.grad, 1e-9, 2 * test::eps_of(DType::BF16),
               "grad, V = 50257");
}

TEST(CrossEntropy, DeterministicAcrossRunsThreadsAndIsas) {
  IsaRestore restore;
  const int64_t n = 40, v = 3000;
  const auto tv = make_targets(n, v);
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    auto run = [&] {
      Tensor logits = randn({n, v}, 9, 2.f, dt).set_requires_grad(true);
      Tensor loss = ops::cross_entropy(logits, Tensor::from_ints(tv, {n}));
      backward(loss);
      return std::vector<Tensor>{loss, logits.grad()};
    };
    const auto ref = run();
    const std::string d = dtype_name(dt);
    for (int threads : {2, 1, 3}) {
      ThreadsGuard guard(threads);
      const auto got = run();
      for (size_t i = 0; i < ref.size(); ++i)
        test::expect_bitwise_equal(got[i], ref[i], d + " with " + std::to_string(threads) + " thr");
    }
    for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512}) {
      if (static_cast<int>(isa) > static_cast<int>(restore.saved)) continue;
      set_cpu_isa(isa);
      const auto got = run();
      // cross_entropy.inc (vexp included) is compiled without FMA contraction: same bits.
      for (size_t i = 0; i < ref.size(); ++i)
        test::expect_bitwise_equal(got[i], ref[i], d + " on " + cpu_isa_name(isa));
    }
    set_cpu_isa(restore.saved);
  }
}

// When the loss's graph holds the only handle to the logits (the Trainer drops the model output
// before backward), cross_entropy writes the gradient over them instead of a second [N, V] buffer.
// Same bits as the copy made while someone else still holds them; a second backward through the
// graph is a clear error (PyTorch frees saved tensors likewise).
TEST(CrossEntropy, GradientTakesTheLogitsBufferWhenNothingElseHoldsThem) {
  for (DType dt : {DType::F32, DType::BF16}) {
    const Tensor targets = Tensor::from_ints({3, 0, 7, 7, -100, 1}, {6});
    auto run = [&](bool keep_logits, const void** logits_data, const void** grad_data) {
      Tensor x = randn({6, 9}, 5, 2.f, dt).set_requires_grad(true);
      Tensor kept, loss;
      {
        Tensor logits = ops::scale(x, 1.5f);  // not a leaf: nothing but the graph needs it
        *logits_data = logits.data();
        loss = ops::cross_entropy(logits, targets);
        if (keep_logits) kept = logits;
      }
      const int hook =
          add_node_post_hook([&](const Node& n, const Tensor&, const std::vector<Tensor>& grads) {
            if (std::string(n.name()) == "cross_entropy") *grad_data = grads[0].data();
          });
      backward(loss);
      remove_node_post_hook(hook);
      if (!keep_logits) {
        try {
          backward(loss);
          ADD_FAILURE() << "a second backward through the graph ran";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("second time"), std::string::npos) << e.what();
        }
      }
      return x.grad();
    };
    const void *in_place_logits, *in_place_grad, *copy_logits, *copy_grad;
    const Tensor in_place = run(false, &in_place_logits, &in_place_grad);
    const Tensor copied = run(true, &copy_logits, &copy_grad);
    EXPECT_EQ(in_place_grad, in_place_logits) << dtype_name(dt);
    EXPECT_NE(copy_grad, copy_logits) << dtype_name(dt);
    test::expect_bitwise_equal(in_place, copied, std::string("in place vs copy ") + dtype_name(dt));
  }
}

TEST(CrossEntropy, ParityWithPyTorch) {
  // bf16/f16 gradients are one rounding of an f32 value: a unit of their last place.
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    test::ParityTolerance tol;
    tol.atol = 1e-6;
    tol.rtol = 1e-5;  // the loss is f32 in every case
    const double e = d == "f32" ? 1e-5 : test::eps_of(d == "bf16" ? DType::BF16 : DType::F16);
    tol.grad_atol = 1e-7;
    tol.grad_rtol = 2 * e;
    test::expect_parity(
        "cross_entropy", "ce_mean." + d, [](auto& in) { return ops::cross_entropy(in[0], in[1]); },
        tol);
    test::expect_parity(
        "cross_entropy", "ce_sum." + d,
        [](auto& in) { return ops::cross_entropy(in[0], in[1], -100, Reduction::kSum); }, tol);
    test::expect_parity(
        "cross_entropy", "ce_i32." + d, [](auto& in) { return ops::cross_entropy(in[0], in[1]); },
        tol);
    test::expect_parity(
        "cross_entropy", "ce_wide." + d, [](auto& in) { return ops::cross_entropy(in[0], in[1]); },
        tol);
  }
}

}  // namespace
}  // namespace keel
