#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "keel/numerics/convert.h"
#include "keel/numerics/tensor_stats.h"

namespace keel {
namespace {

TEST(TensorStats, CountsEveryClassInF32) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {0.f, -0.f, 1e-40f, -2.5f, 3e38f, inf, -inf, std::nanf(""), 7.f};
  TensorStats s = tensor_stats(v.data(), DType::F32, v.size());
  EXPECT_EQ(s.count, 9);
  EXPECT_EQ(s.nan, 1);
  EXPECT_EQ(s.inf, 2);
  EXPECT_EQ(s.zero, 2);
  EXPECT_EQ(s.subnormal, 1);
  EXPECT_EQ(s.near_max, 1);  // 3e38 is within 2x of f32's max
  EXPECT_EQ(s.abs_min, 0.0);
  EXPECT_FLOAT_EQ(s.abs_max, 3e38f);
  EXPECT_FALSE(s.all_finite());
  EXPECT_NEAR(s.headroom_bits, std::log2(3.4028234663852886e38 / double(3e38f)), 1e-9);
}

TEST(TensorStats, JudgesF32ValuesAgainstF16Limits) {
  // How would these activations fare in f16? 40000 is within 2x of 65504; 1e-6 is subnormal.
  std::vector<float> v = {40000.f, 1e-6f, 1.f};
  TensorStats s = tensor_stats(v.data(), DType::F32, v.size(), DType::F16);
  EXPECT_EQ(s.near_max, 1);
  EXPECT_EQ(s.subnormal, 1);
  EXPECT_NEAR(s.headroom_bits, std::log2(65504.0 / 40000.0), 1e-12);
  EXPECT_TRUE(s.all_finite());
}

TEST(TensorStats, ReadsBf16Storage) {
  std::vector<uint16_t> v = {f32_to_bf16_bits(2.f), f32_to_bf16_bits(-0.5f), 0x7f80 /*inf*/};
  TensorStats s = tensor_stats(v.data(), DType::BF16, v.size());
  EXPECT_EQ(s.inf, 1);
  EXPECT_EQ(s.abs_min, 0.5);
  EXPECT_EQ(s.abs_max, 2.0);
}

}  // namespace
}  // namespace keel
