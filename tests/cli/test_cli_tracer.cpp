// End to end through the keel binary: the tracer with an injected NaN (exit 3, the log naming the
// module), abort_after_batch_num, an unknown inject module, and per-layer grad norms in
// metrics.jsonl.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

using Ran = test::KeelRun;

using test::slurp;

// A small, fast run of the built-in task.
std::string small_run(const std::string& dir) {
  return "train --set run.out_dir=\"" + dir +
         "\" --set data.num_examples=256 --set data.eval_examples=4 --set train.batch_size=8 "
         "--set train.max_steps=6 --set log.tensorboard=false";
}

TEST(CliTracer, InjectedNanStopsWithExit3AndTheLogNamesTheModule) {
  const std::string dir = test::temp_dir("cli-tracer");
  Ran r =
      test::run_keel_sh(small_run(dir) +
                        " --set debug.underflow_overflow.enabled=true"
                        " --set debug.inject.module=transformer.h.0.mlp --set debug.inject.step=3");
  EXPECT_EQ(r.code, 3) << r.output;
  const std::string log = dir + "/debug/underflow_overflow_rank0.log";
  ASSERT_TRUE(fs::exists(log)) << r.output;
  const std::string text = slurp(log);
  EXPECT_NE(text.find("Detected inf/nan during batch_number=3"), std::string::npos) << text;
  EXPECT_NE(text.find("Last 21 forward and backward frames:"), std::string::npos) << text;
  EXPECT_NE(text.find("produced by 'transformer.h.0.mlp' (GPT2MLP) in forward, tensor output"),
            std::string::npos)
      << text;
  // The console names it too, and the step still got its NaN capture (the tracer lets the step
  // finish when a capture is due).
  EXPECT_NE(r.output.find("the first non-finite value was produced by 'transformer.h.0.mlp'"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("stopped: step 3"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/debug/nan_capture/rank0/capture.json")) << r.output;
  EXPECT_EQ(test::step_records(dir).size(), 3u);
}

TEST(CliTracer, WithoutACaptureTheTracerStopsAtOnce) {
  const std::string dir = test::temp_dir("cli-tracer-nocap");
  Ran r =
      test::run_keel_sh(small_run(dir) +
                        " --set debug.underflow_overflow.enabled=true --set debug.nan_capture=false"
                        " --set debug.inject.module=transformer.h.1.attn --set debug.inject.step=2"
                        " --set debug.inject.kind=inf");
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_NE(r.output.find("stopped: underflow/overflow tracer: the first non-finite value was "
                          "produced by 'transformer.h.1.attn' (GPT2Attention)"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir + "/debug/nan_capture"));
  EXPECT_EQ(test::step_records(dir).size(), 1u);  // step 2 stopped inside its forward
}

TEST(CliTracer, AbortAfterBatchNum) {
  const std::string dir = test::temp_dir("cli-tracer-abort");
  Ran r = test::run_keel_sh(small_run(dir) +
                            " --set debug.underflow_overflow.enabled=true"
                            " --set debug.underflow_overflow.abort_after_batch_num=2"
                            " --set 'debug.underflow_overflow.trace_batch_nums=[2]'");
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_NE(r.output.find("abort_after_batch_num"), std::string::npos) << r.output;
  EXPECT_EQ(test::step_records(dir).size(), 2u);
  const std::string text = slurp(dir + "/debug/underflow_overflow_rank0.log");
  EXPECT_NE(text.find("*** Starting batch number=2 (traced) ***"), std::string::npos) << text;
  EXPECT_NE(text.find("transformer.h.1.mlp.c_fc Linear (backward: "), std::string::npos) << text;
}

// Batch numbers count the run's steps, a resumed run's included: abort_after_batch_num = 2 on a
// run resumed at step 3 stopped at once "after batch 2" without training a step (exit 3, as if
// the tracer had found something), and trace_batch_nums = [1] traced nothing without a word.
TEST(CliTracer, BatchNumbersBeforeAResumeStepAreRefusedOrNoted) {
  const std::string dir = test::temp_dir("cli-tracer-resume");
  const std::string three = small_run(dir) + " --set train.max_steps=3";
  Ran first = test::run_keel_sh(three);
  ASSERT_EQ(first.code, 0) << first.output;
  const std::string resume =
      small_run(dir) + " --set run.resume=true" + " --set debug.underflow_overflow.enabled=true";
  Ran early = test::run_keel_sh(resume + " --set debug.underflow_overflow.abort_after_batch_num=2");
  EXPECT_EQ(early.code, 2) << early.output;
  EXPECT_CONTAINS(early.err,
                  "debug.underflow_overflow.abort_after_batch_num = 2 is not past the "
                  "step this run resumes from (3): the tracer would stop before "
                  "training a step; set it above 3 (or to -1)");
  EXPECT_EQ(test::step_records(dir).size(), 3u) << "the refused resume ran no step";
  Ran traced =
      test::run_keel_sh(resume + " --set 'debug.underflow_overflow.trace_batch_nums=[1,5]'" +
                        " --set debug.underflow_overflow.abort_after_batch_num=5");
  EXPECT_EQ(traced.code, 3) << traced.output;
  EXPECT_CONTAINS(traced.output,
                  "debug.underflow_overflow.trace_batch_nums holds 1, at or before "
                  "the step this run resumes from (3): those batches were trained "
                  "before the checkpoint and are not traced; list steps above 3");
  EXPECT_EQ(test::step_records(dir).size(), 5u);
  const std::string log = slurp(dir + "/debug/underflow_overflow_rank0.log");
  EXPECT_CONTAINS(log, "*** Starting batch number=5 (traced) ***");
}

TEST(CliTracer, UnknownInjectModuleIsAUsageError) {
  const std::string dir = test::temp_dir("cli-inject-bad");
  Ran r = test::run_keel_sh(small_run(dir) +
                            " --set debug.inject.module=transformer.h.0.mpl"
                            " --set debug.inject.step=1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("\"transformer.h.0.mpl\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("similar paths: transformer.h.0.mlp"), std::string::npos) << r.output;
}

TEST(CliTracer, PerLayerGradNormsInMetrics) {
  const std::string dir = test::temp_dir("cli-layer-norms");
  Ran r = test::run_keel_sh(small_run(dir) + " --set log.per_layer_grad_norm=true");
  ASSERT_EQ(r.code, 0) << r.output;
  auto recs = test::step_records(dir);
  ASSERT_EQ(recs.size(), 6u);
  for (auto& j : recs) {
    double sq = 0;
    int blocks = 0;
    for (auto& [k, v] : j.items())
      if (k.rfind("grad_norm/", 0) == 0) {
        sq += v.get<double>() * v.get<double>();
        ++blocks;
      }
    EXPECT_EQ(blocks, 5) << j.dump();  // wte, wpe, h.0, h.1, ln_f
    EXPECT_TRUE(j.contains("grad_norm/transformer.h.1")) << j.dump();
    const double g = j["grad_norm"].get<double>();
    EXPECT_NEAR(std::sqrt(sq), g, 1e-9 * g) << j.dump();
  }
  // Off by default.
  const std::string dir2 = test::temp_dir("cli-layer-norms-off");
  ASSERT_EQ(test::run_keel_sh(small_run(dir2)).code, 0);
  for (auto& j : test::step_records(dir2)) EXPECT_FALSE(j.contains("grad_norm/transformer.h.0"));
}

TEST(CliTracer, TracerOnAFiniteRunChangesNothing) {
  // Same losses bit for bit with and without the tracer: it only reads.
  const std::string a = test::temp_dir("cli-tracer-a"), b = test::temp_dir("cli-tracer-b");
  ASSERT_EQ(test::run_keel_sh(small_run(a)).code, 0);
  Ran r = test::run_keel_sh(small_run(b) + " --set debug.underflow_overflow.enabled=true");
  ASSERT_EQ(r.code, 0) << r.output;
  auto ma = test::step_records(a), mb = test::step_records(b);
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i]["loss"], mb[i]["loss"]);
    EXPECT_EQ(ma[i]["grad_norm"], mb[i]["grad_norm"]);
  }
  EXPECT_FALSE(fs::exists(b + "/debug/underflow_overflow_rank0.log"));  // nothing to report
}

}  // namespace
}  // namespace keel
