// rope: an f64 reference (angles, cos/sin and rotation in f64), gradcheck, PyTorch parity against
// HF's apply_rotary_pos_emb, determinism and the per-ISA kernels against each other.
#include <gtest/gtest.h>

#include <cmath>

#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "keel/ops/rope.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::expect_close;
using test::randn;

// Reference: for x [B, H, T, D], pair (i, i + D/2) at position t + offset rotates by
// (t + offset) * theta^(-2i/D); everything in f64.
std::vector<float> rope_ref(const Tensor& x, double theta, int64_t offset, bool inverse = false) {
  const auto xv = x.to_floats();
  const int64_t t = x.size(2), d = x.size(3), h = d / 2, rows = x.size(0) * x.size(1);
  std::vector<float> out(xv.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < t; ++p)
      for (int64_t i = 0; i < h; ++i) {
        const double angle = (p + offset) * std::pow(theta, -2.0 * i / d) * (inverse ? -1 : 1);
        const int64_t base = (r * t + p) * d;
        const double a = xv[base + i], b = xv[base + i + h];
        out[base + i] = static_cast<float>(a * std::cos(angle) - b * std::sin(angle));
        out[base + i + h] = static_cast<float>(b * std::cos(angle) + a * std::sin(angle));
      }
  return out;
}

struct IsaRestore {
  CpuIsa saved = cpu_isa();
  ~IsaRestore() { set_cpu_isa(saved); }
};
// The ISA levels this CPU runs (up to the detected one).
std::vector<CpuIsa> runnable_isas() {
  std::vector<CpuIsa> v;
  for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512})
    if (static_cast<int>(isa) <= static_cast<int>(cpu_isa())) v.push_back(isa);
  return v;
}

TEST(Rope, ForwardAndBackwardMatchReferenceInEveryDtype) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const std::string what = dtype_name(dt);
    // D/2 = 600 spans two of the kernel's 512-element chunks.
    for (const Shape& s : {Shape{2, 3, 7, 16}, Shape{1, 1, 3, 1200}}) {
      Tensor x = randn(s, 1, 1.f, dt).set_requires_grad(true);
      Tensor y = ops::rope(x, 10000.f, 3);
      EXPECT_EQ(y.dtype(), dt);
      EXPECT_EQ(y.shape(), s);
      // f32: cos/sin rounded to f32 and two f32 products; others: one rounding into dt.
      const double tol = dt == DType::F32 ? 1e-6 : test::eps_of(dt);
      expect_close(y.to_floats(), rope_ref(x, 10000.0, 3), 1e-6, tol, "forward " + what);
      Tensor g = randn(s, 2, 1.f, dt);
      backward(y, g);
      ASSERT_EQ(x.grad().dtype(), dt);
      // The gradient of an orthogonal map is the inverse rotation of g.
      expect_close(x.grad().to_floats(), rope_ref(g, 10000.0, 3, /*inverse=*/true), 1e-6, tol,
                   "backward " + what);
    }
  }
}

TEST(Rope, AnglesAreExactAtLongPositions) {
  // At position 1e5 an f32 angle is off by ~1e5 * 2^-24 = 6e-3 rad; keel computes it in f64.
  Tensor x = randn({1, 2, 4, 8}, 3);
  expect_close(ops::rope(x, 10000.f, 100000).to_floats(), rope_ref(x, 10000.0, 100000), 1e-6, 1e-6,
               "rope at position 1e5");
  // Position 0 is the identity.
  EXPECT_EQ(ops::rope(x, 10000.f, 0).to_floats()[3], x.to_floats()[3]);
}

TEST(Rope, Gradcheck) {
  test::expect_gradcheck([](const std::vector<Tensor>& in) { return ops::rope(in[0], 10000.f, 2); },
                         {randn({2, 2, 3, 6}, 4)}, {}, "rope");
  test::expect_gradcheck(
      [](const std::vector<Tensor>& in) { return ops::rope(in[0], 500000.f, 9); },
      {randn({1, 3, 4, 8}, 5)}, {}, "rope llama3 theta");
}

TEST(Rope, RejectsBadShapes) {
  EXPECT_THROW(ops::rope(randn({2, 3, 4, 5}, 1)), Error);  // odd head dim
  EXPECT_THROW(ops::rope(randn({3, 4, 8}, 1)), Error);     // not [B, H, T, D]
  EXPECT_THROW(ops::rope(randn({1, 1, 2, 4}, 1), 0.f), Error);
}

TEST(Rope, DeterministicAndSameOnEveryIsa) {
  IsaRestore restore;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    auto run = [&] {
      Tensor x = randn({2, 4, 33, 64}, 6, 1.f, dt).set_requires_grad(true);
      Tensor y = ops::rope(x, 10000.f, 5);
      backward(y, randn(y.shape(), 7, 1.f, dt));
      return std::vector<Tensor>{y, x.grad()};
    };
    auto ref = run();
    const auto again = run();
    for (size_t i = 0; i < ref.size(); ++i) test::expect_bitwise_equal(ref[i], again[i], "rerun");
    // rope.inc is compiled without FMA contraction: every ISA computes the same bits.
    for (CpuIsa isa : runnable_isas()) {
      set_cpu_isa(isa);
      const auto got = run();
      for (size_t i = 0; i < ref.size(); ++i)
        test::expect_bitwise_equal(
            got[i], ref[i], std::string("rope ") + dtype_name(dt) + " on " + cpu_isa_name(isa));
    }
    set_cpu_isa(restore.saved);
  }
}

TEST(Rope, ParityWithHuggingFace) {
  for (const char* dn : {"f32", "bf16", "f16"}) {
    const std::string d = dn;
    test::expect_parity("rope", "rope." + d, [](auto& in) { return ops::rope(in[0], 10000.f, 0); });
    test::expect_parity("rope", "rope_offset." + d,
                        [](auto& in) { return ops::rope(in[0], 500000.f, 7); });
  }
}

}  // namespace
}  // namespace keel
