// Trend advisor on synthetic step sequences: each class is recognised, advice is given only when
// the class changes, and a healthy run (including a normal 16-mixed start) prints nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "keel/monitor/advisor.h"
#include "keel/monitor/replay_step.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using monitor::AdvisorOptions;
using monitor::Trend;
using monitor::TrendAdvisor;

StepResult step(int64_t i, double loss, double grad_norm) {
  StepResult r;
  r.step = i;
  r.loss = loss;
  r.grad_norm = grad_norm;
  r.lr = 3e-3;
  r.stepped = std::isfinite(grad_norm);
  r.found_inf = !std::isfinite(grad_norm);
  return r;
}

struct Feed {
  TrendAdvisor adv;
  std::vector<std::pair<int64_t, std::string>> advice;  // (step, line)
  std::vector<Trend> trends;
  explicit Feed(AdvisorOptions o = {}) : adv(o) {}
  void feed(StepResult r) {
    const std::string a = adv.observe(r);
    EXPECT_EQ(a, r.advice);
    if (!a.empty()) advice.emplace_back(r.step, a);
    trends.push_back(adv.trend());
  }
};

// A healthy run: loss decays, grad norm wobbles around 1 and slowly decays.
double healthy_norm(int64_t i) { return (1.0 + 0.3 * std::sin(0.7 * i)) * std::exp(-0.01 * i); }
double healthy_loss(int64_t i) { return 2.0 + 3.0 * std::exp(-0.05 * i) + 0.05 * std::cos(i); }

TEST(Advisor, HealthyRunIsStableAndSilent) {
  Feed run;
  for (int64_t i = 1; i <= 200; ++i) run.feed(step(i, healthy_loss(i), healthy_norm(i)));
  EXPECT_TRUE(run.advice.empty()) << run.advice.front().second;
  EXPECT_EQ(run.adv.trend(), Trend::kStable);
}

TEST(Advisor, ExplodingGradNormWithRisingLoss) {
  Feed run;
  for (int64_t i = 1; i <= 15; ++i) run.feed(step(i, healthy_loss(i), healthy_norm(i)));
  EXPECT_TRUE(run.advice.empty());
  // Grad norm grows 1.5x per step from step 16, the loss climbs.
  double g = 1.0;
  for (int64_t i = 16; i <= 40; ++i) {
    g *= 1.5;
    run.feed(step(i, 3.0 + 0.2 * (i - 15), g));
  }
  ASSERT_FALSE(run.advice.empty());
  const auto& [at, line] = run.advice.front();
  EXPECT_EQ(line.rfind("exploding: ", 0), 0u) << line;
  EXPECT_NE(line.find("lower optim.lr (now 0.003, try 0.0003)"), std::string::npos) << line;
  EXPECT_EQ(line.find("train.precision"), std::string::npos) << line;  // precision unknown
  EXPECT_GT(at, 16);
  EXPECT_LT(at, 30);
  EXPECT_EQ(run.adv.trend(), Trend::kExploding);
  // Exactly one line while the class holds.
  EXPECT_EQ(run.advice.size(), 1u);
}

// In a schedule's tail the step's rate is not optim.lr: a llama at optim.lr 0.1, cosine, spiked at
// step 32 (rate 0.012) and was told "lower optim.lr (now 0.012, try 0.0012)", a peak 83x lower. The
// key's value comes first, the step's rate beside it, and the try is a tenth of the key's.
TEST(Advisor, TheLearningRateToLowerIsOptimLrsValueNotTheSchedulesRate) {
  AdvisorOptions o;
  o.peak_lr = 0.1;
  Feed run(o);
  for (int64_t i = 1; i <= 15; ++i) run.feed(step(i, healthy_loss(i), healthy_norm(i)));
  double g = 1.0;
  for (int64_t i = 16; i <= 40; ++i) {
    g *= 1.5;
    StepResult r = step(i, 3.0 + 0.2 * (i - 15), g);
    r.lr = 0.012;
    run.feed(r);
  }
  ASSERT_FALSE(run.advice.empty());
  EXPECT_CONTAINS(run.advice.front().second,
                  "lower optim.lr (now 0.1, 0.012 at this step of the schedule; try 0.01)");
  // Vanishing's "raise" names the key's value too.
  Feed low(o);
  for (int64_t i = 1; i <= 40; ++i) {
    StepResult r = step(i, 5.5, std::pow(0.5, i));
    r.lr = 0.05;
    low.feed(r);
  }
  ASSERT_FALSE(low.advice.empty());
  EXPECT_CONTAINS(low.advice.front().second,
                  "raise optim.lr (now 0.1, 0.05 at this step of the schedule)");
}

// A pretrained start (loss 0.5, ln V = 5.56) and then losses of 3: a divergence when step 1's
// batch is as bad under the new weights, harder data when that batch still scores 0.5.
TEST(Advisor, ALossFarAboveAPretrainedStartIsDivergedOnlyIfStepOnesBatchIsToo) {
  for (const double again : {0.55, 3.2}) {
    AdvisorOptions o;
    o.uniform_loss = std::log(259.0);
    int64_t probes = 0;
    o.batch_loss = [&](const std::vector<int64_t>& ids) {
      ++probes;
      EXPECT_EQ(ids, std::vector<int64_t>({7, 9}));
      return again;
    };
    Feed run(o);
    for (int64_t i = 1; i <= 6; ++i) {
      StepResult r = step(i, i == 1 ? 0.5 : 3.0 + 0.01 * static_cast<double>(i), 0.5);
      r.example_ids = i == 1 ? std::vector<int64_t>{7, 9} : std::vector<int64_t>{1, 2};
      run.feed(r);
    }
    if (again > 1) {
      ASSERT_EQ(run.advice.size(), 1u);
      EXPECT_EQ(run.advice[0].first, 3);
      EXPECT_CONTAINS(run.advice[0].second, "over 3x the loss before any update (0.5)");
      EXPECT_CONTAINS(run.advice[0].second, "step 1's batch now has a loss of 3.2");
      EXPECT_EQ(probes, 1);  // once: the verdict holds without measuring again
    } else {
      EXPECT_TRUE(run.advice.empty()) << run.advice.front().second;
      EXPECT_EQ(probes, 1);  // once a window, not a forward at every step
    }
  }
}

TEST(Advisor, GrowingGradNormWhileTheLossFallsIsNotExploding) {
  // 3x growth with an improving loss (common early in training) stays stable.
  Feed run;
  for (int64_t i = 1; i <= 40; ++i) run.feed(step(i, 5.0 - 0.05 * i, 0.2 * std::pow(1.03, i)));
  EXPECT_TRUE(run.advice.empty()) << run.advice.front().second;
}

TEST(Advisor, NonFiniteLossIsExplodingAtOnce) {
  Feed run;
  for (int64_t i = 1; i <= 3; ++i) run.feed(step(i, healthy_loss(i), healthy_norm(i)));
  StepResult r = step(4, std::nan(""), std::nan(""));
  r.nan_steps = 1;
  run.feed(r);
  ASSERT_EQ(run.advice.size(), 1u);
  EXPECT_EQ(run.advice[0].first, 4);
  EXPECT_EQ(run.advice[0].second.rfind("exploding: non-finite loss at step 4", 0), 0u)
      << run.advice[0].second;
  EXPECT_NE(run.advice[0].second.find("debug.underflow_overflow.enabled = true"),
            std::string::npos);
  // Under bf16-mixed the advice names 32-true.
  AdvisorOptions o;
  o.precision = "bf16-mixed";
  Feed bf(o);
  StepResult s = step(1, 2.0, std::nan(""));
  s.nan_steps = 1;
  bf.feed(s);
  ASSERT_EQ(bf.advice.size(), 1u);
  EXPECT_EQ(bf.advice[0].second.rfind("exploding: non-finite gradients at step 1", 0), 0u)
      << bf.advice[0].second;
  EXPECT_NE(bf.advice[0].second.find("try train.precision = \"32-true\""), std::string::npos)
      << bf.advice[0].second;
}

TEST(Advisor, ExactlyZeroGradNormsAreVanishing) {
  // f16 gradient underflow without a scaler: the norm is exactly 0 from step 6 on.
  AdvisorOptions o;
  o.precision = "16-true";
  Feed run(o);
  for (int64_t i = 1; i <= 5; ++i) run.feed(step(i, 5.5, 1e-3));
  for (int64_t i = 6; i <= 12; ++i) run.feed(step(i, 5.5, 0.0));
  ASSERT_EQ(run.advice.size(), 1u);
  EXPECT_EQ(run.advice[0].first, 8);  // the third zero in a row
  const std::string& line = run.advice[0].second;
  EXPECT_EQ(line.rfind("vanishing: the grad norm was exactly 0 on the last 3 steps", 0), 0u)
      << line;
  EXPECT_NE(line.find("switch train.precision to 16-mixed (its GradScaler)"), std::string::npos)
      << line;
  // Under 32-true exact zeros mean nothing reaches the parameters, not an underflow.
  Feed f32;
  for (int64_t i = 1; i <= 3; ++i) f32.feed(step(i, 5.5, 0.0));
  ASSERT_EQ(f32.advice.size(), 1u);
  EXPECT_NE(f32.advice[0].second.find("not every label is ignored"), std::string::npos);
  EXPECT_EQ(f32.advice[0].second.find("switch train.precision to 16-mixed"), std::string::npos);
  // 16-mixed with scaler.enabled = false (the scale stays 1): the advice is to turn it on.
  o.precision = "16-mixed";
  Feed mixed(o);
  for (int64_t i = 1; i <= 3; ++i) mixed.feed(step(i, 5.5, 1e-3));
  for (int64_t i = 4; i <= 6; ++i) mixed.feed(step(i, 5.5, 0.0));
  ASSERT_EQ(mixed.advice.size(), 1u);
  EXPECT_NE(mixed.advice[0].second.find("set scaler.enabled = true"), std::string::npos)
      << mixed.advice[0].second;
  // A decay already classed vanishing (the ratio rule), then exact zeros: a second line, with
  // the underflow's fix (what a near-converged f16 run without a scaler prints).
  Feed decay(o);
  for (int64_t i = 1; i <= 14; ++i) decay.feed(step(i, 1.0, std::pow(10.0, -0.5 * i)));
  ASSERT_EQ(decay.advice.size(), 1u);
  EXPECT_EQ(decay.advice[0].second.find("scaler"), std::string::npos) << decay.advice[0].second;
  for (int64_t i = 15; i <= 20; ++i) decay.feed(step(i, 1.0, 0.0));
  ASSERT_EQ(decay.advice.size(), 2u);
  EXPECT_EQ(decay.advice[1].first, 17);
  EXPECT_EQ(decay.advice[1].second.rfind("vanishing: the grad norm was exactly 0", 0), 0u)
      << decay.advice[1].second;
  EXPECT_NE(decay.advice[1].second.find("set scaler.enabled = true"), std::string::npos);
  // With a scaler on (scale 65536), zeros are not the missing scaler's fault.
  Feed scaled(o);
  for (int64_t i = 1; i <= 3; ++i) {
    StepResult r = step(i, 5.5, 0.0);
    r.loss_scale = r.loss_scale_after = 65536;
    scaled.feed(r);
  }
  ASSERT_EQ(scaled.advice.size(), 1u);
  EXPECT_EQ(scaled.advice[0].second.find("scaler.enabled"), std::string::npos)
      << scaled.advice[0].second;
}

TEST(Advisor, DecayingGradNormIsVanishingAndSuggestsAHigherLrForTinyModels) {
  AdvisorOptions o;
  o.num_params = 100'000;
  Feed run(o);
  for (int64_t i = 1; i <= 40; ++i) run.feed(step(i, 5.5, std::pow(0.5, i)));
  ASSERT_FALSE(run.advice.empty());
  const std::string& line = run.advice.front().second;
  EXPECT_EQ(line.rfind("vanishing: the grad norm fell ", 0), 0u) << line;
  EXPECT_NE(line.find("raise optim.lr"), std::string::npos) << line;
  EXPECT_NE(line.find("tiny models"), std::string::npos) << line;
}

// The same decay in a run whose updates blew a weight up (a LoRA at optim.lr 1000 in bf16-mixed:
// lora_B at 3e9 by step 8, the attention saturated, the grad norm falling 1e6x): it was told
// "vanishing: ... raise optim.lr (now 872)". It has diverged: lower optim.lr, never raise it; and
// the verdict holds while the weight stays up there, however calm the grad norm looks.
TEST(Advisor, ADecayOfAModelWhoseWeightsBlewUpIsADivergence) {
  AdvisorOptions o;
  o.num_params = 100'000;
  double largest = 0.05;
  o.largest_weight = [&largest] { return monitor::LargestWeight{"h.1.lora_B.weight", largest}; };
  Feed run(o);
  for (int64_t i = 1; i <= 40; ++i) {
    largest = i == 1 ? 0.05 : 3e9;
    run.feed(step(i, 5.8, std::pow(0.1, i)));
  }
  ASSERT_EQ(run.advice.size(), 1u);
  const std::string& line = run.advice.front().second;
  EXPECT_EQ(line.rfind("exploding: diverged: the grad norm fell ", 0), 0u) << line;
  EXPECT_CONTAINS(line, "h.1.lora_B.weight up to |w| = 3e+09");
  EXPECT_CONTAINS(line, "lower optim.lr");
  EXPECT_EQ(line.find("raise optim.lr"), std::string::npos) << line;
  EXPECT_EQ(run.adv.trend(), Trend::kExploding);
  // Weights that stay in a sane range (the same decay with |w| <= 1e4) remain vanishing.
  largest = 1e4;
  Feed sane(o);
  for (int64_t i = 1; i <= 40; ++i) sane.feed(step(i, 5.8, std::pow(0.5, i)));
  ASSERT_FALSE(sane.advice.empty());
  EXPECT_EQ(sane.advice.front().second.rfind("vanishing: the grad norm fell ", 0), 0u);
}

// A run that learns its task: the loss and the grad norm fall together towards 0. It is
// converging, not vanishing: a converged 32-true run (examples/f16-no-scaler's config) was told
// to raise optim.lr.
TEST(Advisor, ALossAndGradNormFallingTogetherIsConvergingNotVanishing) {
  AdvisorOptions o;
  o.num_params = 100'000;
  Feed run(o);
  for (int64_t i = 1; i <= 40; ++i) run.feed(step(i, 2.0 * std::pow(0.6, i), std::pow(0.5, i)));
  EXPECT_TRUE(run.advice.empty()) << run.advice.front().second;
  for (Trend t : run.trends) EXPECT_EQ(t, Trend::kStable);
}

TEST(Advisor, SpikeThenStableAgain) {
  Feed run;
  for (int64_t i = 1; i <= 30; ++i)
    run.feed(step(i, healthy_loss(i), i == 20 ? 50.0 : healthy_norm(i)));
  ASSERT_EQ(run.advice.size(), 2u);
  EXPECT_EQ(run.advice[0].first, 20);
  EXPECT_EQ(run.advice[0].second.rfind("spiking: step 20's grad norm jumped to 50", 0), 0u)
      << run.advice[0].second;
  EXPECT_NE(run.advice[0].second.find("check the data around step 20"), std::string::npos);
  EXPECT_EQ(run.advice[1].first, 25);  // spike_hold = 5 steps
  EXPECT_EQ(run.advice[1].second.rfind("stable: ", 0), 0u) << run.advice[1].second;
  EXPECT_NE(run.advice[1].second.find("no action needed"), std::string::npos);
}

// Spikes the optimizer made (they recur on other batches), then calm steps: "stable ... no action
// needed" came 5 steps after the third spike of a run at optim.lr 0.5 that spiked again 2 steps
// later. The rate that made them is still set, and the verdict says so.
TEST(Advisor, StableAfterTheOptimizersSpikesKeepsTheLearningRateInView) {
  Feed run;
  for (int64_t i = 1; i <= 40; ++i)
    run.feed(step(i, healthy_loss(i), i == 20 || i == 28 ? 50.0 : healthy_norm(i)));
  ASSERT_GE(run.advice.size(), 2u);
  const std::string& last = run.advice.back().second;
  EXPECT_EQ(last.rfind("stable: ", 0), 0u) << last;
  EXPECT_CONTAINS(last,
                  "; no spike since step 28, which the optimizer made (not its batch); "
                  "none now; if spikes recur, lower optim.lr (now 0.003, try 0.0003)");
  EXPECT_NOT_CONTAINS(last, "no action needed");
}

// Recurring spikes name the clipping the run has: it said "set train.max_grad_norm (now
// clipping)" to a run clipping at 1.0 already.
TEST(Advisor, RecurringSpikesNameTheClippingThreshold) {
  auto advice_at_second_spike = [](double max_grad_norm) {
    AdvisorOptions o;
    o.max_grad_norm = max_grad_norm;
    Feed run(o);
    for (int64_t i = 1; i <= 28; ++i) {
      StepResult r = step(i, healthy_loss(i), i == 20 || i == 28 ? 50.0 : healthy_norm(i));
      r.clipped = max_grad_norm > 0 && r.grad_norm > max_grad_norm;
      run.feed(r);
    }
    EXPECT_FALSE(run.advice.empty());
    return run.advice.empty() ? std::string() : run.advice.back().second;
  };
  // Clipped at 1, the spikes of 50 are contained: the advice then was "lower train.max_grad_norm
  // (now 1: it clipped this step)", more of what the run did; the step size is what is left.
  const std::string clipping = advice_at_second_spike(1.0);
  EXPECT_CONTAINS(clipping, "spikes recur (steps 20 28)");
  EXPECT_CONTAINS(clipping,
                  "train.max_grad_norm = 1 already clipped it (grad norm 50 cut to 1), which "
                  "contains the spike, and a lower threshold would not remove its cause: lower "
                  "optim.lr");
  EXPECT_NOT_CONTAINS(clipping, "lower train.max_grad_norm");
  EXPECT_NOT_CONTAINS(clipping, "set train.max_grad_norm");
  // A threshold above the spike did not touch it: lowering it is the advice.
  EXPECT_CONTAINS(advice_at_second_spike(100.0),
                  "or lower train.max_grad_norm (now 100, above the spike's grad norm)");
  EXPECT_CONTAINS(advice_at_second_spike(0.0),
                  "or set train.max_grad_norm = 1.0 (now 0: no clipping)");
}

// Warmup is advised only where it can help: "add warmup (sched.warmup_steps)" was said to spikes
// at the end of a run and to runs that warm up already. Recurring grad-norm spikes at steps 20 and
// 28 (the optimizer's), under schedules that make them late or early.
TEST(Advisor, WarmupIsAdvisedOnlyWhereItCanHelp) {
  auto advice = [](int64_t warmup, int64_t total) {
    AdvisorOptions o;
    o.max_grad_norm = 0;
    o.warmup_steps = warmup;
    o.total_steps = total;
    Feed run(o);
    for (int64_t i = 1; i <= 28; ++i)
      run.feed(step(i, healthy_loss(i), i == 20 || i == 28 ? 50.0 : healthy_norm(i)));
    EXPECT_FALSE(run.advice.empty());
    return run.advice.empty() ? std::string() : run.advice.back().second;
  };
  // No warmup, and the spike is late (step 28 of 30): a warmup would be long over.
  const std::string late = advice(0, 30);
  EXPECT_CONTAINS(late, "spikes recur (steps 20 28)");
  EXPECT_CONTAINS(late, "lower optim.lr (now 0.003, try 0.0003) or set train.max_grad_norm = 1.0");
  EXPECT_NOT_CONTAINS(late, "warmup");
  // No warmup, and the spike falls in the first tenth of a 300-step run: add one that covers it.
  EXPECT_CONTAINS(advice(0, 300),
                  ", and add warmup (sched.warmup_steps = 30, a tenth of the run's 300 steps; "
                  "none now)");
  // A warmup of 20 steps that step 28 follows closely: lengthen it, not "add" one.
  const std::string ramp = advice(20, 300);
  EXPECT_CONTAINS(ramp,
                  "lengthen the warmup (sched.warmup_steps, now 20 steps: step 28 came soon after");
  EXPECT_NOT_CONTAINS(ramp, "add warmup");
  // A warmup of 5 steps, long over by step 28: warmup is not the fix.
  EXPECT_NOT_CONTAINS(advice(5, 300), "warmup");
  // The schedule unknown: the key, as before.
  EXPECT_CONTAINS(advice(-1, 0), ", and add warmup (sched.warmup_steps)");
}

// The learning rate to try is one the advisor's own rule calls safe: optim.lr 10 on a model whose
// weights' RMS is 0.0174 was told "try 1", still 57x that RMS (AdamW moves each weight by ~lr),
// which wrecks the model as 10 did. It is now the power of ten below a tenth of the RMS for an
// untrained model (a hundredth for a pretrained one); a tenth of a sane optim.lr stays a tenth.
TEST(Advisor, TheLearningRateToTryIsSafeAgainstTheWeights) {
  auto advice = [](double lr, double start, double rms, bool adaptive) {
    AdvisorOptions o;
    o.peak_lr = lr;
    o.weight_rms = rms;
    o.adaptive = adaptive;
    o.uniform_loss = std::log(259.0);
    Feed run(o);
    for (int64_t i = 1; i <= 15; ++i) {
      StepResult r = step(i, i == 1 ? start : healthy_loss(i), healthy_norm(i));
      r.lr = lr;
      run.feed(r);
    }
    double g = 1.0;
    for (int64_t i = 16; i <= 40; ++i) {
      g *= 1.5;
      StepResult r = step(i, 3.0 + 0.2 * static_cast<double>(i - 15), g);
      r.lr = lr;
      run.feed(r);
    }
    EXPECT_FALSE(run.advice.empty());
    return run.advice.empty() ? std::string() : run.advice.front().second;
  };
  EXPECT_CONTAINS(advice(10, 5.5, 0.0174, true),
                  "lower optim.lr (now 10, try 0.001, below 0.1x the weights' RMS 0.0174)");
  EXPECT_CONTAINS(advice(10, 2.0, 0.0174, true),
                  "lower optim.lr (now 10, try 0.0001, below 0.01x the weights' RMS 0.0174)");
  EXPECT_CONTAINS(advice(3e-3, 5.5, 0.0174, true), "lower optim.lr (now 0.003, try 0.0003)");
  EXPECT_CONTAINS(advice(10, 5.5, 0.0174, false), "lower optim.lr (now 10, try 1)");  // SGD
}

TEST(Advisor, LossSpikeIsSpiking) {
  Feed run;
  for (int64_t i = 1; i <= 20; ++i) run.feed(step(i, i == 15 ? 9.0 : 2.0, 1.0));
  ASSERT_FALSE(run.advice.empty());
  EXPECT_EQ(run.advice[0].first, 15);
  EXPECT_EQ(run.advice[0].second.rfind("spiking: ", 0), 0u);
}

// 16-mixed: scaler steps. `skip` backs off 2x; otherwise the scale holds.
StepResult scaled(int64_t i, double& scale, bool skip) {
  StepResult r = step(i, 2.0, skip ? INFINITY : 0.5);
  r.loss_scale = scale;
  if (skip) {
    scale *= 0.5;
    r.skipped_steps = 1;
  }
  r.loss_scale_after = scale;
  return r;
}

TEST(Advisor, NormalSixteenMixedStartIsNotACollapse) {
  // PyTorch's 65536 usually backs off a few times at the start: 65536 -> 8192, then steps.
  Feed run;
  double scale = 65536;
  for (int64_t i = 1; i <= 3; ++i) run.feed(scaled(i, scale, true));
  for (int64_t i = 4; i <= 40; ++i) run.feed(scaled(i, scale, false));
  EXPECT_TRUE(run.advice.empty()) << run.advice.front().second;
}

TEST(Advisor, LossScaleCollapse) {
  Feed run;
  double scale = 65536;
  for (int64_t i = 1; i <= 5; ++i) run.feed(scaled(i, scale, false));
  // Every other step overflows: eight back-offs within the window.
  for (int64_t i = 6; i <= 22; ++i) run.feed(scaled(i, scale, i % 2 == 0));
  ASSERT_FALSE(run.advice.empty());
  const std::string& line = run.advice.front().second;
  EXPECT_EQ(line.rfind("loss-scale collapsing: the loss scale fell from 65536 to ", 0), 0u) << line;
  EXPECT_NE(line.find("bf16-mixed or 32-true"), std::string::npos) << line;
  EXPECT_EQ(run.adv.trend(), Trend::kScaleCollapsing);

  // Below 1 is a collapse at once.
  Feed low;
  double s = 1.0;
  low.feed(scaled(1, s, true));
  ASSERT_EQ(low.advice.size(), 1u);
  EXPECT_EQ(low.advice[0].second.rfind("loss-scale collapsing: the loss scale fell to 0.5", 0), 0u)
      << low.advice[0].second;
}

TEST(Advisor, ScalerSkippedStepsAreLeftOutOfTheMedians) {
  // An inf grad norm on a skipped step is not a spike and not an explosion.
  Feed run;
  double scale = 65536;
  for (int64_t i = 1; i <= 30; ++i) run.feed(scaled(i, scale, i == 20));
  EXPECT_TRUE(run.advice.empty()) << run.advice.front().second;
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// A non-finite step: with the tracer already on, the advice points at its log instead of asking
// to enable it; and before any update was applied it never blames the learning rate.
TEST(Advisor, NonFiniteAdviceKnowsTheTracerIsOnAndThatNoUpdateWasApplied) {
  AdvisorOptions o;
  o.precision = "16-true";
  o.tracer_on = true;
  o.tracer_log = "out/debug/underflow_overflow_rank0.log";
  Feed traced(o);
  StepResult r = step(1, std::nan(""), std::nan(""));
  r.nan_steps = 1;
  traced.feed(r);
  ASSERT_EQ(traced.advice.size(), 1u);
  const std::string& line = traced.advice[0].second;
  EXPECT_NE(line.find("the tracer's log (out/debug/underflow_overflow_rank0.log) names the module"),
            std::string::npos)
      << line;
  EXPECT_EQ(line.find("debug.underflow_overflow.enabled = true"), std::string::npos) << line;
  EXPECT_EQ(line.find("optim.lr"), std::string::npos) << line;
  EXPECT_NE(line.find("not the learning rate"), std::string::npos) << line;

  // Without the tracer, after an applied update: enable the tracer, and lr is a suspect.
  Feed plain(AdvisorOptions{});
  plain.feed(step(1, 5.0, 1.0));
  StepResult n = step(2, std::nan(""), std::nan(""));
  n.nan_steps = 1;
  plain.feed(n);
  ASSERT_EQ(plain.advice.size(), 1u);
  EXPECT_NE(plain.advice[0].second.find("debug.underflow_overflow.enabled = true"),
            std::string::npos);
  EXPECT_NE(plain.advice[0].second.find("lower optim.lr"), std::string::npos);
}

// A divergence that settles on a high plateau stays exploding: the best window so far (and ln V
// when known) is the reference, not the diverged steps themselves. It clears once the loss is back.
TEST(Advisor, ExplodingVerdictHoldsUntilTheConditionClears) {
  for (double uniform : {0.0, 5.56}) {
    AdvisorOptions o;
    o.uniform_loss = uniform;
    Feed run(o);
    for (int64_t i = 1; i <= 12; ++i) run.feed(step(i, healthy_loss(i), healthy_norm(i)));
    EXPECT_TRUE(run.advice.empty());
    for (int64_t i = 13; i <= 60; ++i) run.feed(step(i, 2500.0 + (i % 3), 2.6e4 + 10.0 * (i % 5)));
    // Step 13 alone looks like a spike; at step 14 it is a divergence, and one line says so.
    ASSERT_EQ(run.advice.size(), 2u) << run.advice.back().second;
    EXPECT_EQ(run.advice[0].first, 13);
    EXPECT_EQ(run.advice[0].second.rfind("spiking: ", 0), 0u) << run.advice[0].second;
    EXPECT_EQ(run.advice[1].first, 14) << "the second diverged step";
    EXPECT_EQ(run.advice[1].second.rfind("exploding: diverged: ", 0), 0u) << run.advice[1].second;
    EXPECT_EQ(run.adv.trend(), Trend::kExploding);
    // Back at the best window's loss and grad norm: the verdict clears.
    for (int64_t i = 61; i <= 64; ++i) run.feed(step(i, healthy_loss(12), healthy_norm(12)));
    ASSERT_EQ(run.advice.size(), 3u);
    EXPECT_EQ(run.advice[2].second.rfind("stable: ", 0), 0u) << run.advice[2].second;
    // Not "no action needed": the learning rate that made it diverge is still set.
    EXPECT_CONTAINS(run.advice[2].second,
                    "; recovered from the divergence found at step 14; "
                    "none now; if it diverges again, lower optim.lr (now "
                    "0.003, try 0.0003)");
    EXPECT_NOT_CONTAINS(run.advice[2].second, "no action needed");
  }
}

// A single loss spike's batch measured against the batch before it, under the same weights: the
// harder batch is the data (check the data); a batch no harder means the weights moved (the
// optimizer's fix). Measured once, on the loss spike's first sighting, never for a grad-norm-only
// spike.
TEST(Advisor, ASpikeBatchIsComparedWithTheBatchBeforeUnderTheSameWeights) {
  for (const double spike_now : {6.0, 2.1}) {
    AdvisorOptions o;
    std::vector<std::vector<int64_t>> asked;
    o.batch_loss = [&](const std::vector<int64_t>& ids) {
      asked.push_back(ids);
      return ids[0] == 12 ? spike_now : 2.0;
    };
    Feed run(o);
    for (int64_t i = 1; i <= 12; ++i) {
      StepResult r = step(i, i == 12 ? 6.0 : 2.0, 1.0);
      r.example_ids = {i, i + 100};
      run.feed(r);
    }
    ASSERT_EQ(asked.size(), 2u);
    EXPECT_EQ(asked[0], (std::vector<int64_t>{12, 112}));  // the spike's batch
    EXPECT_EQ(asked[1], (std::vector<int64_t>{11, 111}));  // the batch before it
    ASSERT_FALSE(run.advice.empty());
    const std::string& line = run.advice.back().second;
    if (spike_now == 6.0) {
      EXPECT_CONTAINS(line, "its batch's loss is 6 and the step before's batch's 2: the batch");
      EXPECT_CONTAINS(line, "check the data around step 12");
    } else {
      // 2.1 against 2.0 was called "no harder": it is harder, by too little to be the cause.
      EXPECT_CONTAINS(line,
                      "its batch is only 1.05x harder (under 1.5x), too little to make the "
                      "spike: the update before moved the weights");
      EXPECT_CONTAINS(line, "lower optim.lr");
      EXPECT_NOT_CONTAINS(line, "check the data");
    }
  }
  // A grad-norm spike alone is probed too: it went unprobed and was sent to "check the data"
  // (optim.lr 0.03 on the clean arithmetic task). Its batch is no harder here: the optimizer.
  AdvisorOptions o;
  int calls = 0;
  o.batch_loss = [&](const std::vector<int64_t>&) { return ++calls, 2.0; };
  Feed run(o);
  for (int64_t i = 1; i <= 12; ++i) {
    StepResult r = step(i, 2.0, i == 12 ? 50.0 : 1.0);
    r.example_ids = {i};
    run.feed(r);
  }
  EXPECT_EQ(calls, 2);
  ASSERT_FALSE(run.advice.empty());
  EXPECT_NOT_CONTAINS(run.advice.back().second, "check the data");
  EXPECT_CONTAINS(run.advice.back().second, "lower optim.lr");
  // Without a probe (the tracer or the injector on) neither cause is asserted.
  Feed unprobed;
  for (int64_t i = 1; i <= 12; ++i) {
    StepResult r = step(i, 2.0, i == 12 ? 50.0 : 1.0);
    r.example_ids = {i};
    unprobed.feed(r);
  }
  ASSERT_FALSE(unprobed.advice.empty());
  EXPECT_CONTAINS(unprobed.advice.back().second, "if its batch looks wrong, check the data");
  EXPECT_CONTAINS(unprobed.advice.back().second, "if spikes recur, it is the optimizer");
}

// ---- per-layer underflow and rounded-away updates (issue 21 items 3, 4) -----------------------

using monitor::BlockGradNorm;
using monitor::Finding;

// A GPT-2's blocks: the embedding (gradient alive), two blocks and the final norm. `dead`: which
// of the blocks have every element 0 (or below f16's smallest normal).
std::vector<BlockGradNorm> layers_of(bool dead_h0, bool dead_h1, bool subnormal = false) {
  auto block = [](const std::string& name, bool dead, bool sub) {
    BlockGradNorm b;
    b.block = name;
    b.count = 1000;
    b.zero = dead ? (sub ? 400 : 1000) : 10;
    b.below_normal = dead ? (sub ? 600 : 0) : 5;
    b.norm = dead ? (sub ? 1e-6 : 0.0) : 0.5;
    return b;
  };
  return {block("transformer.wte", false, false), block("transformer.h.0", dead_h0, subnormal),
          block("transformer.h.1", dead_h1, subnormal), block("transformer.ln_f", false, false)};
}

struct LayerFeed {
  TrendAdvisor adv;
  std::vector<Finding> findings;
  std::vector<std::string> lines;
  explicit LayerFeed(AdvisorOptions o) : adv(o) {}
  void feed(StepResult r, const std::vector<BlockGradNorm>& layers) {
    const std::string a = adv.observe(r, &layers);
    EXPECT_EQ(a, r.advice);
    for (const Finding& f : adv.findings()) findings.push_back(f);
    if (!a.empty()) lines.push_back(a);
  }
  std::vector<Finding> of(const std::string& trend) const {
    std::vector<Finding> out;
    for (const Finding& f : findings)
      if (f.trend == trend) out.push_back(f);
    return out;
  }
};

// 16-mixed without a scaler: the blocks' gradients vanish while the embedding's does not. The
// global norm is not 0, so the trend alone would see a decay and ask for a higher lr; the finding
// names the two blocks, the f16 underflow and the scaler, once, on the third such step.
TEST(Advisor, VanishedBlocksAreNamedWithTheirPrecisionCauseAndFix) {
  AdvisorOptions o;
  o.precision = "16-mixed";
  o.num_params = 100000;
  LayerFeed run(o);
  for (int64_t i = 1; i <= 10; ++i) run.feed(step(i, 3.0, 1.0), layers_of(false, false));
  for (int64_t i = 11; i <= 20; ++i) run.feed(step(i, 3.0, 1e-4), layers_of(true, true));
  const auto under = run.of("underflow");
  ASSERT_EQ(under.size(), 1u) << (run.lines.empty() ? "" : run.lines.back());
  const Finding& f = under[0];
  EXPECT_EQ(f.step, 13);
  EXPECT_EQ(f.layers, (std::vector<std::string>{"transformer.h.0", "transformer.h.1"}));
  EXPECT_NE(f.cause.find("the gradients of 2 of 4 blocks vanished on the last 3 steps: "
                         "transformer.h.0, transformer.h.1"),
            std::string::npos)
      << f.cause;
  EXPECT_NE(f.cause.find("while transformer.wte's did not"), std::string::npos) << f.cause;
  EXPECT_NE(f.cause.find("f16 underflow"), std::string::npos) << f.cause;
  EXPECT_NE(f.action.find("set scaler.enabled = true"), std::string::npos) << f.action;
  EXPECT_NE(f.action.find("bf16-mixed"), std::string::npos) << f.action;
  EXPECT_EQ(f.share, 1.0);
  // Whatever the trend says meanwhile, it never asks for a higher learning rate.
  for (const std::string& l : run.lines)
    EXPECT_EQ(l.find("raise optim.lr"), std::string::npos) << l;

  // Only subnormal (not zero) f16 gradients count as vanished too; and a block that recovers and
  // vanishes again is named again.
  LayerFeed sub(o);
  for (int64_t i = 1; i <= 4; ++i) sub.feed(step(i, 3.0, 1.0), layers_of(false, true, true));
  for (int64_t i = 5; i <= 6; ++i) sub.feed(step(i, 3.0, 1.0), layers_of(false, false));
  for (int64_t i = 7; i <= 9; ++i) sub.feed(step(i, 3.0, 1.0), layers_of(true, true, true));
  const auto s = sub.of("underflow");
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].step, 3);
  EXPECT_EQ(s[0].layers, std::vector<std::string>{"transformer.h.1"});
  EXPECT_EQ(s[0].share, 0.4);
  EXPECT_EQ(s[1].step, 9);
  EXPECT_EQ(s[1].layers.size(), 2u);

  // Under bf16-mixed (bf16 reaches 1e-38) all-zero blocks are no underflow: another action.
  o.precision = "bf16-mixed";
  LayerFeed bf(o);
  for (int64_t i = 1; i <= 5; ++i) bf.feed(step(i, 3.0, 1.0), layers_of(true, false));
  ASSERT_EQ(bf.of("underflow").size(), 1u);
  EXPECT_NE(bf.of("underflow")[0].cause.find("not an underflow of bf16's range"),
            std::string::npos);
  EXPECT_EQ(bf.of("underflow")[0].action.find("scaler"), std::string::npos);
}

// Blocks that vanish after the run diverged died of it (saturated activations of blown-up
// weights), in any format: the finding says so and gives the divergence's fix, not the format's
// (f16: a loss scaler) nor a detached layer's.
TEST(Advisor, VanishedBlocksOfADivergedRunAreTheDivergences) {
  for (const std::string precision : {"32-true", "16-mixed"}) {
    AdvisorOptions o;
    o.precision = precision;
    o.uniform_loss = 5.56;
    LayerFeed run(o);
    run.feed(step(1, 5.5, 3.0), layers_of(false, false));
    for (int64_t i = 2; i <= 8; ++i)
      run.feed(step(i, 1e6 * static_cast<double>(i), 1e5), layers_of(i >= 4, i >= 4));
    ASSERT_FALSE(run.of("exploding").empty()) << precision;
    const int64_t diverged = run.of("exploding")[0].step;
    const auto under = run.of("underflow");
    ASSERT_EQ(under.size(), 1u) << precision;
    EXPECT_CONTAINS(under[0].cause,
                    "the run has diverged (since step " + std::to_string(diverged) + ")");
    EXPECT_CONTAINS(under[0].action, "lower optim.lr");
    EXPECT_NOT_CONTAINS(under[0].action, "scaler");
    EXPECT_NOT_CONTAINS(under[0].action, "detached");
  }
}

TEST(Advisor, HealthyLayersAndSkippedStepsGiveNoUnderflowFinding) {
  AdvisorOptions o;
  o.precision = "16-mixed";
  LayerFeed run(o);
  for (int64_t i = 1; i <= 30; ++i)
    run.feed(step(i, healthy_loss(i), healthy_norm(i)), layers_of(false, false));
  EXPECT_TRUE(run.findings.empty());
  // A scaler's skipped steps carry inf gradients: no evidence either way, the count holds.
  LayerFeed skips(o);
  skips.feed(step(1, 3.0, 1.0), layers_of(true, false));
  skips.feed(step(2, 3.0, INFINITY), layers_of(false, false));
  skips.feed(step(3, 3.0, 1.0), layers_of(true, false));
  EXPECT_TRUE(skips.of("underflow").empty());
  skips.feed(step(4, 3.0, 1.0), layers_of(true, false));
  EXPECT_EQ(skips.of("underflow").size(), 1u);
}

StepResult update_step(int64_t i, int64_t elements, int64_t away) {
  StepResult r = step(i, 3.0, 1.0);
  r.update_elements = elements;
  r.rounded_away = away;
  return r;
}

// bf16-true at a small lr: 94% of the updates round away step after step. The finding gives the
// share and both fixes, once; bf16-mixed (f32 masters, nothing rounds away) and a run with
// stochastic rounding on say nothing.
TEST(Advisor, RoundedAwayUpdatesAreReportedWithTheFix) {
  AdvisorOptions o;
  o.precision = "bf16-true";
  LayerFeed run(o);
  for (int64_t i = 1; i <= 10; ++i) run.feed(update_step(i, 1000, 940), layers_of(false, false));
  const auto r = run.of("rounding");
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].step, 3);
  EXPECT_DOUBLE_EQ(r[0].share, 0.94);
  EXPECT_EQ(r[0].cause.rfind("94% of the weight updates rounded away (step 3: 940 of 1000", 0), 0u)
      << r[0].cause;
  EXPECT_NE(r[0].action.find("bf16-mixed (f32 master weights keep every update)"),
            std::string::npos);
  EXPECT_NE(r[0].action.find("optim.stochastic_rounding = true"), std::string::npos);
  // Below the share for a step: the run restarts, and a later relapse is reported again.
  run.feed(update_step(11, 1000, 10), layers_of(false, false));
  for (int64_t i = 12; i <= 14; ++i) run.feed(update_step(i, 1000, 990), layers_of(false, false));
  EXPECT_EQ(run.of("rounding").size(), 2u);

  o.precision = "bf16-mixed";
  LayerFeed mixed(o);
  for (int64_t i = 1; i <= 10; ++i) mixed.feed(update_step(i, 1000, 0), layers_of(false, false));
  EXPECT_TRUE(mixed.findings.empty());
  o.precision = "bf16-true";
  o.stochastic_rounding = true;
  LayerFeed sr(o);
  for (int64_t i = 1; i <= 10; ++i) sr.feed(update_step(i, 1000, 800), layers_of(false, false));
  EXPECT_TRUE(sr.of("rounding").empty());
}

// optim.lr = 1e-6 where 1e-3 was meant: the loss barely moves and nothing else is wrong, so no
// trend fires. "stalled" needs both a flat loss and updates tiny against the weights: the same
// flat loss at a healthy lr (data with little left to learn) and the same lr with a falling loss
// say nothing, nor do a warmup's and a decayed tail's steps count.
StepResult lr_step(int64_t i, double loss, double lr) {
  StepResult r = step(i, loss, 2.0);
  r.lr = lr;
  return r;
}

TEST(Advisor, AFlatLossUnderUpdatesTinyAgainstTheWeightsIsStalled) {
  AdvisorOptions o;
  o.peak_lr = 1e-6;
  o.weight_rms = 0.02;               // an update moves the weights by 5e-5 of their RMS
  o.uniform_loss = std::log(259.0);  // 5.56: the loss of 5.5 below is an untrained model's
  LayerFeed low(o);
  for (int64_t i = 1; i <= 80; ++i)
    low.feed(lr_step(i, 5.5 - 1e-4 * static_cast<double>(i) + 0.02 * std::cos(i), 1e-6), {});
  const auto f = low.of("stalled");
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].step, 50);
  EXPECT_CONTAINS(f[0].cause, "in 50 updates at the full learning rate");
  EXPECT_CONTAINS(f[0].cause, "~5e-05 of their RMS (0.02; AdamW moves each by about lr = 1e-06)");
  EXPECT_CONTAINS(f[0].action,
                  "optim.lr is far too low: raise it (AdamW usually trains a model "
                  "from scratch at 1e-4 to 3e-3)");

  // A pretrained model (loss 2.0 against ln V = 10.4) fine-tuned at 1e-6 learns slowly by design:
  // its updates of 5e-5 of the weights are no stall; at 1e-7 (5e-6) they are.
  AdvisorOptions tuned = o;
  tuned.uniform_loss = std::log(32000.0);
  for (const double lr : {1e-6, 1e-7}) {
    tuned.peak_lr = lr;
    LayerFeed ft(tuned);
    for (int64_t i = 1; i <= 60; ++i) ft.feed(lr_step(i, 2.0 + 0.01 * std::cos(i), lr), {});
    if (lr == 1e-6) {
      EXPECT_TRUE(ft.of("stalled").empty());
    } else {
      ASSERT_EQ(ft.of("stalled").size(), 1u);
      EXPECT_CONTAINS(ft.of("stalled")[0].action,
                      "AdamW usually fine-tunes a whole pretrained model at 1e-5 to 2e-4");
    }
  }

  o.peak_lr = 1e-3;  // the same flat loss with updates of 5% of the weights: not the lr
  LayerFeed flat(o);
  for (int64_t i = 1; i <= 80; ++i) flat.feed(lr_step(i, 5.5 + 0.02 * std::cos(i), 1e-3), {});
  EXPECT_TRUE(flat.of("stalled").empty());

  o.peak_lr = 1e-6;  // the same lr, and the loss falls: it learns, slowly
  LayerFeed falling(o);
  for (int64_t i = 1; i <= 80; ++i)
    falling.feed(lr_step(i, 5.5 * std::exp(-0.002 * static_cast<double>(i)), 1e-6), {});
  EXPECT_TRUE(falling.of("stalled").empty());

  LayerFeed warmup(o);  // 60 warmup steps below half the peak, 30 at it: not yet 50
  for (int64_t i = 1; i <= 90; ++i)
    warmup.feed(lr_step(i, 5.5, i <= 60 ? 1e-6 * static_cast<double>(i) / 200 : 1e-6), {});
  EXPECT_TRUE(warmup.of("stalled").empty());

  o.adaptive = false;  // SGD moves by lr x gradient: 1e-6 * 2 / (0.02 * sqrt(1e4)) = 1e-6
  o.num_params = 10000;
  LayerFeed sgd(o);
  for (int64_t i = 1; i <= 60; ++i) sgd.feed(lr_step(i, 5.5, 1e-6), {});
  ASSERT_EQ(sgd.of("stalled").size(), 1u);
  EXPECT_CONTAINS(sgd.of("stalled")[0].cause, "SGD moves them by lr = 1e-06 times the gradient");
  // SGD's range, not AdamW's (it was told "AdamW usually trains a model from scratch at 1e-4").
  EXPECT_CONTAINS(sgd.of("stalled")[0].action, "usually trains at 1e-2 to 1e-1");
  EXPECT_NOT_CONTAINS(sgd.of("stalled")[0].action, "AdamW");
}

// Step 1's loss is one batch's: ~5% off the run's typical loss by batch noise alone, more than the
// 2% "fell" threshold. A pretrained LoRA at optim.lr 1e-7 whose step 1 drew a batch 5% harder
// "fell" 5% and was never called stalled; the first 10 losses' median is the baseline now. A run
// that learns (its loss falls 10% over the same steps) stays silent.
TEST(Advisor, StalledComparesTheMediansOfTheFirstAndLastLossesNotStepOnesBatch) {
  AdvisorOptions o;
  o.peak_lr = 1e-7;
  o.weight_rms = 0.05;
  o.uniform_loss = std::log(259.0);
  o.adapter = "lora";
  auto noise = [](int64_t i) { return 0.1 * std::sin(1.7 * static_cast<double>(i)); };
  LayerFeed hard_first(o);
  for (int64_t i = 1; i <= 60; ++i)
    hard_first.feed(lr_step(i, i == 1 ? 2.1 : 2.0 + noise(i), 1e-7), {});
  ASSERT_EQ(hard_first.of("stalled").size(), 1u);
  EXPECT_CONTAINS(hard_first.of("stalled")[0].cause, "(median of the first 10 losses ");
  LayerFeed learning(o);
  for (int64_t i = 1; i <= 60; ++i)
    learning.feed(lr_step(i, 2.0 * (1 - 0.002 * static_cast<double>(i)) + noise(i), 1e-7), {});
  EXPECT_TRUE(learning.of("stalled").empty());
}

// The range "stalled" suggests fits what is trained: an adapter on a random base was told "AdamW
// usually trains a model from scratch at 1e-4 to 3e-3", one on a pretrained base the ranges of a
// full fine-tune and LoRA side by side; a DoRA is no LoRA.
TEST(Advisor, AStalledAdapterIsGivenTheAdaptersLearningRateRange) {
  for (const bool pretrained : {false, true}) {
    AdvisorOptions o;
    o.peak_lr = 1e-8;
    o.weight_rms = 0.02;
    o.uniform_loss = std::log(259.0);
    o.adapter = "dora";
    LayerFeed run(o);
    const double start = pretrained ? 1.0 : 5.5;
    for (int64_t i = 1; i <= 60; ++i) run.feed(lr_step(i, start + 0.01 * std::cos(i), 1e-8), {});
    ASSERT_EQ(run.of("stalled").size(), 1u) << pretrained;
    const std::string action = run.of("stalled")[0].action;
    EXPECT_CONTAINS(action, "AdamW usually trains DoRA adapters at 1e-4 to 1e-3");
    EXPECT_NOT_CONTAINS(action, "from scratch");
    EXPECT_NOT_CONTAINS(action, "fine-tunes");
  }
}

// A cosine schedule decays to ~0: its last updates round away by design, and "raise optim.lr"
// misled a healthy run at its end. Below a tenth of the peak, rounding is not counted.
TEST(Advisor, UpdatesRoundedAwayInADecayedTailAreTheSchedule) {
  AdvisorOptions o;
  o.peak_lr = 3e-3;
  LayerFeed tail(o);
  for (int64_t i = 1; i <= 10; ++i) {
    StepResult r = update_step(i, 1000, 900);
    r.lr = 1e-6;
    tail.feed(r, layers_of(false, false));
  }
  EXPECT_TRUE(tail.of("rounding").empty());
  LayerFeed full(o);
  for (int64_t i = 1; i <= 10; ++i) full.feed(update_step(i, 1000, 900), layers_of(false, false));
  EXPECT_EQ(full.of("rounding").size(), 1u);
}

// A spike names as "far above the recent median" only what jumped. A grad-norm spike whose loss
// was below its median (init_std 5: grad norm 2.43e4, loss 32.4 against a median loss of 33.9)
// read "step 48 jumped (grad norm 2.43e+04, loss 32.4) far above the recent median (grad norm
// 69.3, loss 33.9)".
TEST(Advisor, ASpikeNamesOnlyWhatJumped) {
  Feed norm_only;
  for (int64_t i = 1; i <= 22; ++i)
    norm_only.feed(step(i, i == 20 ? 2.9 : 3.0 + 0.01 * std::cos(i), i == 20 ? 50.0 : 1.0));
  ASSERT_FALSE(norm_only.advice.empty());
  const std::string& a = norm_only.advice.front().second;
  EXPECT_CONTAINS(a,
                  "step 20's grad norm jumped to 50, far above the recent median 1 (its loss "
                  "2.9, median 3)");
  EXPECT_NOT_CONTAINS(a, "loss 2.9) far above");
  Feed loss_only;
  for (int64_t i = 1; i <= 17; ++i) loss_only.feed(step(i, i == 15 ? 9.0 : 2.0, 1.0));
  ASSERT_FALSE(loss_only.advice.empty());
  EXPECT_CONTAINS(loss_only.advice.front().second,
                  "step 15's loss jumped to 9, far above the recent median 2 (its grad norm 1, "
                  "median 1)");
  Feed both;
  for (int64_t i = 1; i <= 17; ++i) both.feed(step(i, i == 15 ? 9.0 : 2.0, i == 15 ? 50.0 : 1.0));
  ASSERT_FALSE(both.advice.empty());
  EXPECT_CONTAINS(both.advice.front().second,
                  "step 15 jumped (grad norm 50, loss 9) far above the recent median (grad norm "
                  "1, loss 2)");
}

// scaler.init_scale set below 1 is the setting, not a collapse: "loss-scale collapsing: the loss
// scale fell to 0.001 (below 1); f16 overflows at any usable scale: switch train.precision to
// bf16-mixed" named a fall that never happened and a fix that leaves the scale where it is. Set
// far above f16's range (1e30), its back-offs towards a usable scale are no collapse either.
TEST(Advisor, ALossScaleSetBelowOneOrFarAboveIsTheSettingNotACollapse) {
  AdvisorOptions o;
  o.precision = "16-mixed";
  o.init_scale = 1e-3;
  LayerFeed low(o);
  double scale = static_cast<float>(1e-3);
  for (int64_t i = 1; i <= 30; ++i) low.feed(scaled(i, scale, false), {});
  ASSERT_EQ(low.of("loss scale").size(), 1u);
  EXPECT_EQ(low.of("loss scale")[0].step, 1);
  EXPECT_CONTAINS(low.of("loss scale")[0].cause,
                  "scaler.init_scale = 0.001 starts the loss scale "
                  "below 1");
  EXPECT_CONTAINS(low.of("loss scale")[0].action, "raise scaler.init_scale");
  EXPECT_EQ(low.adv.trend(), Trend::kStable);
  for (const auto& line : low.lines) EXPECT_NOT_CONTAINS(line, "collapsing");

  o.init_scale = 1e30;
  LayerFeed high(o);
  scale = static_cast<float>(1e30);
  for (int64_t i = 1; i <= 12; ++i) high.feed(scaled(i, scale, true), {});
  ASSERT_EQ(high.of("loss scale").size(), 1u);
  EXPECT_EQ(high.of("loss scale")[0].step, 4);
  EXPECT_CONTAINS(high.of("loss scale")[0].cause,
                  "the loss scale started at scaler.init_scale = 1e+30 and has backed off 4 times");
  EXPECT_CONTAINS(high.of("loss scale")[0].action, "lower scaler.init_scale");
  for (const auto& line : high.lines) EXPECT_NOT_CONTAINS(line, "collapsing");

  // From PyTorch's 65536, a fall below 1 is still a collapse.
  o.init_scale = 65536;
  LayerFeed fall(o);
  scale = 65536;
  for (int64_t i = 1; i <= 18; ++i) fall.feed(scaled(i, scale, true), {});
  EXPECT_EQ(fall.adv.trend(), Trend::kScaleCollapsing);
  EXPECT_TRUE(fall.of("loss scale").empty());
}

// SGD moves by the clipped gradient: train.max_grad_norm = 1e-6 held the loss flat for 120 steps
// without a finding (the pre-clip norm made the update look large), and "raise optim.lr" would
// not be the fix. AdamW's update does not scale with the norm: its stall stays optim.lr's.
TEST(Advisor, SgdStalledByATinyClippingThresholdNamesIt) {
  AdvisorOptions o;
  o.peak_lr = 0.1;
  o.weight_rms = 0.02;
  o.adaptive = false;
  o.num_params = 10000;
  o.max_grad_norm = 1e-6;
  LayerFeed sgd(o);
  for (int64_t i = 1; i <= 60; ++i) {
    StepResult r = lr_step(i, 5.5, 0.1);
    r.clipped = true;
    sgd.feed(r, {});
  }
  const auto f = sgd.of("stalled");
  ASSERT_EQ(f.size(), 1u);
  EXPECT_CONTAINS(f[0].cause, "times the gradient, clipped to train.max_grad_norm = 1e-06");
  EXPECT_CONTAINS(f[0].action, "train.max_grad_norm = 1e-06 cuts every gradient");
  EXPECT_NOT_CONTAINS(f[0].action, "optim.lr");
  o.max_grad_norm = 1.0;  // the same run clipped at 1: the update is large, no stall
  LayerFeed clipped_at_one(o);
  for (int64_t i = 1; i <= 60; ++i) clipped_at_one.feed(lr_step(i, 5.5, 0.1), {});
  EXPECT_TRUE(clipped_at_one.of("stalled").empty());
}

// A divergence's fix said "keep train.max_grad_norm > 0" to a run with it at 0.
TEST(Advisor, ADivergenceWithoutClippingIsToldToSetIt) {
  AdvisorOptions o;
  o.uniform_loss = std::log(259.0);
  o.max_grad_norm = 0;
  Feed run(o);
  for (int64_t i = 1; i <= 4; ++i) run.feed(step(i, i <= 2 ? 5.0 : 12.0, 3.0));
  ASSERT_FALSE(run.advice.empty());
  EXPECT_CONTAINS(run.advice.back().second, "set train.max_grad_norm = 1.0 (now 0: no clipping)");
  EXPECT_NOT_CONTAINS(run.advice.back().second, "keep train.max_grad_norm");
}

// [debug.inject] puts its fault at its step: the non-finite loss there was told "then lower
// optim.lr (now 0.00196, try 0.000196)", and an injected spike "check the data around step 15
// ...; if spikes recur, it is the optimizer: lower optim.lr", fixes that fix nothing. Other steps
// keep their advice.
TEST(Advisor, AFaultInjectedByDebugInjectIsNamedNotTheLearningRate) {
  AdvisorOptions o;
  o.inject_step = 5;
  o.inject_what = "nan into transformer.h.0.mlp.c_fc's output";
  Feed nan_run(o);
  for (int64_t i = 1; i <= 5; ++i) nan_run.feed(step(i, i == 5 ? NAN : 3.0, i == 5 ? NAN : 1.0));
  ASSERT_EQ(nan_run.advice.size(), 1u);
  const std::string& a = nan_run.advice[0].second;
  EXPECT_CONTAINS(a,
                  "non-finite loss at step 5; debug.inject put nan into "
                  "transformer.h.0.mlp.c_fc's output at this step");
  EXPECT_CONTAINS(a, "set debug.inject.module = \"\"");
  EXPECT_NOT_CONTAINS(a, "optim.lr");

  o.inject_step = 15;
  o.inject_what = "a factor of 50 into transformer.ln_f's output";
  Feed spike(o);
  for (int64_t i = 1; i <= 16; ++i) spike.feed(step(i, i == 15 ? 11.9 : 3.0, i == 15 ? 235 : 3.0));
  ASSERT_FALSE(spike.advice.empty());
  EXPECT_CONTAINS(spike.advice[0].second, "debug.inject put a factor of 50");
  EXPECT_NOT_CONTAINS(spike.advice[0].second, "check the data");
  EXPECT_NOT_CONTAINS(spike.advice[0].second, "optim.lr");

  o.inject_step = 3;  // a fault at step 5 that the injector did not put there
  Feed other(o);
  for (int64_t i = 1; i <= 5; ++i) other.feed(step(i, i == 5 ? NAN : 3.0, i == 5 ? NAN : 1.0));
  ASSERT_EQ(other.advice.size(), 1u);
  EXPECT_NOT_CONTAINS(other.advice[0].second, "debug.inject");
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// 16-true keeps AdamW's moments in f16: squared gradients flushed to 0 make updates of lr * m / eps
// that overflow the forward. The non-finite step was told "lower optim.lr (try 0.000296)", which
// still ends in NaN; the optimizer state's own cause and fix are the finding, said once, even in a
// run already exploding.
TEST(Advisor, ANonFiniteStepOfFlushedAdamMomentsNamesThemNotTheLearningRate) {
  AdvisorOptions o;
  o.precision = "16-true";
  std::string state;
  o.state_underflow = [&state] { return state; };
  Feed run(o);
  for (int64_t i = 1; i <= 3; ++i) run.feed(step(i, 5.5, 1.0));
  state = std::string("AdamW's second moment (exp_avg_sq, stored in f16) underflowed to 0: ") +
          monitor::kStateUnderflowFix;
  StepResult r = step(4, std::nan(""), std::nan(""));
  r.nan_steps = 1;
  run.feed(r);
  ASSERT_EQ(run.advice.size(), 1u);
  EXPECT_EQ(run.advice[0].second,
            std::string("exploding: non-finite loss at step 4: AdamW's second moment (exp_avg_sq, "
                        "stored in f16) underflowed to 0; ") +
                monitor::kStateUnderflowFix);
  EXPECT_TRUE(run.adv.state_underflow_said());
  r.step = 5;
  r.nan_steps = 2;
  run.feed(r);
  EXPECT_EQ(run.advice.size(), 1u);  // said once
  // Not flushed: the usual advice.
  state = "";
  Feed other(o);
  for (int64_t i = 1; i <= 3; ++i) other.feed(step(i, 5.5, 1.0));
  r.step = 4;
  r.nan_steps = 1;
  other.feed(r);
  ASSERT_EQ(other.advice.size(), 1u);
  EXPECT_CONTAINS(other.advice[0].second, "lower optim.lr");
  EXPECT_FALSE(other.adv.state_underflow_said());
}

// A scale the scaler keeps growing back into overflow (scaler.growth_interval = 1): every other
// step skipped, without a word. One "loss scale" finding names the key; a normal start (a few
// back-offs, no regrowth) and a collapse (back-offs only) are not it.
TEST(Advisor, AScaleGrownBackIntoOverflowNamesGrowthInterval) {
  AdvisorOptions o;
  o.init_scale = 65536;
  o.growth_interval = 1;
  Feed run(o);
  double scale = 65536;
  for (int64_t i = 1; i <= 40; ++i) {
    const bool skip = i % 2 == 0;
    StepResult r = scaled(i, scale, skip);
    if (!skip) r.loss_scale_after = scale *= 2;  // grown after one clean update
    run.feed(r);
  }
  ASSERT_EQ(run.advice.size(), 1u);
  EXPECT_EQ(run.advice[0].first, 20);
  EXPECT_EQ(run.advice[0].second.rfind("loss scale: 10 of the last 20 steps were skipped", 0), 0u)
      << run.advice[0].second;
  EXPECT_CONTAINS(run.advice[0].second,
                  "(10 growths; the scale moves between 65536 and 131072): it grows after every "
                  "scaler.growth_interval = 1 clean update; raise scaler.growth_interval");
  Feed start(o);
  scale = 65536;
  for (int64_t i = 1; i <= 40; ++i) start.feed(scaled(i, scale, i <= 3));
  EXPECT_TRUE(start.advice.empty()) << start.advice.front().second;
}

// A mixture of experts' routers collapsing (StepResult::moe_*): 6 experts, 2 a token. Said once
// when the busiest expert took >= 3/4 of the most it can (3x its layer's mean) or the aux loss
// reached 1.5 x 2, on 5 steps in a row; a burst of 4 is not; from a spread start it is the updates'
// doing (lower the lr too), from a collapsed one the model's; the fix names the key; said again
// after the routing evened out; a resumed advisor says it at the same step; a dense model never.
StepResult routed(int64_t i, double aux, double load) {
  StepResult r = step(i, 3.0, 1.0);
  r.moe_layers = 2;
  r.moe_aux_loss = aux;
  r.moe_max_load = load;
  r.moe_unused_experts = load >= 2.5 ? 8 : 0;
  return r;
}

TEST(Advisor, RoutersCollapsingOntoAFewExpertsAreSaidWithTheLoadBalancingFix) {
  AdvisorOptions o;
  o.experts = 6;
  o.experts_per_token = 2;
  o.peak_lr = 1e-2;
  auto run = [&](AdvisorOptions opt, const std::function<StepResult(int64_t)>& at, int64_t n) {
    LayerFeed f(opt);
    for (int64_t i = 1; i <= n; ++i) f.feed(at(i), {});
    return f.of("routing");
  };
  // Near-even probabilities, every token to the same 2 experts from step 4 (the load alone).
  const auto soft = [](int64_t i) { return routed(i, i < 4 ? 2.0 : 2.27, i < 4 ? 1.5 : 3.0); };
  auto said = run(o, soft, 20);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_EQ(said[0].step, 8);
  EXPECT_CONTAINS(said[0].cause,
                  "at step 8 the busiest expert took 3x its layer's mean (3x: every "
                  "token's), 8 (layer, expert) pairs took no token, and "
                  "moe/aux_loss is 2.27 (2 when even); step 1 was spread");
  EXPECT_CONTAINS(said[0].action, "set model.router_aux_loss_coef = 0.001");
  EXPECT_CONTAINS(said[0].action, "or lower optim.lr (now 0.01, 0.003 at this step");
  // The aux loss alone (3.2 >= 1.5 x 2), with the loss already on: raise it.
  o.router_aux_loss_coef = 0.001;
  said = run(
      o, [](int64_t i) { return routed(i, i < 4 ? 2.0 : 3.2, 2.0); }, 20);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_CONTAINS(said[0].action, "raise model.router_aux_loss_coef (now 0.001)");
  o.router_aux_loss_coef = 0;
  // Collapsed from step 1: the model's routers, no learning rate to lower.
  said = run(
      o, [](int64_t i) { return routed(i, 2.27, 3.0); }, 20);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_EQ(said[0].step, 5);
  EXPECT_CONTAINS(said[0].cause, "so from step 1: the model's routers on this data");
  EXPECT_EQ(said[0].action.find("optim.lr"), std::string::npos) << said[0].action;
  // A burst of 4 steps, and uneven loads below the thresholds (2x of 3; aux 2.8): nothing.
  EXPECT_TRUE(run(
                  o, [](int64_t i) { return routed(i, 2.1, i >= 5 && i <= 8 ? 3.0 : 1.5); }, 30)
                  .empty());
  EXPECT_TRUE(run(
                  o, [](int64_t i) { return routed(i, 2.8, 2.0); }, 30)
                  .empty());
  // Evened out, then collapsed again: said again.
  said = run(
      o, [](int64_t i) { return routed(i, 2.0, i % 20 < 10 ? 1.2 : 3.0); }, 40);
  EXPECT_EQ(said.size(), 2u);
  // A dense model (no sparse layers) and an advisor without the mixture's sizes say nothing.
  EXPECT_TRUE(run(
                  o, [](int64_t i) { return step(i, 3.0, 1.0); }, 20)
                  .empty());
  AdvisorOptions unknown;
  EXPECT_TRUE(run(unknown, soft, 20).empty());
  // Resumed after step 6 (two steps into the collapse): said at step 8 all the same.
  LayerFeed before(o);
  for (int64_t i = 1; i <= 6; ++i) before.feed(soft(i), {});
  LayerFeed after(o);
  after.adv.restore(nlohmann::json::parse(before.adv.state().dump()), "trainer.json", "fix");
  for (int64_t i = 7; i <= 20; ++i) after.feed(soft(i), {});
  ASSERT_EQ(after.of("routing").size(), 1u);
  EXPECT_EQ(after.of("routing")[0].step, 8);
  EXPECT_CONTAINS(after.of("routing")[0].cause, "step 1 was spread");
}

// A run resumed from a checkpoint carries on with the advisor's state saved in it (state(), through
// JSON as trainer.json holds it): wherever it is cut, the resumed advisor says what the
// uninterrupted one says, at the same steps. It started over: its "loss scale" finding, its spike
// recurrence and its "stalled" counts began again at the resumed step.
TEST(Advisor, ARestoredStateGivesTheUninterruptedRunsFindings) {
  AdvisorOptions o;
  o.num_params = 100'000;
  o.precision = "16-mixed";
  o.uniform_loss = std::log(259.0);
  o.peak_lr = 3e-3;
  o.weight_rms = 0.02;
  o.init_scale = 65536;
  o.batch_loss = [](const std::vector<int64_t>& ids) { return ids[0] == 26 ? 9.0 : 3.0; };
  auto at = [](int64_t i) {
    StepResult r = step(i, i <= 45 ? healthy_loss(i) : 2.0, healthy_norm(i));
    if (i == 26) r.grad_norm *= 20;                                        // a spike
    if (i > 45) r.grad_norm = std::pow(0.3, static_cast<double>(i - 45));  // a decay
    if (i == 3) r.grad_norm = HUGE_VAL;                                    // a scaler skip
    r.stepped = std::isfinite(r.grad_norm);
    r.found_inf = !r.stepped;
    r.loss_scale = i <= 3 ? 65536 : 32768;
    r.loss_scale_after = i < 3 ? 65536 : 32768;
    r.example_ids = {i};
    r.update_elements = r.stepped ? 100 : 0;
    r.rounded_away = i >= 30 && i <= 33 ? 60 : 0;
    return r;
  };
  constexpr int64_t kSteps = 70;
  Feed whole(o);
  for (int64_t i = 1; i <= kSteps; ++i) whole.feed(at(i));
  ASSERT_GE(whole.advice.size(), 3u);
  for (int64_t cut : {1, 2, 3, 10, 26, 27, 31, 33, 47, 55}) {
    Feed before(o);
    for (int64_t i = 1; i <= cut; ++i) before.feed(at(i));
    AdvisorOptions fresh = o;
    fresh.weight_rms = 0;  // a resumed process cannot measure it: the state carries it
    Feed after(fresh);
    after.adv.restore(nlohmann::json::parse(before.adv.state().dump()), "trainer.json", "fix");
    for (int64_t i = cut + 1; i <= kSteps; ++i) after.feed(at(i));
    std::vector<std::pair<int64_t, std::string>> resumed = before.advice;
    resumed.insert(resumed.end(), after.advice.begin(), after.advice.end());
    EXPECT_EQ(resumed, whole.advice) << "cut after step " << cut;
    EXPECT_EQ(after.adv.trend(), whole.adv.trend()) << "cut after step " << cut;
  }
  // A damaged state is an Error naming the file and the key.
  TrendAdvisor adv(o);
  nlohmann::json damaged = whole.adv.state();
  damaged.erase("backoffs");
  try {
    adv.restore(damaged, "out/checkpoints/last/trainer.json", "resume from another one");
    ADD_FAILURE() << "a damaged state was restored";
  } catch (const Error& e) {
    EXPECT_CONTAINS(std::string(e.what()),
                    "out/checkpoints/last/trainer.json: \"advisor\": \"backoffs\" is missing; "
                    "resume from another one");
  }
}

}  // namespace
}  // namespace keel
