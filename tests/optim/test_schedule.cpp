// LR schedules: HF transformers' lr_lambda formulas (optimization.py, transcribed below as the
// reference), hand-computed anchor values, warmup_ratio rounding and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "keel/numerics/error.h"
#include "keel/optim/schedule.h"

namespace keel {
namespace {

using optim::LrSchedule;
using optim::make_lr_schedule;

// transformers/optimization.py, verbatim in C++ (num_cycles = 0.5).
double hf_warmup(int64_t step, int64_t w) { return double(step) / double(std::max<int64_t>(1, w)); }
double hf_constant(int64_t step, int64_t w) { return step < w ? hf_warmup(step, w) : 1.0; }
double hf_linear(int64_t step, int64_t w, int64_t t) {
  if (step < w) return hf_warmup(step, w);
  return std::max(0.0, double(t - step) / double(std::max<int64_t>(1, t - w)));
}
double hf_cosine(int64_t step, int64_t w, int64_t t, double min_lr_rate = 0.0) {
  if (step < w) return hf_warmup(step, w);
  const double progress = double(step - w) / double(std::max<int64_t>(1, t - w));
  double factor = 0.5 * (1.0 + std::cos(std::numbers::pi * 0.5 * 2.0 * progress));
  if (min_lr_rate > 0) factor = factor * (1 - min_lr_rate) + min_lr_rate;  // _with_min_lr_
  return std::max(0.0, factor);
}

TEST(LrSchedule, MatchesHfFormulasAtEveryStep) {
  for (int64_t w : {0, 1, 7}) {
    for (int64_t t : {1, 10, 53}) {
      const auto c = make_lr_schedule("constant", 3e-4, t, w);
      const auto l = make_lr_schedule("linear", 3e-4, t, w);
      const auto k = make_lr_schedule("cosine", 3e-4, t, w);
      const auto km = make_lr_schedule("cosine", 3e-4, t, w, 0.0, 0.1);
      for (int64_t s = 0; s <= t + 3; ++s) {
        const std::string at =
            "w=" + std::to_string(w) + " t=" + std::to_string(t) + " step=" + std::to_string(s);
        EXPECT_DOUBLE_EQ(c.factor(s), hf_constant(s, w)) << at;
        EXPECT_DOUBLE_EQ(l.factor(s), hf_linear(s, w, t)) << at;
        EXPECT_DOUBLE_EQ(k.factor(s), hf_cosine(s, w, t)) << at;
        EXPECT_DOUBLE_EQ(km.factor(s), hf_cosine(s, w, t, 0.1)) << at;
        EXPECT_DOUBLE_EQ(k.lr(s), 3e-4 * k.factor(s)) << at;
      }
    }
  }
}

TEST(LrSchedule, AnchorValues) {
  const auto cos = make_lr_schedule("cosine", 1.0, 110, 10);
  EXPECT_EQ(cos.factor(0), 0.0);  // HF's first update runs at lr 0 when warming up
  EXPECT_EQ(cos.factor(5), 0.5);
  EXPECT_EQ(cos.factor(10), 1.0);
  EXPECT_NEAR(cos.factor(60), 0.5, 1e-15);
  EXPECT_NEAR(cos.factor(110), 0.0, 1e-15);
  const auto cmin = make_lr_schedule("cosine", 2.0, 110, 10, 0.0, 0.1);
  EXPECT_NEAR(cmin.lr(110), 0.2, 1e-15);
  EXPECT_NEAR(cmin.lr(60), 1.1, 1e-15);
  const auto lin = make_lr_schedule("linear", 1.0, 20, 4);
  EXPECT_EQ(lin.factor(2), 0.5);
  EXPECT_EQ(lin.factor(4), 1.0);
  EXPECT_EQ(lin.factor(12), 0.5);
  EXPECT_EQ(lin.factor(20), 0.0);
  EXPECT_EQ(lin.factor(25), 0.0);
  const auto lmin = make_lr_schedule("linear", 1.0, 20, 4, 0.0, 0.25);
  EXPECT_EQ(lmin.factor(12), 0.625);
  EXPECT_EQ(lmin.factor(20), 0.25);
  EXPECT_EQ(lmin.factor(2), 0.5);  // warmup is not lifted by the floor (as HF)
  const auto con = make_lr_schedule("constant", 1.0, 0, 3);
  EXPECT_EQ(con.factor(1), 1.0 / 3);
  EXPECT_EQ(con.factor(3), 1.0);
  EXPECT_EQ(con.factor(1000), 1.0);
}

// HF TrainingArguments.get_warmup_steps: warmup_steps if > 0 else ceil(total * warmup_ratio).
TEST(LrSchedule, WarmupRatioRoundsUp) {
  EXPECT_EQ(make_lr_schedule("cosine", 1.0, 95, 0, 0.1).warmup_steps, 10);
  EXPECT_EQ(make_lr_schedule("cosine", 1.0, 100, 0, 0.1).warmup_steps, 10);
  EXPECT_EQ(make_lr_schedule("linear", 1.0, 7, 0, 0.5).warmup_steps, 4);
  EXPECT_EQ(make_lr_schedule("linear", 1.0, 7, 2, 0.5).warmup_steps, 2);  // steps win
  EXPECT_EQ(make_lr_schedule("linear", 1.0, 7).warmup_steps, 0);
}

TEST(LrSchedule, BadValuesAreUsageErrors) {
  auto expect_usage = [](auto f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "expected an Error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind, Error::kUsage);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_usage([] { make_lr_schedule("cosin", 1.0, 10); }, "constant, linear, cosine");
  expect_usage([] { make_lr_schedule("cosine", 1.0, 0); }, "total number of steps");
  expect_usage([] { make_lr_schedule("linear", 0.0, 10); }, "optim.lr");
  expect_usage([] { make_lr_schedule("linear", 1.0, 10, -1); }, "sched.warmup_steps");
  expect_usage([] { make_lr_schedule("linear", 1.0, 10, 0, 1.5); }, "sched.warmup_ratio");
  expect_usage([] { make_lr_schedule("linear", 1.0, 10, 0, 0.0, 2.0); }, "sched.min_lr_ratio");
}

}  // namespace
}  // namespace keel
