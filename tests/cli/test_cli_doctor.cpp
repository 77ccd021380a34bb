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

}  // namespace
}  // namespace keel
