// f16 gradient underflow without a loss scaler, from real arithmetic (issue 3's example (a), issue
// 4's "vanishing trend with exactly-zero grads"): examples/f16-no-scaler as shipped. 16-mixed with
// scaler.enabled = false learns a one-byte corpus within a dozen steps; once the model is sure,
// every logit gradient (p - y) / 1008 tokens is below half of f16's smallest subnormal (2^-25,
// ~3e-8) and rounds to 0 when autocast casts it back to f16 for the lm_head's backward: the global
// grad norm is exactly 0 step after step (the f32 loss is still ~1e-5, not 0), the trend advisor
// says vanishing and names the scaler. with-scaler.toml (the same run, scaler on) keeps every
// gradient non-zero once its scale has settled.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

using json = nlohmann::json;

using test::step_records;

// The example's config with out_dir in a temp dir and the corpus by absolute path (the example
// names it relative to the repository root); one thread, as everywhere in tests/cli.
test::KeelRun run_example(const std::string& toml, const std::string& out) {
  const std::string ex = std::string(KEEL_SOURCE_DIR) + "/examples/f16-no-scaler";
  return test::run_keel(
      test::with_sets({"train", ex + "/" + toml},
                      {"run.out_dir=" + out, "run.threads=1", "data.path=" + ex + "/corpus.txt",
                       "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
}

TEST(CliUnderflow, F16WithoutScalerStallsAtExactlyZeroGradNormAndTheScalerFixesIt) {
  const std::string dir = test::temp_dir("cli-f16-underflow");
  const test::KeelRun r = run_example("config.toml", dir + "/off");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto recs = step_records(dir + "/off");
  ASSERT_EQ(recs.size(), 24u) << r.output;

  // Real gradients first, then exactly 0.0 from some step on, and never back.
  EXPECT_GT(recs[0].at("grad_norm").get<double>(), 0.1);
  size_t first_zero = recs.size();
  for (size_t i = 0; i < recs.size(); ++i)
    if (recs[i].at("grad_norm").get<double>() == 0.0) {
      first_zero = i;
      break;
    }
  ASSERT_LT(first_zero, recs.size()) << "no step had a grad norm of exactly 0";
  EXPECT_GE(first_zero, 5u) << "the model has to learn before its gradients can underflow";
  EXPECT_LE(first_zero, 18u) << "at least 6 stalled steps";
  for (size_t i = first_zero; i < recs.size(); ++i)
    EXPECT_EQ(recs[i].at("grad_norm").get<double>(), 0.0) << "step " << i + 1;
  // Not a converged f32 loss of 0: the f32 loss is positive, only the f16 gradients are gone.
  const double stalled_loss = recs[first_zero].at("loss").get<double>();
  EXPECT_GT(stalled_loss, 0.0);
  EXPECT_LT(stalled_loss, 1e-3);
  for (const json& j : recs) EXPECT_EQ(j.at("loss_scale").get<double>(), 1.0);

  // The advisor: vanishing at the third zero in a row, its action names the scaler; printed too.
  const size_t third = first_zero + 2;
  ASSERT_TRUE(recs[third].contains("advice")) << recs[third].dump();
  const std::string advice = recs[third].at("advice").get<std::string>();
  EXPECT_EQ(advice.rfind("vanishing: the grad norm was exactly 0 on the last 3 steps", 0), 0u)
      << advice;
  EXPECT_NE(advice.find("set scaler.enabled = true"), std::string::npos) << advice;
  EXPECT_NE(r.output.find(advice), std::string::npos) << r.output;

  // The scaler fixes it: the same run with the scaler on has a non-zero norm on every step.
  const test::KeelRun s = run_example("with-scaler.toml", dir + "/on");
  ASSERT_EQ(s.code, 0) << s.output;
  const auto on = step_records(dir + "/on");
  ASSERT_EQ(on.size(), 24u);
  int64_t skipped = 0;
  for (const json& j : on) {
    // The first steps overflow at 65536 and are skipped (grad_norm "inf"), as a scaler should.
    if (j.at("grad_norm").is_string()) {
      EXPECT_EQ(j.at("grad_norm").get<std::string>(), "inf") << j.dump();
      EXPECT_EQ(j.at("skipped_steps").get<int64_t>(), ++skipped) << j.dump();
      continue;
    }
    const double g = j.at("grad_norm").get<double>();
    EXPECT_TRUE(std::isfinite(g) && g > 0) << j.dump();
    if (j.contains("advice")) {
      EXPECT_EQ(j.at("advice").get<std::string>().find("exactly 0"), std::string::npos) << j.dump();
    }
  }
  EXPECT_LE(skipped, 3) << "the scaler found its scale within a few steps";

  // The README's table is what these runs print (loss / grad_norm, 3 digits above 0.01, else 2).
  const std::string readme =
      test::slurp(std::string(KEEL_SOURCE_DIR) + "/examples/f16-no-scaler/README.md");
  auto cell = [](const json& j) {
    auto f = [](const json& v) {
      if (v.is_string()) return v.get<std::string>();
      const double x = v.get<double>();
      char buf[32];
      if (x == 0) return std::string("**0**");
      std::snprintf(buf, sizeof buf, x >= 0.01 ? "%.3g" : "%.1e", x);
      return std::string(buf);
    };
    return f(j.at("loss")) + " / " + f(j.at("grad_norm"));
  };
  EXPECT_CONTAINS(
      readme, "| 1 | " + cell(recs[0]) + " | " + cell(on[0]) + ": skipped, scale 65536 → 32768 |");
  EXPECT_CONTAINS(readme,
                  "| 2 | " + cell(recs[1]) + " | " + cell(on[1]) + " (32768 from here on) |");
  for (int step : {13, 14, 15})
    EXPECT_CONTAINS(readme, "| " + std::to_string(step) + " | " + cell(recs[step - 1]) + " | " +
                                cell(on[step - 1]) + " |");
  EXPECT_CONTAINS(readme, "exactly 0 from step " + std::to_string(first_zero + 1) + " to the end");
  EXPECT_GT(on.back().at("loss_scale").get<double>(), 1.0);
  // And it keeps learning where the unscaled run stalled.
  EXPECT_LT(on.back().at("loss").get<double>(), stalled_loss);
}

// Per-layer underflow (issue 21 item 3), the same example: before the global norm reaches 0, the
// blocks' f16 gradients vanish while the embedding's (the tied lm_head's, computed from the f32
// logit gradients) does not. The always-on per-layer statistics show it (log.per_layer_grad_norm
// writes them: grad_underflow/<block> = 1), the advisor names the vanished blocks with the f16
// underflow and the scaler's fix, as a console line and a metrics.jsonl record, and no line asks
// for a higher learning rate. The same run with the scaler on, and in bf16-mixed: no such finding.
TEST(CliUnderflow, F16WithoutScalerNamesTheBlocksWhoseGradientsVanished) {
  const std::string dir = test::temp_dir("cli-f16-layers");
  const std::string ex = std::string(KEEL_SOURCE_DIR) + "/examples/f16-no-scaler";
  auto run = [&](const std::string& toml, const std::string& out, std::vector<std::string> sets) {
    sets.insert(sets.end(),
                {"run.out_dir=" + out, "run.threads=1", "data.path=" + ex + "/corpus.txt",
                 "log.tensorboard=false", "log.per_layer_grad_norm=true"});
    return test::run_keel(test::with_sets({"train", ex + "/" + toml}, sets), {"OMP_NUM_THREADS=1"});
  };
  auto underflow_findings = [](const std::string& out) {
    std::vector<json> v;
    std::ifstream in(out + "/metrics.jsonl");
    for (std::string l; std::getline(in, l);)
      if (json j = json::parse(l); j.value("trend", "") == "underflow") v.push_back(j);
    return v;
  };
  const test::KeelRun r = run("config.toml", dir + "/off", {});
  ASSERT_EQ(r.code, 0) << r.output;
  const auto recs = step_records(dir + "/off");
  ASSERT_EQ(recs.size(), 24u);
  const auto f = underflow_findings(dir + "/off");
  ASSERT_GE(f.size(), 2u) << r.output;
  // Blocks vanish one after another (the position table first: its unused rows are exactly 0,
  // the rest f16-subnormal); each finding names the blocks vanished so far, the embedding last.
  size_t blocks_at = f.size();
  for (size_t i = 0; i < f.size(); ++i) {
    const auto layers = f[i].at("layers").get<std::vector<std::string>>();
    if (i > 0) {
      EXPECT_GT(layers.size(), f[i - 1].at("layers").size());
    }
    const bool h0 = std::find(layers.begin(), layers.end(), "transformer.h.0") != layers.end();
    if (h0 && blocks_at == f.size()) blocks_at = i;
  }
  ASSERT_LT(blocks_at, f.size());
  const json& first = f[blocks_at];
  const auto named = first.at("layers").get<std::vector<std::string>>();
  EXPECT_NE(std::find(named.begin(), named.end(), "transformer.h.1"), named.end());
  EXPECT_EQ(std::find(named.begin(), named.end(), "transformer.wte"), named.end());
  const int64_t at = first.at("step").get<int64_t>();
  // The three steps up to the finding: every element of the named blocks 0 or f16-subnormal,
  // while the embedding's gradient is alive and the global norm is not 0 yet.
  ASSERT_GE(at, 3);
  for (int64_t k = at - 3; k < at; ++k) {
    const json& j = recs[static_cast<size_t>(k)];
    for (const std::string& b : named)
      EXPECT_EQ(j.at("grad_underflow/" + b).get<double>(), 1.0) << b << ": " << j.dump();
    EXPECT_LT(j.at("grad_underflow/transformer.wte").get<double>(), 1.0) << j.dump();
    EXPECT_GT(j.at("grad_norm/transformer.wte").get<double>(), 0.0) << j.dump();
    EXPECT_GT(j.at("grad_norm").get<double>(), 0.0) << "before the global norm is 0: " << j.dump();
  }
  const std::string cause = first.at("cause").get<std::string>(),
                    action = first.at("action").get<std::string>();
  EXPECT_CONTAINS(cause, "blocks vanished on the last 3 steps: ");
  EXPECT_CONTAINS(cause, "transformer.h.0, transformer.h.1");
  EXPECT_CONTAINS(cause, "while transformer.wte's did not");
  EXPECT_CONTAINS(cause, "f16 underflow");
  EXPECT_CONTAINS(action, "set scaler.enabled = true");
  EXPECT_CONTAINS(action, "bf16-mixed");
  EXPECT_CONTAINS(r.output, "advice: underflow: " + cause + "; " + action);
  // Once every block has vanished the global norm is exactly 0 and the trend's line says it: no
  // underflow line then (the embedding, the last alive, is never named).
  for (const json& j : f) {
    const auto layers = j.at("layers").get<std::vector<std::string>>();
    EXPECT_EQ(std::find(layers.begin(), layers.end(), "transformer.wte"), layers.end()) << j.dump();
    EXPECT_GT(recs[static_cast<size_t>(j.at("step").get<int64_t>() - 1)].at("grad_norm"), 0.0);
  }
  // Before: the trend called the decay "vanishing" and asked for a higher learning rate.
  EXPECT_EQ(r.output.find("raise optim.lr"), std::string::npos) << r.output;

  // bf16-mixed (bf16 reaches 1e-38): the gradients never vanish. With the scaler on they stay
  // normal f16 numbers while the model learns; only once it has converged (loss ~1e-6, many steps
  // after the unscaled run's first finding) does a block's gradient fall below f16's normal range
  // even at the scale (32768, which grows only every 2000 steps): then the fix named is the scale,
  // never "enable the scaler".
  const test::KeelRun bf = run("config.toml", dir + "/bf16", {"train.precision=bf16-mixed"});
  ASSERT_EQ(bf.code, 0) << bf.output;
  EXPECT_TRUE(underflow_findings(dir + "/bf16").empty()) << bf.output;
  EXPECT_EQ(bf.output.find("advice: underflow"), std::string::npos) << bf.output;
  const test::KeelRun on = run("with-scaler.toml", dir + "/on", {});
  ASSERT_EQ(on.code, 0) << on.output;
  const auto on_recs = step_records(dir + "/on");
  for (const json& j : underflow_findings(dir + "/on")) {
    EXPECT_GE(j.at("step").get<int64_t>(), f[0].at("step").get<int64_t>() + 8) << j.dump();
    EXPECT_CONTAINS(j.at("action").get<std::string>(), "the loss scale (");
    EXPECT_EQ(j.at("action").get<std::string>().find("scaler.enabled"), std::string::npos);
    EXPECT_LT(
        on_recs[static_cast<size_t>(j.at("step").get<int64_t>() - 1)].at("loss").get<double>(),
        1e-5);
  }
}

// An untied lookup table's rows that no input of the step selected have a gradient of exactly 0
// in any precision: nothing reached them. grad_underflow counted them as underflow, so a 32-true
// run (no f16 anywhere) read model.embed_tokens 0.9498 (246 of 259 rows unused) and GPT-2's
// transformer.wpe 0.9297 (9 of 128 positions used). Over the selected rows f32 keeps every value.
TEST(CliUnderflow, UnusedEmbeddingRowsAreNotUnderflow) {
  const std::string dir = test::temp_dir("cli-unused-rows");
  for (const std::string family : {"llama", "gpt2"}) {
    SCOPED_TRACE(family);
    const std::string m = dir + "/" + family, out = dir + "/run-" + family;
    std::vector<std::string> init = {"init-model", "--out", m, "--family", family};
    if (family == "llama") init.push_back("--untied");
    ASSERT_EQ(test::run_keel(init).code, 0);
    const test::KeelRun r = test::run_keel(
        {"train", "--set", "model.path=" + m, "--set", "train.max_steps=2", "--set",
         "train.precision=32-true", "--set", "log.per_layer_grad_norm=true", "--set",
         "log.tensorboard=false", "--set", "run.threads=1", "--set", "run.out_dir=" + out},
        {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(r.code, 0) << r.output;
    const auto recs = step_records(out);
    ASSERT_EQ(recs.size(), 2u);
    const std::string table = family == "llama" ? "model.embed_tokens" : "transformer.wpe";
    for (const json& j : recs) {
      EXPECT_GT(j.at("grad_norm/" + table).get<double>(), 0.0) << j.dump();
      EXPECT_LT(j.at("grad_underflow/" + table).get<double>(), 0.01) << j.dump();
    }
    EXPECT_EQ(r.output.find("underflow:"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace keel
