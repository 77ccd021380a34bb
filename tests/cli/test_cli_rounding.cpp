// bf16-true updates that round away (issue 21 item 4), on real runs of the default task: bf16
// keeps 8 significant bits, so at a small learning rate most AdamW updates leave the stored
// weight unchanged. The optimizer's pass counts them (metrics.jsonl's `rounded_away`), the advisor
// names the share and the fix (bf16-mixed's f32 masters, or optim.stochastic_rounding = true);
// bf16-mixed has nothing to report, stochastic rounding lowers the share and moves the weights,
// and the counts of a run are the same every time.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/io/safetensors.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

using json = nlohmann::json;

std::vector<json> rounding_findings(const std::string& out_dir, const std::string& trend) {
  std::vector<json> v;
  std::ifstream in(out_dir + "/metrics.jsonl");
  for (std::string l; std::getline(in, l);)
    if (json j = json::parse(l); j.value("kind", "") == "advisor" && j.value("trend", "") == trend)
      v.push_back(j);
  return v;
}

test::KeelRun train_rounding(const std::string& out, const std::vector<std::string>& sets) {
  std::vector<std::string> all = {"run.out_dir=" + out,    "run.threads=1",
                                  "log.tensorboard=false", "log.every=1",
                                  "train.max_steps=12",    "data.eval_examples=16"};
  all.insert(all.end(), sets.begin(), sets.end());
  return test::run_keel(test::with_sets({"train"}, all), {"OMP_NUM_THREADS=1"});
}

// The share of rounded-away elements on each step ("rounded_away", absent = 0).
std::vector<double> shares(const std::string& out_dir) {
  std::vector<double> v;
  for (const json& r : test::step_records(out_dir)) v.push_back(r.value("rounded_away", 0.0));
  return v;
}

// The share of the weights whose value differs between two checkpoints.
double moved_share(const std::string& a, const std::string& b) {
  const io::Safetensors x = io::read_safetensors(a), y = io::read_safetensors(b);
  int64_t moved = 0, total = 0;
  for (const auto& [name, t] : x.tensors) {
    const auto u = t.to_floats(), w = y.at(name).to_floats();
    for (size_t i = 0; i < u.size(); ++i) moved += u[i] != w[i];
    total += static_cast<int64_t>(u.size());
  }
  return total > 0 ? static_cast<double>(moved) / static_cast<double>(total) : 0;
}

TEST(CliRounding, Bf16TrueAtASmallLrReportsTheRoundedAwayShareAndTheFix) {
  const std::string dir = test::temp_dir("cli-rounding");
  const test::KeelRun r =
      train_rounding(dir + "/bf16-true", {"train.precision=bf16-true", "optim.lr=1e-5"});
  ASSERT_EQ(r.code, 0) << r.output;
  const std::vector<double> s = shares(dir + "/bf16-true");
  ASSERT_EQ(s.size(), 12u);
  for (size_t i = 0; i < s.size(); ++i) EXPECT_GT(s[i], 0.5) << "step " << i + 1;
  const auto f = rounding_findings(dir + "/bf16-true", "rounding");
  ASSERT_EQ(f.size(), 1u) << r.output;  // said once, on the third such step
  EXPECT_EQ(f[0].at("step").get<int64_t>(), 3);
  EXPECT_DOUBLE_EQ(f[0].at("share").get<double>(), s[2]);
  const std::string cause = f[0].at("cause").get<std::string>();
  const std::string action = f[0].at("action").get<std::string>();
  EXPECT_CONTAINS(cause, "of the weight updates rounded away (step 3: ");
  EXPECT_CONTAINS(cause, "left the stored bf16 value unchanged");
  EXPECT_CONTAINS(action,
                  "switch train.precision to bf16-mixed (f32 master weights keep every update)");
  EXPECT_CONTAINS(action, "optim.stochastic_rounding = true");
  EXPECT_CONTAINS(r.output, "advice: rounding: " + cause + "; " + action);

  // bf16-mixed, the same run: f32 masters take nearly every update (a few weight-decay and
  // near-zero-gradient updates fall below f32's resolution: under 1 in 1000); no finding.
  const test::KeelRun m =
      train_rounding(dir + "/bf16-mixed", {"train.precision=bf16-mixed", "optim.lr=1e-5"});
  ASSERT_EQ(m.code, 0) << m.output;
  for (double x : shares(dir + "/bf16-mixed")) EXPECT_LT(x, 1e-3);
  EXPECT_TRUE(rounding_findings(dir + "/bf16-mixed", "rounding").empty());
  EXPECT_EQ(m.output.find("advice: rounding"), std::string::npos) << m.output;
}

// Stochastic rounding (seeded from run.seed, the step and the parameter): the share drops, the
// weights move where nearest rounding left them, the finding is not given (the updates land on
// average), and two runs give the same counts and the same weights, bit for bit.
TEST(CliRounding, StochasticRoundingLandsTheUpdatesReproducibly) {
  const std::string dir = test::temp_dir("cli-rounding-sr");
  const std::vector<std::string> base = {"train.precision=bf16-true", "optim.lr=1e-5",
                                         "log.checkpoint_every=2"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), base.begin(), base.end());
    return extra;
  };
  const test::KeelRun n = train_rounding(dir + "/nearest", with({}));
  const test::KeelRun a = train_rounding(dir + "/sr-a", with({"optim.stochastic_rounding=true"}));
  const test::KeelRun b = train_rounding(dir + "/sr-b", with({"optim.stochastic_rounding=true"}));
  const test::KeelRun c =
      train_rounding(dir + "/sr-c", with({"optim.stochastic_rounding=true", "run.seed=7"}));
  for (const test::KeelRun* k : {&n, &a, &b, &c}) ASSERT_EQ(k->code, 0) << k->output;
  const std::vector<double> sn = shares(dir + "/nearest"), sa = shares(dir + "/sr-a");
  ASSERT_EQ(sn.size(), 12u);
  ASSERT_EQ(sa.size(), 12u);
  double mean_n = 0, mean_a = 0;
  for (size_t i = 0; i < sn.size(); ++i) mean_n += sn[i] / 12, mean_a += sa[i] / 12;
  EXPECT_LT(mean_a, mean_n - 0.05) << "stochastic rounding lands more updates";
  // The weights between step 2 and step 12: nearest rounding keeps most of them put.
  const std::string ck = "/checkpoints/step-", model = "/model.safetensors";
  const double moved_n =
      moved_share(dir + "/nearest" + ck + "2" + model, dir + "/nearest" + ck + "12" + model);
  const double moved_a =
      moved_share(dir + "/sr-a" + ck + "2" + model, dir + "/sr-a" + ck + "12" + model);
  EXPECT_GT(moved_a, moved_n + 0.1) << "nearest " << moved_n << ", stochastic " << moved_a;
  EXPECT_TRUE(rounding_findings(dir + "/sr-a", "rounding").empty());
  EXPECT_FALSE(rounding_findings(dir + "/nearest", "rounding").empty());
  // Deterministic: the same seed, the same counts and bits; another seed, other draws.
  EXPECT_EQ(shares(dir + "/sr-b"), sa);
  EXPECT_EQ(test::slurp(dir + "/sr-a/checkpoints/last" + model),
            test::slurp(dir + "/sr-b/checkpoints/last" + model));
  EXPECT_NE(test::slurp(dir + "/sr-a/checkpoints/last" + model),
            test::slurp(dir + "/sr-c/checkpoints/last" + model));
}

}  // namespace
}  // namespace keel
