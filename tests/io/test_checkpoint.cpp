#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "keel/io/checkpoint.h"
#include "keel/io/safetensors.h"
#include "keel/numerics/error.h"
#include "tests/support/check.h"

namespace keel::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::error_of;

// A model and optimizer state whose values depend on `tag`, so that checkpoints are told apart.
struct State {
  NamedTensors model, optimizer;
  json trainer;
};

State make_state(int tag) {
  State s;
  const float t = static_cast<float>(tag);
  s.model = {
      {"transformer.wte.weight", test::randn({16, 8}, 100 + tag)},  // [V, C]
      {"transformer.h.0.ln_1.weight", Tensor::full({8}, t)},
      {"transformer.h.0.attn.c_attn.weight", test::randn({8, 24}, 200 + tag, 1.f, DType::BF16)},
      {"transformer.h.0.mlp.c_fc.weight", test::randn({8, 32}, 300 + tag, 1.f, DType::F16)},
      {"scalar", Tensor::full({}, -t)},
      {"empty", Tensor::zeros({0, 3})},
  };
  s.optimizer = {
      {"state.0.exp_avg", test::randn({16, 8}, 400 + tag)},
      {"state.0.exp_avg_sq", test::rand_uniform({16, 8}, 500 + tag, 0.f, 1.f)},
      {"state.0.step", Tensor::from_ints({tag}, {1}, DType::I64)},
      {"masks", Tensor::from_ints({1, 0, 1, tag % 2}, {4}, DType::U8)},
      {"ids", Tensor::from_ints({-1, 2, 3}, {3}, DType::I32)},
  };
  s.trainer = {
      {"step", 10 * tag},
      {"epoch", tag},
      {"sampler", {{"epoch", tag}, {"index", 123}}},
      {"rng", {18446744073709551615ull, 1ull, 42ull, 9007199254740993ull}},
      {"scaler", {{"scale", 65536.0 / tag}, {"growth_factor", 2.0}, {"_growth_tracker", 7}}},
      {"precision", "16-mixed"}};
  return s;
}

void expect_same(const NamedTensors& got, const NamedTensors& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first) << what << " tensor " << i;  // saved order is kept
    EXPECT_EQ(got[i].second.dtype(), want[i].second.dtype()) << what << " " << want[i].first;
    EXPECT_EQ(got[i].second.shape(), want[i].second.shape()) << what << " " << want[i].first;
    if (got[i].second.nbytes() == want[i].second.nbytes()) {
      EXPECT_EQ(std::memcmp(got[i].second.data(), want[i].second.data(), want[i].second.nbytes()),
                0)
          << what << " " << want[i].first << " differs";
    }
  }
}

void expect_checkpoint(const std::string& dir, int tag) {
  const State s = make_state(tag);
  const Checkpoint c = load_checkpoint(dir);
  expect_same(c.model, s.model, "model of checkpoint " + std::to_string(tag));
  expect_same(c.optimizer, s.optimizer, "optimizer of checkpoint " + std::to_string(tag));
  EXPECT_EQ(c.trainer_state, s.trainer);
}

void save(const std::string& dir, int tag) {
  const State s = make_state(tag);
  save_checkpoint(dir, s.model, s.optimizer, s.trainer);
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Checkpoint, RoundTripIsBitExactAndKeepsOrder) {
  const std::string root = test::temp_dir("ckpt");
  const std::string dir = root + "/checkpoints/last";  // parents are created
  save(dir, 1);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"model.safetensors", "optimizer.safetensors",
                                                    "trainer.json"}));
  EXPECT_EQ(entries(root + "/checkpoints"), (std::vector<std::string>{"last"}));  // no leftovers
  expect_checkpoint(dir, 1);
  EXPECT_EQ(load_checkpoint(dir).dir, fs::path(dir).string());
  // Big integers in the trainer state (RNG words) survive exactly.
  EXPECT_EQ(load_checkpoint(dir).trainer_state["rng"][0].get<uint64_t>(), 18446744073709551615ull);
  // The files are ordinary safetensors / JSON (PyTorch and HF read them).
  const Safetensors st = read_safetensors(dir + "/model.safetensors");
  EXPECT_EQ(st.metadata.at("format"), "pt");
  EXPECT_TRUE(checkpoint_exists(dir));
  EXPECT_TRUE(checkpoint_exists(dir + "/"));
  expect_checkpoint(dir + "/", 1);
  EXPECT_FALSE(checkpoint_exists(root + "/checkpoints/step-5"));
}

TEST(Checkpoint, OverwriteReplacesTheWholeCheckpoint) {
  const std::string root = test::temp_dir("ckpt");
  const std::string dir = root + "/last";
  save(dir, 1);
  // A stray file in the old checkpoint must not survive into the new one: it is replaced whole.
  std::ofstream(dir + "/stray.txt") << "old";
  save(dir, 2);
  expect_checkpoint(dir, 2);
  EXPECT_FALSE(fs::exists(dir + "/stray.txt"));
  EXPECT_EQ(entries(root), (std::vector<std::string>{"last"}));
  save(dir, 3);
  expect_checkpoint(dir, 3);
  EXPECT_EQ(entries(root), (std::vector<std::string>{"last"}));
}

// What a crash at each stage of a save leaves: a child process saves checkpoint 2 over checkpoint 1
// and dies (_exit, no cleanup) right after `stage`.
std::string g_crash_stage;
void crash_at(const char* stage) {
  if (g_crash_stage == stage) ::_exit(0);
}

void crash_during_save(const std::string& dir, const std::string& stage) {
  const State s = make_state(2);  // built before fork: the child only writes files
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    g_crash_stage = stage;
    set_checkpoint_stage_hook(crash_at);
    try {
      save_checkpoint(dir, s.model, s.optimizer, s.trainer);
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(1);  // the stage was never reached
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0) << "the save did not reach stage " << stage;
}

TEST(Checkpoint, ACrashAtAnyStageLeavesACompleteCheckpoint) {
  // Stage -> the checkpoint a reader sees after the crash.
  const std::vector<std::pair<std::string, int>> stages = {
      {"tmp_written", 1}, {"moved_aside", 1}, {"renamed", 2}, {"done", 2}};
  for (auto& [stage, expected] : stages) {
    SCOPED_TRACE("crash after " + stage);
    const std::string root = test::temp_dir("ckpt-crash");
    const std::string dir = root + "/last";
    save(dir, 1);
    crash_during_save(dir, stage);
    EXPECT_TRUE(checkpoint_exists(dir));
    expect_checkpoint(dir, expected);
    if (stage == "moved_aside") {
      // Between the renames `last` is missing; the reader finds the complete old one aside.
      EXPECT_FALSE(fs::exists(dir));
      EXPECT_NE(load_checkpoint(dir).dir.find("last.old-"), std::string::npos);
    }
    if (stage == "tmp_written") {
      // The finished temporary is ignored: `last` still holds checkpoint 1.
      EXPECT_EQ(entries(root).size(), 2u);
      EXPECT_EQ(load_checkpoint(dir).dir, fs::path(dir).string());
    }
    // The next save cleans up whatever the crash left and writes a complete checkpoint.
    save(dir, 3);
    expect_checkpoint(dir, 3);
    EXPECT_EQ(entries(root), (std::vector<std::string>{"last"}));
  }
}

TEST(Checkpoint, PartialTemporaryDirectoriesAreIgnoredAndCleaned) {
  const std::string root = test::temp_dir("ckpt");
  const std::string dir = root + "/step-10";
  save(dir, 1);
  // A crash while writing the temporary: a half-written sibling.
  fs::create_directory(root + "/step-10.tmp-99999");
  std::ofstream(root + "/step-10.tmp-99999/model.safetensors") << "partial";
  // Similar names of other checkpoints are not touched.
  save(root + "/step-100", 4);
  expect_checkpoint(dir, 1);
  save(dir, 2);
  expect_checkpoint(dir, 2);
  expect_checkpoint(root + "/step-100", 4);
  EXPECT_EQ(entries(root), (std::vector<std::string>{"step-10", "step-100"}));
  // A first save that crashed leaves only a temporary: there is no checkpoint.
  fs::create_directory(root + "/new.tmp-123");
  std::ofstream(root + "/new.tmp-123/trainer.json") << "{}";
  EXPECT_FALSE(checkpoint_exists(root + "/new"));
  const std::string msg = error_of([&] { load_checkpoint(root + "/new"); });
  EXPECT_NE(msg.find("no checkpoint at " + root + "/new"), std::string::npos) << msg;
}

TEST(Checkpoint, TruncatedSafetensorsNamesTheFileAndTensor) {
  const std::string dir = test::temp_dir("ckpt") + "/last";
  save(dir, 1);
  const std::string file = dir + "/optimizer.safetensors";
  // The last tensor in the data section is "ids" (3 x i32): cut into it.
  fs::resize_file(file, fs::file_size(file) - 5);
  const std::string msg = error_of([&] { load_checkpoint(dir); });
  EXPECT_NE(msg.find(file), std::string::npos) << msg;
  EXPECT_NE(msg.find("'ids'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  // Cut into the header: still named.
  fs::resize_file(file, 20);
  const std::string msg2 = error_of([&] { load_checkpoint(dir); });
  EXPECT_NE(msg2.find(file), std::string::npos) << msg2;
}

TEST(Checkpoint, MissingOrCorruptFilesAreNamed) {
  const std::string dir = test::temp_dir("ckpt") + "/last";
  save(dir, 1);
  std::ofstream(dir + "/trainer.json") << "{\"step\": 10,";
  std::string msg = error_of([&] { load_checkpoint(dir); });
  EXPECT_NE(msg.find(dir + "/trainer.json: invalid JSON"), std::string::npos) << msg;
  std::ofstream(dir + "/trainer.json") << "{\"step\": 1e400}";  // out_of_range, not parse_error
  msg = error_of([&] { load_checkpoint(dir); });
  EXPECT_NE(msg.find(dir + "/trainer.json: invalid JSON (number overflow"), std::string::npos)
      << msg;
  fs::remove(dir + "/model.safetensors");
  msg = error_of([&] { load_checkpoint(dir); });
  EXPECT_NE(msg.find(dir + "/model.safetensors is missing"), std::string::npos) << msg;
  EXPECT_FALSE(checkpoint_exists(dir));
}

// checkpoints/last as a symbolic link that leads back to itself: resume printed std::filesystem's
// "filesystem error: status: Too many levels of symbolic links [OUT/checkpoints/last]".
TEST(Checkpoint, ASymbolicLinkLoopIsNamedWithTheFix) {
  const std::string root = test::temp_dir("ckpt-loop");
  const std::string dir = root + "/last";
  fs::create_symlink("last", dir);
  std::string msg = error_of([&] { checkpoint_exists(dir); });
  EXPECT_NE(msg.find("cannot look at " + dir + ": "), std::string::npos) << msg;
  EXPECT_NE(msg.find("leads back to itself; fix or remove it"), std::string::npos) << msg;
  msg = error_of([&] { load_checkpoint(dir); });
  EXPECT_NE(msg.find("leads back to itself"), std::string::npos) << msg;
  // A file of a checkpoint that loops.
  const std::string ok = root + "/step-1";
  save(ok, 1);
  fs::remove(ok + "/trainer.json");
  fs::create_symlink("trainer.json", ok + "/trainer.json");
  msg = error_of([&] { load_checkpoint(ok); });
  EXPECT_NE(msg.find("cannot look at " + ok + "/trainer.json"), std::string::npos) << msg;
}

TEST(Checkpoint, NonFiniteTrainerStateIsRejectedBeforeWriting) {
  const std::string dir = test::temp_dir("ckpt") + "/last";
  save(dir, 1);
  State s = make_state(2);
  s.trainer["scaler"]["scale"] = std::numeric_limits<double>::infinity();
  const std::string msg = error_of([&] { save_checkpoint(dir, s.model, s.optimizer, s.trainer); });
  EXPECT_NE(msg.find("/scaler/scale"), std::string::npos) << msg;
  expect_checkpoint(dir, 1);  // untouched
  EXPECT_EQ(entries(fs::path(dir).parent_path().string()), (std::vector<std::string>{"last"}));
}

}  // namespace
}  // namespace keel::io
