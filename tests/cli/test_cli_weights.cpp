// Non-finite weights in a loaded checkpoint (issue 21 item 5), produced the natural way: one
// 16-true step at optim.lr = 1e5 (an AdamW step moves each weight by about lr, beyond f16's 65504)
// overflows the f16 weights. The run refuses to make them checkpoints/last (exit 1) and writes
// them to checkpoints/nonfinite-step-1. Loading that checkpoint as model.path, or resuming from it
// (copied to last, as a hand or another tool would), stops at load time naming the checkpoint's
// file, the tensor, the count and the first index (keel's layout is the file's here), exit 2;
// model.allow_nonfinite_weights = true loads it anyway with a warning, and the first step then says
// which parameter VALUES were already non-finite.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "keel/io/safetensors.h"
#include "keel/io/weight_check.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> overflow_sets(const std::string& out) {
  return {"run.out_dir=" + out,      "run.threads=1",         "model.n_layer=2",
          "model.n_embd=32",         "model.n_head=2",        "data.num_examples=64",
          "data.eval_examples=0",    "data.seq_len=16",       "train.batch_size=16",
          "train.precision=16-true", "train.max_grad_norm=0", "optim.lr=1e5",
          "log.tensorboard=false",   "train.max_steps=1"};
}

test::KeelRun train_with(const std::vector<std::string>& sets) {
  return test::run_keel(test::with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
}

// The diverged checkpoint, once per test binary.
const std::string& diverged_run() {
  static const std::string out = [] {
    const std::string d = test::temp_dir("weights-diverged");
    const test::KeelRun r = train_with(overflow_sets(d));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_CONTAINS(r.err, "step 1: the weights hold NaN or inf in ");
    EXPECT_CONTAINS(r.err, d + "/checkpoints/last was not written; they are in " + d +
                               "/checkpoints/nonfinite-step-1");
    EXPECT_FALSE(fs::exists(d + "/checkpoints/last"));
    return d;
  }();
  return out;
}

// The first tensor of the checkpoint's model.safetensors (file order) holding non-finite values,
// with what the check finds in it: the test's own account of what the message must say.
struct FirstBad {
  std::string name;
  io::NonfiniteWeights w;
};
FirstBad first_bad(const std::string& file) {
  for (auto& [name, t] : io::read_safetensors(file).tensors) {
    io::NonfiniteWeights w = io::find_nonfinite_weights(t.data(), t.dtype(), t.shape());
    if (w.count > 0) return {name, w};
  }
  return {};
}

std::string index_of(const Shape& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

TEST(CliWeights, ADivergedCheckpointAsModelPathIsRefusedNamingTensorAndIndex) {
  const std::string ckpt = diverged_run() + "/checkpoints/nonfinite-step-1";
  const FirstBad bad = first_bad(ckpt + "/model.safetensors");
  ASSERT_FALSE(bad.name.empty()) << "the 16-true step at lr 1e5 left every weight finite";
  const std::string out = test::temp_dir("weights-model-path");
  test::KeelRun r = train_with({"run.out_dir=" + out, "run.threads=1", "model.path=" + ckpt,
                                "data.num_examples=64", "data.eval_examples=0", "data.seq_len=16",
                                "log.tensorboard=false", "train.max_steps=1"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, ckpt + "/model.safetensors: tensor '" + bad.name + "' holds " +
                             std::to_string(bad.w.count) + " non-finite value");
  EXPECT_CONTAINS(r.err, "the first at " + index_of(bad.w.first_index));
  EXPECT_CONTAINS(r.err, "set model.allow_nonfinite_weights = true to load it anyway");
  EXPECT_FALSE(fs::exists(out + "/metrics.jsonl") && !test::step_records(out).empty())
      << "no step may run on the broken weights";

  // The override loads it, warns naming the tensor, and the first step stops on the values.
  test::KeelRun a = train_with({"run.out_dir=" + out + "-allow", "run.threads=1",
                                "model.path=" + ckpt, "model.allow_nonfinite_weights=true",
                                "data.num_examples=64", "data.eval_examples=0", "data.seq_len=16",
                                "log.tensorboard=false", "train.max_steps=1"});
  EXPECT_EQ(a.code, 3) << a.output;
  EXPECT_CONTAINS(a.err, "warning: " + ckpt + "/model.safetensors: tensor '" + bad.name + "'");
  EXPECT_CONTAINS(a.err, "loaded anyway (model.allow_nonfinite_weights = true)");
  EXPECT_CONTAINS(a.err, "parameter values already non-finite in");
}

TEST(CliWeights, ResumingFromADivergedCheckpointIsRefusedUnlessAllowed) {
  const std::string src = diverged_run();
  const std::string out = test::temp_dir("weights-resume");
  fs::copy(src, out, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  const std::string ckpt = out + "/checkpoints/last";
  fs::copy(out + "/checkpoints/nonfinite-step-1", ckpt, fs::copy_options::recursive);
  const FirstBad bad = first_bad(ckpt + "/model.safetensors");
  ASSERT_FALSE(bad.name.empty());
  std::vector<std::string> sets = overflow_sets(out);
  sets.back() = "train.max_steps=2";
  sets.push_back("run.resume=true");
  test::KeelRun r = train_with(sets);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, ckpt + "/model.safetensors: tensor '" + bad.name + "' holds " +
                             std::to_string(bad.w.count) + " non-finite value");
  EXPECT_CONTAINS(r.err, "the first at " + index_of(bad.w.first_index));
  EXPECT_EQ(test::step_records(out).size(), 1u) << "the refused resume ran no step";
  // Allowed: the checkpoint loads (the key is not one a checkpoint fixes) and step 2 stops on it.
  sets.push_back("model.allow_nonfinite_weights=true");
  test::KeelRun a = train_with(sets);
  EXPECT_EQ(a.code, 3) << a.output;
  EXPECT_CONTAINS(a.err, "loaded anyway (model.allow_nonfinite_weights = true)");
  EXPECT_CONTAINS(a.err, "step 2: non-finite");
}

// keel generate / eval / export read no config: their message names their own flag.
TEST(CliWeights, GenerateAndExportNameTheirFlag) {
  const std::string ckpt = diverged_run() + "/checkpoints/nonfinite-step-1";
  const FirstBad bad = first_bad(ckpt + "/model.safetensors");
  ASSERT_FALSE(bad.name.empty());
  const test::KeelRun g =
      test::run_keel({"generate", ckpt, "1+1=", "--max-new-tokens", "2"}, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(g.code, 2) << g.output;
  EXPECT_CONTAINS(g.err, ckpt + "/model.safetensors: tensor '" + bad.name + "' holds");
  EXPECT_CONTAINS(g.err, "set --allow-nonfinite-weights to load it anyway");
  const std::string out = test::temp_dir("weights-export");
  const test::KeelRun e = test::run_keel({"export", ckpt, "--out", out + "/hf"});
  EXPECT_EQ(e.code, 2) << e.output;
  EXPECT_CONTAINS(e.err, "set --allow-nonfinite-weights to load it anyway");
  const test::KeelRun a =
      test::run_keel({"export", ckpt, "--out", out + "/hf", "--allow-nonfinite-weights"});
  EXPECT_EQ(a.code, 0) << a.output;
  EXPECT_CONTAINS(a.err, "loaded anyway (--allow-nonfinite-weights)");
  EXPECT_TRUE(fs::exists(out + "/hf/model.safetensors"));
}

}  // namespace
}  // namespace keel
