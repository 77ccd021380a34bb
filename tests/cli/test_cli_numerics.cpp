// `keel numerics`: the README's three examples say what they promise, and bad flags are usage
// errors that name the flag (not the config key behind it).
#include <gtest/gtest.h>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

using test::run_keel;

TEST(CliNumerics, TheReadmeExamplesExplainWhatTheyPromise) {
  struct Example {
    std::vector<std::string> args;
    std::vector<const char*> says;
  };
  for (const Example& e : std::vector<Example>{
           {{"numerics", "cast", "1e-8", "--to", "f16"},
            {"1e-08 -> f16: stored 0 (bits 0x0000): underflow",
             "need a loss scale (16-mixed) or bf16"}},
           {{"numerics", "scaler", "--grad", "2.0"},
            {"step 1: scale 65536 ", "step 3: scale 16384 ", "= 32768 ",
             "applied after 2 skipped steps"}},
           {{"numerics", "scaler", "--grad", "1.5"}, {"applied after 1 skipped step;"}},
           {{"numerics", "scaler", "--grad", "1e-13"},
            {"underflows f16 to 0: the update is zero", "A scale of 524288 makes it nonzero"}},
           {{"numerics", "formats"}, {"65504"}},
           // bf16 flushes 1e-41 too: the f16 advice named it anyway.
           {{"numerics", "cast", "1e-41", "--to", "f16"},
            {"a loss scale (16-mixed) or f32 (bf16 flushes it too)"}},
           {{"numerics", "cast", "1e-46", "--to", "f16"}, {"no training format keeps it"}},
       }) {
    const auto r = run_keel(e.args);
    ASSERT_EQ(r.code, 0) << r.output;
    for (const char* s : e.says) EXPECT_CONTAINS(r.out, s);
  }
}

// A value just below f16's round-to-inf point (65520) rounds to 65504, as IEEE (and numpy's
// float16) rounds it: once. keel rounded it to f32 first (65520, a tie) and then to inf, and
// echoed it as "65520" (9 digits).
TEST(CliNumerics, CastRoundsOnceAndEchoesTheValueRead) {
  const auto r = run_keel({"numerics", "cast", "65519.99999", "--to", "f16"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.out, "65519.99999 -> f16: stored 65504 (bits 0x7bff): rounded");
  // The scaler's trace too: 0.99975585936 x 65536 = 65519.99999... fits at the first try.
  const auto s = run_keel({"numerics", "scaler", "--grad", "0.99975585936"});
  ASSERT_EQ(s.code, 0) << s.output;
  EXPECT_CONTAINS(s.out, "applied at the first try");
}

// A gradient beyond f16's max (70000): the scaler backs off 17 times to a scale of 0.5 and the
// step is applied there. The trace ended "applied after 17 skipped step(s)", read as a success,
// while keel train's advisor calls a scale below 1 a collapsing scaler whose fix is bf16-mixed.
// A gradient f16 holds at scale 1 or more gets no such line.
TEST(CliNumerics, AGradientBeyondF16sMaxIsNoScalerSuccess) {
  const auto r = run_keel({"numerics", "scaler", "--grad", "70000"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.out, "step 18: scale 0.5 ");
  EXPECT_CONTAINS(r.out, "applied after 17 skipped steps");
  EXPECT_CONTAINS(r.out,
                  "The scale fell below 1 (PyTorch warns there; keel train's advisor calls it "
                  "loss-scale collapsing): |grad| = 70000 is itself beyond f16's max 65504");
  EXPECT_CONTAINS(r.out, "use bf16-mixed");
  const auto ok = run_keel({"numerics", "scaler", "--grad", "60000"});
  ASSERT_EQ(ok.code, 0) << ok.output;
  EXPECT_NOT_CONTAINS(ok.out, "below 1");
}

// The scale, not f16, is at fault when --init-scale is set far off. Below 1 from the start
// (0.5) the trace printed "scale starts at 0" and blamed a gradient of 0.001 as "itself beyond
// f16's max 65504"; far above (1e30) it gave up after 64 back-offs with "never finite ...; use
// bf16-mixed" for a gradient of 100 that f16 holds at any scale up to 655.
TEST(CliNumerics, AnInitScaleSetFarOffIsNamedNotTheFormat) {
  const auto low = run_keel({"numerics", "scaler", "--grad", "1e-3", "--init-scale", "0.5"});
  ASSERT_EQ(low.code, 0) << low.output;
  EXPECT_CONTAINS(low.out, "scale starts at 0.5)");
  EXPECT_CONTAINS(low.out, "the scale starts below 1 (--init-scale 0.5)");
  EXPECT_CONTAINS(low.out, "start at a scale of 1 or more");
  EXPECT_NOT_CONTAINS(low.out, "beyond f16's max");
  EXPECT_NOT_CONTAINS(low.out, "bf16-mixed");
  const auto high = run_keel({"numerics", "scaler", "--grad", "100", "--init-scale", "1e30"});
  ASSERT_EQ(high.code, 0) << high.output;
  EXPECT_CONTAINS(high.out, "scale starts at 1e+30)");
  EXPECT_CONTAINS(high.out, "not finite within 64 steps");
  EXPECT_CONTAINS(high.out, "fits f16 at any scale up to 655.04");
  EXPECT_CONTAINS(high.out, "a smaller --init-scale");
  EXPECT_NOT_CONTAINS(high.out, "never finite");
  EXPECT_NOT_CONTAINS(high.out, "bf16-mixed");
  // A gradient f16 cannot hold keeps its verdict.
  const auto beyond = run_keel({"numerics", "scaler", "--grad", "1e20"});
  ASSERT_EQ(beyond.code, 0) << beyond.output;
  EXPECT_CONTAINS(beyond.out, "never finite");
}

// The help named "f16 or bf16" as the targets while --to f32 was accepted.
TEST(CliNumerics, CastHelpNamesEveryTargetItAccepts) {
  const auto help = run_keel({"numerics", "cast", "--help"});
  EXPECT_EQ(help.code, 0) << help.output;
  EXPECT_CONTAINS(help.out, "What a value becomes in f16, bf16 or f32");
  const auto f32 = run_keel({"numerics", "cast", "0.1", "--to", "f32"});
  EXPECT_EQ(f32.code, 0) << f32.output;
  EXPECT_CONTAINS(f32.out, "0.1 -> f32: stored 0.100000001");
}

TEST(CliNumerics, BadFlagsAreUsageErrorsNamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  for (const Case& c : std::vector<Case>{
           {{"numerics", "cast", "abc", "--to", "f16"}, "'abc' is not a number"},
           {{"numerics", "cast", "1", "--to", "f8"}, "--to f8: use f16, bf16 or f32"},
           // They named scaler.init_scale / scaler.backoff_factor, keys this command has not.
           {{"numerics", "scaler", "--grad", "1", "--init-scale", "0"},
            "numerics scaler --init-scale 0: a loss scale must be a positive finite f32 value"},
           {{"numerics", "scaler", "--grad", "1", "--init-scale", "1e39"}, "--init-scale 1e+39"},
           // 0 in f32: every step "applied", the gradient lost, called a normal f16 value.
           {{"numerics", "scaler", "--grad", "1", "--init-scale", "1e-300"},
            "--init-scale 1e-300: a loss scale must be a positive finite f32 value"},
           {{"numerics", "scaler", "--grad", "1", "--backoff", "0"},
            "numerics scaler --backoff 0: the backoff factor must be in (0, 1)"},
           {{"numerics", "scaler", "--grad", "1", "--backoff", "nan"}, "--backoff nan"},
       }) {
    const auto r = run_keel(c.args);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, c.message);
    EXPECT_NOT_CONTAINS(r.err, "scaler.");
  }
}

}  // namespace
}  // namespace keel
