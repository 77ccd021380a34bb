#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "keel/log/console.h"

namespace keel::log {
namespace {

StepResult normal_step(int64_t step) {
  StepResult r;
  r.step = step;
  r.loss = 2.314;
  r.grad_norm = 0.84;
  r.lr = 2.9e-5;
  r.loss_scale = r.loss_scale_after = 65536;
  r.stepped = true;
  r.tokens_per_s = 41234;
  r.seconds = 0.5;
  return r;
}

TEST(Console, TheDesignLine) {
  EXPECT_EQ(progress_line(normal_step(120), 500, 72),
            "step 120/500 | loss 2.314 | grad_norm 0.84 | lr 2.9e-05 | scale 65536 | "
            "41.2k tok/s | eta 1m12s");
  // Without a scaler, without a known total.
  EXPECT_EQ(progress_line(normal_step(7), 0, 10, false),
            "step 7 | loss 2.314 | grad_norm 0.84 | lr 2.9e-05 | 41.2k tok/s");
}

// A share printed with one decimal: 1 exact match of 5000 held-out problems printed "0.0%".
TEST(Console, PercentsNeverRoundToNoneOrAll) {
  EXPECT_EQ(format_percent(0, 5000), "0.0%");
  EXPECT_EQ(format_percent(1, 5000), "<0.1%");      // 0.02%
  EXPECT_EQ(format_percent(3, 5000), "0.1%");       // 0.06%: one decimal holds it
  EXPECT_EQ(format_percent(4999, 5000), ">99.9%");  // 99.98%
  EXPECT_EQ(format_percent(5000, 5000), "100.0%");
  EXPECT_EQ(format_percent(1, 500), "0.2%");
  EXPECT_EQ(format_percent(0, 0), "0.0%");
}

TEST(Console, Durations) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(5.4), "5s");
  EXPECT_EQ(format_duration(59.6), "1m00s");
  EXPECT_EQ(format_duration(72), "1m12s");
  EXPECT_EQ(format_duration(3599), "59m59s");
  EXPECT_EQ(format_duration(3600), "1h00m");
  EXPECT_EQ(format_duration(7384), "2h03m");
  EXPECT_EQ(format_duration(86400 * 3 + 3600 * 4 + 5), "3d04h");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_duration(std::nan("")), "?");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::infinity()), "?");
}

TEST(Console, TokensPerSecond) {
  EXPECT_EQ(format_tokens_per_s(0), "0 tok/s");
  EXPECT_EQ(format_tokens_per_s(0.2166), "0.22 tok/s");  // a 1B step on a busy CPU: not "0"
  EXPECT_EQ(format_tokens_per_s(0.004), "0.00 tok/s");
  EXPECT_EQ(format_tokens_per_s(0.996), "1.0 tok/s");
  EXPECT_EQ(format_tokens_per_s(9.94), "9.9 tok/s");
  EXPECT_EQ(format_tokens_per_s(9.96), "10 tok/s");
  EXPECT_EQ(format_tokens_per_s(812.4), "812 tok/s");
  EXPECT_EQ(format_tokens_per_s(999.4), "999 tok/s");
  EXPECT_EQ(format_tokens_per_s(999.7), "1.0k tok/s");
  EXPECT_EQ(format_tokens_per_s(41234), "41.2k tok/s");
  EXPECT_EQ(format_tokens_per_s(999940), "999.9k tok/s");
  EXPECT_EQ(format_tokens_per_s(999960), "1.00M tok/s");
  EXPECT_EQ(format_tokens_per_s(2.5e6), "2.50M tok/s");
  EXPECT_EQ(format_tokens_per_s(std::nan("")), "nan tok/s");
}

TEST(Console, NumbersAreHonest) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(format_number(std::nan(""), 3), "nan");
  EXPECT_EQ(format_number(-std::nan(""), 3), "nan");  // never "-nan"
  EXPECT_EQ(format_number(inf, 3), "inf");
  EXPECT_EQ(format_number(-inf, 3), "-inf");
  EXPECT_EQ(format_number(0.0, 3), "0");
  EXPECT_EQ(format_number(1234.5678, 4), "1235");
  EXPECT_EQ(format_number(3e-3, 3), "0.003");
  EXPECT_EQ(format_scale(65536), "65536");
  EXPECT_EQ(format_scale(16777216), "16777216");
  EXPECT_EQ(format_scale(0.5), "0.5");
  EXPECT_EQ(format_scale(inf), "inf");
}

TEST(Console, SkippedAndNonFiniteStepsAreMarkedAndCounted) {
  const double inf = std::numeric_limits<double>::infinity();
  // The scaler skipped the step and backed off.
  StepResult r = normal_step(121);
  r.grad_norm = inf;
  r.found_inf = true;
  r.stepped = false;
  r.loss_scale_after = 32768;
  r.skipped_steps = 3;
  EXPECT_EQ(progress_line(r, 500, 70),
            "step 121/500 | loss 2.314 | grad_norm inf | lr 2.9e-05 | scale 65536 | skipped 3 | "
            "41.2k tok/s | eta 1m10s | SKIPPED: non-finite gradients, scale 65536 -> 32768");
  // No scaler: a non-finite step handled by on_nonfinite = skip.
  r = normal_step(5);
  r.loss = std::nan("");
  r.grad_norm = std::nan("");
  r.found_inf = true;
  r.stepped = false;
  r.nan_steps = 1;
  EXPECT_EQ(progress_line(r, 10, 2.4, false),
            "step 5/10 | loss nan | grad_norm nan | lr 2.9e-05 | nan 1 | 41.2k tok/s | eta 2s | "
            "NON-FINITE loss: update not applied");
  r.loss = 2.0;
  EXPECT_NE(progress_line(r, 10, 2.5, false).find("| NON-FINITE gradients: update not applied"),
            std::string::npos);
  // Counters carry over to normal steps (they are cumulative).
  r = normal_step(6);
  r.skipped_steps = 2;
  r.nan_steps = 1;
  const std::string line = progress_line(r, 10, 1);
  EXPECT_NE(line.find("| skipped 2 | nan 1 |"), std::string::npos) << line;
  EXPECT_EQ(line.find("SKIPPED"), std::string::npos) << line;
  EXPECT_EQ(line.find("NON-FINITE"), std::string::npos) << line;
}

// Writes to a temporary FILE* and returns what was printed.
struct Captured {
  std::FILE* f = std::tmpfile();
  ~Captured() { std::fclose(f); }
  std::string text() {
    std::fflush(f);
    std::rewind(f);
    std::string s;
    char buf[256];
    while (size_t n = std::fread(buf, 1, sizeof(buf), f)) s.append(buf, n);
    return s;
  }
};

TEST(Console, LoggerPrintsEveryNStepsButNeverHidesATroubledStep) {
  Captured out;
  ConsoleLogger log({.total_steps = 10, .every = 4, .show_scale = false}, out.f);
  std::vector<int64_t> printed;
  for (int64_t s = 1; s <= 10; ++s) {
    StepResult r = normal_step(s);
    r.seconds = s == 1 ? 5.0 : 1.0;  // the first step pays setup
    if (s == 6) {
      r.grad_norm = std::numeric_limits<double>::infinity();
      r.found_inf = true;
      r.stepped = false;
    }
    if (s == 7) r.advice = "grad_norm is spiking: lower optim.lr";
    if (log.log(r)) printed.push_back(s);
  }
  // First step, every 4th, the non-finite step, the step with advice, the last step.
  EXPECT_EQ(printed, (std::vector<int64_t>{1, 4, 6, 7, 8, 10}));
  const std::string text = out.text();
  EXPECT_NE(text.find("step 6/10 | loss 2.314 | grad_norm inf"), std::string::npos) << text;
  EXPECT_NE(text.find("\n  advice: grad_norm is spiking: lower optim.lr\n"), std::string::npos);
  EXPECT_EQ(text.find("scale"), std::string::npos);  // show_scale = false
  EXPECT_EQ(log.last_line().rfind("step 10/10 |", 0), 0u);
}

TEST(Console, EtaUsesTheMeanStepTimeAfterTheFirst) {
  ConsoleLogger log({.total_steps = 100, .every = 5, .show_scale = true}, nullptr);
  EXPECT_EQ(log.eta_seconds(0), -1);  // nothing seen yet
  StepResult r = normal_step(1);
  r.seconds = 10;  // setup
  log.log(r);
  EXPECT_DOUBLE_EQ(log.eta_seconds(1), 99 * 10.0);  // only the first step to go by
  for (int64_t s = 2; s <= 5; ++s) {
    r = normal_step(s);
    r.seconds = s % 2 ? 1.0 : 2.0;
    log.log(r);
  }
  EXPECT_DOUBLE_EQ(log.eta_seconds(5), 95 * 1.5);
  EXPECT_NE(log.last_line().find("| eta 2m23s"), std::string::npos) << log.last_line();
  EXPECT_DOUBLE_EQ(log.eta_seconds(100), 0.0);
  ConsoleLogger unknown({.total_steps = 0, .every = 1, .show_scale = true}, nullptr);
  unknown.log(normal_step(1));
  EXPECT_EQ(unknown.eta_seconds(1), -1);
  EXPECT_EQ(unknown.last_line().find("eta"), std::string::npos);
}

}  // namespace
}  // namespace keel::log
