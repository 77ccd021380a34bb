// `keel train` options that a run would accept and then never act on are refused before anything
// is built or written, naming the key, what it lacks and the fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

std::vector<std::string> tiny_train(const std::string& out, std::vector<std::string> more) {
  std::vector<std::string> sets = {
      "run.out_dir=" + out,    "run.threads=1",       "model.n_layer=1",    "model.n_embd=32",
      "model.n_head=2",        "data.seq_len=16",     "train.batch_size=8", "train.max_steps=2",
      "log.tensorboard=false", "data.num_examples=64"};
  sets.insert(sets.end(), more.begin(), more.end());
  return test::with_sets({"train"}, sets);
}

// A one-step run said "1 steps" in its header and in its done line.
TEST(CliTrainOptions, AOneStepRunSaysOneStep) {
  const std::string dir = test::temp_dir("train-one-step");
  const auto r = test::run_keel(tiny_train(dir + "/out", {"train.max_steps=1"}));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.out, " | 1 step | out ");
  EXPECT_CONTAINS(r.out, "done: 1 step, checkpoint in ");
  EXPECT_EQ(r.output.find("1 steps"), std::string::npos) << r.output;
}

// train.eval_every with no validation split ran no evaluation, without a word.
TEST(CliTrainOptions, EvalEveryWithoutAValidationSplitIsRefused) {
  const std::string dir = test::temp_dir("train-eval-every");
  { std::ofstream(dir + "/train.txt") << "one paragraph\n\nanother paragraph\n"; }
  auto r = test::run_keel(tiny_train(
      dir + "/text", {"data.task=text", "data.path=" + dir + "/train.txt", "train.eval_every=1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "train.eval_every = 1 evaluates the run's validation split, but it has "
                  "none (data.task = \"text\" without data.eval_path or data.eval_fraction)");
  EXPECT_FALSE(std::filesystem::exists(dir + "/text")) << "the refused run wrote its out_dir";
  r = test::run_keel(tiny_train(dir + "/arith", {"data.eval_examples=0", "train.eval_every=1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "(data.eval_examples = 0); raise data.eval_examples, or remove "
                  "train.eval_every");
  // With a split it evaluates after each step.
  r = test::run_keel(
      tiny_train(dir + "/split", {"data.task=text", "data.path=" + dir + "/train.txt",
                                  "data.eval_fraction=0.5", "train.eval_every=1"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(test::records_with(dir + "/split", "eval_loss").size(), 2u);
}

// sched.warmup_ratio beside sched.warmup_steps, and sched.min_lr_ratio under a constant schedule,
// changed no learning rate.
TEST(CliTrainOptions, ScheduleKeysThatWouldNotActAreRefused) {
  const std::string dir = test::temp_dir("train-sched-keys");
  auto r = test::run_keel(
      tiny_train(dir + "/warmup", {"sched.warmup_steps=2", "sched.warmup_ratio=0.1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "sched.warmup_steps = 2 and sched.warmup_ratio = 0.1 both set the "
                  "warmup, and warmup_ratio is ignored when warmup_steps is set");
  r = test::run_keel(tiny_train(dir + "/floor", {"sched.name=constant", "sched.min_lr_ratio=0.1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "sched.min_lr_ratio = 0.1 floors the decay of a linear or cosine "
                  "schedule, but sched.name = \"constant\" does not decay");
  EXPECT_FALSE(std::filesystem::exists(dir + "/warmup"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/floor"));
  // Each alone acts: a constant schedule warms up, a cosine one keeps its floor.
  r = test::run_keel(tiny_train(
      dir + "/ok", {"sched.name=cosine", "sched.warmup_ratio=0.5", "sched.min_lr_ratio=0.1"}));
  EXPECT_EQ(r.code, 0) << r.output;
}

// The options of the optimizer not chosen trained without them, without a word: momentum = 0.9
// under AdamW (whose momentum is beta1), beta2 under SGD, and dampening with no momentum.
TEST(CliTrainOptions, OptionsOfTheOptimizerNotChosenAreRefused) {
  const std::string dir = test::temp_dir("train-optim-keys");
  auto r =
      test::run_keel(tiny_train(dir + "/adamw", {"optim.momentum=0.9", "optim.nesterov=true"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "optim.momentum = 0.9 and optim.nesterov = true are options of SGD, but "
                  "optim.name = \"adamw\" does not read them (AdamW's momentum is optim.beta1); "
                  "remove them, or set optim.name = \"sgd\"");
  r = test::run_keel(tiny_train(dir + "/sgd", {"optim.name=sgd", "optim.beta2=0.95"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "optim.beta2 = 0.95 is an option of AdamW, but optim.name = \"sgd\" does not "
                  "read it; remove it, or set optim.name = \"adamw\"");
  r = test::run_keel(tiny_train(dir + "/damp", {"optim.name=sgd", "optim.dampening=0.5"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "optim.dampening = 0.5 damps SGD's momentum, but optim.momentum = 0 keeps none");
  for (const char* d : {"/adamw", "/sgd", "/damp"})
    EXPECT_FALSE(std::filesystem::exists(dir + d)) << d;
  // Each under its own optimizer trains.
  r = test::run_keel(tiny_train(dir + "/ok", {"optim.name=sgd", "optim.momentum=0.9",
                                              "optim.dampening=0.1", "optim.beta1=0.9"}));
  EXPECT_EQ(r.code, 0) << r.output;
}

// optim.stochastic_rounding acts on bf16 parameters only (bf16-true): under 32-true it trained as
// without it, without a word; under 16-true AdamW refused it naming no key; with an adapter
// (always f32) it did nothing.
TEST(CliTrainOptions, StochasticRoundingWithoutBf16ParametersIsRefused) {
  const std::string dir = test::temp_dir("train-stochastic-rounding");
  auto r = test::run_keel(tiny_train(dir + "/f32", {"optim.stochastic_rounding=true"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "optim.stochastic_rounding = true rounds the updates of bf16 parameters, but "
                  "train.precision = \"32-true\" trains f32 parameters (no rounding to do); set "
                  "train.precision = \"bf16-true\", or remove optim.stochastic_rounding");
  r = test::run_keel(
      tiny_train(dir + "/f16", {"optim.stochastic_rounding=true", "train.precision=16-true"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "train.precision = \"16-true\" trains f16 parameters");
  r = test::run_keel(tiny_train(
      dir + "/lora", {"optim.stochastic_rounding=true", "train.precision=bf16-true",
                      "model.adapter.kind=lora", "model.adapter.target_modules=[\"c_attn\"]"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "model.adapter.kind = \"lora\" trains f32 adapters");
  for (const char* d : {"/f32", "/f16", "/lora"})
    EXPECT_FALSE(std::filesystem::exists(dir + d)) << d;
  r = test::run_keel(
      tiny_train(dir + "/ok", {"optim.stochastic_rounding=true", "train.precision=bf16-true"}));
  EXPECT_EQ(r.code, 0) << r.output;
}

// model.dropout drops GPT-2's residual streams and embedding; a Llama has no such layers and
// trained as without it, without a word. An HF directory's attention_dropout (Granite-3's 0.1) is
// what HF trains with: a run whose model.attention_dropout differs says so, one that sets it does
// not; on CUDA (whose attention drops nothing yet) it is refused before anything is written.
TEST(CliTrainOptions, ModelDropoutOnALlamaIsRefusedAndAttentionDropoutIsSaid) {
  const std::string dir = test::temp_dir("train-llama-dropout");
  auto r = test::run_keel(tiny_train(dir + "/llama", {"model.family=llama", "model.dropout=0.1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "model.dropout = 0.1 with model.family = \"llama\": keel's Llama-family "
                  "models have no such dropout layers");
  EXPECT_CONTAINS(r.err,
                  "attention probabilities: model.attention_dropout); remove model.dropout "
                  "(model.adapter.dropout is an adapter's input dropout)");
  const test::KeelRun init =
      test::run_keel({"init-model", "--family", "granite", "--out", dir + "/granite", "--n-layer",
                      "1", "--n-embd", "32", "--n-head", "2", "--max-seq-len", "16"});
  ASSERT_EQ(init.code, 0) << init.output;
  r = test::run_keel(
      tiny_train(dir + "/from-dir", {"model.path=" + dir + "/granite", "model.dropout=0.1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "model.dropout = 0.1 with model.path = " + dir + "/granite (granite)");
  r = test::run_keel(tiny_train(
      dir + "/cuda", {"model.family=llama", "run.device=cuda", "model.attention_dropout=0.1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "model.attention_dropout = 0.1");
  EXPECT_CONTAINS(r.err,
                  "keel's CUDA attention does not drop probabilities yet; set "
                  "run.device = \"cpu\", or remove model.attention_dropout");
  for (const char* d : {"/llama", "/from-dir", "/cuda"})
    EXPECT_FALSE(std::filesystem::exists(dir + d)) << "the refused run wrote its out_dir " << d;
  {
    std::ifstream in(dir + "/granite/config.json");
    nlohmann::json cfg = nlohmann::json::parse(in);
    cfg["attention_dropout"] = 0.1;
    std::ofstream(dir + "/granite/config.json") << cfg.dump(2);
  }
  r = test::run_keel(tiny_train(dir + "/granite-run", {"model.path=" + dir + "/granite"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "note: " + dir +
                                "/granite/config.json's attention_dropout = 0.1 (HF trains with "
                                "it) differs from model.attention_dropout = 0.0 (no dropout); set "
                                "model.attention_dropout = 0.1 to train as HF does");
  r = test::run_keel(tiny_train(dir + "/granite-dropped",
                                {"model.path=" + dir + "/granite", "model.attention_dropout=0.1"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("attention_dropout"), std::string::npos) << r.output;
  // A Llama-family file's residual dropout (a Phi-3's resid_pdrop) has no keel key to set.
  {
    nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir + "/granite/config.json"));
    cfg["resid_pdrop"] = 0.1;
    std::ofstream(dir + "/granite/config.json") << cfg.dump(2);
  }
  r = test::run_keel(tiny_train(dir + "/granite-resid",
                                {"model.path=" + dir + "/granite", "model.attention_dropout=0.1"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output,
                  "/granite/config.json's resid_pdrop = 0.1 is not applied: keel's "
                  "granite has no residual or embedding dropout");
  EXPECT_EQ(r.output.find("set model.dropout"), std::string::npos) << r.output;
  // GPT-2's three (HF's gpt2 config.json: 0.1 each; keel's init-model writes 0).
  ASSERT_EQ(test::run_keel({"init-model", "--family", "gpt2", "--out", dir + "/gpt2", "--n-layer",
                            "1", "--n-embd", "32", "--n-head", "2", "--max-seq-len", "16"})
                .code,
            0);
  r = test::run_keel(tiny_train(dir + "/gpt2-run", {"model.path=" + dir + "/gpt2"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("pdrop"), std::string::npos) << r.output;
  {
    std::ifstream in(dir + "/gpt2/config.json");
    nlohmann::json cfg = nlohmann::json::parse(in);
    for (const char* k : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) cfg[k] = 0.1;
    std::ofstream(dir + "/gpt2/config.json") << cfg.dump(2);
  }
  r = test::run_keel(
      tiny_train(dir + "/gpt2-hf", {"model.path=" + dir + "/gpt2", "model.attention_dropout=0.1"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output,
                  "/gpt2/config.json's resid_pdrop = 0.1 (HF trains with it) differs "
                  "from model.dropout = 0.0 (no dropout); set model.dropout = 0.1 to "
                  "train as HF does");
  EXPECT_CONTAINS(r.output,
                  "/gpt2/config.json's embd_pdrop = 0.1 (HF trains with it) differs "
                  "from model.dropout = 0.0");
  EXPECT_EQ(r.output.find("attn_pdrop"), std::string::npos) << r.output;
}

// A run's checkpoint and its export said the base's dropouts (or none), not those it trained with:
// HF, or keel from the export, went on with other ones. Now they say the run's, and a file's
// dropout that is no probability is refused naming the field.
TEST(CliTrainOptions, TheDropoutsARunTrainedWithAreWhatItsCheckpointAndExportSay) {
  const std::string dir = test::temp_dir("train-dropouts-written");
  auto config_of = [](const std::string& d) {
    return nlohmann::json::parse(std::ifstream(d + "/config.json"));
  };
  auto init = [&](const std::string& family) {
    const test::KeelRun r =
        test::run_keel({"init-model", "--family", family, "--out", dir + "/" + family, "--n-layer",
                        "1", "--n-embd", "32", "--n-head", "2", "--max-seq-len", "16"});
    ASSERT_EQ(r.code, 0) << r.output;
  };
  init("gpt2");
  auto r = test::run_keel(tiny_train(
      dir + "/gpt2-run",
      {"model.path=" + dir + "/gpt2", "model.dropout=0.05", "model.attention_dropout=0.1"}));
  ASSERT_EQ(r.code, 0) << r.output;
  ASSERT_EQ(test::run_keel({"export", dir + "/gpt2-run", "--out", dir + "/gpt2-export"}).code, 0);
  for (const std::string& d : {dir + "/gpt2-run/checkpoints/last", dir + "/gpt2-export"}) {
    const nlohmann::json c = config_of(d);
    EXPECT_EQ(c.at("resid_pdrop"), 0.05) << d;
    EXPECT_EQ(c.at("embd_pdrop"), 0.05) << d;
    EXPECT_EQ(c.at("attn_pdrop"), 0.1) << d;
  }
  // Trained on from its export with the same keys: nothing to say.
  r = test::run_keel(tiny_train(
      dir + "/gpt2-again",
      {"model.path=" + dir + "/gpt2-export", "model.dropout=0.05", "model.attention_dropout=0.1"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("pdrop"), std::string::npos) << r.output;
  // A Granite whose file says 0.1, trained at keel's default: the export says 0.
  init("granite");
  nlohmann::json granite = config_of(dir + "/granite");
  granite["attention_dropout"] = 0.1;
  std::ofstream(dir + "/granite/config.json") << granite.dump(2);
  r = test::run_keel(tiny_train(dir + "/granite-run", {"model.path=" + dir + "/granite"}));
  ASSERT_EQ(r.code, 0) << r.output;
  ASSERT_EQ(test::run_keel({"export", dir + "/granite-run", "--out", dir + "/granite-export"}).code,
            0);
  EXPECT_EQ(config_of(dir + "/granite-export").at("attention_dropout"), 0.0);
  EXPECT_EQ(config_of(dir + "/granite-run/checkpoints/last").at("attention_dropout"), 0.0);
  // No probability: refused, naming the file and the field.
  for (const auto& [field, value, said] :
       std::vector<std::tuple<std::string, nlohmann::json, std::string>>{
           {"attention_dropout", 1.5, "must be a dropout probability in [0, 1), got 1.5"},
           {"attention_dropout", "0.1", "must be a number, got \"0.1\""},
           {"attention_dropout", -0.1, "must be a dropout probability in [0, 1), got -0.1"}}) {
    nlohmann::json bad = granite;
    bad[field] = value;
    std::ofstream(dir + "/granite/config.json") << bad.dump(2);
    r = test::run_keel(tiny_train(dir + "/granite-bad", {"model.path=" + dir + "/granite"}));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, dir + "/granite/config.json: field '" + field + "' " + said);
  }
  nlohmann::json gpt2 = config_of(dir + "/gpt2");
  gpt2["attn_pdrop"] = 1;
  std::ofstream(dir + "/gpt2/config.json") << gpt2.dump(2);
  r = test::run_keel(tiny_train(dir + "/gpt2-bad", {"model.path=" + dir + "/gpt2"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "field 'attn_pdrop' must be a dropout probability in [0, 1), got 1");
  EXPECT_FALSE(std::filesystem::exists(dir + "/gpt2-bad"));
}

}  // namespace
}  // namespace keel
