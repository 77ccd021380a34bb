// Every example under examples/ does what its README says (issue 21 item 8). Two layers:
//  - ReadmesShowWhatTheRunsPrint: for every example directory (a new one is covered without
//    touching this file), each plain ``` block that follows a ```sh block is output that the
//    block's first `keel train` command prints: every line must match an output line, in order,
//    "..." standing for any text (a line that is only "..." skips lines). "exit code N" is the
//    command's exit status. Blocks with an info string (```text, ```toml) are not output.
//  - one test per example for the claims in its prose (numbers, files, counters).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::step_records;

const std::string kSrc = KEEL_SOURCE_DIR;

struct Block {
  std::string info;  // the fence's info string ("sh", "", "text", ...)
  std::vector<std::string> lines;
};

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

std::vector<Block> fenced_blocks(const std::string& md) {
  std::vector<Block> out;
  std::istringstream in(md);
  std::string line;
  Block* open = nullptr;
  while (std::getline(in, line)) {
    const std::string t = trim(line);  // fences inside list items are indented
    if (t.rfind("```", 0) == 0) {
      if (open) {
        open = nullptr;
      } else {
        out.push_back({t.substr(3), {}});
        open = &out.back();
      }
    } else if (open) {
      open->lines.push_back(line);
    }
  }
  return out;
}

// The first `keel train ...` command of a sh block (backslash continuations joined), without its
// trailing `; ...` or `# ...`, and without the binary's path.
std::string train_command(const Block& b) {
  std::string joined;
  for (const std::string& l : b.lines) {
    std::string t = trim(l);
    const bool cont = !t.empty() && t.back() == '\\';
    if (cont) t.pop_back();
    joined += t + " ";
    if (cont) continue;
    const auto at = joined.find("keel train ");
    if (at != std::string::npos) {
      std::string cmd = joined.substr(at + 5);
      for (const char* end : {";", "#"})
        if (cmd.find(end) != std::string::npos) cmd = cmd.substr(0, cmd.find(end));
      return trim(cmd);
    }
    joined.clear();
  }
  return "";
}

// Whether `line` matches `pattern`, "..." standing for any text.
bool matches(const std::string& pattern, const std::string& line) {
  const std::string p = trim(pattern), l = trim(line);
  size_t pos = 0, from = 0;
  bool first = true;
  while (true) {
    const size_t dots = p.find("...", from);
    const std::string piece =
        p.substr(from, dots == std::string::npos ? std::string::npos : dots - from);
    if (!piece.empty()) {
      const size_t at = l.find(piece, pos);
      if (at == std::string::npos || (first && at != 0)) return false;
      pos = at + piece.size();
    }
    first = false;
    if (dots == std::string::npos) return pos == l.size() || piece.empty();
    from = dots + 3;
  }
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) v.push_back(l);
  return v;
}

// Runs `keel <cmd>` from the repository root (the examples name their files relative to it), with
// the run's out_dir in `out` and one thread.
test::KeelRun run_from_root(const std::string& cmd, const std::string& out,
                            const std::vector<std::string>& sets = {}) {
  std::string line = "cd '" + kSrc + "' && '" + test::keel_binary() + "' " + cmd +
                     " --set run.out_dir='" + out + "' --set run.threads=1";
  for (const std::string& s : sets) line += " --set '" + s + "'";
  return test::run_command({"/bin/sh", "-c", line}, {"OMP_NUM_THREADS=1"});
}

TEST(CliExamples, ReadmesShowWhatTheRunsPrint) {
  int examples = 0, checked_blocks = 0;
  for (const auto& entry : fs::directory_iterator(kSrc + "/examples")) {
    if (!entry.is_directory()) continue;
    ++examples;
    const std::string name = entry.path().filename().string();
    const std::string readme = test::slurp(entry.path().string() + "/README.md");
    ASSERT_FALSE(readme.empty()) << "examples/" << name << " has no README.md";
    std::string cmd;
    std::map<std::string, test::KeelRun> runs;
    for (const Block& b : fenced_blocks(readme)) {
      if (b.info == "sh") {
        cmd = train_command(b);
        continue;
      }
      if (!b.info.empty()) continue;
      ASSERT_FALSE(cmd.empty()) << "examples/" << name << ": an output block without a keel "
                                << "train command before it";
      if (!runs.count(cmd)) {
        const std::string out = test::temp_dir("example-" + name) + "/out";
        runs[cmd] = run_from_root(cmd, out);
      }
      const test::KeelRun& r = runs[cmd];
      std::vector<std::string> printed = lines_of(r.out + r.err);
      printed.push_back("exit code " + std::to_string(r.code));
      size_t at = 0;
      for (const std::string& want : b.lines) {
        if (trim(want) == "..." || trim(want).empty()) continue;
        while (at < printed.size() && !matches(want, printed[at])) ++at;
        EXPECT_LT(at, printed.size()) << "examples/" << name << "/README.md shows\n  " << want
                                      << "\nbut `keel " << cmd << "` printed (in this order):\n"
                                      << r.out << r.err;
        if (at >= printed.size()) break;
        ++at;
      }
      ++checked_blocks;
    }
  }
  EXPECT_GE(examples, 4);
  EXPECT_GE(checked_blocks, 4);
}

TEST(CliExamples, MatcherReadsDotsAsAnyText) {
  EXPECT_TRUE(matches("step 1/5 | loss 5.638 | ...", "step 1/5 | loss 5.638 | grad_norm 1"));
  EXPECT_TRUE(matches("error: every step ... epoch 1 ...", "error: every step x epoch 1 (y)"));
  EXPECT_FALSE(matches("step 1/5 | loss 5.638 | ...", "step 1/5 | loss 5.639 | grad_norm 1"));
  EXPECT_FALSE(matches("loss 5.638", "step 1 | loss 5.638")) << "the first piece starts the line";
  EXPECT_FALSE(matches("done: 5 steps", "done: 5 steps, checkpoint")) << "no dots, whole line";
}

// all-nonfinite: step 1 applies the destructive update, every later step is non-finite (nan, never
// 0.0) with a growing nan counter, and the first epoch without an update stops with exit code 1.
TEST(CliExamples, AllNonfinite) {
  const std::string out = test::temp_dir("example-all-nonfinite");
  const test::KeelRun r = run_from_root("train examples/all-nonfinite/config.toml", out);
  ASSERT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err,
                  "error: every step produced non-finite gradients in epoch 1 (no update "
                  "was applied");
  const auto recs = step_records(out);
  ASSERT_GE(recs.size(), 9u) << r.output;  // epoch 0 (8 steps) and epoch 1
  EXPECT_TRUE(recs[0].at("grad_norm").is_number()) << "step 1 applies the update";
  for (size_t i = 1; i < recs.size(); ++i) {
    EXPECT_EQ(recs[i].at("grad_norm"), "nan") << recs[i].dump();
    EXPECT_EQ(recs[i].at("nan_steps").get<int64_t>(), static_cast<int64_t>(i)) << recs[i].dump();
  }
  EXPECT_CONTAINS(r.out, "NON-FINITE");
}

// remainder-window: one step per epoch, each with the one example's tokens, the epoch loss logged;
// under 16-mixed the scaler's first skip is calibration and the run trains to the end.
TEST(CliExamples, RemainderWindow) {
  const std::string out = test::temp_dir("example-remainder");
  const test::KeelRun r =
      run_from_root("train examples/remainder-window/config.toml", out + "/32", {"log.every=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  const auto recs = step_records(out + "/32");
  ASSERT_EQ(recs.size(), 5u);
  for (size_t i = 0; i < recs.size(); ++i) {
    EXPECT_EQ(recs[i].at("epoch").get<int64_t>(), static_cast<int64_t>(i));
    EXPECT_TRUE(recs[i].at("loss").is_number());
    EXPECT_CONTAINS(r.out, "step " + std::to_string(i + 1) + "/5 | loss ");
  }
  EXPECT_LT(recs.back().at("loss").get<double>(), recs.front().at("loss").get<double>());
  // The epoch records: token mean over the applied steps (one step each: that step's loss).
  std::vector<json> epochs;
  std::ifstream in(out + "/32/metrics.jsonl");
  for (std::string l; std::getline(in, l);)
    if (json j = json::parse(l); j.contains("epoch_loss")) epochs.push_back(j);
  ASSERT_EQ(epochs.size(), 5u);
  for (size_t i = 0; i < epochs.size(); ++i) {
    EXPECT_EQ(epochs[i].at("epoch_updates").get<int64_t>(), 1);
    EXPECT_EQ(epochs[i].at("epoch_tokens").get<int64_t>(), epochs[0].at("epoch_tokens"));
    EXPECT_EQ(epochs[i].at("epoch_loss").get<double>(), recs[i].at("loss").get<double>());
  }

  const test::KeelRun h = run_from_root(
      "train examples/remainder-window/config.toml --set train.precision=16-mixed", out + "/16");
  ASSERT_EQ(h.code, 0) << h.output;
  EXPECT_CONTAINS(h.out,
                  "epoch 0 | no update applied: its steps were the loss scaler's "
                  "calibration skips");
  EXPECT_CONTAINS(h.out, "done: 5 steps");
}

// precision = auto is reported as auto's choice in the training header (the policy it resolved
// to, and that it was chosen), not as if the config had named it.
TEST(CliExamples, PrecisionAutoIsReportedAsAutosChoice) {
  const std::string out = test::temp_dir("example-auto");
  const test::KeelRun r =
      run_from_root("train examples/remainder-window/config.toml --set train.precision=auto", out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.out, "(precision = auto's choice on ");
  const test::KeelRun named = run_from_root(
      "train examples/remainder-window/config.toml --set train.precision=32-true", out + "/named");
  EXPECT_NOT_CONTAINS(named.out, "auto's choice");
}

// lora-llama-bf16: make_checkpoint.sh writes the HF base, the run writes metrics, TensorBoard,
// checkpoints and a PEFT adapter directory with the keys and tensor names the README lists; step 1
// has the README's loss and grad norm (3 steps here: step 1 runs before any update, whatever
// max_steps is).
TEST(CliExamples, LoraLlamaBf16) {
  const std::string out = test::temp_dir("example-lora");
  const test::KeelRun m = test::run_command(
      {"/bin/sh", kSrc + "/examples/lora-llama-bf16/make_checkpoint.sh"},
      {"KEEL=" + test::keel_binary(), "OUT=" + out + "/base", "OMP_NUM_THREADS=1"});
  ASSERT_EQ(m.code, 0) << m.output;
  const test::KeelRun r = run_from_root("train examples/lora-llama-bf16/config.toml", out + "/run",
                                        {"model.path=" + out + "/base", "train.max_steps=3"});
  ASSERT_EQ(r.code, 0) << r.output;
  const auto recs = step_records(out + "/run");
  ASSERT_EQ(recs.size(), 3u);
  // The first row of the README's table: | 1 | bf16 loss | f32 loss | bf16 grad_norm | f32 ... |
  // bf16 products round differently on CPUs with AMX, with AVX-512 and with AVX2 only (no bf16
  // kernel: products in f32 from exact copies): AMX machines print 5.6526 where the README says
  // 5.6525, the AVX2 kernel set (an AMD EPYC) reads 5.65266.
  const std::string readme = test::slurp(kSrc + "/examples/lora-llama-bf16/README.md");
  const size_t row = readme.find("\n| 1 | ");
  ASSERT_NE(row, std::string::npos) << "the README has no row for step 1";
  double bf16_loss = 0, f32_loss = 0, bf16_norm = 0;
  ASSERT_EQ(std::sscanf(readme.c_str() + row, "\n| 1 | %lf | %lf | %lf |", &bf16_loss, &f32_loss,
                        &bf16_norm),
            3)
      << readme.substr(row + 1, readme.find('\n', row + 1) - row - 1);
  EXPECT_NEAR(recs[0].at("loss").get<double>(), bf16_loss, 2.5e-4) << "the README's step-1 loss";
  EXPECT_NEAR(recs[0].at("grad_norm").get<double>(), bf16_norm, 1.5e-3)
      << "the README's step-1 grad_norm";
  for (const json& j : recs)
    EXPECT_EQ(j.at("skipped_steps").get<int64_t>() + j.at("nan_steps").get<int64_t>(), 0);
  EXPECT_TRUE(fs::exists(out + "/run/checkpoints/last"));
  EXPECT_FALSE(fs::is_empty(out + "/run/tb"));
  const json cfg = json::parse(test::slurp(out + "/run/adapter/adapter_config.json"));
  EXPECT_EQ(cfg.at("peft_type"), "LORA");
  EXPECT_EQ(cfg.at("r"), 32);
  EXPECT_EQ(cfg.at("lora_alpha").get<double>(), 64.0);
  EXPECT_EQ(cfg.at("lora_dropout").get<double>(), 0.05);
  EXPECT_EQ(cfg.at("task_type"), "CAUSAL_LM");
  EXPECT_EQ(cfg.at("use_dora"), false);
  EXPECT_EQ(cfg.at("target_modules").size(), 5u);
  EXPECT_CONTAINS(test::slurp(out + "/run/adapter/adapter_model.safetensors"),
                  "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
}

}  // namespace
}  // namespace keel
