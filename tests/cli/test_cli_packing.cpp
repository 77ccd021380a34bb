// data.pack with a JSONL file, end to end: the examples train packed into full rows (the loss
// falls, the run says how full its rows are), keel eval scores them packed as it scores them one a
// row, a validation split is held out before packing, and a NaN in a packed run is captured with
// its rows' positions and replays bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "keel/io/safetensors.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel::cli_packing_test {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::run_keel;
using test::with_sets;

// 96 lines "reverse: abcd =" -> " dcba" (16 to 20 bytes and eos): about three to a 64-token row.
std::string write_data(const std::string& dir) {
  const std::string path = dir + "/data.jsonl";
  std::ofstream f(path);
  for (int i = 0; i < 96; ++i) {
    std::string w;
    for (int k = 0; k < 3 + i % 3; ++k) w += static_cast<char>('a' + (i * 7 + k * 3) % 26);
    f << json{{"prompt", "reverse: " + w + " ="},
              {"completion", " " + std::string(w.rbegin(), w.rend())}}
             .dump()
      << "\n";
  }
  return path;
}

std::vector<std::string> packed_run(const std::string& out, const std::string& data) {
  return {"run.out_dir=" + out, "run.threads=1",         "model.family=llama", "model.n_layer=2",
          "model.n_embd=64",    "model.n_head=4",        "model.n_kv_head=2",  "data.task=jsonl",
          "data.path=" + data,  "data.pack=true",        "data.seq_len=64",    "train.batch_size=4",
          "optim.lr=3e-3",      "log.tensorboard=false", "log.every=1"};
}

TEST(CliPacking, PackedJsonlTrainsAndEvaluatesAsOneExampleARow) {
  const std::string dir = test::temp_dir("cli-packing");
  const std::string data = write_data(dir);
  const std::string out = dir + "/run";
  auto sets = packed_run(out, data);
  sets.push_back("train.max_steps=24");
  const test::KeelRun r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "data: 96 training examples packed into ");
  EXPECT_CONTAINS(r.err, " of at most data.seq_len = 64 tokens (");
  const auto steps = test::step_records(out);
  ASSERT_EQ(steps.size(), 24u);
  // Rows hold about three examples: an epoch is about a third of 24 batches of 4.
  EXPECT_LT(steps.back().at("epoch").get<int64_t>(), steps.size());
  double first = 0, last = 0;
  for (size_t i = 0; i < 4; ++i) first += steps[i].at("loss").get<double>() / 4;
  for (size_t i = steps.size() - 4; i < steps.size(); ++i)
    last += steps[i].at("loss").get<double>() / 4;
  EXPECT_LT(last, 0.7 * first) << "loss " << first << " -> " << last;

  // keel eval follows the run's packing; --per-example scores one example a row. The same loss
  // over the same target tokens (the sums in another order: f32 rounding apart).
  const test::KeelRun packed = run_keel({"eval", out, "--data", data, "--json"});
  ASSERT_EQ(packed.code, 0) << packed.output;
  const test::KeelRun alone =
      run_keel({"eval", out, "--data", data, "--json", "--per-example", dir + "/per.jsonl"});
  ASSERT_EQ(alone.code, 0) << alone.output;
  const json p = json::parse(packed.out), a = json::parse(alone.out);
  EXPECT_EQ(p.at("examples"), 96);
  EXPECT_LT(p.at("rows").get<int64_t>(), 48);
  EXPECT_EQ(a.at("rows"), 96);
  EXPECT_EQ(p.at("tokens"), a.at("tokens"));
  EXPECT_NEAR(p.at("loss").get<double>(), a.at("loss").get<double>(),
              1e-5 * a.at("loss").get<double>());
  const test::KeelRun text = run_keel({"eval", out, "--data", data});
  EXPECT_CONTAINS(text.out, " target tokens in 96 examples (packed into ");
}

// Packing is deterministic (the file and the lengths decide the rows; the loader's seed their
// order): a packed run stopped and resumed takes the steps of one that was not, to the bit.
TEST(CliPacking, AResumedPackedRunIsTheUninterruptedOne) {
  const std::string dir = test::temp_dir("cli-packing-resume");
  const std::string data = write_data(dir);
  auto train = [&](const std::string& out, int64_t steps, bool resume) {
    auto sets = packed_run(out, data);
    // (a constant learning rate: a schedule's would follow max_steps, 6 then 14)
    sets.insert(sets.end(), {"train.max_steps=" + std::to_string(steps), "train.epochs=2",
                             "log.checkpoint_every=3", "sched.name=constant"});
    if (resume) sets.push_back("run.resume=true");
    const test::KeelRun r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
  };
  train(dir + "/straight", 14, false);
  train(dir + "/resumed", 6, false);
  train(dir + "/resumed", 14, true);
  const auto a = test::step_records(dir + "/straight"), b = test::step_records(dir + "/resumed");
  ASSERT_EQ(a.size(), 14u);
  ASSERT_EQ(b.size(), 14u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].at("loss").get<double>(), b[i].at("loss").get<double>()) << "step " << i + 1;
    EXPECT_EQ(a[i].at("grad_norm").get<double>(), b[i].at("grad_norm").get<double>());
  }
}

TEST(CliPacking, TheValidationSplitIsTheFilesLastExamplesPacked) {
  const std::string dir = test::temp_dir("cli-packing-split");
  const std::string data = write_data(dir);
  auto sets = packed_run(dir + "/run", data);
  sets.insert(sets.end(), {"train.max_steps=2", "data.eval_fraction=0.25", "train.eval_every=2"});
  const test::KeelRun r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "data: 72 training examples packed into ");
  EXPECT_CONTAINS(r.err, "data: 24 validation examples packed into ");
  // The validation loss is the loss of the file's last 24 lines, however they are batched.
  {
    std::ifstream in(data);
    std::ofstream tail(dir + "/tail.jsonl");
    std::string line;
    for (int i = 0; std::getline(in, line); ++i)
      if (i >= 72) tail << line << "\n";
  }
  const auto evals = test::records_with(dir + "/run", "eval_loss");
  ASSERT_FALSE(evals.empty());
  const test::KeelRun e = run_keel({"eval", dir + "/run", "--data", dir + "/tail.jsonl", "--json"});
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_NEAR(json::parse(e.out).at("loss").get<double>(),
              evals.back().at("eval_loss").get<double>(), 1e-4);
}

TEST(CliPacking, ANanInAPackedRunReplaysWithItsRowsPositions) {
  const std::string dir = test::temp_dir("cli-packing-nan");
  const std::string data = write_data(dir);
  const std::string out = dir + "/run";
  auto sets = packed_run(out, data);
  sets.insert(sets.end(), {"train.max_steps=4", "debug.inject.module=model.layers.1.self_attn",
                           "debug.inject.step=3", "debug.inject.kind=nan"});
  const test::KeelRun r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 3) << r.output;
  const std::string capture = out + "/debug/nan_capture/rank0";
  const io::Safetensors mb = io::read_safetensors(capture + "/microbatches.safetensors");
  const Tensor* pos = mb.find("mb0.position_ids");
  ASSERT_NE(pos, nullptr) << "a packed run's capture holds its rows' positions";
  const Tensor* ids = mb.find("mb0.input_ids");
  ASSERT_NE(ids, nullptr);
  EXPECT_EQ(pos->shape(), ids->shape());
  int64_t restarts = 0;  // more examples than rows
  for (int64_t v : pos->to_ints()) restarts += v == 0;
  EXPECT_GT(restarts, ids->size(0));
  const test::KeelRun rp = run_keel({"replay", capture, "--json"});
  ASSERT_EQ(rp.code, 0) << rp.output;
  const json j = json::parse(rp.out);
  EXPECT_TRUE(j.value("reproduced", false)) << j.dump(2);
  EXPECT_TRUE(j.value("bit_exact", false)) << j.dump(2);
  EXPECT_EQ(j.value("first_module", std::string()), "model.layers.1.self_attn") << j.dump(2);
  // A capture whose positions describe no examples is named, not run.
  io::Safetensors bad = mb;
  for (auto& [name, t] : bad.tensors)
    if (name == "mb0.position_ids") {
      Tensor c = t.clone();
      c.data_as<int64_t>()[1] = 5;
      t = c;
    }
  io::write_safetensors(capture + "/microbatches.safetensors", bad.tensors, bad.metadata);
  const test::KeelRun broken = run_keel({"replay", capture});
  EXPECT_EQ(broken.code, 2) << broken.output;
  EXPECT_CONTAINS(broken.err, capture +
                                  "/microbatches.safetensors: mb0.position_ids holds 5 at "
                                  "[0, 1], where a packed row's position is 0");
}

// A NaN embedding row that one example's token reads: in a packed run the replay names the row
// that holds it as a packed row, not as an example of the file.
TEST(CliPacking, ATokensNanRowIsTracedToItsPackedRow) {
  const std::string dir = test::temp_dir("cli-packing-row");
  const std::string data = dir + "/data.jsonl";
  {
    std::ofstream f(data);
    for (int i = 0; i < 24; ++i)
      f << json{{"text", i == 17 ? "price ~ 42" : "line " + std::to_string(i) + " of text"}}.dump()
        << "\n";
  }
  const std::string out = dir + "/run";
  auto sets = packed_run(out, data);
  sets.insert(sets.end(), {"train.max_steps=1", "data.shuffle=false"});
  ASSERT_EQ(run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"}).code, 0);
  const std::string model = out + "/checkpoints/last/model.safetensors";
  io::Safetensors st = io::read_safetensors(model);
  for (auto& [name, t] : st.tensors)
    if (name == "model.embed_tokens.weight") {
      Tensor c = t.clone();
      for (int64_t k = 0; k < c.size(1); ++k)
        c.data_as<float>()[126 * c.size(1) + k] = std::numeric_limits<float>::quiet_NaN();  // '~'
      t = c;
    }
  io::write_safetensors(model, st.tensors, st.metadata);
  sets.insert(sets.end(),
              {"train.max_steps=20", "run.resume=true", "model.allow_nonfinite_weights=true"});
  const test::KeelRun r = run_keel(with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 3) << r.output;
  const test::KeelRun rp = run_keel({"replay", out + "/debug/nan_capture/rank0", "--bisect"});
  EXPECT_CONTAINS(rp.out, "; token 126 occurs in micro-batch 0 row ");
  EXPECT_CONTAINS(rp.out, ", packed)");
  EXPECT_NOT_CONTAINS(rp.out, "(dataset example");
}

}  // namespace keel::cli_packing_test
