// Data-parallel training end to end: `mpirun -np 2 keel train` on one machine (issue 8 "Tests").
//   - 2 ranks x grad_accum 1 gives the losses and weights of 1 rank x grad_accum 2 (the same
//     global batch, the same examples in the same steps) bit for bit, including an epoch whose
//     last window holds one micro-batch (rank 1 has no data there and joins with zero
//     gradients); 2 ranks x grad_accum 2 gives those of 1 rank x 4 within 1e-6 relative; the two
//     ranks always end with bit-identical weights and optimizer state;
//   - an overflow on rank 1 only (16-mixed) makes both ranks skip the step and back off the scale;
//   - a NaN on rank 1 only makes both ranks stop with exit code 3, the capture written by rank 1;
//   - a 2-rank run resumes from rank 0's checkpoint and continues bit-identically;
//   - a tracer finding on one rank stops both; ranks with different configs stop before the first
//     collective with an error naming the keys (exit 2, no hang); a rank that stops answering
//     ends the job after dist.timeout_s with an error naming the collective and the rank.
// Skipped when mpirun is absent, and under the sanitizers unless leak checking is off (Open MPI's
// own allocations at MPI_Init/Finalize are reported as leaks by LeakSanitizer, aborting every
// rank; scripts/test.sh runs the sanitizer build with detect_leaks=0, and there they pass).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "keel/io/safetensors.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string find_mpirun() {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':'))
    if (!dir.empty() && access((dir + "/mpirun").c_str(), X_OK) == 0) return dir + "/mpirun";
  return "";
}

// When a rank exits with an error, Open MPI's mpirun signals the others (SIGCONT, SIGTERM, SIGKILL)
// with odls_base_sigkill_timeout (1 s) between each, even after all of them have exited: each
// job that ended on an error took 2.4 s, of which 0.4 were keel's (this file: a minute, half of
// it asleep). Without the waits a rank still running is killed at once; no test here relies on
// the checkpoint a rank writes on SIGTERM (ServeRuns checks that path), and a user's setting wins.
[[maybe_unused]] const bool kMpirunKillsAtOnce =
    setenv("OMPI_MCA_odls_base_sigkill_timeout", "0", 0) == 0;

// Skips the test (with the reason) where these runs cannot or should not happen. Under the
// sanitizers they run when leak checking is off (scripts/test.sh sets ASAN_OPTIONS=detect_leaks=0):
// with it on, LeakSanitizer reports Open MPI's own allocations at exit and aborts every rank.
bool leak_checks_on() {
  const char* o = std::getenv("ASAN_OPTIONS");
  return !o || std::string(o).find("detect_leaks=0") == std::string::npos;
}
#define SKIP_WITHOUT_MPIRUN()                                                                   \
  do {                                                                                          \
    if (std::getenv("KEEL_TEST_SANITIZED") && leak_checks_on())                                 \
      GTEST_SKIP() << "mpirun tests under the sanitizers need ASAN_OPTIONS=detect_leaks=0: "    \
                      "LeakSanitizer reports Open MPI's own allocations and aborts every rank"; \
    if (find_mpirun().empty()) GTEST_SKIP() << "mpirun is not installed (Debian openmpi-bin)";  \
  } while (0)

using Ran = test::KeelRun;
using test::slurp;

// `keel train --set S...` as argv words.
std::vector<std::string> train_words(const std::vector<std::string>& sets) {
  std::vector<std::string> w = {test::keel_binary(), "train"};
  for (const std::string& s : sets) {
    w.push_back("--set");
    w.push_back(s);
  }
  return w;
}

// Runs `keel train --set ...` on `ranks` processes: 1 = the keel binary itself, more = under
// mpirun (as root it needs --allow-run-as-root; --oversubscribe lets 2 ranks share fewer cores).
Ran run_train(int ranks, const std::vector<std::string>& sets) {
  std::vector<std::string> args;
  if (ranks > 1)
    args = {find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", std::to_string(ranks)};
  for (const std::string& w : train_words(sets)) args.push_back(w);
  return test::run_command(args);
}

// A tiny GPT-2 on the built-in task, one OpenMP thread per rank: 7 micro-batches of 8 examples
// per epoch, so a 2-rank epoch is 4 steps and the last holds one micro-batch.
std::vector<std::string> tiny(const std::string& out, std::vector<std::string> more = {}) {
  std::vector<std::string> s = {
      "run.out_dir=" + out, "run.threads=1",          "model.n_layer=1",      "model.n_embd=32",
      "model.n_head=2",     "data.num_examples=56",   "data.eval_examples=0", "data.seq_len=16",
      "train.batch_size=8", "log.tensorboard=false",  "log.every=1",          "sched.name=constant",
      "optim.lr=0.01",      "dist.rank_weights=true", "dist.check_every=1"};
  s.insert(s.end(), more.begin(), more.end());
  return s;
}

using test::step_records;

// Rank 0's final state (checkpoints/last) and rank 1's (debug/rank1/checkpoint) bit for bit.
void expect_ranks_identical(const std::string& dir) {
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string a = slurp(dir + "/checkpoints/last/" + f);
    const std::string b = slurp(dir + "/debug/rank1/checkpoint/" + f);
    EXPECT_FALSE(a.empty()) << f;
    EXPECT_TRUE(a == b) << f << ": rank 0 and rank 1 ended with different bytes";
  }
}

// One micro-batch per rank: the 2-rank gradient is g0 + g1 summed by MPI, the 1-rank gradient
// g0 + g1 accumulated by backward: the same single f32 addition (commutative), so the runs agree
// bit for bit, losses and weights.
TEST(CliDist, TwoRanksMatchOneRankWithTheSameGlobalBatch) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-eq");
  // 2 epochs: 8 steps of 2 micro-batches, the 4th and 8th a remainder window of one.
  Ran one = run_train(1, tiny(dir + "/one", {"train.grad_accum=2", "train.epochs=2"}));
  ASSERT_EQ(one.code, 0) << one.out << one.err;
  Ran two = run_train(2, tiny(dir + "/two", {"train.grad_accum=1", "train.epochs=2"}));
  ASSERT_EQ(two.code, 0) << two.out << two.err;
  EXPECT_NE(two.out.find("2 ranks (mpi)"), std::string::npos) << two.out;
  // 8 steps, one bucket each (the model's 0.03M gradients fit in one 25 MB bucket).
  EXPECT_NE(two.out.find("dist: 8 gradient buckets"), std::string::npos) << two.out;
  // Rank 0 alone prints the console line and writes metrics.
  EXPECT_EQ(two.out.find("keel train |"), two.out.rfind("keel train |")) << two.out;
  const auto a = step_records(dir + "/one"), b = step_records(dir + "/two");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].at("loss").get<double>(), b[i].at("loss").get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i].at("grad_norm").get<double>(), b[i].at("grad_norm").get<double>());
  }
  EXPECT_TRUE(slurp(dir + "/one/checkpoints/last/model.safetensors") ==
              slurp(dir + "/two/checkpoints/last/model.safetensors"));
  expect_ranks_identical(dir + "/two");
  // The consistency check ran every step; its failure would have stopped the run.
  EXPECT_EQ(two.err.find("ranks disagree"), std::string::npos) << two.err;
}

// A mixture of experts (a tiny OLMoE, 6 experts a layer, 2 a token) with its load-balancing loss:
// an expert routed on one rank's micro-batch only gets a zero gradient on the other, and each
// rank's balance loss is its micro-batch's, weighted by its share of the global window's tokens:
// 2 ranks x 1 give the losses, routing figures and weights of 1 rank x 2 bit for bit.
TEST(CliDist, TwoRanksTrainAMixtureOfExpertsAsOneRankDoes) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-moe");
  const Ran init =
      test::run_keel({"init-model", "--family", "olmoe", "--out", dir + "/base", "--n-layer", "2",
                      "--n-embd", "32", "--n-head", "2", "--max-seq-len", "32", "--num-experts",
                      "6", "--experts-per-token", "2", "--expert-size", "16"});
  ASSERT_EQ(init.code, 0) << init.output;
  auto sets = [&](const std::string& out, const std::string& accum) {
    std::vector<std::string> s =
        tiny(dir + "/" + out,
             {"train.grad_accum=" + accum, "train.max_steps=4", "model.router_aux_loss_coef=0.05"});
    s.erase(std::remove_if(s.begin(), s.end(),
                           [](const std::string& k) { return k.rfind("model.n_", 0) == 0; }),
            s.end());
    s.push_back("model.path=" + dir + "/base");
    return s;
  };
  Ran one = run_train(1, sets("one", "2"));
  ASSERT_EQ(one.code, 0) << one.out << one.err;
  Ran two = run_train(2, sets("two", "1"));
  ASSERT_EQ(two.code, 0) << two.out << two.err;
  const auto a = step_records(dir + "/one"), b = step_records(dir + "/two");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].at("loss").get<double>(), b[i].at("loss").get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i].at("grad_norm").get<double>(), b[i].at("grad_norm").get<double>());
    EXPECT_GT(b[i].at("moe/aux_loss").get<double>(), 0) << "step " << i + 1;
  }
  EXPECT_TRUE(slurp(dir + "/one/checkpoints/last/model.safetensors") ==
              slurp(dir + "/two/checkpoints/last/model.safetensors"));
  expect_ranks_identical(dir + "/two");
}

// Two micro-batches per rank: (g0 + g2) + (g1 + g3) across ranks against ((g0 + g1) + g2) + g3 on
// one rank, so f32 rounding differs; the losses stay within 1e-6 relative over 8 AdamW steps
// (measured: 1.6e-8), the grad norms within 1e-5 (measured: 1.0e-6). 15 micro-batches per epoch:
// each epoch's last window holds 3 (rank 0 runs two, rank 1 one).
TEST(CliDist, TwoRanksWithAccumulationMatchOneRankWithinRounding) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-accum");
  Ran one = run_train(
      1, tiny(dir + "/one", {"train.grad_accum=4", "train.epochs=2", "data.num_examples=120"}));
  ASSERT_EQ(one.code, 0) << one.out << one.err;
  Ran two = run_train(
      2, tiny(dir + "/two", {"train.grad_accum=2", "train.epochs=2", "data.num_examples=120"}));
  ASSERT_EQ(two.code, 0) << two.out << two.err;
  const auto a = step_records(dir + "/one"), b = step_records(dir + "/two");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  // Step 1 starts from the same weights: the same sum of the same per-token losses.
  EXPECT_EQ(a[0].at("loss").get<double>(), b[0].at("loss").get<double>());
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i].at("loss").get<double>(), lb = b[i].at("loss").get<double>();
    EXPECT_NEAR(la, lb, 1e-6 * std::fabs(la)) << "step " << i + 1;
    const double ga = a[i].at("grad_norm").get<double>(), gb = b[i].at("grad_norm").get<double>();
    EXPECT_NEAR(ga, gb, 1e-5 * ga) << "step " << i + 1;
  }
  // Weights of the 1-rank and the 2-rank runs agree closely; the two ranks exactly.
  const auto wa = io::read_safetensors(dir + "/one/checkpoints/last/model.safetensors");
  const auto wb = io::read_safetensors(dir + "/two/checkpoints/last/model.safetensors");
  double max_diff = 0;
  for (const auto& [name, t] : wa.tensors) {
    const auto x = t.to_floats(), y = wb.at(name).to_floats();
    ASSERT_EQ(x.size(), y.size()) << name;
    for (size_t i = 0; i < x.size(); ++i)
      max_diff = std::max<double>(max_diff, std::fabs(x[i] - y[i]));
  }
  EXPECT_LT(max_diff, 1e-4);
  expect_ranks_identical(dir + "/two");
}

// A garbage row that only rank 1 trains on (a data spike): rank 0's advisor knew only its own
// half of the window, so it probed that half ("its batch is no harder ... the optimizer, not the
// data") and listed rank 0's rows, never the bad one. The ranks now gather the window's rows, and
// the finding is the 1-rank run's with the same global batch, record for record.
TEST(CliDist, AdvisorNamesTheSpikingRowOfAnotherRank) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-spike");
  // 880 rows, in file order: step s trains rows 16(s-1) .. 16s-1, rank 1 the last 8 of them.
  // Row 808 (line 809: step 51, rank 1) is 30 CJK characters, after 50 steps on one sentence.
  {
    std::ofstream f(dir + "/spike.jsonl");
    for (int i = 0; i < 880; ++i)
      f << (i == 808 ? "{\"text\": \"\u4e01\u4e8c\u4e03\u4e09\u4e0a\u4e0b\u4e0d\u4e0e\u4e10"
                       "\u4e11\u4e13\u4e14\u4e15\u4e16\u4e17\u4e18\u4e19\u4e1a\u4e1c\u4e1d"
                       "\u4e1e\u4e1f\u4e20\u4e21\u4e22\u4e23\u4e24\u4e25\u4e26\u4e27\"}\n"
                     : "{\"text\": \"the cat sat on the mat and the dog sat on the log.\"}\n");
  }
  auto sets = [&](const std::string& out, const std::string& accum) {
    std::vector<std::string> s = {"run.out_dir=" + out,
                                  "run.threads=1",
                                  "model.n_layer=1",
                                  "model.n_embd=32",
                                  "model.n_head=2",
                                  "data.task=jsonl",
                                  "data.path=" + dir + "/spike.jsonl",
                                  "data.seq_len=64",
                                  "data.shuffle=false",
                                  "train.batch_size=8",
                                  "train.grad_accum=" + accum,
                                  "train.max_steps=55",
                                  "log.tensorboard=false",
                                  "sched.name=constant",
                                  "optim.lr=0.01"};
    return s;
  };
  Ran one = run_train(1, sets(dir + "/one", "2"));
  ASSERT_EQ(one.code, 0) << one.out << one.err;
  Ran two = run_train(2, sets(dir + "/two", "1"));
  ASSERT_EQ(two.code, 0) << two.out << two.err;
  auto advice = [](const std::string& out) {
    std::vector<json> recs;
    std::ifstream f(out + "/metrics.jsonl");
    for (std::string line; std::getline(f, line);) {
      const json j = json::parse(line);
      if (j.value("kind", "") == "advisor") recs.push_back(j);
    }
    return recs;
  };
  const std::vector<json> a = advice(dir + "/one"), b = advice(dir + "/two");
  ASSERT_FALSE(b.empty()) << two.out;
  const json& spike = b.back();
  EXPECT_EQ(spike.at("step").get<int64_t>(), 51) << spike.dump();
  EXPECT_CONTAINS(spike.at("cause").get<std::string>(), "the batch is the harder, the data");
  const auto rows = spike.at("examples").get<std::vector<std::string>>();
  EXPECT_EQ(rows.size(), 16u) << spike.dump();
  EXPECT_NE(std::find(rows.begin(), rows.end(), dir + "/spike.jsonl:809"), rows.end())
      << spike.dump();
  EXPECT_EQ(a, b) << "1 rank x grad_accum 2 and 2 ranks x 1 found different things";
}

TEST(CliDist, OverflowOnOneRankMakesBothRanksSkip) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-skip");
  // 16-mixed (scale 65536). Step 2, rank 1 only: ln_f's output x 1000, so the logits are 1000x
  // too: the loss stays finite (about 100), the backward's f16 activation gradients overflow
  // (any factor from 300 to 3000 does). The same run without the injection applies step 2: the
  // overflow is the injection's, not the scale's.
  const std::vector<std::string> common = {"train.precision=16-mixed", "train.max_steps=3"};
  auto base_sets = tiny(dir + "/base", common);
  Ran base = run_train(2, base_sets);
  ASSERT_EQ(base.code, 0) << base.out << base.err;
  auto inj_sets = tiny(dir + "/inj", common);
  inj_sets.insert(inj_sets.end(),
                  {"debug.inject.module=transformer.ln_f", "debug.inject.kind=scale",
                   "debug.inject.factor=1000", "debug.inject.step=2", "debug.inject.only_rank=1"});
  Ran r = run_train(2, inj_sets);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const auto b = step_records(dir + "/base"), recs = step_records(dir + "/inj");
  ASSERT_EQ(b.size(), 3u);
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(b[1].at("skipped_steps").get<int64_t>(), 0) << b[1].dump();
  EXPECT_EQ(recs[0].at("loss").get<double>(), b[0].at("loss").get<double>());
  EXPECT_EQ(recs[0].at("skipped_steps").get<int64_t>(), 0);
  EXPECT_EQ(recs[1].at("skipped_steps").get<int64_t>(), 1) << recs[1].dump();
  EXPECT_TRUE(recs[1].at("grad_norm").is_string()) << recs[1].dump();  // "nan" or "inf"
  EXPECT_TRUE(std::isfinite(recs[1].at("loss").get<double>())) << recs[1].dump();
  EXPECT_EQ(recs[1].at("loss_scale").get<double>(), 65536.0);
  EXPECT_EQ(recs[2].at("loss_scale").get<double>(), 32768.0);  // backed off once, on both ranks
  EXPECT_FALSE(fs::exists(dir + "/inj/debug/nan_capture"))
      << "a scaler-handled overflow is no capture";
  // Rank 0 saw nothing wrong, yet skipped too: the ranks still hold the same weights (and the
  // consistency check, run every step, agreed on scale, step and LR clock).
  expect_ranks_identical(dir + "/inj");
}

TEST(CliDist, NanOnOneRankStopsBothWithTheCaptureOfThatRank) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-nan");
  Ran r = run_train(
      2, tiny(dir, {"train.max_steps=4", "debug.inject.module=transformer.h.0.attn",
                    "debug.inject.kind=nan", "debug.inject.step=3", "debug.inject.only_rank=1"}));
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  const std::string capture = dir + "/debug/nan_capture/rank1";
  ASSERT_TRUE(fs::exists(capture + "/capture.json")) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/debug/nan_capture/rank0")) << "rank 0 saw nothing";
  const json meta = json::parse(slurp(capture + "/capture.json"));
  EXPECT_EQ(meta.at("rank").get<int>(), 1);
  EXPECT_EQ(meta.at("step").get<int64_t>(), 3);
  // Both ranks stopped at step 3 and said so; rank 0 points at rank 1's capture.
  EXPECT_NE(r.err.find("stopped (rank 1): step 3: non-finite"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("capture written to " + capture), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("stopped (rank 0): step 3:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 1 saw the non-finite value"), std::string::npos) << r.err;
  EXPECT_EQ(step_records(dir).size(), 3u);  // rank 0 logged steps 1-3, nothing after
}

// How many times `what` stands in `text`.
size_t times_in(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// 16-true at the default learning rate: AdamW's f16 second moment flushes and step 4 overflows
// (CliNan.AdamWSecondMomentUnderflowIn16TrueIsNamedAsTheCause). Rank 0's advice names the cause;
// rank 1, which has no advisor, printed it again as a "cause:" line.
TEST(CliDist, SecondMomentUnderflowIsNamedOnce) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-16true-adam");
  Ran r = run_train(
      2, {"run.out_dir=" + dir, "run.threads=1", "log.tensorboard=false", "train.precision=16-true",
          "train.max_steps=8", "data.num_examples=1280", "data.eval_examples=0"});
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_CONTAINS(r.out, "advice: exploding: non-finite ");
  const std::string all = r.out + r.err, what = "AdamW's second moment (exp_avg_sq, stored in f16)";
  EXPECT_EQ(times_in(all, what), 1u) << all;
  EXPECT_NOT_CONTAINS(r.err, "cause: AdamW's second moment");
}

// on_nonfinite = abort writes no capture: rank 0's stop said only that, not that rank 1 was
// where the non-finite value came from.
TEST(CliDist, AbortOnOneRanksNanNamesThatRankOnEveryRank) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-abort");
  Ran r =
      run_train(2, tiny(dir, {"train.max_steps=4", "train.on_nonfinite=abort",
                              "debug.inject.module=transformer.h.0.attn", "debug.inject.kind=nan",
                              "debug.inject.step=2", "debug.inject.only_rank=1"}));
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  for (const char* rank : {"0", "1"})
    EXPECT_CONTAINS(r.err, std::string("stopped (rank ") + rank + "): step 2: ");
  EXPECT_EQ(r.err.find("no capture written (on_nonfinite = abort)"), std::string::npos) << r.err;
  EXPECT_EQ(times_in(r.err,
                     "no capture written (on_nonfinite = abort; rank 1 saw the "
                     "non-finite value)"),
            2u)
      << r.err;
  EXPECT_FALSE(fs::exists(dir + "/debug/nan_capture"));
}

// Replay of one rank's capture (issue 21 item 6). At step 3 both ranks scale the MLP's input by
// 1e21: the GELU's derivative overflows to NaN in backward while the loss stays finite (the final
// LayerNorm's variance overflows and its output is the bias), so each rank's loss is its own
// batch's. Each rank writes its capture, and each replays alone bit for bit — its local loss (its
// loss sum over its own target tokens) and its gradients before the all-reduce (still scaled),
// with dropout on (its micro-batches' global indices seed it) — the two ranks' differ, and each
// replay's tracer log is named after its rank.
TEST(CliDist, ReplayOfEachRanksCaptureIsBitExact) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-replay");
  Ran r =
      run_train(2, tiny(dir, {"train.max_steps=4", "model.dropout=0.1",
                              "debug.inject.module=transformer.h.0.ln_2", "debug.inject.kind=scale",
                              "debug.inject.factor=1e21", "debug.inject.step=3"}));
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  // The stop line names the gradient backward produced first: the MLP's, not the embedding.
  EXPECT_CONTAINS(r.err, "(first produced by backward: transformer.h.0.mlp.c_fc.");
  std::vector<json> replays;
  for (int rank : {0, 1}) {
    const std::string capture = dir + "/debug/nan_capture/rank" + std::to_string(rank);
    ASSERT_TRUE(fs::exists(capture + "/capture.json")) << r.err;
    const json meta = json::parse(slurp(capture + "/capture.json"));
    EXPECT_EQ(meta.at("world_size").get<int>(), 2);
    EXPECT_EQ(meta.at("rank").get<int>(), rank);
    EXPECT_EQ(meta.at("micro_batches")[0].at("global_index").get<int>(), rank);
    EXPECT_FALSE(meta.at("local_grads_fingerprint").get<std::string>().empty());
    const Ran rep = test::run_keel({"replay", capture, "--json"}, {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(rep.code, 0) << rep.output;
    const json j = json::parse(rep.out);
    EXPECT_TRUE(j.at("bit_exact").get<bool>()) << rep.out;
    EXPECT_TRUE(j.at("reproduced").get<bool>()) << rep.out;
    EXPECT_EQ(j.at("compared"), "local");
    EXPECT_EQ(j.at("loss_bits"), meta.at("local_loss_bits"));
    EXPECT_EQ(j.at("grads_fingerprint"), meta.at("local_grads_fingerprint"));
    EXPECT_EQ(j.at("rank").get<int>(), rank);
    const std::string log = j.at("tracer_log");
    EXPECT_EQ(fs::path(log).filename(), "underflow_overflow_rank" + std::to_string(rank) + ".log")
        << log;
    EXPECT_TRUE(fs::exists(log)) << log;
    const Ran text = test::run_keel({"replay", capture}, {"OMP_NUM_THREADS=1"});
    EXPECT_CONTAINS(text.out, "rank         " + std::to_string(rank) + " of 2");
    EXPECT_CONTAINS(text.out, "bit-exact    yes (local loss same bits, pre-reduce gradients same");
    EXPECT_TRUE(meta.at("local_loss").is_number()) << meta.at("local_loss");
    EXPECT_TRUE(meta.at("loss").is_number()) << "the global loss, finite too";
    replays.push_back(j);
  }
  EXPECT_NE(replays[0].at("loss_bits"), replays[1].at("loss_bits"))
      << "each rank replays its own micro-batches";
  EXPECT_NE(replays[0].at("grads_fingerprint"), replays[1].at("grads_fingerprint"));
}

TEST(CliDist, TwoRanksResumeFromRankZerosCheckpoint) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-resume");
  Ran full = run_train(2, tiny(dir + "/full", {"train.max_steps=6"}));
  ASSERT_EQ(full.code, 0) << full.out << full.err;
  Ran first = run_train(2, tiny(dir + "/part", {"train.max_steps=3"}));
  ASSERT_EQ(first.code, 0) << first.out << first.err;
  Ran rest = run_train(2, tiny(dir + "/part", {"train.max_steps=6", "run.resume=true"}));
  ASSERT_EQ(rest.code, 0) << rest.out << rest.err;
  const auto a = step_records(dir + "/full"), b = step_records(dir + "/part");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);  // 3 + 3, appended
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(b[i].at("step").get<int64_t>(), static_cast<int64_t>(i + 1));
    EXPECT_EQ(a[i].at("loss").get<double>(), b[i].at("loss").get<double>()) << "step " << i + 1;
  }
  EXPECT_TRUE(slurp(dir + "/full/checkpoints/last/model.safetensors") ==
              slurp(dir + "/part/checkpoints/last/model.safetensors"));
  expect_ranks_identical(dir + "/part");
}

TEST(CliDist, TracerOnOneRankStopsBothRanks) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-tracer");
  // on_nonfinite = skip: the step itself goes on, so only the tracers' agreement stops rank 0.
  Ran r =
      run_train(2, tiny(dir, {"train.max_steps=4", "debug.underflow_overflow.enabled=true",
                              "train.on_nonfinite=skip", "debug.inject.module=transformer.h.0.attn",
                              "debug.inject.step=2", "debug.inject.only_rank=1"}));
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_TRUE(fs::exists(dir + "/debug/underflow_overflow_rank1.log"));
  EXPECT_FALSE(fs::exists(dir + "/debug/underflow_overflow_rank0.log"));
  EXPECT_NE(
      r.err.find("stopped (rank 1): underflow/overflow tracer: the first non-finite value was "
                 "produced by 'transformer.h.0.attn'"),
      std::string::npos)
      << r.err;
  EXPECT_NE(
      r.err.find("stopped (rank 0): another rank's tracer found a non-finite value at step 2"),
      std::string::npos)
      << r.err;
}

// Two programs in one job (mpirun's MPMD form): rank 0 runs `a`, rank 1 runs `b`.
Ran run_mpmd(const std::vector<std::string>& a, const std::vector<std::string>& b,
             const std::vector<std::string>& env = {}) {
  std::vector<std::string> args = {find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np",
                                   "1"};
  for (const std::string& w : train_words(a)) args.push_back(w);
  for (const char* w : {":", "-np", "1"}) args.push_back(w);
  for (const std::string& w : train_words(b)) args.push_back(w);
  return test::run_command(args, env);
}

// Ranks compare a digest of their effective configs before the first collective (issue 22): a
// different learning rate, bucket size (which corrupted the heap), max_steps (which hung) or
// batch size (which went unnoticed) stops every rank with an error naming the keys (exit 2).
TEST(CliDist, RanksWithDifferentConfigsStopWithAnErrorNamingThem) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-mismatch");
  Ran r = run_mpmd(tiny(dir, {"train.max_steps=3", "optim.lr=0.01"}),
                   tiny(dir, {"train.max_steps=3", "optim.lr=0.02"}));
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("the ranks' configs differ before the first collective"), std::string::npos)
      << r.err;
  // Both ranks find it; mpirun ends the job at the first rank's exit, which may end the other
  // before it printed (seen once in a loaded run: rank 1's line alone).
  EXPECT_TRUE(r.err.find("optim.lr = 0.01 here, another value on rank 1") != std::string::npos ||
              r.err.find("optim.lr = 0.02 here, another value on rank 0") != std::string::npos)
      << r.err;
  EXPECT_EQ(step_records(dir).size(), 0u);  // checked before the first step ran
  r = run_mpmd(tiny(dir, {"dist.bucket_mb=25", "train.max_steps=3", "train.batch_size=8"}),
               tiny(dir, {"dist.bucket_mb=0.001", "train.max_steps=5", "train.batch_size=4"}));
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  for (const char* key : {"dist.bucket_mb = ", "train.max_steps = ", "train.batch_size = "})
    EXPECT_NE(r.err.find(key), std::string::npos) << key << "\n" << r.err;
  EXPECT_EQ(r.err.find("rank consistency check"), std::string::npos) << r.err;
  // A rank's own thread count may differ.
  r = run_mpmd(tiny(dir + "/threads", {"train.max_steps=2"}),
               tiny(dir + "/threads", {"train.max_steps=2", "run.threads=2"}));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
}

// A crash of a 2-rank run between the two renames of a save leaves checkpoints/last moved aside;
// on resume rank 0 puts it back while rank 1 read it from where it was: rank 1 failed ("cannot
// read .../last.old-PID/model.safetensors") in 3 of 5 tries. Two tries here.
TEST(CliDist, TwoRanksResumeAfterACrashMidSave) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-crash");
  for (int i = 0; i < 2; ++i) {
    const std::string out = dir + "/" + std::to_string(i);
    std::vector<std::string> args = {find_mpirun(),
                                     "--allow-run-as-root",
                                     "--oversubscribe",
                                     "-x",
                                     "KEEL_TEST_CRASH_AT",
                                     "-np",
                                     "2"};
    for (const std::string& w :
         train_words(tiny(out, {"train.max_steps=4", "log.checkpoint_every=1"})))
      args.push_back(w);
    Ran r = test::run_command(args, {"KEEL_TEST_CRASH_AT=moved_aside:2"});  // step 2's last
    ASSERT_NE(r.code, 0) << r.out << r.err;
    r = run_train(2, tiny(out, {"train.max_steps=4", "run.resume=true"}));
    ASSERT_EQ(r.code, 0) << "try " << i << ": " << r.out << r.err;
    EXPECT_CONTAINS(r.err, "resumed from");
    EXPECT_EQ(step_records(out).size(), 4u);
  }
}

// The child processes of `parent` (mpirun's ranks), from /proc.
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f(e.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t close = stat.rfind(')');  // the command may hold spaces and parentheses
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    long ppid = 0;
    if (rest >> state >> ppid && ppid == parent) out.push_back(std::stoi(name));
  }
  return out;
}

// A scheduler's preemption or Ctrl-C on a multi-rank run: the stop handlers were installed for one
// process only, and a SIGTERM ended every rank with no checkpoint and no word. The ranks now agree
// on the step (the request rides on the step's found-inf all-reduce), rank 0 saves, and each
// stops after that step. The signal goes to one rank only (a preempted node): both stop.
TEST(CliDist, ASigtermToOneRankStopsEveryRankAfterTheSameStepWithACheckpoint) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-sigterm");
  const std::string out = dir + "/run";
  std::vector<std::string> words = {find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np",
                                    "2"};
  for (const std::string& w : train_words(tiny(out, {"train.max_steps=100000"})))
    words.push_back(w);
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t job = fork();
  if (job == 0) {
    if (!std::freopen((dir + "/out").c_str(), "w", stdout) ||
        !std::freopen((dir + "/err").c_str(), "w", stderr))
      _exit(127);
    execv(argv[0], argv.data());
    _exit(127);
  }
  ASSERT_GT(job, 0);
  // Bounded waits: a hung job is killed, and the test fails instead of waiting for ctest.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  auto lines = [&] {
    const std::string m = slurp(out + "/metrics.jsonl");
    return std::count(m.begin(), m.end(), '\n');
  };
  while (lines() < 3 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const std::vector<pid_t> ranks = children_of(job);
  ASSERT_EQ(ranks.size(), 2u) << slurp(dir + "/err");
  ASSERT_EQ(kill(ranks[0], SIGTERM), 0);
  int status = 0;
  while (waitpid(job, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(job, SIGKILL);
      waitpid(job, &status, 0);
      FAIL() << "the job did not stop within 60 s of the SIGTERM: " << slurp(dir + "/err");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::string said = slurp(dir + "/out"), err = slurp(dir + "/err");
  ASSERT_TRUE(WIFEXITED(status)) << said << err;
  EXPECT_EQ(WEXITSTATUS(status), 0) << said << err;
  const size_t at = said.find("stopped by request at step ");
  ASSERT_NE(at, std::string::npos) << said << err;
  EXPECT_EQ(said.find("stopped by request", at + 1), std::string::npos) << "said once: " << said;
  const int64_t step = std::stoll(said.substr(at + 27));
  const auto records = step_records(out);
  ASSERT_FALSE(records.empty());
  EXPECT_EQ(records.back().at("step").get<int64_t>(), step);
  const json state = json::parse(slurp(out + "/checkpoints/last/trainer.json"));
  EXPECT_EQ(state.at("step").get<int64_t>(), step);
  // Resumable on two ranks.
  Ran r =
      run_train(2, tiny(out, {"train.max_steps=" + std::to_string(step + 2), "run.resume=true"}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(step_records(out).back().at("step").get<int64_t>(), step + 2);
}

// A rank that stops answering (KEEL_TEST_STALL_RANK: rank 1 sleeps before its first gradient
// all-reduce) no longer hangs the other: after dist.timeout_s it stops with an error naming the
// collective and the missing rank, and the job ends.
TEST(CliDist, ARankThatStopsAnsweringEndsTheJobAfterTheDeadline) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-stall");
  std::vector<std::string> args = {find_mpirun(),
                                   "--allow-run-as-root",
                                   "--oversubscribe",
                                   "-x",
                                   "KEEL_TEST_STALL_RANK",
                                   "-np",
                                   "2"};
  for (const std::string& w : train_words(tiny(dir, {"train.max_steps=3", "dist.timeout_s=1.5"})))
    args.push_back(w);
  const auto t0 = std::chrono::steady_clock::now();
  Ran r = test::run_command(args, {"KEEL_TEST_STALL_RANK=1"});
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out << r.err;
  EXPECT_LT(secs, 60) << "the job did not end soon after the deadline";
  EXPECT_NE(r.err.find("MPI_Allreduce(sum of gradients) while summing gradient bucket 1 of 1 at "
                       "step 1 did not complete within dist.timeout_s = 1.5 s on rank 0: rank 1 "
                       "did not arrive"),
            std::string::npos)
      << r.err;
}

// The deadline's error named only the operation ("MPI_Allreduce(max) did not complete ... rank 1
// did not arrive"): a step makes five collectives, and it did not say which one rank 1 never
// reached. Each says what it is for (KEEL_TEST_STALL_AT stalls rank 1 before the first collective
// whose purpose contains the text).
TEST(CliDist, TheDeadlineNamesWhatTheCollectiveWasFor) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-stall-at");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"non-finite",
       "MPI_Allreduce(max) while agreeing on non-finite gradients and stop requests "
       "at step 1 did not complete"},
      {"token count",
       "MPI_Allreduce(sum) while summing the step's token count at step 1 did not "
       "complete"},
      {"final rank check",
       "MPI_Allgather while running the final rank check after step 2 did not "
       "complete"}};
  for (const auto& [at, said] : cases) {
    std::vector<std::string> args = {find_mpirun(),
                                     "--allow-run-as-root",
                                     "--oversubscribe",
                                     "-x",
                                     "KEEL_TEST_STALL_RANK",
                                     "-x",
                                     "KEEL_TEST_STALL_AT",
                                     "-np",
                                     "2"};
    for (const std::string& w :
         train_words(tiny(dir, {"train.max_steps=2", "dist.timeout_s=1", "run.overwrite=true"})))
      args.push_back(w);
    const auto t0 = std::chrono::steady_clock::now();
    Ran r = test::run_command(args, {"KEEL_TEST_STALL_RANK=1", "KEEL_TEST_STALL_AT=" + at});
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.code, 0) << r.out << r.err;
    EXPECT_LT(secs, 60) << at;
    EXPECT_CONTAINS(r.err, said + " within dist.timeout_s = 1 s on rank 0: rank 1 did not arrive");
  }
}

// Rank 0's advisor probes a loss spike's first sighting with forward passes over the step's whole
// window (about 2W/3 step-times), while the other ranks waited in the next step's first
// collective: its deadline ended the job saying that rank 0 "did not arrive". They wait for it
// now under a deadline that names it. The spike is a natural one: step 12's 16 rows (both ranks')
// are long CJK lines after 11 steps of one short sentence. Rows are padded to data.seq_len = 2048,
// so that steps are long enough to time: a run measures the step time S on this machine, then
// the deadline is 0.7 S, past the probe's 1.3 S but not a step's own jitter.
TEST(CliDist, RankZerosSpikeProbePastTheDeadlineIsNamedAsSuch) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-probe");
  {
    std::ofstream f(dir + "/spike.jsonl");
    for (int i = 0; i < 400; ++i) {
      std::string text = "the cat sat on the mat and the dog sat on the log.";
      if (i >= 176 && i < 192) {  // step 12's window (8 rows x 2 ranks a step): garbage
        text.clear();
        for (int k = 0; k < 700; ++k) {
          const int c = 0x4e01 + (k * 13 + 7 * i) % 5000;  // 3 UTF-8 bytes
          text += static_cast<char>(0xe0 | (c >> 12));
          text += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
          text += static_cast<char>(0x80 | (c & 0x3f));
        }
      }
      f << "{\"text\": \"" << text << "\"}\n";
    }
  }
  auto train = [&](const std::string& out, const std::vector<std::string>& env) {
    std::vector<std::string> args = {find_mpirun(), "--allow-run-as-root", "--oversubscribe"};
    for (const std::string& e : env) args.insert(args.end(), {"-x", e.substr(0, e.find('='))});
    args.insert(args.end(), {"-np", "2"});
    for (const std::string& w :
         train_words({"run.out_dir=" + dir + "/" + out, "run.threads=1", "model.n_layer=1",
                      "model.n_embd=32", "model.n_head=2", "data.task=jsonl",
                      "data.path=" + dir + "/spike.jsonl", "data.seq_len=64", "data.shuffle=false",
                      "train.batch_size=8", "train.max_steps=13", "log.tensorboard=false",
                      "sched.name=constant", "optim.lr=0.01", "dist.timeout_s=2"}))
      args.push_back(w);
    return test::run_command(args, env);
  };
  // The spike at step 12 is probed (its record names the probe's comparison) ...
  Ran r = train("plain", {});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  bool probed = false;
  for (const json& j : test::records_with(dir + "/plain", "trend"))
    probed |= j.value("step", int64_t{0}) == 12 &&
              j.value("cause", "").find("under the same weights") != std::string::npos;
  ASSERT_TRUE(probed) << "no probed spike at step 12: " << slurp(dir + "/plain/metrics.jsonl");
  // ... and a probe that outlasts dist.timeout_s (each forward made 3 s longer) is named as rank
  // 0's work: without the wait, rank 1's next collective said "rank 0 did not arrive".
  r = train("slow", {"KEEL_TEST_SLOW_PROBE_S=3"});
  EXPECT_NE(r.code, 0) << r.out << r.err;
  EXPECT_CONTAINS(r.err,
                  "rank 0's trend advisor's checks at step 12 (a loss spike's first sighting runs "
                  "forward passes over the step's whole window) (done by rank 0 alone) did not "
                  "finish within dist.timeout_s = ");
  EXPECT_NOT_CONTAINS(r.err, "rank 0 did not arrive");
}

// An error every rank hits alike (the config is the same everywhere) was printed once per rank,
// before MPI started ("error: --set data.num_examples=0: ..." twice) and after ("error (rank R
// of 2): ..." from each rank for a refused resume). Rank 0 says it once now; an error that only
// one rank hits is still said by that rank, and ranks failing differently each say their own.
TEST(CliDist, AnErrorOfEveryRankIsSaidOnceAndOneRanksOwnIsNeverLost) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-said-once");
  auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  Ran r = run_train(2, tiny(dir + "/a", {"data.num_examples=0"}));
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_EQ(count(r.err, "data.num_examples must be in"), 1u) << r.err;
  EXPECT_CONTAINS(r.err, "error (every rank of 2): --set data.num_examples=0");
  // Rank 1's own (its config does not load; rank 0's does and waits for it in the config check).
  const auto t0 = std::chrono::steady_clock::now();
  r = run_mpmd(tiny(dir + "/b", {"train.max_steps=1"}),
               tiny(dir + "/b", {"train.max_steps=1", "data.num_examples=0"}));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60);
  EXPECT_NE(r.code, 0) << r.out << r.err;
  EXPECT_CONTAINS(r.err, "error (rank 1 of 2): --set data.num_examples=0");
  // Two ranks, two errors: each says its own.
  r = run_mpmd(tiny(dir + "/c", {"data.num_examples=0"}), tiny(dir + "/c", {"data.seq_len=1"}));
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_CONTAINS(r.err, "error (rank 0 of 2): --set data.num_examples=0");
  EXPECT_CONTAINS(r.err, "error (rank 1 of 2): --set data.seq_len=1");
  // A refused resume, found by every rank as it builds the run.
  r = run_train(2, tiny(dir + "/d", {"train.max_steps=1"}));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  r = run_train(2, tiny(dir + "/d", {"train.max_steps=2", "run.resume=true", "model.n_embd=64"}));
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_EQ(count(r.err, "this resume changes what the checkpoint fixes"), 1u) << r.err;
  EXPECT_CONTAINS(r.err, "error (every rank of 2): ");
}

// Rank 0 alone evaluates and writes checkpoints: the other ranks waited for it in their next
// collective, whose deadline ended the job when that work took longer than dist.timeout_s (a
// large checkpoint, a long evaluation), saying that rank 0 "did not arrive (stopped, hung, ...)".
// The deadline stays (a rank 0 hung in its file system must not hang the job); its error names
// rank 0's work and the key to raise.
TEST(CliDist, RankZerosEvaluationPastTheDeadlineIsNamedAsSuch) {
  SKIP_WITHOUT_MPIRUN();
  const std::string dir = test::temp_dir("cli-dist-eval");
  // An evaluation of 7000 problems takes over a second; the deadline is half of one.
  Ran r = run_train(2, tiny(dir, {"train.max_steps=1", "train.eval_every=1",
                                  "data.eval_examples=7000", "dist.timeout_s=0.5"}));
  EXPECT_NE(r.code, 0) << r.out << r.err;
  EXPECT_CONTAINS(r.err,
                  "rank 0's evaluation at step 1 (done by rank 0 alone) did not finish within "
                  "dist.timeout_s = 0.5 s; raise dist.timeout_s if it needs longer");
  EXPECT_NOT_CONTAINS(r.err, "did not arrive");
}

// `mpirun -np 2 keel doctor` (the line keel train runs with): each rank printed a whole report,
// both of one rank's windows ("7 steps per epoch ..., no remainder"); rank 0 alone checks now,
// for 2 ranks. Outside mpirun a config for several ranks says its windows are one rank's.
TEST(CliDist, DoctorUnderMpirunReportsOnceForItsRanks) {
  const std::string dir = test::temp_dir("cli-dist-doctor");
  std::vector<std::string> args = {test::keel_binary(), "doctor", "--no-sanity"};
  for (const std::string& s :
       {std::string("model.n_layer=1"), std::string("model.n_embd=32"),
        std::string("model.n_head=2"), std::string("data.num_examples=56"),
        std::string("data.eval_examples=0"), std::string("train.batch_size=8"),
        std::string("dist.backend=mpi")}) {
    args.push_back("--set");
    args.push_back(s);
  }
  Ran one = test::run_command(args);
  EXPECT_EQ(one.code, 0) << one.out << one.err;
  EXPECT_CONTAINS(one.out, "windows: 7 steps per epoch of 1 x 8 examples, no remainder");
  EXPECT_CONTAINS(one.out,
                  "the windows above are one rank's: run keel doctor under the same "
                  "mpirun -np N as keel train");
  SKIP_WITHOUT_MPIRUN();
  args.insert(args.begin(), {find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "2"});
  Ran two = test::run_command(args);
  EXPECT_EQ(two.code, 0) << two.out << two.err;
  EXPECT_EQ(two.out.find("keel doctor"), two.out.rfind("keel doctor")) << two.out;
  EXPECT_CONTAINS(two.out,
                  "remainder window of 1 micro-batch instead of 2 (step 4 of 4; rank 1 has no "
                  "micro-batch there");
  EXPECT_NOT_CONTAINS(two.out, "the windows above are one rank's");
}

TEST(CliDist, NcclWithoutAGpuIsOneClearError) {
  const std::string dir = test::temp_dir("cli-dist-nccl");
  Ran r = run_train(1, tiny(dir, {"dist.backend=nccl", "train.max_steps=1"}));
  // No GPU here (or no NCCL in this build): a usage error naming the backend and the fix.
  if (r.code == 0) GTEST_SKIP() << "this machine has a GPU and NCCL: the run succeeded";
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("dist.backend = \"nccl\""), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("use dist.backend = \"mpi\""), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

}  // namespace
}  // namespace keel
