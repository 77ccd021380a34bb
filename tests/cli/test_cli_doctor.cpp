// `keel doctor` through the binary: exit 0 with a readable report when nothing blocks training,
// exit 1 (and the JSON's blocking = true) when something does, exit 2 for a bad config.
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

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

}  // namespace
}  // namespace keel
