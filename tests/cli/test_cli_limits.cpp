// Sizes from input end as errors, never as crashes or hangs (issue 22, item 1): a run whose
// estimated memory exceeds MemAvailable is refused before anything large is allocated, naming the
// estimate and the keys; threads beyond the cores are capped with a warning; absurd sizes are
// config errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

using test::run_keel;

int64_t available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  long long kb = -1;
  while (std::getline(in, line))
    if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kb) == 1) return kb * 1024;
  return -1;
}

std::vector<std::string> tiny_limits(const std::string& out, std::vector<std::string> more = {}) {
  std::vector<std::string> s = {"train",
                                "--set",
                                "run.out_dir=" + out,
                                "--set",
                                "model.n_layer=1",
                                "--set",
                                "model.n_embd=32",
                                "--set",
                                "model.n_head=2",
                                "--set",
                                "data.num_examples=32",
                                "--set",
                                "data.eval_examples=0",
                                "--set",
                                "data.seq_len=16",
                                "--set",
                                "train.batch_size=8",
                                "--set",
                                "train.max_steps=2",
                                "--set",
                                "log.tensorboard=false"};
  for (const std::string& m : more) s.insert(s.end(), {"--set", m});
  return s;
}

TEST(CliLimits, ARunThatCannotFitIsRefusedBeforeAllocating) {
  const std::string out = test::temp_dir("cli-limits-mem");
  // 1024 layers 65536 wide: about 2 PB of weights; it used to be built (or killed by the OOM
  // killer) before anything was checked.
  auto r =
      run_keel(tiny_limits(out, {"model.n_layer=1024", "model.n_embd=65536", "model.n_head=64"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "the run needs at least");
  EXPECT_CONTAINS(r.err, "MemAvailable");
  EXPECT_CONTAINS(r.err, "model.n_layer");
  EXPECT_CONTAINS(r.err, "train.batch_size");
  EXPECT_LT(r.max_rss_kb, 512 * 1024) << "refused only after allocating";
  // Weights of a third of the available memory: the lower bound passes, the full estimate (with
  // gradients and AdamW's two moments, 4x the weights) does not.
  const int64_t avail = available_bytes();
  ASSERT_GT(avail, 0);
  const int64_t width = std::max<int64_t>(
      64, static_cast<int64_t>(std::sqrt(static_cast<double>(avail) / 144.0)) / 64 * 64);
  r = run_keel(tiny_limits(out, {"model.n_embd=" + std::to_string(width)}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "the run needs");
  EXPECT_CONTAINS(r.err, "are available (MemAvailable");
  EXPECT_EQ(r.err.find("bad_alloc"), std::string::npos) << r.err;
}

// An allocation that fails for real (the address space capped below what the run needs, while
// MemAvailable says it fits, so the estimate's check passes) is an error naming the keys that size
// the run, exit 1: never "std::bad_alloc" and never a crash. AddressSanitizer reserves terabytes
// of shadow address space, so the cap cannot apply under it.
TEST(CliLimits, AnAllocationThatFailsIsAnOutOfMemoryErrorNamingTheKeys) {
  // GCC defines __SANITIZE_ADDRESS__, clang does not (it has __has_feature); the sanitized suites
  // also set KEEL_TEST_SANITIZED.
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "an address-space limit cannot apply under AddressSanitizer";
#else
  if (std::getenv("KEEL_TEST_SANITIZED"))
    GTEST_SKIP() << "an address-space limit cannot apply under AddressSanitizer";
  const std::string out = test::temp_dir("cli-limits-oom");
  std::string cmd = "ulimit -v 700000 && exec " + std::string(KEEL_BINARY_DIR) + "/keel";
  for (const std::string& a :
       tiny_limits(out, {"model.n_layer=4", "model.n_embd=1024", "model.n_head=8",
                         "train.batch_size=64", "data.seq_len=64", "run.threads=1"}))
    cmd += " '" + a + "'";
  auto r = test::run_command({"/bin/sh", "-c", cmd});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "out of memory");
  EXPECT_CONTAINS(r.err, "train.batch_size");
  EXPECT_CONTAINS(r.err, "keel memory");
  EXPECT_EQ(r.output.find("bad_alloc"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("keel/"), std::string::npos)
      << "a path into keel's sources: " << r.output;
#endif
}

// The allocator's message names training's keys: `keel init-model` (or generate, export) out of
// memory was told to "lower train.batch_size or data.seq_len", which it has not. Now each
// command's own: here its size flags.
TEST(CliLimits, OutOfMemoryOutsideTrainingNamesTheCommandsOwnFix) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "an address-space limit cannot apply under AddressSanitizer";
#else
  if (std::getenv("KEEL_TEST_SANITIZED"))
    GTEST_SKIP() << "an address-space limit cannot apply under AddressSanitizer";
  const std::string out = test::temp_dir("cli-limits-oom-init") + "/m";
  // 8 layers 2048 wide: 1.6 GB of f32 weights under a 700 MB address space.
  auto r = test::run_command({"/bin/sh", "-c",
                              "ulimit -v 700000 && exec " + std::string(KEEL_BINARY_DIR) +
                                  "/keel init-model --out " + out +
                                  " --n-layer 8 --n-embd 2048 --n-head 16"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "out of memory allocating a tensor of");
  EXPECT_CONTAINS(r.err, "lower --n-layer, --n-embd or --vocab-size");
  EXPECT_EQ(r.err.find("train.batch_size"), std::string::npos) << r.err;
  EXPECT_EQ(r.output.find("bad_alloc"), std::string::npos) << r.output;
#endif
}

TEST(CliLimits, ThreadsBeyondTheCoresAreCappedWithAWarning) {
  const std::string out = test::temp_dir("cli-limits-threads");
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  auto r = run_keel(tiny_limits(out, {"run.threads=4096"}));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "run.threads = 4096 exceeds the " + std::to_string(cores) +
                             " cores of this machine: using " + std::to_string(cores));
  r = run_keel(tiny_limits(out, {"run.threads=100000"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "run.threads must be in [0, 4096], got 100000");
}

TEST(CliLimits, OverflowingSizeKeysAreConfigErrors) {
  const std::string out = test::temp_dir("cli-limits-keys");
  for (const char* key : {"model.vocab_size", "model.max_seq_len", "train.batch_size",
                          "train.grad_accum", "model.intermediate_size"}) {
    auto r = run_keel(tiny_limits(out, {std::string(key) + "=9223372036854775807"}));
    EXPECT_EQ(r.code, 2) << key << ": " << r.output;
    EXPECT_CONTAINS(r.err, std::string(key) + " must be in [");
  }
}

// A device never ends: /dev/zero as a dataset, a tokenizer or the config was read until the OOM
// killer stopped the run. Each is a config error naming the key before anything is allocated.
TEST(CliLimits, DevicesNamedAsInputFilesAreConfigErrors) {
  const std::string out = test::temp_dir("cli-limits-devices");
  auto r = run_keel(tiny_limits(out, {"data.task=text", "data.path=/dev/zero"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "dataset file /dev/zero is a character device, not a file; "
                  "data.path must name a file");
  r = run_keel(tiny_limits(
      out, {"data.task=text", "data.path=/dev/null", "data.tokenizer=hf:/dev/urandom"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "HF tokenizer file /dev/urandom is a character device");
  r = run_keel({"train", "/dev/zero"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "cannot read config file /dev/zero: it is a character device");
}

// keel init-model's flags are the model.* keys' values: the same bounds and messages (before,
// --n-layer 1000000000 ran for minutes and --norm-eps -1 or --rope-theta 0 wrote a model whose
// first forward is NaN), and a model that cannot fit is refused before it is built.
TEST(CliLimits, InitModelFlagsHaveTheConfigKeysBounds) {
  const std::string out = test::temp_dir("cli-limits-init") + "/m";
  auto init = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), {"init-model", "--out", out});
    return run_keel(flags);
  };
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--n-layer", "1000000000"}, "init-model --n-layer 1000000000: model.n_layer must be in ["},
      {{"--n-embd", "99999999999", "--n-head", "1"}, "model.n_embd must be in [1, 65536]"},
      {{"--norm-eps", "-1"}, "init-model --norm-eps -1: model.norm_eps must be > 0, got -1"},
      {{"--norm-eps", "nan"}, "model.norm_eps must be a finite number, got nan"},
      {{"--rope-theta", "0"}, "init-model --rope-theta 0: model.rope_theta must be > 0"},
      {{"--init-std", "inf"}, "model.init_std must be a finite number, got inf"},
      {{"--shard-bytes", "-5"}, "init-model --shard-bytes -5: use 0 (one file)"},
      // A one-token vocabulary was written (nothing to learn: the loss is 0), 0 named no flag.
      {{"--vocab-size", "1"}, "init-model --vocab-size 1: a model needs at least 2 tokens"},
      {{"--vocab-size", "0"}, "init-model --vocab-size 0: a model needs at least 2 tokens"},
      // Dropped silently for GPT-2 (the summary still printed "(2 kv)").
      {{"--family", "gpt2", "--n-kv-head", "2"}, "GPT-2 has no grouped key/value heads"},
      {{"--family", "gpt2", "--rope-theta", "5"}, "GPT-2 has learned positions, no RoPE"},
      // Draws f16 cannot hold: the model was written with 95% of its embedding inf.
      {{"--dtype", "f16", "--init-std", "1e6"}, "init-model --init-std 1e+06: "},
      // Sizes that do not fit together named the model's fields ("model: llama needs an even
      // head dim for RoPE, got 9"), not the flags.
      {{"--n-embd", "64", "--n-head", "3"},
       "init-model --n-embd 64 is not divisible by --n-head 3"},
      {{"--n-embd", "36", "--n-head", "4"},
       "init-model --n-embd 36 / --n-head 4 gives heads of 9 channels; llama's rotary embedding"},
      {{"--n-kv-head", "3"}, "init-model --n-head 4 is not a multiple of --n-kv-head 3"},
      {{"--head-dim", "9"}, "init-model --head-dim 9 is odd; llama's rotary embedding"},
      {{"--family", "gpt2", "--head-dim", "32"}, "GPT-2's heads are --n-embd / --n-head wide"},
      {{"--head-dim", "2048"}, "init-model --head-dim 2048: model.head_dim must be in [0, 1024]"},
      // Taken as 2^64 - 1 (and 2^64 as 0): bounded as run.seed is.
      {{"--seed", "-1"},
       "--seed: -1: use a whole number from 0 to 9223372036854775807 (as run.seed)"},
      {{"--seed", "9223372036854775808"}, "--seed: 9223372036854775808: use a whole number"},
      {{"--seed", "18446744073709551616"}, "--seed: 18446744073709551616: use a whole number"},
  };
  for (const auto& [flags, want] : cases) {
    const auto r = init(flags);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, want);
  }
  const int64_t avail = available_bytes();
  if (avail > 0 && avail < (int64_t{1} << 42)) {  // 3.3 TB of f32 weights
    const auto r = init({"--n-layer", "1024", "--n-embd", "8192", "--n-head", "64"});
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, "init-model: 824921063424 parameters need 3299.68 GB in f32");
    EXPECT_CONTAINS(r.err, "lower --n-layer");
  }
  EXPECT_FALSE(std::filesystem::exists(out));
}

}  // namespace
}  // namespace keel
