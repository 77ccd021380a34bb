// The step of DESIGN §3 end to end through the Trainer: token-weighted windows, remainder windows,
// scaler skips that keep the LR clock, on_nonfinite, resume, and every precision policy training
// the built-in task.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "keel/autograd/node.h"
#include "keel/backend/cuda_api.h"
#include "keel/io/safetensors.h"
#include "keel/train/trainer.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

bool sanitized() { return std::getenv("KEEL_TEST_SANITIZED") != nullptr; }

// A small, fast config on the built-in task.
Config small_config(const std::string& tag) {
  Config c;
  c.run.out_dir = test::temp_dir(tag);
  c.run.seed = 11;
  c.model.n_layer = 1;
  c.model.n_embd = 32;
  c.model.n_head = 2;
  c.data.digits = 2;
  c.data.num_examples = 256;
  c.data.eval_examples = 32;
  c.data.seq_len = 16;
  c.train.batch_size = 16;
  c.train.max_steps = 8;
  c.log.tensorboard = false;
  c.log.metrics = false;
  c.log.console = false;
  return c;
}

TEST(Trainer, WindowLossIsTheTokenMeanWhateverTheSplit) {
  // One batch of 16 examples vs a window of 4 micro-batches of 4 holding the same examples: the
  // loss and the gradients must agree (the loss is weighted by tokens, not by micro-batch count).
  Config one = small_config("split1");
  Trainer a(one);
  Config four = small_config("split4");
  four.train.batch_size = 4;
  four.train.grad_accum = 4;
  four.data.shuffle = false;
  one.data.shuffle = false;
  Trainer b(four);
  Trainer a2(one);
  const auto big = std::vector<data::Batch>{a2.loader().batch(0, 0)};
  std::vector<data::Batch> small;
  for (int i = 0; i < 4; ++i) small.push_back(b.loader().batch(0, i));
  int64_t tok_big = big[0].n_targets, tok_small = 0;
  for (auto& mb : small) tok_small += mb.n_targets;
  ASSERT_EQ(tok_big, tok_small);
  a2.optimizer().zero_grad();
  b.optimizer().zero_grad();
  const double la = a2.forward_backward(big, 1, 1.0) / tok_big;
  const double lb = b.forward_backward(small, 1, 1.0) / tok_small;
  EXPECT_NEAR(la, lb, 1e-6 * std::fabs(la));
  for (size_t i = 0; i < a2.trainable().size(); ++i)
    test::expect_close(b.trainable()[i].second.grad(), a2.trainable()[i].second.grad(), 1e-6, 1e-4,
                       a2.trainable()[i].first);
}

// Plays rank 1 of 2: all_gather reports rank 0 with a finite loss and a gradient for every
// parameter; all_reduce_grads sums nothing and records what it was handed and whether every value
// in it was 0.
class RankOneOfTwo final : public Collective {
 public:
  int rank() const override { return 1; }
  int world_size() const override { return 2; }
  std::string backend() const override { return "fake"; }
  void all_reduce_grads(std::vector<Tensor>& grads) override {
    handed.push_back(grads);
    bool zero = true;
    for (const Tensor& g : grads)
      for (float v : g.to_floats()) zero = zero && v == 0.f;
    all_zero.push_back(zero);
  }
  void all_reduce_sum(double*, size_t) override {}
  void all_reduce_max(double*, size_t) override {}
  void all_gather(const double* in, size_t n, double* out) override {
    std::memcpy(out + n, in, n * sizeof(double));
    std::memcpy(out, in, n * sizeof(double));
    if (n != 3 + trainable + rows) return;  // not the step's gather: rank 0 agrees
    out[0] = 1, out[1] = 0, out[2] = 1;     // loss sum, saw non-finite, norm
    for (size_t i = 3; i < 3 + trainable; ++i) out[i] = 1;
    // Rank 0's micro-batch holds rows 100, 101, ... (its other slots unused: -1).
    for (size_t i = 0; i < rows; ++i) out[3 + trainable + i] = i < 2 ? 100.0 + i : -1;
  }
  std::vector<std::vector<Tensor>> handed;
  std::vector<bool> all_zero;
  // The step's gather holds 3 + trainable (parameters the trainer updates) + rows (slots for
  // the rows of this rank's micro-batches: grad_accum x batch_size).
  size_t trainable = 0, rows = 0;
};

TEST(Trainer, ARankWithoutDataJoinsTheSumWithZerosInItsFlatHomes) {
  // train_step takes this rank's share of the window: one micro-batch in step 1, none in step 2
  // (a remainder window), where rank 1 joins rank 0's sum with zeros. They go into the flat
  // homes, whose values from step 1 zero_grad left behind, and the all-reduce is handed the whole
  // flat buffers (offset ranges), not one tensor per parameter.
  Config c = small_config("rank1of2");
  c.dist.check_every = 0;
  c.train.batch_size = 4;
  auto group = std::make_shared<RankOneOfTwo>();
  Trainer t(c, {}, group);
  group->trainable = t.trainable().size();
  group->rows = 4;
  const std::vector<Tensor> buffers = t.optimizer().flat_grad_buffers();
  ASSERT_FALSE(buffers.empty());
  const StepResult first = t.train_step({t.loader().batch(0, 1)}, 0);
  const StepResult second = t.train_step({}, 0);
  // Each step names the global window's rows, rank 0's micro-batch first (the 1-rank order).
  std::vector<int64_t> want = {100, 101};
  for (int64_t id : t.loader().batch(0, 1).example_ids) want.push_back(id);
  EXPECT_EQ(first.example_ids, want);
  EXPECT_EQ(second.example_ids, (std::vector<int64_t>{100, 101}));
  ASSERT_EQ(group->handed.size(), 2u);
  for (const std::vector<Tensor>& h : group->handed) {
    ASSERT_EQ(h.size(), buffers.size());
    for (size_t k = 0; k < h.size(); ++k) EXPECT_EQ(h[k].data(), buffers[k].data());
  }
  EXPECT_FALSE(group->all_zero[0]) << "step 1: rank 1 ran a micro-batch";
  EXPECT_TRUE(group->all_zero[1]) << "step 2: stale gradients of step 1 joined the sum";
  for (const auto& [name, p] : t.trainable()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    bool in_buffer = false;
    for (const Tensor& b : buffers) in_buffer |= p.grad().shares_storage(b);
    EXPECT_TRUE(in_buffer) << name << ": its zero gradient is not in its flat home";
  }
}

// Rank 1 of 2 whose own gradients, and rank 0's, are finite while their sum overflows: rank 0
// writes the capture (no rank saw it), and rank 1's stop said "on this rank;  saw the non-finite
// value and wrote it under ...", naming no rank.
class RankOneSumOverflows final : public Collective {
 public:
  int rank() const override { return 1; }
  int world_size() const override { return 2; }
  std::string backend() const override { return "fake"; }
  void all_reduce_grads(std::vector<Tensor>& grads) override {
    for (Tensor& g : grads) g.data_as<float>()[0] = INFINITY;  // the sum overflowed
  }
  void all_reduce_sum(double*, size_t) override {}
  void all_reduce_max(double*, size_t) override {}
  void all_gather(const double* in, size_t n, double* out) override {
    std::memcpy(out, in, n * sizeof(double));  // rank 0 reports what rank 1 does: all finite
    std::memcpy(out + n, in, n * sizeof(double));
  }
};

TEST(Trainer, ASumThatOverflowsOnEveryRankSaysWhichRankCaptured) {
  Config c = small_config("sum-overflows");
  c.dist.check_every = 0;
  c.train.batch_size = 4;
  TrainerHooks h;
  bool captured = false;
  h.on_capture = [&](const NonfiniteEvent&) {
    captured = true;
    return std::string("unused");
  };
  Trainer t(c, h, std::make_shared<RankOneSumOverflows>());
  const StepResult r = t.train_step({t.loader().batch(0, 1)}, 0);
  EXPECT_TRUE(r.found_inf);
  EXPECT_FALSE(captured) << "rank 0 writes it";
  EXPECT_CONTAINS(t.stop_message(),
                  "no capture written (on this rank; every rank's own gradients were finite, "
                  "their sum across ranks overflowed: rank 0 wrote it under ");
}

TEST(Trainer, RemainderWindowStepsWithAFiniteLoss) {
  // One example, accumulation 4: the only window holds one micro-batch (r = 1 < K = 4). Its loss
  // is the token mean of that micro-batch, not a quarter of it, and is finite.
  Config c = small_config("remainder");
  c.data.num_examples = 1;
  c.train.batch_size = 1;
  c.train.grad_accum = 4;
  c.train.max_steps = 0;
  c.train.epochs = 3;
  std::vector<StepResult> steps;
  TrainerHooks h;
  h.on_step = [&](const StepResult& r) { steps.push_back(r); };
  Trainer t(c, h);
  EXPECT_EQ(t.total_steps(), 3);
  EXPECT_EQ(t.fit(), 0);
  ASSERT_EQ(steps.size(), 3u);
  for (auto& r : steps) {
    EXPECT_EQ(r.micro_batches, 1);
    EXPECT_TRUE(r.stepped);
    EXPECT_TRUE(std::isfinite(r.loss));
    EXPECT_GT(r.loss, 1.0) << "a token mean over a 259-token vocabulary starts near ln(259)";
  }
}

TEST(Trainer, EpochLossIsTheTokenMeanOverTheAppliedSteps) {
  // 3 epochs of 5 steps, the last batch of each a remainder (72 examples, 16 per batch): each
  // epoch's loss is the token-weighted mean of its steps' losses, reported once per epoch at its
  // last step.
  Config c = small_config("epoch-loss");
  c.data.num_examples = 72;
  c.train.max_steps = 0;
  c.train.epochs = 3;
  std::vector<StepResult> steps;
  std::vector<EpochResult> epochs;
  TrainerHooks h;
  h.on_step = [&](const StepResult& r) { steps.push_back(r); };
  h.on_epoch = [&](const EpochResult& e) { epochs.push_back(e); };
  Trainer t(c, h);
  ASSERT_EQ(t.fit(), 0);
  ASSERT_EQ(epochs.size(), 3u);
  for (const EpochResult& e : epochs) {
    double sum = 0;
    int64_t tokens = 0, updates = 0, last = 0;
    for (const StepResult& r : steps)
      if (r.epoch == e.epoch && r.stepped) {
        sum += r.loss * static_cast<double>(r.tokens);
        tokens += r.tokens;
        ++updates;
        last = r.step;
      }
    EXPECT_EQ(e.updates, 5);
    EXPECT_EQ(e.updates, updates);
    EXPECT_EQ(e.tokens, tokens);
    EXPECT_EQ(e.step, last);
    EXPECT_NEAR(e.loss, sum / static_cast<double>(tokens), 1e-12 * e.loss);
  }
  EXPECT_LT(steps[4].tokens, steps[0].tokens) << "the remainder window holds 8 of 16 examples";
}

TEST(Trainer, ScalerSkipsKeepTheLrClockAndBackOff) {
  // 16-mixed with an initial scale of 2^40: the f16 gradients overflow, the scaler skips and
  // halves until the scale fits. Skipped steps do not advance the LR schedule (warmup here).
  Config c = small_config("scaler");
  c.train.precision = "16-mixed";
  c.scaler.init_scale = std::ldexp(1.0, 40);
  c.data.num_examples = 1024;  // an epoch longer than the back-off (an epoch of skips stops)
  c.sched.name = "linear";
  c.sched.warmup_steps = 4;
  c.train.max_steps = 40;
  std::vector<StepResult> steps;
  TrainerHooks h;
  h.on_step = [&](const StepResult& r) { steps.push_back(r); };
  h.on_capture = [](const NonfiniteEvent&) -> std::string {
    ADD_FAILURE() << "an overflow the scaler handles must never be captured";
    return "";
  };
  Trainer t(c, h);
  EXPECT_EQ(t.fit(), 0);
  int skipped = 0;
  double prev_scale = c.scaler.init_scale;
  for (auto& r : steps) {
    if (!r.stepped) {
      ++skipped;
      EXPECT_TRUE(r.found_inf);
      EXPECT_EQ(r.lr, 0.0) << "warmup factor 0/4: the schedule has not advanced";
      EXPECT_EQ(r.loss_scale_after, r.loss_scale * 0.5);
      EXPECT_EQ(r.skipped_steps, skipped);
      EXPECT_EQ(r.nan_steps, 0);
    }
    EXPECT_LE(r.loss_scale, prev_scale);
    prev_scale = r.loss_scale_after;
  }
  EXPECT_GE(skipped, 10) << "2^40 needs many halvings before f16 gradients fit";
  EXPECT_TRUE(steps.back().stepped);
  // The first applied step runs at the schedule's step 0.
  for (auto& r : steps)
    if (r.stepped) {
      EXPECT_EQ(r.lr, 0.0);
      break;
    }
}

// Poisons one weight with NaN so that every step is non-finite.
void poison(Trainer& t) {
  NoGradGuard g;
  Tensor w = t.model().find_parameter("transformer.h.0.mlp.c_fc.weight");
  ASSERT_TRUE(w.defined());
  w.data_as<float>()[3] = std::numeric_limits<float>::quiet_NaN();
}

TEST(Trainer, EveryStepNonFiniteStopsWithTheMessage) {
  Config c = small_config("allnan");
  c.train.on_nonfinite = "skip";
  c.train.max_steps = 0;
  c.train.epochs = 2;
  std::vector<StepResult> steps;
  TrainerHooks h;
  h.on_step = [&](const StepResult& r) { steps.push_back(r); };
  Trainer t(c, h);
  poison(t);
  try {
    t.fit();
    FAIL() << "expected a stop";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("every step produced non-finite gradients"),
              std::string::npos)
        << e.what();
    // The weights were poisoned before the first step: no update was ever applied, so the advice
    // must not send the user after the learning rate.
    EXPECT_CONTAINS(e.what(), "the learning rate is not the cause");
    EXPECT_EQ(std::string(e.what()).find("lower the learning rate"), std::string::npos) << e.what();
    // Under 32-true, precision is not the cause: it said "switch precision to bf16-mixed or
    // 32-true" to a 32-true run.
    EXPECT_CONTAINS(e.what(), "under 32-true the weights or the data are the suspects");
    EXPECT_NOT_CONTAINS(e.what(), "switch train.precision");
  }
  // Under bf16-mixed, the one wider policy is named.
  c.train.precision = "bf16-mixed";
  Trainer b(c, {});
  poison(b);
  const std::string m = test::error_of([&] { b.fit(); });
  EXPECT_CONTAINS(m, "every step produced non-finite gradients");
  EXPECT_CONTAINS(m, "or switch train.precision to 32-true");
  ASSERT_FALSE(steps.empty());
  for (auto& r : steps) {
    EXPECT_FALSE(r.stepped);
    EXPECT_TRUE(r.found_inf);
    EXPECT_FALSE(std::isfinite(r.grad_norm)) << "a non-finite norm is reported, never 0";
  }
  EXPECT_EQ(steps.back().nan_steps, static_cast<int64_t>(steps.size()));
}

TEST(Trainer, CaptureStopsWithExitCode3AndNamesTheParameter) {
  Config c = small_config("capture");
  NonfiniteEvent seen;
  int captures = 0;
  TrainerHooks h;
  h.on_capture = [&](const NonfiniteEvent& ev) {
    seen = ev;
    ++captures;
    return std::string("/tmp/capture-dir");
  };
  Trainer t(c, h);
  poison(t);
  EXPECT_EQ(t.fit(), 3);
  EXPECT_EQ(captures, 1);
  EXPECT_EQ(seen.step, 1);
  EXPECT_FALSE(seen.nonfinite_params.empty());
  EXPECT_NE(t.stop_message().find("step 1"), std::string::npos) << t.stop_message();
  EXPECT_NE(t.stop_message().find("/tmp/capture-dir"), std::string::npos) << t.stop_message();
  EXPECT_NE(t.stop_message().find("keel replay"), std::string::npos) << t.stop_message();
}

TEST(Trainer, AbortStopsWithoutCapture) {
  Config c = small_config("abort");
  c.train.on_nonfinite = "abort";
  TrainerHooks h;
  h.on_capture = [](const NonfiniteEvent&) -> std::string {
    ADD_FAILURE() << "abort must not capture";
    return "";
  };
  Trainer t(c, h);
  poison(t);
  EXPECT_EQ(t.fit(), 3);
  EXPECT_NE(t.stop_message().find("abort"), std::string::npos);
}

struct Interrupt {};

TEST(Trainer, ResumeContinuesBitIdentically) {
  auto losses_of = [](Config c, int64_t stop_after, bool resume) {
    c.run.resume = resume;
    std::vector<double> losses;
    TrainerHooks h;
    h.on_step = [&](const StepResult& r) {
      if (stop_after > 0 && r.step > stop_after) throw Interrupt{};
      losses.push_back(r.loss);
    };
    Trainer t(c, h);
    try {
      t.fit();
    } catch (const Interrupt&) {
    }
    return losses;
  };
  Config c = small_config("resume");
  c.train.max_steps = 8;
  c.log.checkpoint_every = 3;
  c.model.dropout = 0.1;            // dropout masks must replay too
  c.model.attention_dropout = 0.1;  // the attention probabilities' as well
  Config straight = c;
  straight.run.out_dir = test::temp_dir("resume-straight");
  const auto full = losses_of(straight, 0, false);
  ASSERT_EQ(full.size(), 8u);
  const auto first = losses_of(c, 3, false);  // "crashes" during step 4, after step 3's checkpoint
  ASSERT_EQ(first.size(), 3u);
  const auto rest = losses_of(c, 0, true);
  ASSERT_EQ(rest.size(), 5u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(first[i], full[i]) << "step " << i + 1;
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(rest[i], full[i + 3]) << "step " << i + 4 << " after resume";
}

// A checkpoint whose optimizer state or scaler state is damaged names its file (these errors used
// to read "AdamW::load_state: missing entry 'step'", with no file).
TEST(Trainer, ADamagedOptimizerOrScalerStateNamesTheCheckpointFile) {
  Config c = small_config("damaged-state");
  c.train.precision = "16-mixed";  // a scaler, whose state trainer.json holds
  c.data.eval_examples = 0;
  const std::string dir = c.run.out_dir + "/ck";
  Trainer(c).save_checkpoint(dir);
  const std::string opt_file = dir + "/optimizer.safetensors";
  const auto good = io::read_safetensors(opt_file).tensors;
  std::vector<std::pair<std::string, Tensor>> without_step;
  for (const auto& [name, t] : good)
    if (name != "step") without_step.emplace_back(name, t.clone());
  io::write_safetensors(opt_file, without_step);
  std::string m = test::error_of([&] { Trainer(c).load_checkpoint(dir); });
  EXPECT_CONTAINS(m, opt_file + ": AdamW state: missing entry 'step'");
  EXPECT_CONTAINS(m, "resume from another one");
  EXPECT_EQ(m.find("::"), std::string::npos) << m;

  Trainer(c).save_checkpoint(dir);
  const std::string tj = dir + "/trainer.json";
  nlohmann::json st = nlohmann::json::parse(test::slurp(tj));
  st["scaler"].erase("scale");
  std::ofstream(tj) << st.dump();
  m = test::error_of([&] { Trainer(c).load_checkpoint(dir); });
  EXPECT_CONTAINS(m, tj + ": \"scaler\": ");
  EXPECT_CONTAINS(m, "the loss scaler's state: missing key 'scale'");
  EXPECT_EQ(m.find("::"), std::string::npos) << m;  // it named "GradScaler::load_state_dict"
}

// A 16-mixed checkpoint without a scaler's state resumed a fresh scaler without a word, and one
// with a state under a run whose scaler is off dropped it silently: both are said.
TEST(Trainer, AResumeThatStartsOrDropsTheLossScalerSaysSo) {
  Config c = small_config("scaler-state");
  c.train.precision = "16-mixed";
  c.data.eval_examples = 0;
  const std::string dir = c.run.out_dir + "/ck";
  Trainer(c).save_checkpoint(dir);
  auto said_on_load = [&](const Config& cfg) {
    std::string said;
    TrainerHooks h;
    h.on_message = [&](const std::string& m) { said += m + "\n"; };
    Trainer t(cfg, h);
    t.load_checkpoint(dir);
    return said;
  };
  EXPECT_NOT_CONTAINS(said_on_load(c), "scale");
  Config off = c;
  off.scaler.enabled = false;
  EXPECT_CONTAINS(said_on_load(off),
                  "/ck/trainer.json holds a loss scale of 65536.0 that this "
                  "run drops: scaler.enabled = false now");
  const std::string tj = dir + "/trainer.json";
  nlohmann::json st = nlohmann::json::parse(test::slurp(tj));
  st.erase("scaler");
  std::ofstream(tj) << st.dump();
  EXPECT_CONTAINS(said_on_load(c),
                  "/ck/trainer.json holds no loss-scaler state (its run had "
                  "scaler.enabled = false, or the file lost it): the scaler "
                  "starts afresh at scaler.init_scale = 65536.0");
}

TEST(Trainer, DeterministicAcrossRuns) {
  auto run = [] {
    Config c = small_config("det");
    std::vector<double> losses;
    TrainerHooks h;
    h.on_step = [&](const StepResult& r) {
      losses.push_back(r.loss);
      losses.push_back(r.grad_norm);
    };
    Trainer t(c, h);
    t.fit();
    return losses;
  };
  EXPECT_EQ(run(), run());
}

// model.attention_dropout drops attention probabilities while training, in both families and
// every attention backend: the first step's loss moves (the initial weights are the same), the
// loss still falls, a second run draws the same masks, and evaluation drops nothing (the same
// weights evaluate alike with and without it).
TEST(Trainer, AttentionDropoutDropsWhileTrainingOnly) {
  for (const char* family : {"gpt2", "llama"})
    for (const char* backend : {"eager", "math", "flash"}) {
      const std::string what = std::string(family) + " " + backend;
      auto run = [&](double p, std::vector<double>& losses) {
        Config c = small_config(std::string("attn-drop-") + family + backend);
        c.model.family = family;
        c.model.attention = backend;
        c.model.attention_dropout = p;
        c.train.max_steps = 12;
        TrainerHooks h;
        h.on_step = [&](const StepResult& r) { losses.push_back(r.loss); };
        Trainer t(c, h);
        const double before = t.evaluate().loss;
        EXPECT_EQ(t.fit(), 0) << what;
        return before;
      };
      std::vector<double> plain, dropped, again;
      const double eval_plain = run(0, plain), eval_dropped = run(0.2, dropped);
      run(0.2, again);
      EXPECT_EQ(eval_plain, eval_dropped) << what << ": evaluation must not drop";
      ASSERT_EQ(dropped.size(), 12u) << what;
      EXPECT_NE(plain[0], dropped[0]) << what << ": the first step's loss must see the dropout";
      EXPECT_EQ(dropped, again) << what << ": one seed, one set of masks";
      EXPECT_LT(dropped.back(), 0.9 * dropped.front()) << what << ": the loss must fall";
    }
}

// Each precision policy trains the built-in task; the mixed policies end within 5% of 32-true.
TEST(Trainer, EveryPolicyTrainsTheBuiltinTask) {
  const int64_t steps = sanitized() ? 40 : 200;
  std::map<std::string, double> eval_loss;
  for (const char* p : {"32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"}) {
    Config c = small_config(std::string("policy-") + p);
    c.train.precision = p;
    c.train.max_steps = steps;
    c.optim.lr = 1e-2;
    c.sched.warmup_steps = 10;
    // Pure f16 AdamW state underflows: eps = 1e-8 is 0 in f16 and v = g^2 flushes, so the update
    // divides by zero (as model.half() with torch.optim.AdamW does). fp16 Adam needs eps >= 1e-4.
    if (std::string(p) == "16-true") c.optim.adamw.eps = 1e-4;
    std::vector<double> losses;
    TrainerHooks h;
    h.on_step = [&](const StepResult& r) { losses.push_back(r.loss); };
    h.on_eval = [&](const EvalResult& e) { eval_loss[p] = e.loss; };
    Trainer t(c, h);
    ASSERT_EQ(t.fit(), 0) << p << ": " << t.stop_message();
    ASSERT_EQ(static_cast<int64_t>(losses.size()), steps);
    double head = 0, tail = 0;
    for (int i = 0; i < 10; ++i) head += losses[i] / 10, tail += losses[losses.size() - 1 - i] / 10;
    EXPECT_LT(tail, head * (sanitized() ? 0.9 : 0.8))
        << p << ": the loss must fall (first 10 steps " << head << ", last 10 " << tail << ")";
    if (std::string(p) == "bf16-true" || std::string(p) == "16-true") continue;
    EXPECT_TRUE(std::isfinite(eval_loss[p])) << p;
  }
  if (!sanitized()) {  // the short sanitizer run only checks that every policy learns
    for (const char* p : {"bf16-mixed", "16-mixed"}) {
      EXPECT_NEAR(eval_loss[p], eval_loss["32-true"], 0.05 * eval_loss["32-true"]) << p;
    }
  }
}

// Exact match on the built-in task: evaluate() (the generation loop, with its key/value cache)
// counts the held-out problems whose greedy answer, cut at the newline, is the answer's text. The
// reference decodes here without a cache, re-running the whole sequence for each token. The run is
// trained until some answers are right and some wrong, so neither 0 nor 1 passes.
TEST(Trainer, ExactMatchCountsTheGreedyAnswersThatAreRight) {
  Config c = small_config("exact-match");
  c.data.eval_examples = 64;
  c.data.digits = 1;
  c.train.max_steps = sanitized() ? 60 : 120;
  c.optim.lr = 1e-2;
  Trainer t(c);
  ASSERT_EQ(t.fit(), 0) << t.stop_message();
  const keel::Run& run = t.run();
  NoGradGuard no_grad;
  t.model().train(false);
  int64_t right = 0;
  for (size_t i = 0; i < run.data.eval_prompts.size(); ++i) {
    std::vector<int32_t> ids = t.tokenizer().encode(run.data.eval_prompts[i]);
    std::vector<int32_t> answer;
    for (int64_t k = 0; k < run.data.max_answer_tokens; ++k) {
      const int64_t n = static_cast<int64_t>(ids.size());
      Tensor logits = t.model().forward(
          Tensor::from_ints(std::vector<int64_t>(ids.begin(), ids.end()), {1, n}), Tensor());
      const std::vector<float> row = logits.view({n, -1}).slice_rows(n - 1, n).to_floats();
      const int32_t best =
          static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
      if (best == run.data.stop_token) break;
      answer.push_back(best);
      ids.push_back(best);
    }
    right += t.tokenizer().decode(answer) == run.data.eval_answers[i];
  }
  const EvalResult e = t.evaluate();
  ASSERT_EQ(e.examples, 64);
  EXPECT_GT(right, 0);
  EXPECT_LT(right, 64);
  EXPECT_DOUBLE_EQ(e.accuracy, static_cast<double>(right) / 64);
}

TEST(Trainer, BadConfigsGiveClearErrors) {
  Config c = small_config("bad");
  c.data.task = "text";
  c.data.path = "/nonexistent/corpus.txt";
  try {
    Trainer t(c);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/corpus.txt"), std::string::npos) << e.what();
  }
  c = small_config("bad2");
  c.model.attention = "sdpa";
  EXPECT_THROW(Trainer t(c), Error);
  c = small_config("bad3");
  c.run.device = "cuda:0";
  if (!cuda::status().usable) {  // one line, then the CPU (tests/cuda checks the line)
    Trainer t(c);
    EXPECT_TRUE(t.device().is_cpu());
  }
}

}  // namespace
}  // namespace keel
