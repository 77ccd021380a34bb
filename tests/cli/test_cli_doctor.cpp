// `keel doctor` through the binary: exit 0 with a readable report when nothing blocks training,
// exit 1 (and the JSON's blocking = true) when something does, exit 2 for a bad config.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "keel/data/token_file.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

// stdout (the report / the JSON) is in .out.
test::KeelRun doctor(const std::string& args) { return test::run_keel_sh("doctor " + args); }

const std::string kSmall =
    "--set run.threads=1 --set model.n_layer=1 --set model.n_embd=32 --set model.n_head=2 "
    "--set data.num_examples=64 --set data.eval_examples=0 --set data.seq_len=16 "
    "--set train.batch_size=8";

TEST(CliDoctor, HealthyConfigExitsZeroWithTheReport) {
  test::KeelRun r = doctor(kSmall + " --set train.precision=bf16-mixed");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* part :
       {"[ok     ] pad-token", "windows:", "memory:", "one-batch sanity pass", "configured",
        "32-true", "attention=math", "attention=flash", "verdict: nothing blocks training"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
}

// Bad data that every other check passes: a token file whose ids are all the byte tokenizer's pad
// id (256: padding written into the data), and a text file of one repeated byte. Training on
// either runs "healthy" (the pad file's loss falls from 4.8 to 0.18 in 30 steps) and learns
// nothing; doctor said "nothing blocks training" with no word on the data. The healthy built-in
// task gets no data warning.
TEST(CliDoctor, PaddingOrOneRepeatedTokenAsTheDataIsFlagged) {
  const std::string dir = test::temp_dir("cli-doctor-data");
  {
    const std::vector<int32_t> ids(4000, 256);
    std::ofstream(dir + "/pad.bin", std::ios::binary) << data::token_file_bytes(ids, 259);
    std::ofstream(dir + "/a.txt") << std::string(4000, 'a') << "\n";
  }
  test::KeelRun pad =
      doctor(kSmall + " --set data.task=tokens --set data.path=" + dir + "/pad.bin");
  EXPECT_EQ(pad.code, 0) << pad.output;
  EXPECT_CONTAINS(
      pad.out,
      "[warning] data: 100% of the first micro-batch's 120 target tokens are the pad id "
      "256 ('<pad>'): padding is in the data itself");
  test::KeelRun one = doctor(
      kSmall + " --set data.task=text --set data.pack=true --set data.path=" + dir + "/a.txt");
  EXPECT_EQ(one.code, 0) << one.output;
  EXPECT_CONTAINS(one.out,
                  "target tokens are one token, id 97 ('a'): the data is (almost) one "
                  "repeated token");
  test::KeelRun healthy = doctor(kSmall);
  EXPECT_EQ(healthy.code, 0) << healthy.output;
  EXPECT_NOT_CONTAINS(healthy.out, "] data:");
}

// JSONL examples of mixed lengths, one a row, are mostly padding: doctor names the share and what
// data.pack would make of it (the rows best fit decreasing fills); a packed run, and examples that
// fill their rows, get no such line.
TEST(CliDoctor, RowsOfMostlyPaddingSuggestPacking) {
  const std::string dir = test::temp_dir("cli-doctor-padding");
  {
    std::ofstream f(dir + "/mixed.jsonl");
    for (int i = 0; i < 32; ++i)  // 10 or 40 bytes and eos, in batches of 8 at seq_len 64
      f << "{\"text\": \"" << std::string(i % 4 == 0 ? 40 : 10, 'a' + i % 26) << "\"}\n";
    std::ofstream g(dir + "/full.jsonl");
    for (int i = 0; i < 32; ++i) g << "{\"text\": \"" << std::string(60, 'a' + i % 26) << "\"}\n";
  }
  const std::string jsonl =
      kSmall + " --set data.task=jsonl --set data.seq_len=64 --set data.path=";
  test::KeelRun mixed = doctor(jsonl + dir + "/mixed.jsonl --no-sanity");
  EXPECT_EQ(mixed.code, 0) << mixed.output;
  // 8 examples of 41 tokens and 24 of 11: 592 tokens; each batch of 8 (this seed's order) holds
  // a long one, and is padded to 44 (41 rounded to an eighth of 32): 32 x 44 positions. Packed:
  // each long example with two short ones (63 tokens), the other 8 short ones five to a row.
  EXPECT_CONTAINS(mixed.out,
                  "[info   ] padding: an epoch's rows of one example each are 58% padding (592 "
                  "tokens in 1408 positions): data.pack = true packs the 32 examples side by side "
                  "into 10 rows of at most data.seq_len = 64 tokens (at most 8% padding), each "
                  "attending only to itself");
  test::KeelRun packed = doctor(jsonl + dir + "/mixed.jsonl --set data.pack=true --no-sanity " +
                                "--set train.batch_size=5");
  EXPECT_EQ(packed.code, 0) << packed.output;
  EXPECT_NOT_CONTAINS(packed.out, "] padding:");
  // Its windows count rows, which hold several examples each.
  EXPECT_CONTAINS(packed.out, "windows: 2 steps per epoch of 1 x 5 packed rows, no remainder");
  test::KeelRun full = doctor(jsonl + dir + "/full.jsonl --no-sanity");
  EXPECT_EQ(full.code, 0) << full.output;
  EXPECT_NOT_CONTAINS(full.out, "] padding:");
}

TEST(CliDoctor, JsonSaysWhatBlocks) {
  // lr 1000 with AdamW's default weight decay flips and grows the weights every step; a window
  // of 4 micro-batches is larger than this 3-micro-batch epoch.
  test::KeelRun r = doctor(
      kSmall + " --set optim.lr=1000 --set data.num_examples=20 --set train.grad_accum=4 --json");
  EXPECT_EQ(r.code, 1) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j.at("blocking").get<bool>());
  bool lr_error = false, window_warning = false;
  for (const auto& c : j.at("checks")) {
    lr_error |= c.at("check") == "optimizer" && c.at("severity") == "error";
    window_warning |= c.at("check") == "windows" && c.at("severity") == "warning";
  }
  EXPECT_TRUE(lr_error) << j.dump(2);
  EXPECT_TRUE(window_warning) << j.dump(2);
  EXPECT_GE(j.at("sanity").size(), 3u);
  EXPECT_GT(j.at("memory").at("total").get<double>(), 0);
}

TEST(CliDoctor, BadConfigIsAUsageError) {
  EXPECT_EQ(doctor("--set train.precisoin=16-mixed").code, 2);
}

// An out_dir holding a previous run got "nothing blocks training", and keel train refused it.
// Doctor judges the out_dir as train will claim it, and changes nothing in it.
TEST(CliDoctor, AnOutDirTrainWouldRefuseBlocks) {
  const std::string dir = test::temp_dir("cli-doctor-outdir");
  { std::ofstream(dir + "/metrics.jsonl") << "{\"step\": 1, \"loss\": 1.0}\n"; }
  test::KeelRun r = doctor(kSmall + " --no-sanity --set run.out_dir=" + dir);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.out, "[error  ] out_dir: run.out_dir " + dir + " holds a previous run (" + dir +
                             "/metrics.jsonl); set run.resume = true to continue it");
  r = doctor(kSmall + " --no-sanity --set run.out_dir=" + dir +
             " --set run.resume=true --set run.overwrite=true");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.out, "run.resume = true and run.overwrite = true contradict each other");
  r = doctor(kSmall + " --no-sanity --set run.out_dir=" + dir + " --set run.overwrite=true");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NOT_CONTAINS(r.out, "out_dir:");
  EXPECT_TRUE(std::filesystem::exists(dir + "/metrics.jsonl")) << "doctor removed the old run";
}

// Keys keel train refuses because they would never act: doctor said "nothing blocks training"
// (exit 0) to each, and train then exited 2. Doctor refuses them alike, with train's message.
TEST(CliDoctor, WhatTrainRefusesDoctorRefuses) {
  struct Case {
    const char* sets;
    const char* message;
  };
  for (const Case& c :
       {Case{"--set train.eval_every=1", "train.eval_every = 1 evaluates the run's validation"},
        Case{"--set sched.warmup_steps=2 --set sched.warmup_ratio=0.1",
             "both set the warmup, and warmup_ratio is ignored"},
        Case{"--set sched.name=constant --set sched.min_lr_ratio=0.1",
             "but sched.name = \"constant\" does not decay"},
        Case{"--set run.resume=true", "run.resume = true but run.out_dir is not set"}}) {
    test::KeelRun r = doctor(kSmall + " --no-sanity " + c.sets);
    EXPECT_EQ(r.code, 2) << c.sets << "\n" << r.output;
    EXPECT_CONTAINS(r.err, c.message);
  }
}

// Sizes out of all reach: keel train refuses them before anything is built, and doctor said "no
// estimate" (its int64 estimate would overflow), built its probe and failed on a 4.4 TB tensor.
// Doctor refuses them first, as an error check with train's own message, and builds nothing.
TEST(CliDoctor, SizesTrainRefusesForMemoryAreRefusedAlike) {
  const std::string sets =
      "--set model.n_layer=1024 --set model.n_embd=65536 --set model.n_head=1024 "
      "--set model.vocab_size=16777216 --set data.seq_len=1048576 --set model.max_seq_len=1048576 "
      "--set train.batch_size=65536";
  test::KeelRun r = doctor("--no-sanity " + sets);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.out, "[error  ] memory: the run needs at least ");
  EXPECT_CONTAINS(r.out, "it would not fit in memory");
  EXPECT_NOT_CONTAINS(r.out, "no estimate");
  EXPECT_NOT_CONTAINS(r.out, "the run cannot start");
  test::KeelRun train = test::run_keel_sh("train " + sets);
  EXPECT_EQ(train.code, 2) << train.output;
  const size_t at = train.err.find("the run needs at least ");
  ASSERT_NE(at, std::string::npos) << train.err;
  const std::string message = train.err.substr(at, train.err.find('\n', at) - at);
  // The same message, but for MemAvailable, which moves between the two processes.
  const size_t only = message.find(" but only "), avail = message.find(" are available");
  ASSERT_NE(avail, std::string::npos) << message;
  EXPECT_CONTAINS(r.out, "memory: " + message.substr(0, only + 10));
  EXPECT_CONTAINS(r.out, message.substr(avail));
}

// With the tracer enabled, doctor said "debug.underflow_overflow.enabled = false: the tracer is
// off" (its probe turned the tracer off) instead of keel train's notes on the tracer's keys.
TEST(CliDoctor, AnEnabledTracerIsNotCalledOff) {
  test::KeelRun r =
      doctor(kSmall +
             " --no-sanity --set train.max_steps=3 --set debug.underflow_overflow.enabled=true "
             "--set 'debug.underflow_overflow.trace_batch_nums=[1, 9]'");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NOT_CONTAINS(r.err, "the tracer is off");
  EXPECT_CONTAINS(r.err,
                  "note: debug.underflow_overflow.trace_batch_nums holds 9, past the run's last "
                  "step (3)");
}

// A debug.inject.module that names no module: keel train refuses it once the model is built, and
// doctor said "nothing blocks training". Doctor looks it up in the model it builds, as train does.
TEST(CliDoctor, AnInjectModuleTrainWouldRefuseBlocks) {
  const std::string bad = " --set debug.inject.module=transformer.h.9 --set debug.inject.step=1";
  test::KeelRun r = doctor(kSmall + " --no-sanity" + bad);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.out,
                  "[error  ] inject: debug.inject.module = \"transformer.h.9\": no module "
                  "with this path in GPT2LMHeadModel; similar paths: transformer.h.0");
  const std::string dir = test::temp_dir("cli-doctor-inject");
  test::KeelRun t = test::run_keel_sh("train " + kSmall + bad + " --set run.out_dir=" + dir);
  EXPECT_EQ(t.code, 2) << t.output;
  EXPECT_CONTAINS(t.err, "debug.inject.module = \"transformer.h.9\": no module with this path");
  r = doctor(kSmall +
             " --no-sanity --set debug.inject.module=transformer.h.0 --set "
             "debug.inject.step=1");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NOT_CONTAINS(r.out, "inject:");
}

// Every file under `dir` with its size and modification time: what doctor must leave as it was
// (but the lock, which a refused keel train takes and lets go).
std::string tree_state(const std::string& dir) {
  std::string s;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.path().filename() != ".keel.lock")
      s += e.path().string() + " " +
           (e.is_regular_file() ? std::to_string(e.file_size()) : std::string("dir")) + " " +
           std::to_string(e.last_write_time().time_since_epoch().count()) + "\n";
  return s;
}

// A resume keel train refuses (the checkpoint fixes another seed, batch, precision, model or data;
// a lost or damaged checkpoint) got "nothing blocks training" from doctor. Doctor now judges the
// checkpoint as the resume does, reading it in place: each refusal is an error check with train's
// own message (and train refuses the same config), and the out_dir is left as it was.
TEST(CliDoctor, AResumeTrainWouldRefuseBlocks) {
  const std::string dir = test::temp_dir("cli-doctor-resume");
  { std::ofstream(dir + "/corpus.txt") << std::string(3000, 'x') << "\nabc def ghi\n"; }
  const std::string base = kSmall + " --set log.tensorboard=false --set log.checkpoint_every=1";
  const std::string text = " --set data.task=text --set data.path=" + dir + "/corpus.txt";
  // Two runs: the arith task, and a text file (whose content a resume checks).
  for (const std::string run : {"arith", "text"}) {
    test::KeelRun t =
        test::run_keel_sh("train " + base + " --set train.max_steps=2" +
                          (run == "text" ? text : "") + " --set run.out_dir=" + dir + "/" + run);
    ASSERT_EQ(t.code, 0) << t.output;
  }
  auto resume = [&](const std::string& run, const std::string& sets) {
    return base + " --set run.out_dir=" + dir + "/" + run + " --set run.resume=true" +
           (run == "text" ? text : "") + " " + sets;
  };
  const std::string before = tree_state(dir);
  test::KeelRun ok = doctor(resume("arith", "--set train.max_steps=4 --no-sanity"));
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_CONTAINS(ok.out, "[ok     ] resume: the checkpoint in " + dir + "/arith");
  test::KeelRun done = doctor(resume("arith", "--set train.max_steps=2 --no-sanity"));
  EXPECT_EQ(done.code, 0) << done.output;
  EXPECT_CONTAINS(done.out, "[warning] resume: nothing left to train: the checkpoint is at step 2");
  test::KeelRun late =
      doctor(resume("arith",
                    "--set train.max_steps=4 --no-sanity --set debug.inject.step=2 "
                    "--set debug.inject.module=transformer.h.0.mlp"));
  EXPECT_CONTAINS(late.out,
                  "[warning] resume: debug.inject.step = 2 is at or before the step "
                  "this run resumes from (2): nothing is injected; set it above 2");
  struct Case {
    const char* run;
    const char* sets;
    const char* message;  // in doctor's error check and in keel train's error alike
  };
  for (const Case& c : {
           Case{"arith", "--set run.seed=7", "run.seed: 1337 in the checkpoint, 7 now"},
           Case{"arith", "--set train.batch_size=4",
                "train.batch_size: 8 in the checkpoint, 4 now"},
           Case{"arith", "--set train.precision=bf16-mixed",
                "train.precision: \"32-true\" in the checkpoint, \"bf16-mixed\" now"},
           Case{"arith", "--set train.precision=bf16-true --set run.resume_force=true",
                "a resume cannot change the parameters' dtype, even with run.resume_force"},
           // The key, not the tensor it reshapes (train said "the model expects [259, 64]").
           Case{"arith", "--set model.n_embd=64", "model.n_embd: 32 in the checkpoint, 64 now"},
           // Train said "SGD state: unexpected entry ...; the checkpoint is damaged".
           Case{"arith", "--set optim.name=sgd",
                "optim.name: \"adamw\" in the checkpoint, \"sgd\" now"},
           Case{"arith", "--set model.n_layer=2 --set run.resume_force=true",
                "model.n_layer: 1 in the checkpoint, 2 now"},
           Case{"text", "--set data.seq_len=24", "data.seq_len: 16 in the checkpoint, 24 now"},
           Case{"arith",
                "--set debug.underflow_overflow.enabled=true "
                "--set debug.underflow_overflow.abort_after_batch_num=1",
                "abort_after_batch_num = 1 is not past the step this run resumes from (2)"},
       }) {
    test::KeelRun d =
        doctor(resume(c.run, std::string(c.sets) + " --set train.max_steps=4 --json"));
    EXPECT_EQ(d.code, 1) << c.sets << "\n" << d.output;
    bool found = false;
    const nlohmann::json report = nlohmann::json::parse(d.out);
    for (const auto& check : report.at("checks"))
      found |= check.at("check") == "resume" && check.at("severity") == "error" &&
               check.at("message").get<std::string>().find(c.message) != std::string::npos;
    EXPECT_TRUE(found) << c.sets << "\n" << d.out;
    EXPECT_EQ(tree_state(dir), before) << c.sets << ": doctor changed the out_dir";
    test::KeelRun t =
        test::run_keel_sh("train " + resume(c.run, c.sets) + " --set train.max_steps=4");
    EXPECT_NE(t.code, 0) << c.sets << "\n" << t.output;
    EXPECT_CONTAINS(t.err, c.message);
  }
  EXPECT_EQ(tree_state(dir), before) << "a refused train changed the out_dir";
  // The data file changed since the checkpoint.
  { std::ofstream(dir + "/corpus.txt", std::ios::app) << "more text\n"; }
  test::KeelRun data = doctor(resume("text", "--set train.max_steps=4 --no-sanity"));
  EXPECT_EQ(data.code, 1) << data.output;
  EXPECT_CONTAINS(data.out, "[error  ] resume: " + dir +
                                "/text/checkpoints/last/trainer.json: the data changed since "
                                "this checkpoint was written");
  // A lost `last` beside step-N checkpoints, and a `last` missing a file.
  std::filesystem::rename(dir + "/arith/checkpoints/last", dir + "/arith-last");
  test::KeelRun lost = doctor(resume("arith", "--set train.max_steps=4 --no-sanity"));
  EXPECT_EQ(lost.code, 1) << lost.output;
  EXPECT_CONTAINS(lost.out, "[error  ] resume: run.resume = true but " + dir +
                                "/arith/checkpoints/last does not exist, while " + dir +
                                "/arith/checkpoints/step-2 does");
  std::filesystem::rename(dir + "/arith-last", dir + "/arith/checkpoints/last");
  std::filesystem::remove(dir + "/arith/checkpoints/last/optimizer.safetensors");
  test::KeelRun damaged = doctor(resume("arith", "--set train.max_steps=4 --no-sanity"));
  EXPECT_EQ(damaged.code, 1) << damaged.output;
  EXPECT_CONTAINS(damaged.out, "optimizer.safetensors");
  // No checkpoint at all: train starts from scratch, and says so; doctor warns.
  std::filesystem::remove_all(dir + "/arith/checkpoints");
  test::KeelRun none = doctor(resume("arith", "--set train.max_steps=4 --no-sanity"));
  EXPECT_CONTAINS(none.out, "[warning] resume: run.resume = true but " + dir +
                                "/arith/checkpoints/last does not exist: starting from scratch");
}

}  // namespace
}  // namespace keel
