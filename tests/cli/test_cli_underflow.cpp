// f16 gradient underflow without a loss scaler, from real arithmetic (issue 3's example (a), issue
// 4's "vanishing trend with exactly-zero grads"): examples/f16-no-scaler as shipped. 16-mixed with
// scaler.enabled = false learns a one-byte corpus within a dozen steps; once the model is sure,
// every logit gradient (p - y) / 1008 tokens is below half of f16's smallest subnormal (2^-25,
// ~3e-8) and rounds to 0 when autocast casts it back to f16 for the lm_head's backward: the global
// grad norm is exactly 0 step after step (the f32 loss is still ~1e-5, not 0), the trend advisor
// says vanishing and names the scaler. with-scaler.toml (the same run, scaler on) keeps every
// gradient non-zero once its scale has settled.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

using json = nlohmann::json;

using test::step_records;

// The example's config with out_dir in a temp dir and the corpus by absolute path (the example
// names it relative to the repository root); one thread, as everywhere in tests/cli.
test::KeelRun run_example(const std::string& toml, const std::string& out) {
  const std::string ex = std::string(KEEL_SOURCE_DIR) + "/examples/f16-no-scaler";
  return test::run_keel(
      test::with_sets({"train", ex + "/" + toml},
                      {"run.out_dir=" + out, "run.threads=1", "data.path=" + ex + "/corpus.txt",
                       "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
}

TEST(CliUnderflow, F16WithoutScalerStallsAtExactlyZeroGradNormAndTheScalerFixesIt) {
  const std::string dir = test::temp_dir("cli-f16-underflow");
  const test::KeelRun r = run_example("config.toml", dir + "/off");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto recs = step_records(dir + "/off");
  ASSERT_EQ(recs.size(), 24u) << r.output;

  // Real gradients first, then exactly 0.0 from some step on, and never back.
  EXPECT_GT(recs[0].at("grad_norm").get<double>(), 0.1);
  size_t first_zero = recs.size();
  for (size_t i = 0; i < recs.size(); ++i)
    if (recs[i].at("grad_norm").get<double>() == 0.0) {
      first_zero = i;
      break;
    }
  ASSERT_LT(first_zero, recs.size()) << "no step had a grad norm of exactly 0";
  EXPECT_GE(first_zero, 5u) << "the model has to learn before its gradients can underflow";
  EXPECT_LE(first_zero, 18u) << "at least 6 stalled steps";
  for (size_t i = first_zero; i < recs.size(); ++i)
    EXPECT_EQ(recs[i].at("grad_norm").get<double>(), 0.0) << "step " << i + 1;
  // Not a converged f32 loss of 0: the f32 loss is positive, only the f16 gradients are gone.
  const double stalled_loss = recs[first_zero].at("loss").get<double>();
  EXPECT_GT(stalled_loss, 0.0);
  EXPECT_LT(stalled_loss, 1e-3);
  for (const json& j : recs) EXPECT_EQ(j.at("loss_scale").get<double>(), 1.0);

  // The advisor: vanishing at the third zero in a row, its action names the scaler; printed too.
  const size_t third = first_zero + 2;
  ASSERT_TRUE(recs[third].contains("advice")) << recs[third].dump();
  const std::string advice = recs[third].at("advice").get<std::string>();
  EXPECT_EQ(advice.rfind("vanishing: the grad norm was exactly 0 on the last 3 steps", 0), 0u)
      << advice;
  EXPECT_NE(advice.find("set scaler.enabled = true"), std::string::npos) << advice;
  EXPECT_NE(r.output.find(advice), std::string::npos) << r.output;

  // The scaler fixes it: the same run with the scaler on has a non-zero norm on every step.
  const test::KeelRun s = run_example("with-scaler.toml", dir + "/on");
  ASSERT_EQ(s.code, 0) << s.output;
  const auto on = step_records(dir + "/on");
  ASSERT_EQ(on.size(), 24u);
  int64_t skipped = 0;
  for (const json& j : on) {
    // The first steps overflow at 65536 and are skipped (grad_norm "inf"), as a scaler should.
    if (j.at("grad_norm").is_string()) {
      EXPECT_EQ(j.at("grad_norm").get<std::string>(), "inf") << j.dump();
      EXPECT_EQ(j.at("skipped_steps").get<int64_t>(), ++skipped) << j.dump();
      continue;
    }
    const double g = j.at("grad_norm").get<double>();
    EXPECT_TRUE(std::isfinite(g) && g > 0) << j.dump();
    if (j.contains("advice")) {
      EXPECT_EQ(j.at("advice").get<std::string>().find("exactly 0"), std::string::npos) << j.dump();
    }
  }
  EXPECT_LE(skipped, 3) << "the scaler found its scale within a few steps";

  // The README's table is what these runs print (loss / grad_norm, 3 digits above 0.01, else 2).
  const std::string readme =
      test::slurp(std::string(KEEL_SOURCE_DIR) + "/examples/f16-no-scaler/README.md");
  auto cell = [](const json& j) {
    auto f = [](const json& v) {
      if (v.is_string()) return v.get<std::string>();
      const double x = v.get<double>();
      char buf[32];
      if (x == 0) return std::string("**0**");
      std::snprintf(buf, sizeof buf, x >= 0.01 ? "%.3g" : "%.1e", x);
      return std::string(buf);
    };
    return f(j.at("loss")) + " / " + f(j.at("grad_norm"));
  };
  EXPECT_CONTAINS(
      readme, "| 1 | " + cell(recs[0]) + " | " + cell(on[0]) + ": skipped, scale 65536 → 32768 |");
  EXPECT_CONTAINS(readme,
                  "| 2 | " + cell(recs[1]) + " | " + cell(on[1]) + " (32768 from here on) |");
  for (int step : {13, 14, 15})
    EXPECT_CONTAINS(readme, "| " + std::to_string(step) + " | " + cell(recs[step - 1]) + " | " +
                                cell(on[step - 1]) + " |");
  EXPECT_CONTAINS(readme, "exactly 0 from step " + std::to_string(first_zero + 1) + " to the end");
  EXPECT_GT(on.back().at("loss_scale").get<double>(), 1.0);
  // And it keeps learning where the unscaled run stalled.
  EXPECT_LT(on.back().at("loss").get<double>(), stalled_loss);
}

}  // namespace
}  // namespace keel
