// The numerics explainer behind `keel numerics` (monitor/explain): the format table, what a value
// becomes in each format, and the scaler trace with its verdict, against the formats' known facts
// (IEEE binary16: max 65504, smallest normal 2^-14, smallest subnormal 2^-24; bfloat16: f32's
// exponent with 8 significant bits).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "keel/monitor/explain.h"
#include "tests/support/check.h"

namespace keel::monitor {
namespace {

TEST(Explain, FormatTableHoldsEachFormatsLimits) {
  const std::string t = format_table();
  EXPECT_CONTAINS(t, "65504");        // f16 max
  EXPECT_CONTAINS(t, "6.10352e-05");  // f16 smallest normal, 2^-14
  EXPECT_CONTAINS(t, "5.96046e-08");  // f16 smallest subnormal, 2^-24
  EXPECT_CONTAINS(t, "3.38953e+38");  // bf16 max
  EXPECT_CONTAINS(t, "0.0078125");    // bf16 epsilon, 2^-7
}

TEST(Explain, CastNamesEachOutcome) {
  struct Case {
    double v;
    DType to;
    const char* outcome;
    double stored;
  };
  const double inf = std::numeric_limits<double>::infinity();
  for (const Case& c : std::vector<Case>{
           {65504, DType::F16, "exact", 65504},
           {70000, DType::F16, "overflow", inf},
           {65519, DType::F16, "rounded", 65504},  // below 65520 rounds down
           {1e-8, DType::F16, "underflow", 0},     // below half of 2^-24
           {std::ldexp(1.0, -20), DType::F16, "subnormal", std::ldexp(1.0, -20)},
           {1e-6, DType::F16, "subnormal", std::ldexp(17.0, -24)},  // 16.78 x 2^-24 rounds to 17
           {1e-8, DType::BF16, "rounded", 0},  // stored: checked below (a normal bf16 value)
           {70000, DType::BF16, "rounded", 70144},
           {1.5, DType::F32, "exact", 1.5},
       }) {
    const CastReport r = cast_value(c.v, c.to);
    EXPECT_EQ(r.outcome, c.outcome) << c.v << " -> " << dtype_name(c.to);
    if (c.stored != 0 || std::string(c.outcome) == "underflow") {
      EXPECT_EQ(r.stored, c.stored) << c.v << " -> " << dtype_name(c.to);
    }
    EXPECT_FALSE(r.explanation.empty());
  }
  EXPECT_NEAR(cast_value(1e-8, DType::BF16).rel_error, 0, 1.0 / 256);  // 8 significant bits
  EXPECT_EQ(cast_value(70000, DType::F16).bits, 0x7c00u);              // +inf
  EXPECT_CONTAINS(cast_value(1e-8, DType::F16).explanation, "flushes to 0");
  EXPECT_EQ(cast_value(std::nan(""), DType::F16).outcome, "nan");
}

// A decimal value rounds ONCE into the target format, as IEEE 754 (and numpy's f64 -> f16) does.
// Through f32 first it rounded twice: a value just off an f16/bf16 midpoint landed on the f32 tie
// and then went the other way. Each expectation is derived from the format's spacing below.
TEST(Explain, CastRoundsOnceAsIeeeDoes) {
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    double v;
    DType to;
    double stored;
    const char* outcome;
  };
  for (const Case& c : std::vector<Case>{
           // f16 spacing at 2^15 is 32: 65504 + 16 = 65520 is the midpoint to inf; 1e-5 below
           // it is nearer 65504 (f32 rounded it up to 65520, and then to inf).
           {65519.99999, DType::F16, 65504, "rounded"},
           {65520, DType::F16, inf, "overflow"},  // the midpoint itself: ties to inf (even)
           // f16 spacing at 1 is 2^-10: 1 + 2^-11 is the midpoint; 2^-40 above it is nearer
           // 1 + 2^-10 (f32, 24 bits, dropped the 2^-40 and the tie went to the even 1).
           {1 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40), DType::F16, 1 + std::ldexp(1.0, -10),
            "rounded"},
           // bf16 spacing at 1 is 2^-7: the same above its midpoint 1 + 2^-8.
           {1 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30), DType::BF16, 1 + std::ldexp(1.0, -7),
            "rounded"},
           // Half of f16's smallest subnormal 2^-24 ties to 0; anything above it is nearer 2^-24.
           {std::ldexp(1.0, -25), DType::F16, 0, "underflow"},
           {std::ldexp(1.0, -25) + std::ldexp(1.0, -50), DType::F16, std::ldexp(1.0, -24),
            "subnormal"},
       }) {
    const CastReport r = cast_value(c.v, c.to);
    EXPECT_EQ(r.stored, c.stored) << std::hexfloat << c.v << " -> " << dtype_name(c.to);
    EXPECT_EQ(r.outcome, c.outcome) << std::hexfloat << c.v << " -> " << dtype_name(c.to);
  }
  // The bits are those of the value stored: 1 + 2^-10 in f16 is 0x3c01, 1 + 2^-7 in bf16 0x3f81.
  EXPECT_EQ(cast_value(1 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40), DType::F16).bits, 0x3c01u);
  EXPECT_EQ(cast_value(1 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30), DType::BF16).bits, 0x3f81u);
  // The scaler's trace stores grad x scale the same way: 65519.99999 fits f16 at the first try.
  const auto t = scaler_trace(65519.99999 / 65536, GradScalerOptions{});
  ASSERT_EQ(t.size(), 1u);
  EXPECT_TRUE(t[0].finite);
  EXPECT_EQ(t[0].scaled_grad, 65504);
}

// The advice fits the format asked about: bf16 was told to "use bf16", f32 too, and bf16's
// round-to- inf point was printed as its largest finite value.
TEST(Explain, CastAdviceFitsTheTargetFormat) {
  const std::string f16_over = cast_value(70000, DType::F16).explanation;
  EXPECT_CONTAINS(f16_over, "(values from 65520 up round to inf)");
  EXPECT_CONTAINS(f16_over, "or use bf16, whose range matches f32");
  // bf16's largest finite value is 0x7f7f = 3.38953e38; plus half its ulp, 2^119, rounds to inf.
  EXPECT_EQ(cast_value(3.3961e38, DType::BF16).outcome, "rounded");
  const std::string bf16_over = cast_value(3.3962e38, DType::BF16).explanation;
  EXPECT_CONTAINS(bf16_over, "(values from 3.39618e+38 up round to inf)");
  EXPECT_CONTAINS(bf16_over, "f32 holds it (up to 3.40282e+38): keep this tensor in f32");
  for (DType to : {DType::BF16, DType::F32}) {
    const std::string over = cast_value(1e40, to).explanation;
    EXPECT_CONTAINS(over, "no training format holds it");
    EXPECT_NOT_CONTAINS(over, "use bf16");
  }
  EXPECT_CONTAINS(cast_value(1e-8, DType::F16).explanation, "need a loss scale (16-mixed) or bf16");
  const CastReport bf16_under = cast_value(1e-42, DType::BF16);  // an f32 subnormal, not a bf16 one
  EXPECT_EQ(bf16_under.outcome, "underflow");
  EXPECT_CONTAINS(bf16_under.explanation, "f32 keeps it");
  for (const auto& [v, to] : {std::pair{1e-50, DType::BF16}, std::pair{1e-46, DType::F32}}) {
    const std::string under = cast_value(v, to).explanation;
    EXPECT_CONTAINS(under, "no training format keeps it");
    EXPECT_NOT_CONTAINS(under, "or bf16");
  }
}

std::vector<ScalerTrial> trace(double grad) { return scaler_trace(grad, GradScalerOptions{}); }

TEST(Explain, ScalerBacksOffUntilTheScaledGradientFitsF16) {
  // 2 x 65536 and 2 x 32768 = 65536 overflow f16 (from 65520 up rounds to inf); 2 x 16384 fits.
  const auto t = trace(2.0);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].scale, 65536);
  EXPECT_FALSE(t[0].finite);
  EXPECT_EQ(t[0].outcome, "overflow");
  EXPECT_EQ(t[1].scale, 32768);
  EXPECT_FALSE(t[1].finite);
  EXPECT_EQ(t[2].scale, 16384);
  EXPECT_TRUE(t[2].finite);
  EXPECT_EQ(t[2].scaled_grad, 32768);
  EXPECT_EQ(scaler_verdict(2.0, t),
            "applied after 2 skipped steps; the LR schedule does not advance on skips.");
  EXPECT_EQ(scaler_verdict(0.5, trace(0.5)),  // x 65536 = 32768
            "applied at the first try: grad x scale is a normal f16 value.");
}

// A gradient that underflows is applied as a zero update: the verdict must say so (it used to say
// "update applied" and nothing else) and name the scale that would keep it.
TEST(Explain, AnUnderflowingGradientIsNamedAsLostWithTheScaleThatKeepsIt) {
  const auto t = trace(1e-13);  // x 65536 = 6.6e-9, below half of 2^-24
  ASSERT_EQ(t.size(), 1u);
  EXPECT_TRUE(t[0].finite);
  EXPECT_EQ(t[0].outcome, "underflow");
  EXPECT_EQ(t[0].scaled_grad, 0);
  const std::string v = scaler_verdict(1e-13, t);
  EXPECT_CONTAINS(v, "underflows f16 to 0: the update is zero");
  EXPECT_CONTAINS(v, "grad_norm 0.0");
  // 2^19: 1e-13 x 2^19 = 5.2e-8 is above half of 2^-24 and rounds up to it (the verdict said
  // 2^20, twice the scale that is needed); all 11 bits need 2^30 (1.07e-4 >= 2^-14).
  EXPECT_CONTAINS(v, "A scale of 524288 makes it nonzero");
  EXPECT_CONTAINS(v, "1.07374e+09 keeps all 11 bits");
  EXPECT_NE(round_to(DType::F16, static_cast<float>(1e-13 * 524288)), 0.0f);
  EXPECT_EQ(round_to(DType::F16, static_cast<float>(1e-13 * 262144)), 0.0f);
  // Below what any f32 scale lifts into f16's range: no scale is named (it printed "at least 0").
  const std::string none = scaler_verdict(1e-50, trace(1e-50));
  EXPECT_CONTAINS(none, "no loss scale within f32's range keeps it");
  EXPECT_EQ(none.find("A scale of"), std::string::npos) << none;
  const std::string sub = scaler_verdict(1e-11, trace(1e-11));  // 6.6e-7: subnormal
  EXPECT_CONTAINS(sub, "is an f16 subnormal");
  EXPECT_CONTAINS(sub, "at least 8.38861e+06 keeps all 11 bits");  // 2^23 x 1e-11 >= 2^-14
}

// NaN and inf are non-finite at every scale: one trial, and a verdict that does not blame f16's
// range (it used to say "overflows f16 even unscaled; use bf16-mixed" for a NaN).
TEST(Explain, NanAndInfGradientsAreNotBlamedOnTheFormat) {
  for (double g : {std::nan(""), std::numeric_limits<double>::infinity()}) {
    const auto t = trace(g);
    ASSERT_EQ(t.size(), 1u);
    EXPECT_FALSE(t[0].finite);
    const std::string v = scaler_verdict(g, t);
    EXPECT_CONTAINS(v, "at every scale");
    EXPECT_CONTAINS(v, "no scale or format fixes it");
    EXPECT_EQ(v.find("bf16-mixed"), std::string::npos) << v;
  }
  EXPECT_EQ(trace(std::nan(""))[0].outcome, "nan");
  EXPECT_CONTAINS(scaler_verdict(0.0, trace(0.0)), "a zero gradient");
  // A finite gradient too large for f16 at every scale the trace reaches.
  const auto huge = trace(1e30);
  EXPECT_FALSE(huge.back().finite);
  EXPECT_CONTAINS(scaler_verdict(1e30, huge), "never finite");
  EXPECT_CONTAINS(scaler_verdict(1e30, huge), "use bf16-mixed");
}

}  // namespace
}  // namespace keel::monitor
