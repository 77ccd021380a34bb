// End to end through the keel binary (issue 4 "Tests"): real failures, each one trained until it
// stops (exit 3), with the tracer's producing module, the NaN capture on disk, `keel replay`
// reproducing the step bit for bit, and `--bisect` naming the cause:
//   (a) an f16 overflow in an MLP output from large activations (no injection),
//   (b) an exploding learning rate under bf16-mixed (attention scores overflow in forward),
//   (c) a non-finite value in what a step reads: a NaN embedding row that only the batches holding
//       its token reach,
//   (d) an injected NaN in one attention module at step 5.
// Plus: an ordinary 16-mixed overflow is handled by the scaler and never captured; nan_capture =
// false stops without writing; malformed captures get errors naming the file. (The memory
// estimate against real runs' peak RSS: test_cli_memory_rss.cpp.)
//
// Every run uses one OpenMP thread (fast and steady on a shared machine; replay re-runs on the
// captured thread count either way).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "keel/io/safetensors.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using Ran = test::KeelRun;
using test::run_keel;
using test::slurp;
using test::with_sets;

// A small GPT-2 on the built-in task; `out` is the run's out_dir.
std::vector<std::string> small_gpt2(const std::string& out) {
  return {"run.out_dir=" + out,    "run.threads=1",      "model.n_layer=2",
          "model.n_embd=64",       "model.n_head=4",     "data.num_examples=256",
          "data.eval_examples=0",  "train.batch_size=8", "data.seq_len=32",
          "log.tensorboard=false", "log.every=1"};
}

using test::step_records;

json replay_json(const std::string& capture, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {"replay", capture, "--json"};
  args.insert(args.end(), extra.begin(), extra.end());
  Ran r = run_keel(args);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  try {
    return json::parse(r.out);
  } catch (const json::exception& e) {
    ADD_FAILURE() << "replay --json printed no JSON: " << r.out << r.err;
    return json::object();
  }
}

// What every scenario checks of a run that stopped on a non-finite step: exit 3, ONE message
// naming the step, the capture path and the replay command, and the capture's files.
std::string expect_captured_stop(const Ran& r, const std::string& out_dir, int64_t* step) {
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  const std::string capture = out_dir + "/debug/nan_capture/rank0";
  EXPECT_TRUE(fs::is_directory(capture)) << r.err;
  for (const char* f :
       {"capture.json", "model.safetensors", "optimizer.safetensors", "microbatches.safetensors"})
    EXPECT_TRUE(fs::exists(capture + "/" + f)) << f;
  const size_t at = r.err.find("stopped: step ");
  EXPECT_NE(at, std::string::npos) << r.err;
  EXPECT_NE(r.err.find("capture written to " + capture + "; replay with: keel replay " + capture),
            std::string::npos)
      << r.err;
  const json meta = json::parse(slurp(capture + "/capture.json"));
  *step = meta.at("step").get<int64_t>();
  if (at != std::string::npos) {
    EXPECT_EQ(r.err.compare(at, 14 + std::to_string(*step).size() + 1,
                            "stopped: step " + std::to_string(*step) + ":"),
              0)
        << r.err;
  }
  EXPECT_EQ(meta.at("threads").get<int>(), 1);
  EXPECT_EQ(meta.at("format").get<std::string>(), "keel-nan-capture");
  EXPECT_EQ(meta.at("loss_bits").get<std::string>().size(), 18u);  // "0x" + 16 hex digits
  return capture;
}

// The tracer's log of a training run names the producing module.
void expect_log_names(const std::string& out_dir, const std::string& module,
                      const std::string& type) {
  const std::string log = slurp(out_dir + "/debug/underflow_overflow_rank0.log");
  EXPECT_NE(log.find("produced by '" + module + "' (" + type + ")"), std::string::npos) << log;
}

void expect_reproduced(const json& j, const std::string& module, const std::string& type,
                       const std::string& tensor) {
  EXPECT_TRUE(j.value("reproduced", false)) << j.dump(2);
  EXPECT_TRUE(j.value("bit_exact", false)) << j.dump(2);
  EXPECT_TRUE(j.value("loss_bit_exact", false)) << j.dump(2);
  EXPECT_TRUE(j.value("grads_bit_exact", false)) << j.dump(2);
  EXPECT_EQ(j.value("first_module", std::string("?")), module) << j.dump(2);
  EXPECT_EQ(j.value("first_module_type", std::string("?")), type) << j.dump(2);
  EXPECT_EQ(j.value("first_phase", std::string("?")), "forward") << j.dump(2);
  EXPECT_EQ(j.value("first_tensor", std::string("?")), tensor) << j.dump(2);
}

// The bisect's list, as change -> finite.
std::map<std::string, bool> bisect_of(const json& j) {
  std::map<std::string, bool> m;
  for (const json& t : j.value("bisect", json::array()))
    m[t.at("change").get<std::string>()] = t.at("finite").get<bool>();
  return m;
}

// (a) A model whose activations outgrow f16: init_std 10 (as a checkpoint pretrained in bf16 can
// have) and a wide MLP whose c_proj sums 16384 products, trained in 16-true. The attention scores
// stay below 65504; the MLP's output projection does not, at the first step. Nothing is injected:
// the f16 rounding of real arithmetic overflows.
TEST(CliNan, F16OverflowInMlpOutputIsCapturedReplayedAndBisectedToBf16) {
  const std::string dir = test::temp_dir("cli-nan-a");
  Ran t = run_keel(with_sets({"train"}, [&] {
    auto s = small_gpt2(dir + "/traced");
    s.insert(s.end(),
             {"train.precision=16-true", "model.init_std=10", "model.intermediate_size=16384",
              "train.max_steps=3", "debug.underflow_overflow.enabled=true"});
    return s;
  }()));
  int64_t step = 0;
  const std::string capture = expect_captured_stop(t, dir + "/traced", &step);
  EXPECT_EQ(step, 1);
  EXPECT_NE(t.err.find("non-finite loss"), std::string::npos) << t.err;
  expect_log_names(dir + "/traced", "transformer.h.0.mlp.c_proj", "Linear");

  const json j = replay_json(capture, {"--bisect"});
  expect_reproduced(j, "transformer.h.0.mlp.c_proj", "Linear", "output");
  EXPECT_EQ(j.value("precision", std::string()), "16-true");
  const auto b = bisect_of(j);
  // Attention is not the producer, and 16-mixed still rounds the MLP output to f16.
  EXPECT_EQ(b.count("attention=math"), 1u);
  EXPECT_FALSE(b.at("attention=math"));
  EXPECT_FALSE(b.at("precision=16-mixed"));
  EXPECT_TRUE(b.at("precision=bf16-mixed"));
  EXPECT_TRUE(b.at("precision=32-true"));
  EXPECT_EQ(j.value("cause", std::string()), "precision=bf16-mixed") << j.dump(2);
  EXPECT_NE(j.value("explanation", std::string()).find("65504"), std::string::npos);

  // Another precision is a different computation: finite, and not bit-exact.
  const json f32 = replay_json(capture, {"--precision", "32-true"});
  EXPECT_FALSE(f32.value("reproduced", true)) << f32.dump(2);
  EXPECT_FALSE(f32.value("bit_exact", true));
  EXPECT_EQ(f32.value("precision", std::string()), "32-true");
  EXPECT_TRUE(f32.value("first_module", std::string("?")).empty());
  // Nothing of the original run was rewritten by the replays.
  EXPECT_TRUE(fs::exists(capture + "/replay/debug/underflow_overflow_rank0.log"));
  EXPECT_EQ(json::parse(slurp(capture + "/capture.json")).at("step").get<int64_t>(), step);
}

// (b) An exploding learning rate: AdamW at lr 1e6 under bf16-mixed (clipping on, as by default).
// Decoupled weight decay multiplies every decayed weight by (1 - lr*wd) = -9999 per step, so the
// weights' magnitudes are set by the decay, not by the signs of the gradients: step 1 is sane,
// the loss climbs by orders of magnitude on steps 2-3, and on step 4 the attention scores (which
// grow with the fourth power of the weights) leave f32's and bf16's range inside
// transformer.h.0.attn, between its children: the loss is NaN. Step 3's grad norm is ~1e11, eight
// decades below the 1.8e19 where the norm's f32 sum of squares overflows.
//
// Why not lr 1000 (-9 per step): there the grad norm reached ~3e18 on step 3, within 7x of that
// overflow, and the run ends either on a gradient element overflowing in some Linear's backward or
// on the norm alone, depending on the last bits of a diverging run: oneDNN's bf16 matmul differs
// per CPU (AMX, AVX-512 BF16, AVX2: the loss bits differ between ONEDNN_MAX_CPU_ISA settings on
// the same machine), so the outcome changed with the machine, not with anything in keel. At lr 1e6
// every oneDNN ISA and seed tried (1-3) stops at step 4 in transformer.h.0.attn.
TEST(CliNan, ExplodingLearningRateInBf16MixedIsDivergedParameters) {
  const std::string dir = test::temp_dir("cli-nan-b");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(), {"train.precision=bf16-mixed", "optim.lr=1e6", "train.max_steps=40",
                           "debug.underflow_overflow.enabled=true"});
  Ran r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  EXPECT_EQ(step, 4);
  EXPECT_NE(r.err.find("stopped: step 4: non-finite loss (nan)"), std::string::npos) << r.err;
  const auto recs = step_records(dir);
  ASSERT_EQ(recs.size(), 4u);
  EXPECT_LT(recs[0].at("loss").get<double>(), 10) << "step 1 is sane";
  EXPECT_GT(recs[2].at("loss").get<double>(), 1e12) << "the loss exploded before the NaN";
  EXPECT_LT(recs[2].at("grad_norm").get<double>(), 1e15) << "far from the norm's f32 overflow";
  const json meta = json::parse(slurp(capture + "/capture.json"));
  EXPECT_FALSE(meta.at("loss_finite").get<bool>());
  EXPECT_TRUE(meta.at("nonfinite_param_values").empty()) << "huge weights, but finite ones";
  expect_log_names(dir, "transformer.h.0.attn", "GPT2Attention");

  const json j = replay_json(capture, {"--bisect"});
  expect_reproduced(j, "transformer.h.0.attn", "GPT2Attention",
                    "input[0] of transformer.h.0.attn.c_proj");
  // No numerics change fixes it: the model diverged before the step.
  EXPECT_EQ(j.at("bisect").size(), 2u);  // attention=math, precision=32-true
  const auto b = bisect_of(j);
  EXPECT_FALSE(b.at("attention=math"));
  EXPECT_FALSE(b.at("precision=32-true"));
  EXPECT_EQ(j.value("cause", std::string()), "diverged-parameters") << j.dump(2);
  EXPECT_NE(j.value("explanation", std::string()).find("optim.lr"), std::string::npos);
  EXPECT_NE(j.value("explanation", std::string()).find("1 - lr*wd = -9999"), std::string::npos)
      << j.value("explanation", std::string());
}

// examples/all-nonfinite's run (optim.lr 1e4 in 16-true) captured at its first non-finite step:
// every weight is ~1e4 after step 1. Under 32-true the step is finite, with a loss of ~9e8: the
// model diverged, so the learning rate is the cause, not the precision (bisect said
// "precision=32-true: low-precision compute under 16-true produces it").
TEST(CliNan, ADivergedModelFiniteInAWiderFormatIsNotBlamedOnThePrecision) {
  const std::string dir = test::temp_dir("cli-nan-lr-16true");
  Ran r = run_keel(
      {"train", std::string(KEEL_SOURCE_DIR) + "/examples/all-nonfinite/config.toml", "--set",
       "run.out_dir=" + dir, "--set", "train.on_nonfinite=capture", "--set", "run.threads=1"},
      {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  const json j = replay_json(capture, {"--bisect"});
  EXPECT_TRUE(j.value("reproduced", false)) << j.dump(2);
  bool wider_ran = false;
  for (const json& t : j.at("bisect"))
    if (t.at("change") == "precision=32-true" && t.at("finite").get<bool>()) {
      wider_ran = true;
      EXPECT_GT(t.at("loss").get<double>(), 1e4) << t.dump();
      EXPECT_TRUE(t.at("diverged").get<bool>()) << t.dump();
    }
  EXPECT_TRUE(wider_ran) << j.dump(2);
  EXPECT_EQ(j.value("cause", std::string()), "diverged-parameters") << j.dump(2);
  EXPECT_CONTAINS(j.value("explanation", std::string()), "lower optim.lr");
  EXPECT_CONTAINS(j.value("explanation", std::string()),
                  "precision=32-true leaves this step finite with a loss of");
  // Its f16 second moment flushed too, but lr 1e4 makes 1e4 weights in one update whatever it
  // holds: the flushed moment is not named as the cause, by bisect or by the run's stop.
  EXPECT_NOT_CONTAINS(j.value("explanation", std::string()), "exp_avg_sq");
  EXPECT_NOT_CONTAINS(r.err, "exp_avg_sq");
}

// optim.lr = 1 under 16-mixed (the scaler on, clipping on): the first update takes the loss from
// 5.5 to ~22, and a few steps later the loss is NaN (captured). Under attention=math the step is
// finite, but its loss is ~25, far above the uniform guess ln V = 5.56: the model the updates
// destroyed, not the attention backend. Bisect named attention=math the cause ("the attention
// scores overflow ...; model.attention = math"), a fix that keeps training a diverged model.
TEST(CliNan, ALearningRateDivergenceIsNotBlamedOnTheAttentionBackend) {
  const std::string dir = test::temp_dir("cli-nan-lr1-16mixed");
  Ran r =
      run_keel(with_sets({"train"},
                         {"run.out_dir=" + dir, "run.threads=1", "log.tensorboard=false",
                          "log.every=1", "train.precision=16-mixed", "optim.lr=1",
                          "train.max_steps=40", "data.num_examples=1280", "data.eval_examples=0"}),
               {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  EXPECT_GT(step, 2) << "updates were applied before the non-finite step";
  const json j = replay_json(capture, {"--bisect"});
  EXPECT_TRUE(j.value("reproduced", false)) << j.dump(2);
  bool finite_trial = false;
  for (const json& t : j.at("bisect"))
    if (t.at("finite").get<bool>()) {
      finite_trial = true;
      EXPECT_GT(t.at("loss").get<double>(), 1.5 * std::log(259.0)) << t.dump();
      EXPECT_TRUE(t.at("diverged").get<bool>()) << t.dump();
    }
  EXPECT_TRUE(finite_trial) << j.dump(2);
  EXPECT_EQ(j.value("cause", std::string()), "diverged-parameters") << j.dump(2);
  const std::string why = j.value("explanation", std::string());
  EXPECT_CONTAINS(why, "the parameters themselves have diverged");
  EXPECT_CONTAINS(why, "updates were applied): lower optim.lr");
  EXPECT_CONTAINS(why, "above 1.5 x the uniform guess ln V = 5.56");
  EXPECT_NOT_CONTAINS(why, "model.attention");
}

// A LoRA on c_attn at optim.lr 1e4 under bf16-mixed: decoupled decay (1 - lr*wd = -99) takes the
// adapter's weights to ~1e8 in 3 updates, the attention saturates and the loss stays near 5.8
// while the step's gradient norm overflows. attention=math, 32-true and adapter=none each leave
// the step finite; bisect named attention=math the cause (a run with it diverges all the same),
// and had it been alone, adapter=none ("the adapter's update produces it (check its rank/alpha)").
TEST(CliNan, AnAdapterDivergedByTheLearningRateIsNotBlamedOnTheBackendOrTheAdapter) {
  const std::string dir = test::temp_dir("cli-nan-lora-lr");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(), {"model.adapter.kind=lora", "model.adapter.target_modules=[\"c_attn\"]",
                           "optim.lr=1e4", "train.precision=bf16-mixed", "train.max_steps=20"});
  Ran r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  EXPECT_GT(step, 1) << "updates were applied before the non-finite step";
  const json j = replay_json(capture, {"--bisect"});
  EXPECT_TRUE(j.value("reproduced", false)) << j.dump(2);
  EXPECT_GT(j.value("largest_weight", 0.0), 1e4) << j.dump(2);
  for (const json& t : j.at("bisect"))
    EXPECT_TRUE(!t.at("finite").get<bool>() || t.at("diverged").get<bool>()) << t.dump();
  EXPECT_EQ(j.value("cause", std::string()), "diverged-parameters") << j.dump(2);
  const std::string why = j.value("explanation", std::string());
  EXPECT_CONTAINS(why, "lora_B.weight); the run diverged before this step");
  EXPECT_CONTAINS(why, "lower optim.lr");
  EXPECT_NOT_CONTAINS(why, "model.attention");
  EXPECT_NOT_CONTAINS(why, "rank/alpha");
}

// scaler.init_scale = 1e30 under 16-mixed: every step's scaled f16 gradients overflow, the scale
// backs off 32 times (still 2.3e20) and the run stops, the scaler unable to settle. Bisect named
// precision=bf16-mixed ("a value exceeds f16's range"): it is finite only because bf16-mixed has
// no scaler. The smallest change is the loss scale, and the fix the user's own key.
// A LoRA at optim.lr 300 under 16-mixed: AdamW's first update sets the adapters' weights to about
// +-300 (8000x their initial RMS), and step 2 overflows f16. The run's advice says "lower
// optim.lr ... no train.precision survives that"; bisect named precision=bf16-mixed, which only
// keeps the wrecked model finite (its loss stays near ln V: the loss alone does not show it).
TEST(CliNan, ALoraWreckedByOneUpdateIsNotBlamedOnThePrecision) {
  const std::string dir = test::temp_dir("cli-nan-lora-lr");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(), {"model.adapter.kind=lora",
                           "model.adapter.target_modules=[\"c_attn\", "
                           "\"c_proj\"]",
                           "train.precision=16-mixed", "optim.lr=300", "train.max_steps=20"});
  Ran r = run_keel(with_sets({"train"}, sets));
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  EXPECT_EQ(step, 2);
  EXPECT_CONTAINS(r.output, "lower optim.lr");
  const json j = replay_json(capture, {"--bisect"});
  EXPECT_TRUE(j.value("bit_exact", false)) << j.dump(2);
  EXPECT_EQ(j.value("cause", std::string()), "diverged-parameters") << j.dump(2);
  EXPECT_CONTAINS(j.value("explanation", std::string()), "lower optim.lr");
  EXPECT_CONTAINS(j.value("explanation", std::string()),
                  "precision=bf16-mixed leaves this step finite with a loss of");
}

// `keel replay CAPTURE --out RUN` wrote the replay's tracer log over the run's own
// (RUN/debug/underflow_overflow_rank0.log) without a word: a keel run's out_dir is refused.
TEST(CliNan, ReplayRefusesToWriteIntoARunsOutDir) {
  const std::string dir = test::temp_dir("cli-nan-out");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(),
              {"train.precision=16-true", "model.init_std=10", "model.intermediate_size=16384",
               "train.max_steps=3", "debug.underflow_overflow.enabled=true"});
  Ran r = run_keel(with_sets({"train"}, sets));
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  const std::string log = slurp(dir + "/debug/underflow_overflow_rank0.log");
  Ran rp = run_keel({"replay", capture, "--out", dir});
  EXPECT_EQ(rp.code, 2) << rp.output;
  EXPECT_CONTAINS(rp.err, "replay --out " + dir + ": a keel run's out_dir");
  EXPECT_EQ(slurp(dir + "/debug/underflow_overflow_rank0.log"), log);
  const json j = replay_json(capture, {"--out", dir + "/elsewhere"});
  EXPECT_TRUE(j.value("bit_exact", false)) << j.dump(2);
}

TEST(CliNan, AHugeInitialLossScaleIsBisectedToTheScale) {
  const std::string dir = test::temp_dir("cli-nan-init-scale");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(),
              {"train.precision=16-mixed", "scaler.init_scale=1e30", "train.max_steps=40"});
  Ran r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  const json j = replay_json(capture, {"--bisect"});
  EXPECT_TRUE(j.value("reproduced", false)) << j.dump(2);
  EXPECT_TRUE(bisect_of(j).at("loss_scale=65536")) << j.dump(2);
  EXPECT_EQ(j.value("cause", std::string()), "loss_scale=65536") << j.dump(2);
  const std::string why = j.value("explanation", std::string());
  EXPECT_CONTAINS(why, "lower scaler.init_scale (now 1e+30");
  EXPECT_NOT_CONTAINS(why, "bf16");
}

// The same run's stop: its advice said "find the module ..., then switch train.precision to
// bf16-mixed or 32-true" and the stop line "lower scaler.init_scale if the scale started far above
// 65536", of a start both knew was 1e30 (the "loss scale" finding at step 4 had named it). Both now
// lead with the key and its value.
TEST(CliNan, AHugeInitialLossScaleIsNamedByTheStopAndItsAdvice) {
  const std::string dir = test::temp_dir("cli-nan-init-scale-stop");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(),
              {"train.precision=16-mixed", "scaler.init_scale=1e30", "train.max_steps=40"});
  Ran r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  expect_captured_stop(r, dir, &step);
  EXPECT_CONTAINS(r.out + r.err,
                  "advice: exploding: non-finite gradients at step " + std::to_string(step) +
                      "; lower scaler.init_scale (now 1e+30; PyTorch's default 65536)");
  EXPECT_CONTAINS(r.err,
                  "; lower scaler.init_scale (now 1e+30; PyTorch's default 65536): every step "
                  "overflowed at a scale still above 65536");
  EXPECT_NOT_CONTAINS(r.out + r.err, "if the scale started far above");
  EXPECT_NOT_CONTAINS(r.out + r.err, "32-true");
}

// A checkpoint with one huge but finite weight: model.layers.1.mlp.up_proj.weight[0, 5] = 1e5, as
// written by keel init-model and edited (a bad merge, a conversion that scaled one tensor). It
// loads (the value is finite in f32), and under 16-mixed the first step is NaN: autocast rounds
// the weight to f16, where 1e5 is inf. The tracer named the module and said "its inputs and
// weights are finite, its output has 1024 inf": the weight that is not representable in the
// computation's format went unnamed. It now names the tensor, its largest |value| and f16's max.
TEST(CliNan, AWeightBeyondF16sRangeIsNamedByTheTracer) {
  const std::string dir = test::temp_dir("cli-nan-huge-weight");
  Ran init = run_keel({"init-model", "--family", "llama", "--out", dir + "/base", "--seed", "1"});
  ASSERT_EQ(init.code, 0) << init.output;
  const std::string model_path = dir + "/base/model.safetensors";
  {
    io::Safetensors st = io::read_safetensors(model_path);
    for (auto& [name, t] : st.tensors)
      if (name == "model.layers.1.mlp.up_proj.weight") {
        Tensor c = t.clone();
        c.data_as<float>()[5] = 1e5f;
        t = c;
      }
    io::write_safetensors(model_path, st.tensors, st.metadata);
  }
  Ran r = run_keel(
      with_sets({"train"}, {"run.out_dir=" + dir + "/run", "run.threads=1",
                            "model.path=" + dir + "/base", "train.precision=16-mixed",
                            "train.max_steps=2", "data.num_examples=64", "data.eval_examples=0",
                            "log.tensorboard=false", "debug.underflow_overflow.enabled=true"}),
      {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  expect_captured_stop(r, dir + "/run", &step);
  EXPECT_EQ(step, 1);
  expect_log_names(dir + "/run", "model.layers.1.mlp.up_proj", "Linear");
  const std::string log = slurp(dir + "/run/debug/underflow_overflow_rank0.log");
  EXPECT_CONTAINS(log,
                  "its inputs and weights are finite as stored, but its weight "
                  "model.layers.1.mlp.up_proj.weight holds |values| up to 1e+05, beyond f16's "
                  "max 65504: rounded to f16 for the computation they are inf");
  EXPECT_CONTAINS(log, "train in bf16-mixed");
  // Its bisect agrees: bf16's range holds it.
  const json j = replay_json(dir + "/run/debug/nan_capture/rank0", {"--bisect"});
  EXPECT_EQ(j.value("cause", std::string()), "precision=bf16-mixed") << j.dump(2);
}

// 16-true at the default learning rate (0.003): AdamW's state is f16 like the weights, and the
// squares of most gradients (below 2.4e-4) flush to 0 in exp_avg_sq while exp_avg keeps them, so
// those elements are updated by lr * m / eps (eps 1e-8): the MLP's weights grow from 0.02 to
// hundreds in 3 updates and step 4's forward overflows f16. Bisect said only "a value exceeds
// f16's range ...; bf16 has f32's range", the symptom; the cause (and optim.eps, which fixes it
// too) went unnamed. Replay's note and bisect's explanation now name the flushed second moment.
TEST(CliNan, AdamWSecondMomentUnderflowIn16TrueIsNamedAsTheCause) {
  const std::string dir = test::temp_dir("cli-nan-16true-adam");
  Ran r =
      run_keel(with_sets({"train"}, {"run.out_dir=" + dir, "run.threads=1", "log.tensorboard=false",
                                     "train.precision=16-true", "train.max_steps=40",
                                     "data.num_examples=1280", "data.eval_examples=0"}),
               {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  EXPECT_GT(step, 1);
  // The run's own advice names it, once, with its fix: it said "lower optim.lr (now 0.00296, try
  // 0.000296)", which still ends in NaN, and the stop's "cause:" line then contradicted it.
  EXPECT_CONTAINS(r.out, "advice: exploding: non-finite ");
  EXPECT_CONTAINS(r.out,
                  ": AdamW's second moment (exp_avg_sq, stored in f16) underflowed to 0 for ");
  EXPECT_CONTAINS(r.out,
                  "; train in 16-mixed or bf16-mixed (f32 master weights and optimizer "
                  "state), or raise optim.eps (to about 1e-4)");
  EXPECT_NOT_CONTAINS(r.output, "lower optim.lr");
  EXPECT_NOT_CONTAINS(r.err, "cause: AdamW's second moment");
  // The forward's overflow made the loss NaN, and backward carried it into every gradient: the
  // stop said "(first produced by backward: transformer.ln_f.weight)", sending the user to a
  // LayerNorm that only passed it on.
  EXPECT_CONTAINS(r.err,
                  "(the loss's own nan, carried back: the forward produced it, not "
                  "backward)");
  EXPECT_NOT_CONTAINS(r.err, "first produced by backward");
  const json j = replay_json(capture, {"--bisect"});
  EXPECT_TRUE(j.value("reproduced", false)) << j.dump(2);
  const std::string why = j.value("explanation", std::string());
  EXPECT_CONTAINS(why, "AdamW's second moment (exp_avg_sq, stored in f16) underflowed to 0 for ");
  EXPECT_CONTAINS(why, "updated by lr * m / eps (optim.eps = 1e-08)");
  EXPECT_CONTAINS(why, "train in 16-mixed or bf16-mixed");
  EXPECT_CONTAINS(why, "raise optim.eps");
  // Not also "lower optim.lr": an update of lr * m / eps blows up at any lr.
  EXPECT_NOT_CONTAINS(why, "lower optim.lr");
  EXPECT_CONTAINS(why, "by the updates of the flushed second moment");
  bool noted = false;
  for (const json& n : j.at("notes"))
    noted |= n.get<std::string>().find("exp_avg_sq") != std::string::npos;
  EXPECT_TRUE(noted) << j.dump(2);
  // The fix it names: the same run with optim.eps = 1e-4 trains to the end.
  Ran fixed = run_keel(
      with_sets({"train"}, {"run.out_dir=" + dir + "-eps", "run.threads=1", "log.tensorboard=false",
                            "train.precision=16-true", "optim.eps=1e-4", "train.max_steps=40",
                            "data.num_examples=1280", "data.eval_examples=0"}),
      {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(fixed.code, 0) << fixed.output;
}

// (c) A non-finite value reaches the step through its input. Token ids cannot be NaN, so it comes
// in through the embedding row of one token: a checkpoint whose row for '~' is NaN (a resized
// vocabulary whose new row was never initialized, a save that overflowed), resumed on a JSONL
// dataset where only example 29 contains '~'. The resume refuses it at load time unless
// model.allow_nonfinite_weights = true. Training runs on until the batch holding that
// example; the capture names its step and example, and bisect says the state came in broken.
TEST(CliNan, NanEmbeddingRowHitByOneExampleIsCapturedAtItsBatch) {
  const std::string dir = test::temp_dir("cli-nan-c");
  {
    std::ofstream f(dir + "/data.jsonl");
    for (int i = 0; i < 48; ++i)
      f << json{{"text", i == 29 ? "line 29: price ~ 42 dollars"
                                 : "line " + std::to_string(i) + ": the quick brown fox jumps"}}
               .dump()
        << "\n";
  }
  auto sets_for = [&](const std::string& out) {
    return std::vector<std::string>{"run.out_dir=" + out,
                                    "run.threads=1",
                                    "model.family=llama",
                                    "model.tie_embeddings=false",
                                    "model.n_layer=2",
                                    "model.n_embd=64",
                                    "model.n_head=4",
                                    "data.task=jsonl",
                                    "data.path=" + dir + "/data.jsonl",
                                    "data.shuffle=false",
                                    "data.seq_len=48",
                                    "train.batch_size=4",
                                    "log.tensorboard=false",
                                    "log.every=1"};
  };
  const std::string run = dir + "/run";
  auto first = sets_for(run);
  first.push_back("train.max_steps=2");
  Ran r0 = run_keel(with_sets({"train"}, first));
  ASSERT_EQ(r0.code, 0) << r0.out << r0.err;
  // Corrupt the checkpoint's row for '~' (126).
  const std::string model_path = run + "/checkpoints/last/model.safetensors";
  {
    io::Safetensors st = io::read_safetensors(model_path);
    for (auto& [name, t] : st.tensors)
      if (name == "model.embed_tokens.weight") {
        Tensor c = t.clone();
        float* row = c.data_as<float>() + 126 * c.size(1);
        for (int64_t k = 0; k < c.size(1); ++k) row[k] = std::numeric_limits<float>::quiet_NaN();
        t = c;
      }
    io::write_safetensors(model_path, st.tensors, st.metadata);
  }
  fs::copy(run, dir + "/traced", fs::copy_options::recursive);
  auto resume = sets_for(run);
  resume.insert(resume.end(), {"train.max_steps=12", "run.resume=true"});
  // The resume finds the row at load time (io/weight_check.h), naming the tensor and its index;
  // the override loads it, and the step that reads the row stops.
  Ran refused = run_keel(with_sets({"train"}, resume));
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_CONTAINS(refused.err, model_path +
                                   ": tensor 'model.embed_tokens.weight' holds 64 non-finite "
                                   "values of 16576 (64 nan, 0 inf); the first at [126, 0]");
  EXPECT_EQ(step_records(run).size(), 2u) << "the refused resume ran no step";
  resume.push_back("model.allow_nonfinite_weights=true");
  Ran r = run_keel(with_sets({"train"}, resume));
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, run, &step);
  // Batches of 4 in order: example 29 is in batch 7 (0-based), step 8; steps 3-7 applied.
  EXPECT_EQ(step, 8);
  const json meta = json::parse(slurp(capture + "/capture.json"));
  EXPECT_EQ(meta.at("nonfinite_param_values"), json::array({"model.embed_tokens.weight"}));
  const auto ids = meta.at("micro_batches").at(0).at("example_ids").get<std::vector<int64_t>>();
  EXPECT_NE(std::find(ids.begin(), ids.end(), 29), ids.end());

  const json j = replay_json(capture, {"--bisect"});
  expect_reproduced(j, "model.embed_tokens", "Embedding", "weight");
  EXPECT_EQ(j.value("cause", std::string()), "nonfinite-parameters") << j.dump(2);
  // One parameter in the singular (the report said "in 1 parameters").
  EXPECT_CONTAINS(run_keel({"replay", capture}).out,
                  "non-finite VALUES before the step in 1 parameter, first: "
                  "model.embed_tokens.weight\n");
  EXPECT_EQ(j.at("nonfinite_rows"), json::array({126}));
  EXPECT_EQ(j.at("nonfinite_token_examples"), json::array({29}));

  // The tracer sees the NaN weight the first time the module runs (before any batch reaches it).
  auto traced = sets_for(dir + "/traced");
  traced.insert(traced.end(),
                {"train.max_steps=12", "run.resume=true", "debug.underflow_overflow.enabled=true",
                 "model.allow_nonfinite_weights=true"});
  Ran t = run_keel(with_sets({"train"}, traced));
  EXPECT_EQ(t.code, 3) << t.out << t.err;
  expect_log_names(dir + "/traced", "model.embed_tokens", "Embedding");
}

// (d) An injected NaN in one attention module's output at step 5.
// A NaN injected into the MLP makes the loss NaN with its sign bit set: the stop printed
// std::to_string's "non-finite loss (-nan)".
TEST(CliNan, TheStopNamesANanLossWithoutItsSign) {
  const std::string dir = test::temp_dir("cli-nan-sign");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(), {"train.max_steps=6", "debug.inject.module=transformer.h.0.mlp.c_fc",
                           "debug.inject.step=5", "debug.nan_capture=false"});
  const Ran r = run_keel(with_sets({"train"}, sets));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "stopped: step 5: non-finite loss (nan)");
  EXPECT_NOT_CONTAINS(r.err, "-nan");
}

TEST(CliNan, InjectedNanInAttentionAtStep5IsBisectedToTheInjection) {
  const std::string dir = test::temp_dir("cli-nan-d");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(), {"train.max_steps=8", "debug.inject.module=transformer.h.1.attn",
                           "debug.inject.step=5", "debug.inject.kind=nan",
                           "debug.underflow_overflow.enabled=true"});
  Ran r = run_keel(with_sets({"train"}, sets));
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  EXPECT_EQ(step, 5);
  EXPECT_EQ(step_records(dir).size(), 5u);
  expect_log_names(dir, "transformer.h.1.attn", "GPT2Attention");
  const json j = replay_json(capture, {"--bisect"});
  expect_reproduced(j, "transformer.h.1.attn", "GPT2Attention", "output");
  const auto b = bisect_of(j);
  EXPECT_FALSE(b.at("attention=math"));
  EXPECT_TRUE(b.at("inject=off"));
  EXPECT_EQ(j.value("cause", std::string()), "inject=off") << j.dump(2);
}

// The stop's replay command is one a shell runs: an out_dir with a space (or a quote) made it
// several words, none of them the capture.
TEST(CliNan, TheReplayCommandOfACaptureInAPathWithSpacesRuns) {
  const std::string root = test::temp_dir("cli-nan-space");
  const std::string dir = root + "/run 1's";
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(), {"train.max_steps=3", "debug.inject.module=transformer.h.0.attn",
                           "debug.inject.step=2", "debug.inject.kind=nan"});
  Ran r = run_keel(with_sets({"train"}, sets));
  ASSERT_EQ(r.code, 3) << r.output;
  const std::string said =
      "replay with: keel replay '" + root + "/run 1'\\''s/debug/nan_capture/rank0'";
  EXPECT_CONTAINS(r.err, said);
  const size_t at = r.err.find("replay with: keel ");
  ASSERT_NE(at, std::string::npos) << r.err;
  const std::string command = r.err.substr(at + 18, r.err.find('\n', at) - at - 18);
  Ran rp = test::run_command({"/bin/sh", "-c", test::keel_binary() + " " + command + " --json"});
  EXPECT_EQ(rp.code, 0) << command << "\n" << rp.output;
  EXPECT_CONTAINS(rp.out, "\"reproduced\":true");
}

// The stop line of a step debug.inject corrupted names the injection (only the advice line did:
// "stopped: step 3: non-finite gradients in 27 of 28 parameters ..." read as the run's failure).
TEST(CliNan, TheStopOfAnInjectedFaultNamesDebugInject) {
  const std::string dir = test::temp_dir("cli-nan-inject-stop");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(), {"train.max_steps=6", "debug.inject.module=transformer.h.1.attn",
                           "debug.inject.step=3", "debug.inject.kind=inf"});
  Ran r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  expect_captured_stop(r, dir, &step);
  EXPECT_EQ(step, 3);
  EXPECT_CONTAINS(r.err,
                  "; debug.inject put inf into transformer.h.1.attn's output at this step; "
                  "capture written to");
}

// A Llama (grouped-query attention) with DoRA and two micro-batches a step, at optim.lr
// 1e4 under 16-mixed: the magnitudes are ~1e4 after the first update and step 2 is NaN. Its
// replay is bit-exact, and the report counts in the singular: "1 updates were applied" and
// "1 threads" before.
TEST(CliNan, ADoraLlamaCaptureReplaysBitExactlyAndItsReportCountsRight) {
  const std::string dir = test::temp_dir("cli-nan-dora-llama");
  Ran r = run_keel(
      with_sets({"train"}, {"run.out_dir=" + dir, "run.threads=1", "model.family=llama",
                            "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
                            "model.n_kv_head=2", "model.adapter.kind=dora", "data.num_examples=256",
                            "data.eval_examples=0", "train.batch_size=4", "train.grad_accum=2",
                            "data.seq_len=32", "log.tensorboard=false", "optim.lr=1e4",
                            "train.precision=16-mixed", "train.max_steps=10"}),
      {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, dir, &step);
  EXPECT_EQ(step, 2);
  Ran rep = run_keel({"replay", capture, "--bisect"});
  EXPECT_EQ(rep.code, 0) << rep.output;
  EXPECT_CONTAINS(rep.out, "16-mixed, attention eager, 1 thread\n");
  EXPECT_CONTAINS(rep.out, "bit-exact    yes");
  EXPECT_CONTAINS(rep.out, "(1 update was applied): lower optim.lr");
  // The first module is the DoRA adapter's own lora_B, which the line called a plain "Linear".
  EXPECT_CONTAINS(rep.out,
                  "first module model.layers.0.self_attn.q_proj.lora_B (DoRA adapter's Linear, "
                  "forward, output)");
}

// Under 16-mixed the scaler owns overflowing gradients: a scale far too high overflows the f16
// gradients of the first steps, the scaler skips them and backs off, and training finishes. No
// capture is written, even with the tracer on.
TEST(CliNan, OrdinaryOverflowUnder16MixedIsNeverCaptured) {
  const std::string dir = test::temp_dir("cli-nan-scaler");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(), {"train.precision=16-mixed", "scaler.init_scale=1048576",
                           "train.max_steps=8", "debug.underflow_overflow.enabled=true"});
  Ran r = run_keel(with_sets({"train"}, sets));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_FALSE(fs::exists(dir + "/debug/nan_capture")) << r.err;
  const auto recs = step_records(dir);
  ASSERT_EQ(recs.size(), 8u);
  EXPECT_GT(recs.back().at("skipped_steps").get<int64_t>(), 0) << "the scale never overflowed";
  EXPECT_EQ(recs.back().at("nan_steps").get<int64_t>(), 0);
  EXPECT_LT(recs.back().at("loss_scale").get<double>(), 1048576.0);
}

TEST(CliNan, NanCaptureOffStopsWithoutWriting) {
  const std::string dir = test::temp_dir("cli-nan-off");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(),
              {"train.precision=16-true", "model.init_std=10", "model.intermediate_size=16384",
               "train.max_steps=3", "debug.nan_capture=false"});
  Ran r = run_keel(with_sets({"train"}, sets));
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_FALSE(fs::exists(dir + "/debug/nan_capture"));
  EXPECT_NE(r.err.find("stopped: step 1: non-finite loss"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("no capture written ([debug] nan_capture = false)"), std::string::npos)
      << r.err;
}

// on_nonfinite = skip goes on past non-finite steps; an applied update that overflowed 16-true's
// f16 weights (lr 1) replaced checkpoints/last by weights that do not load, with "done" and exit
// 0. Now last keeps the good one, the weights go beside it, exit 1 naming them.
TEST(CliNan, NonFiniteWeightsAreNeverCheckpointedOverAGoodOne) {
  const std::string dir = test::temp_dir("cli-nan-skip-weights");
  auto sets = small_gpt2(dir);
  sets.insert(sets.end(), {"train.precision=16-true", "optim.lr=1", "train.max_steps=6",
                           "train.on_nonfinite=skip", "log.checkpoint_every=1"});
  Ran r = run_keel(with_sets({"train"}, sets));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, ": the weights hold NaN or inf in ");
  EXPECT_CONTAINS(r.err, dir + "/checkpoints/last was not replaced (the good one there is kept)");
  EXPECT_CONTAINS(r.err, "they are in " + dir + "/checkpoints/nonfinite-step-");
  EXPECT_CONTAINS(r.err, "lower optim.lr or switch train.precision to bf16-mixed or 32-true");
  EXPECT_NOT_CONTAINS(r.output, "done:");
  // The last checkpoint is a good one: it loads (weights are checked on load).
  Ran gen = run_keel({"generate", dir, "1+1=", "--max-new-tokens", "2"});
  EXPECT_EQ(gen.code, 0) << gen.output;
}

TEST(CliNan, ReplayOfAMalformedCaptureNamesTheFileAndTheFix) {
  const std::string dir = test::temp_dir("cli-nan-bad");
  Ran missing = run_keel({"replay", dir + "/nope"});
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find(dir + "/nope is not a directory"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("debug/nan_capture/rank0"), std::string::npos) << missing.err;
  Ran empty = run_keel({"replay", dir});
  EXPECT_EQ(empty.code, 2);
  EXPECT_NE(empty.err.find(dir + "/capture.json: missing"), std::string::npos) << empty.err;
  { std::ofstream(dir + "/capture.json") << "{\"format\": \"keel-nan-capture\", "; }
  Ran bad = run_keel({"replay", dir});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find(dir + "/capture.json: not valid JSON"), std::string::npos) << bad.err;
  {
    std::ofstream(dir + "/capture.json") << "{\"format\": \"keel-nan-capture\", "
                                            "\"format_version\": 1}";
  }
  Ran key = run_keel({"replay", dir});
  EXPECT_EQ(key.code, 2);
  EXPECT_NE(key.err.find(dir + "/capture.json: missing \"step\""), std::string::npos) << key.err;
}

// The last update of a 16-true run at optim.lr 0.01 overflows what the model computes: the
// training losses were finite, the evaluation after step 3 is nan. The run ended "eval step 3 |
// loss nan", then "done", exit 0, without a word: its checkpoint is that model. The evaluation and
// the run's end say so, with the precision's range and the lr as what to change; in bf16-mixed
// the same run evaluates finite (3.86), so the advice holds.
TEST(CliNan, ANonFiniteEvalLossAfterFiniteStepsIsExplainedAndRepeatedAtTheEnd) {
  const std::string dir = test::temp_dir("cli-nan-eval");
  auto train = [&](const std::string& precision) {
    return run_keel(with_sets({"train"}, {"run.out_dir=" + dir + "/" + precision,
                                          "train.precision=" + precision, "optim.lr=0.01",
                                          "train.max_steps=3", "data.eval_examples=16"}),
                    {"OMP_NUM_THREADS=1"});
  };
  Ran r = train("16-true");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const json& rec : step_records(dir + "/16-true"))
    EXPECT_TRUE(rec.at("loss").is_number()) << rec.dump();
  EXPECT_CONTAINS(r.out, "eval step 3 | loss nan");
  EXPECT_CONTAINS(r.out,
                  "advice: the eval loss is nan at step 3, while the training loss was "
                  "finite (");
  EXPECT_CONTAINS(r.out,
                  "overflows f16's range on the held-out data; try train.precision = "
                  "bf16-mixed or 32-true, or lower optim.lr (now 0.01)");
  EXPECT_CONTAINS(r.out,
                  "advice: the run ends with a non-finite eval loss (nan at step 3), so its "
                  "checkpoint is not a model to use as it is");
  Ran wide = train("bf16-mixed");
  ASSERT_EQ(wide.code, 0) << wide.output;
  EXPECT_NOT_CONTAINS(wide.out, "eval loss is");
  EXPECT_NOT_CONTAINS(wide.out, "non-finite eval loss");
}

// A full fine-tune over an HF model.path captures every parameter, but the model's shapes come
// from the directory's config.json: moved after the capture, replay named "no config.json" of the
// old path (exit 1), not the capture or the fix; replaced by another model, it called the capture
// corrupt.
// An adapter run over an HF directory captures only its trained tensors and a reference to the
// base; a replay against a changed base is refused. The refusal called the capture a checkpoint
// ("checkpoint DIR holds only the trained tensors ... when the checkpoint was written").
TEST(CliNan, AnAdapterCaptureOverAChangedBaseIsCalledACapture) {
  const std::string dir = test::temp_dir("cli-nan-base-changed");
  const std::string model = dir + "/model", out = dir + "/out";
  Ran r = run_keel({"init-model", "--family", "gpt2", "--out", model});
  ASSERT_EQ(r.code, 0) << r.output;
  auto sets = small_gpt2(out);
  sets.insert(sets.end(), {"model.path=" + model, "model.adapter.kind=lora",
                           "model.adapter.target_modules=[\"c_attn\"]", "train.max_steps=4",
                           "debug.inject.module=transformer.h.1.attn", "debug.inject.step=2",
                           "debug.inject.kind=inf"});
  r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, out, &step);
  r = run_keel({"init-model", "--family", "gpt2", "--out", model, "--seed", "7"});
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel({"replay", capture});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "capture " + capture + " holds only the trained tensors of an adapter run");
  EXPECT_CONTAINS(r.err, ", when the capture was written ");
  EXPECT_NOT_CONTAINS(r.err, "checkpoint");
}

TEST(CliNan, AFullFineTuneCaptureNamesAModelPathThatMovedOrChanged) {
  const std::string dir = test::temp_dir("cli-nan-moved");
  const std::string model = dir + "/model", out = dir + "/out";
  Ran r = run_keel({"init-model", "--family", "llama", "--out", model, "--init-std", "10",
                    "--intermediate-size", "4096"});
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel(with_sets(
      {"train"},
      {"run.out_dir=" + out, "run.threads=1", "model.path=" + model, "train.precision=16-true",
       "data.num_examples=64", "data.eval_examples=0", "train.batch_size=4", "data.seq_len=16",
       "log.tensorboard=false", "train.max_steps=3"}));
  int64_t step = 0;
  const std::string capture = expect_captured_stop(r, out, &step);
  fs::rename(model, dir + "/moved");
  r = run_keel({"replay", capture});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, capture + "/capture.json: the captured run was built from model.path = " +
                             model + ", which is not a directory any more");
  EXPECT_CONTAINS(r.err, "--set model.path=DIR");
  const json j = replay_json(capture, {"--set", "model.path=" + dir + "/moved"});
  EXPECT_TRUE(j.value("bit_exact", false)) << j.dump(2);

  r = run_keel({"init-model", "--family", "llama", "--out", model, "--n-embd", "32"});
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel({"replay", capture});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "model.path = " + model + " now holds another model");
}

}  // namespace
}  // namespace keel
