// Exactness of the f32 <-> bf16/f16 conversions: every 16-bit pattern, the F16C hardware on
// boundary and random values, and the documented figures users meet.
#include <cpuid.h>
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <random>

#include "keel/backend/cpu/isa.h"
#include "keel/backend/elementwise.h"
#include "keel/numerics/convert.h"
#include "keel/numerics/error.h"
#include "keel/numerics/format_info.h"

namespace keel {
namespace {

__attribute__((target("f16c"))) uint16_t hw_f32_to_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

bool have_f16c() {  // CPUID leaf 1, ECX bit 29 (clang 14's __builtin_cpu_supports lacks "f16c")
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
}

TEST(Convert, EveryBf16PatternRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_bits_to_f32(static_cast<uint16_t>(h));
    const uint16_t back = f32_to_bf16_bits(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_bits_to_f32(back))) << std::hex << h;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << "NaN sign kept for " << std::hex << h;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(Convert, EveryF16PatternRoundTripsAndMatchesHardware) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_bits_to_f32(static_cast<uint16_t>(h));
    const uint16_t back = f32_to_f16_bits(f);
    if (have_f16c()) {
      const float hw = hw_f16_to_f32(static_cast<uint16_t>(h));
      EXPECT_EQ(f32_bits(f), f32_bits(hw)) << "f16->f32 of " << std::hex << h;
    }
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_bits_to_f32(back))) << std::hex << h;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(Convert, F32ToF16MatchesF16cOnBoundariesAndRandomValues) {
  if (!have_f16c()) GTEST_SKIP() << "this CPU has no F16C instructions to compare against";
  std::vector<float> cases = {0.f,
                              -0.f,
                              65504.f,
                              65519.99f,
                              65520.f,
                              65536.f,
                              131072.f,
                              1e-8f,
                              5.960464477539063e-08f,
                              2.98023223876953125e-08f,
                              2.9802326e-08f,
                              6.103515625e-05f,
                              6.1035156e-05f,
                              std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::signaling_NaN(),
                              std::numeric_limits<float>::denorm_min(),
                              std::numeric_limits<float>::max(),
                              1.0f + 1.0f / 2048,
                              1.0f + 3.0f / 2048};
  // Every f16 value, and the f32 values halfway between neighbours and one ulp either side.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const float lo = f16_bits_to_f32(static_cast<uint16_t>(h));
    const float hi = f16_bits_to_f32(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((double(lo) + double(hi)) / 2);
    for (float v : {lo, mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)}) {
      cases.push_back(v);
      cases.push_back(-v);
    }
  }
  for (float v : cases)
    ASSERT_EQ(f32_to_f16_bits(v), hw_f32_to_f16(v))
        << "value " << v << " bits " << std::hex << f32_bits(v);
  std::mt19937_64 rng(12345);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < 10'000'000; ++i) {
    const float v = f32_from_bits(static_cast<uint32_t>(rng()));
    mismatches += f32_to_f16_bits(v) != hw_f32_to_f16(v);
  }
  EXPECT_EQ(mismatches, 0) << "of 10^7 random f32 bit patterns";
}

TEST(Convert, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(round_to(DType::BF16, 1.0f + 1.0f / 256), 1.0f);
  // 1 + 3*2^-8 is halfway between 1+2^-7 and 1+2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(round_to(DType::BF16, 1.0f + 3.0f / 256), 1.0f + 1.0f / 64);
  EXPECT_TRUE(std::isinf(round_to(DType::BF16, 3.4e38f)));
  EXPECT_EQ(round_to(DType::BF16, 3.39e38f), 3.3895313892515355e38f);
  EXPECT_TRUE(std::isnan(round_to(DType::BF16, std::nanf(""))));
  // bf16 keeps f32's subnormals (same exponent range): 2^-133 survives.
  EXPECT_EQ(round_to(DType::BF16, 9.183549615799121e-41f), 9.183549615799121e-41f);
}

TEST(Convert, DocumentedFigures) {
  EXPECT_EQ(round_to(DType::F16, 1e-8f), 0.0f);       // underflow
  EXPECT_EQ(round_to(DType::F16, 65504.f), 65504.f);  // f16's max
  EXPECT_EQ(format_info(DType::F16).max, 65504.0);
  EXPECT_TRUE(std::isinf(round_to(DType::F16, 131072.f)));      // overflow
  EXPECT_TRUE(std::isinf(round_to(DType::F16, 2.0f * 65536)));  // 2 x 65536 in f16
  const float x = 1.0f + 1.0f / 512;                            // 1 + 2^-9
  EXPECT_EQ(round_to(DType::BF16, x), 1.0f);                    // lost in bf16 (8 bits)
  EXPECT_EQ(round_to(DType::F16, x), x);                        // kept in f16 (11 bits)
  EXPECT_EQ(round_to(DType::F16, 5.960464477539063e-08f), 5.960464477539063e-08f);  // min subnormal
  EXPECT_EQ(round_to(DType::F16, 2.98023223876953125e-08f), 0.0f);    // half of it: tie to even 0
  EXPECT_EQ(round_to(DType::F16, 3.0e-08f), 5.960464477539063e-08f);  // just above half: rounds up
}

TEST(Convert, FormatInfoTable) {
  const FormatInfo& f16 = format_info(DType::F16);
  EXPECT_EQ(f16.mantissa_bits, 10);
  EXPECT_EQ(f16.min_normal, std::ldexp(1.0, -14));
  EXPECT_EQ(f16.min_subnormal, std::ldexp(1.0, -24));
  EXPECT_EQ(f16.epsilon, std::ldexp(1.0, -10));
  const FormatInfo& bf = format_info(DType::BF16);
  EXPECT_EQ(bf.mantissa_bits, 7);
  EXPECT_EQ(bf.max, (2 - std::ldexp(1.0, -7)) * std::ldexp(1.0, 127));
  EXPECT_EQ(bf.min_subnormal, std::ldexp(1.0, -133));
  EXPECT_EQ(format_info(DType::F32).max, double(std::numeric_limits<float>::max()));
  EXPECT_THROW(format_info(DType::I32), Error);
}

// The vectorized bulk conversions of every ISA level equal the scalar reference bit for bit.
TEST(Convert, BulkConversionEqualsScalarOnEveryIsa) {
  std::mt19937_64 rng(99);
  std::vector<float> src(100003);
  for (auto& v : src) v = f32_from_bits(static_cast<uint32_t>(rng()));
  for (int i = 0; i < 1000; ++i) src[i] = static_cast<float>(i - 500) * 131.7f;  // ordinary values
  const CpuIsa best = cpu_isa();
  for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512}) {
    if (static_cast<int>(isa) > static_cast<int>(best)) continue;
    set_cpu_isa(isa);
    const auto& ew = elementwise_kernels(Device::cpu());
    for (DType dt : {DType::BF16, DType::F16}) {
      std::vector<uint16_t> out(src.size());
      ew.convert(out.data(), dt, src.data(), DType::F32, src.size());
      std::vector<float> back(src.size());
      ew.convert(back.data(), DType::F32, out.data(), dt, src.size());
      for (size_t i = 0; i < src.size(); ++i) {
        const uint16_t ref = dt == DType::BF16 ? f32_to_bf16_bits(src[i]) : f32_to_f16_bits(src[i]);
        ASSERT_EQ(out[i], ref) << cpu_isa_name(isa) << " " << dtype_name(dt) << " at " << i;
        const float rb = dt == DType::BF16 ? bf16_bits_to_f32(ref) : f16_bits_to_f32(ref);
        ASSERT_EQ(f32_bits(back[i]), f32_bits(rb)) << cpu_isa_name(isa) << " back at " << i;
      }
    }
  }
  set_cpu_isa(best);
}

}  // namespace
}  // namespace keel
