// AdamW refreshes autocast's kept 16-bit weight copies in its own pass: after a step the copy
// holds exactly round(new weight), the next step's autocast uses it without casting again, and a
// weight changed any other way is cast afresh.
#include <gtest/gtest.h>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/backend/optim.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"
#include "keel/optim/adamw.h"
#include "keel/optim/sgd.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::expect_bitwise_equal;
using test::randn;

Tensor rounded(const Tensor& w, DType dt) {
  return Tensor::from_floats(w.to_floats(), w.shape(), dt);
}

// One bf16-mixed forward and backward of y = x·wᵀ; returns the 16-bit weight the linear saw.
Tensor forward_backward(const Tensor& w, DType dt) {
  amp::AutocastGuard autocast(true, dt);
  const Tensor x = randn({8, 32}, 2, 1.f, dt);
  const Tensor wc = amp::autocast(amp::AmpOp::kLinear, w);
  const Tensor y = ops::linear(x, wc, Tensor());
  backward(y, Tensor::full(y.shape(), 1.f, y.dtype()));
  return wc;
}

// A trainable f32 weight of `shape` and its single parameter group.
std::vector<optim::ParamGroup> weight_group(Tensor& w, const Shape& shape, uint64_t seed) {
  w = randn(shape, seed, 1.f);
  w.set_requires_grad(true);
  optim::ParamGroup g;
  g.params = {w};
  g.names = {"w"};
  return {g};
}

TEST(WeightCopy, AdamWWritesTheRoundedWeightAndTheNextStepUsesIt) {
  for (DType dt : {DType::BF16, DType::F16}) {
    amp::clear_weight_copies();
    Tensor w;
    optim::AdamW opt(weight_group(w, {64, 32}, 1));
    const void* copy_data = nullptr;
    for (int step = 0; step < 3; ++step) {
      const Tensor wc = forward_backward(w, dt);
      expect_bitwise_equal(wc, rounded(w, dt), "the cast the linear used");
      if (step > 0) {
        EXPECT_EQ(wc.data(), copy_data) << "step " << step << " reused the copy";
      }
      EXPECT_EQ(w.grad().dtype(), DType::F32);
      opt.step(1e-2, 0.5f);
      opt.zero_grad();
      const Tensor copy = amp::weight_copy(w);
      ASSERT_TRUE(copy.defined()) << "AdamW marked the copy current";
      expect_bitwise_equal(copy, rounded(w, dt), "the copy after the update");
      copy_data = copy.data();
    }
    // A change the optimizer did not make: the copy is no longer current, and is not used.
    w.fill(0.25f);
    w.bump_version();
    EXPECT_FALSE(amp::weight_copy(w).defined());
    const Tensor wc = forward_backward(w, dt);
    expect_bitwise_equal(wc, rounded(w, dt), "cast afresh");
  }
}

TEST(WeightCopy, SgdLeavesTheCopyStaleAndTheNextStepCastsAfresh) {
  amp::clear_weight_copies();
  Tensor w;
  optim::SGD opt(weight_group(w, {16, 32}, 3));
  forward_backward(w, DType::BF16);
  opt.step(1e-1);
  EXPECT_FALSE(amp::weight_copy(w).defined());
  const Tensor wc = forward_backward(w, DType::BF16);
  expect_bitwise_equal(wc, rounded(w, DType::BF16), "cast afresh after SGD");
}

TEST(WeightCopy, CopiesOfWeightsThatAreGoneAreDropped) {
  amp::clear_weight_copies();
  {
    Tensor w = randn({16, 32}, 4, 1.f);
    w.set_requires_grad(true);
    forward_backward(w, DType::BF16);
    EXPECT_EQ(amp::weight_copy_count(), 1u);
  }
  { amp::AutocastGuard outer(true, DType::BF16); }  // the outermost guard's exit prunes
  EXPECT_EQ(amp::weight_copy_count(), 0u);
}

// An activation cast for several products in a row (a norm's output for q, k and v) is rounded
// once: the later casts share the first one's values, each under a graph node of its own, so x's
// gradient has the bits of separate casts. Only the two newest casts are kept (one cast between
// two uses, LoKr's delta weight, does not evict), and a changed tensor is cast afresh.
TEST(WeightCopy, AnActivationCastForSeveralProductsIsRoundedOnce) {
  const Tensor w1 = randn({16, 32}, 5, 1.f, DType::BF16), w2 = randn({16, 32}, 6, 1.f, DType::BF16);
  const Tensor x0 = randn({8, 32}, 7, 1.f);
  auto two_products = [&](bool reuse, const void** first, const void** second) {
    Tensor leaf = x0.clone().set_requires_grad(true);
    amp::AutocastGuard autocast(true, DType::BF16);
    const Tensor x = ops::scale(leaf, 1.5f);  // an activation: not a leaf
    const Tensor c1 = reuse ? amp::autocast(amp::AmpOp::kLinear, x) : ops::cast(x, DType::BF16);
    const Tensor c2 = reuse ? amp::autocast(amp::AmpOp::kLinear, x) : ops::cast(x, DType::BF16);
    EXPECT_NE(c1.grad_fn(), c2.grad_fn()) << "each use has its own cast node";
    *first = c1.data();
    *second = c2.data();
    const Tensor y = ops::add(ops::linear(c1, w1, Tensor()), ops::linear(c2, w2, Tensor()));
    backward(y, randn(y.shape(), 8, 1.f, y.dtype()));
    return leaf.grad();
  };
  const void *a = nullptr, *b = nullptr;
  const Tensor reused = two_products(true, &a, &b);
  EXPECT_EQ(a, b) << "the second cast reused the first one's values";
  const Tensor separate = two_products(false, &a, &b);
  EXPECT_NE(a, b);
  expect_bitwise_equal(reused, separate, "x's gradient");

  amp::AutocastGuard autocast(true, DType::BF16);
  Tensor x = ops::scale(x0, 2.f), other = ops::scale(x0, 3.f), third = ops::scale(x0, 4.f);
  const Tensor c1 = amp::autocast(amp::AmpOp::kLinear, x);
  amp::autocast(amp::AmpOp::kLinear, other);  // one cast between two uses
  EXPECT_EQ(amp::autocast(amp::AmpOp::kLinear, x).data(), c1.data());
  amp::autocast(amp::AmpOp::kLinear, other);
  amp::autocast(amp::AmpOp::kLinear, third);  // two newer ones: x's copy is let go
  EXPECT_NE(amp::autocast(amp::AmpOp::kLinear, x).data(), c1.data());
  const Tensor c3 = amp::autocast(amp::AmpOp::kLinear, x);
  x.bump_version();  // written in place
  EXPECT_NE(amp::autocast(amp::AmpOp::kLinear, x).data(), c3.data());
}

// The CPU kernel writes whole 64-byte lines of a bf16 copy with streaming stores and the ragged
// ends with plain ones: wherever the copy starts and however long it is, every element holds
// round(new weight), across the chunks the update is split into for the threads.
TEST(WeightCopy, TheCopysBitsDoNotDependOnItsAlignmentOrLength) {
  for (int64_t n : {1, 31, 33, 1000, 40000}) {
    for (int64_t offset : {0, 1, 17, 31}) {
      Tensor p = randn({n}, 3, 1.f), g = randn({n}, 4, 1.f);
      Tensor m = Tensor::zeros({n}), v = Tensor::zeros({n});
      Tensor copy = Tensor::full({n + 32}, 7.f, DType::BF16);  // 7: any value not written
      AdamWStep s;
      s.lr = 1e-2;
      s.weight_decay = 0.1;
      s.p_copy = static_cast<bf16_t*>(copy.data()) + offset;
      s.copy_dt = DType::BF16;
      optim_kernels(Device::cpu()).adamw(p.data(), g.data(), m.data(), v.data(), DType::F32, n, s);
      const std::vector<float> c = copy.to_floats(), want = rounded(p, DType::BF16).to_floats();
      for (int64_t i = 0; i < n + 32; ++i) {
        const bool inside = i >= offset && i < offset + n;
        const float expected = inside ? want[i - offset] : 7.f;
        ASSERT_EQ(f32_bits(c[i]), f32_bits(expected))
            << "n " << n << ", copy offset " << offset << ", element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace keel
