#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "keel/log/loggers.h"
#include "keel/log/metrics.h"
#include "keel/numerics/error.h"
#include "tests/support/check.h"

namespace keel::log {
namespace {

using json = nlohmann::json;

std::vector<json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<json> out;
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));  // one per line
  return out;
}

StepResult step(int64_t s, double loss, double grad_norm) {
  StepResult r;
  r.step = s;
  r.epoch = s / 3;
  r.loss = loss;
  r.grad_norm = grad_norm;
  r.lr = 1e-3 * double(s);
  r.loss_scale = 65536.0 / double(s);
  r.skipped_steps = s / 2;
  r.nan_steps = s / 4;
  r.tokens_per_s = 1000.5 * double(s);
  r.stepped = std::isfinite(grad_norm);
  r.found_inf = !r.stepped;
  return r;
}

TEST(Metrics, OneObjectPerStepWithTheDocumentedKeys) {
  const std::string out = test::temp_dir("metrics") + "/run";  // created by the writer
  const double inf = std::numeric_limits<double>::infinity();
  {
    MetricsWriter w(out);
    EXPECT_EQ(w.path(), out + "/metrics.jsonl");
    w.write(step(1, 2.5, 0.75));
    // Flushed per line: readable while the writer is still open.
    EXPECT_EQ(read_jsonl(w.path()).size(), 1u);
    w.write(step(2, 2.25, inf));
    w.write(step(3, std::nan(""), -inf));
    StepResult r = step(4, 1.5, 0.5);
    r.advice = "loss is flat: raise optim.lr";
    w.write(r, {{"eval_loss", 1.25}, {"eval_acc", std::nan("")}, {"note", "x"}});
  }
  const std::vector<json> lines = read_jsonl(out + "/metrics.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  const std::vector<std::string> keys = {"step",          "epoch",         "loss",
                                         "grad_norm",     "learning_rate", "loss_scale",
                                         "skipped_steps", "nan_steps",     "tokens_per_s"};
  for (size_t i = 0; i < lines.size(); ++i) {
    const json& j = lines[i];
    const int64_t s = int64_t(i) + 1;
    ASSERT_TRUE(j.is_object());
    for (const std::string& k : keys) EXPECT_TRUE(j.contains(k)) << "line " << s << " lacks " << k;
    EXPECT_EQ(j["step"], s);
    EXPECT_EQ(j["epoch"], s / 3);
    EXPECT_EQ(j["learning_rate"].get<double>(), 1e-3 * double(s));  // exact round trip
    EXPECT_EQ(j["loss_scale"].get<double>(), 65536.0 / double(s));
    EXPECT_EQ(j["skipped_steps"], s / 2);
    EXPECT_EQ(j["nan_steps"], s / 4);
    EXPECT_EQ(j["tokens_per_s"].get<double>(), 1000.5 * double(s));
    EXPECT_TRUE(j["step"].is_number_integer());
  }
  EXPECT_EQ(lines[0].size(), keys.size());  // nothing else on a plain step
  EXPECT_EQ(lines[0]["loss"].get<double>(), 2.5);
  EXPECT_EQ(lines[0]["grad_norm"].get<double>(), 0.75);
  // Non-finite numbers are strings (JSON has none).
  EXPECT_EQ(lines[1]["grad_norm"], "inf");
  EXPECT_EQ(lines[2]["loss"], "nan");
  EXPECT_EQ(lines[2]["grad_norm"], "-inf");
  // Advice and extras, non-finite extras included.
  EXPECT_EQ(lines[3]["advice"], "loss is flat: raise optim.lr");
  EXPECT_EQ(lines[3]["eval_loss"].get<double>(), 1.25);
  EXPECT_EQ(lines[3]["eval_acc"], "nan");
  EXPECT_EQ(lines[3]["note"], "x");

  // The keys come in the documented order.
  std::ifstream in(out + "/metrics.jsonl");
  std::string first;
  std::getline(in, first);
  EXPECT_EQ(first.rfind("{\"step\":1,\"epoch\":0,\"loss\":2.5,\"grad_norm\":0.75,", 0), 0u)
      << first;

  // A second writer (a resumed run) appends.
  {
    MetricsWriter w(out);
    w.write(step(5, 1.0, 1.0));
  }
  const std::vector<json> after = read_jsonl(out + "/metrics.jsonl");
  ASSERT_EQ(after.size(), 5u);
  EXPECT_EQ(after[4]["step"], 5);
}

TEST(Metrics, ExtrasMustNotShadowTheFixedKeys) {
  const std::string out = test::temp_dir("metrics");
  MetricsWriter w(out);
  try {
    w.write(step(1, 1, 1), {{"loss", 3.0}});
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("extra field 'loss' collides"), std::string::npos);
  }
  EXPECT_THROW(w.write(step(1, 1, 1), json::array({1, 2})), Error);
  EXPECT_NO_THROW(w.write(step(1, 1, 1), json()));  // null = no extras
}

TEST(Metrics, JsonFiniteReplacesNestedNonFiniteNumbers) {
  const double inf = std::numeric_limits<double>::infinity();
  const json in = {{"a", {{"b", inf}, {"c", json::array({1.5, -inf, std::nan("")})}}}, {"d", 2}};
  const json out = json_finite(in);
  EXPECT_EQ(out["a"]["b"], "inf");
  EXPECT_EQ(out["a"]["c"], json::array({1.5, "-inf", "nan"}));
  EXPECT_EQ(out["d"], 2);
  EXPECT_EQ(json::parse(out.dump()), out);  // valid JSON
}

TEST(Metrics, RunLoggersFollowTheLogConfig) {
  const std::string out = test::temp_dir("loggers");
  LogConfig cfg;
  cfg.console = false;
  cfg.tensorboard = false;
  {
    RunLoggers loggers(cfg, out, 10, true);
    EXPECT_EQ(loggers.console(), nullptr);
    EXPECT_EQ(loggers.tensorboard(), nullptr);
    ASSERT_NE(loggers.metrics(), nullptr);
    loggers.log(step(1, 1.0, 1.0), {{"eval_loss", 0.5}});
  }
  EXPECT_FALSE(std::filesystem::exists(out + "/tb"));
  const std::vector<json> lines = read_jsonl(out + "/metrics.jsonl");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["eval_loss"].get<double>(), 0.5);

  cfg = LogConfig{};
  std::FILE* devnull = std::fopen("/dev/null", "w");
  {
    RunLoggers loggers(cfg, out, 10, false, devnull);
    ASSERT_NE(loggers.console(), nullptr);
    ASSERT_NE(loggers.tensorboard(), nullptr);
    loggers.log(step(2, 1.0, 1.0), {{"eval_loss", 0.25}, {"note", "text is not a scalar"}});
    EXPECT_EQ(loggers.console()->last_line().rfind("step 2/10 | loss 1 |", 0), 0u)
        << loggers.console()->last_line();
    // The event file holds file_version, the step's four scalars and the numeric extra.
    const auto size = std::filesystem::file_size(loggers.tensorboard()->path());
    EXPECT_GT(size, 3 * 16u);
  }
  std::fclose(devnull);
  EXPECT_EQ(read_jsonl(out + "/metrics.jsonl").size(), 2u);
}

// A disk that fills (a 16 KB tmpfs): the failed write left half a record as the file's last
// line (and the rest in stdio's buffer, written at close). Now the error names the file and the
// cause, and the file holds exactly the records written before it. Needs root (mount).
TEST(Metrics, AFullDiskLeavesNoHalfRecord) {
  const std::string dir = test::temp_dir("metrics-enospc");
  if (::geteuid() != 0 ||
      std::system(("mount -t tmpfs -o size=16k tmpfs '" + dir + "' 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "needs root and mount (a small tmpfs)";
  struct Unmount {
    std::string dir;
    ~Unmount() { std::system(("umount -l '" + dir + "'").c_str()); }
  } unmount{dir};
  size_t written = 0;
  std::string error;
  {
    MetricsWriter w(dir);
    try {
      for (; written < 100000; ++written) w.write(step(static_cast<int64_t>(written) + 1, 2.5, 1));
    } catch (const Error& e) {
      error = e.what();
    }
  }
  EXPECT_CONTAINS(error, dir + "/metrics.jsonl");
  EXPECT_CONTAINS(error, "No space left on device");
  const std::vector<json> recs = read_jsonl(dir + "/metrics.jsonl");  // every line whole
  ASSERT_EQ(recs.size(), written);
  EXPECT_EQ(recs.back()["step"], static_cast<int64_t>(written));
}

}  // namespace
}  // namespace keel::log
