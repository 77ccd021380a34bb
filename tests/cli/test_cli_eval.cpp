// `keel eval` and the text/JSONL validation split: eval's loss is the training loss of the same
// batches (step 1 of a run, before its update) and the run's own eval_loss records; a checkpoint
// equals its base + PEFT adapter; data.eval_path / data.eval_fraction evaluate every
// train.eval_every; bad input is a usage error naming the flag, key or file.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "keel/io/safetensors.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

using json = nlohmann::json;

struct Files {
  std::string dir, base, train, val;
};

// A tiny Llama base and two JSONL files (8 training, 4 validation examples), once per binary.
const Files& files() {
  static const Files f = [] {
    Files f;
    f.dir = test::temp_dir("eval");
    f.base = f.dir + "/base";
    const test::KeelRun r = test::run_keel(
        {"init-model", "--family", "llama", "--out", f.base, "--n-layer", "2", "--n-embd", "32",
         "--n-head", "4", "--n-kv-head", "2", "--max-seq-len", "64", "--init-std", "0.1"});
    EXPECT_EQ(r.code, 0) << r.output;
    f.train = f.dir + "/train.jsonl";
    f.val = f.dir + "/val.jsonl";
    std::ofstream t(f.train), v(f.val);
    for (int i = 0; i < 8; ++i)
      t << json({{"prompt", "Q" + std::to_string(i) + ": what is " + std::to_string(i * 7) + "?"},
                 {"completion", " it is " + std::string(i + 1, 'x')}})
               .dump()
        << "\n";
    for (int i = 0; i < 4; ++i)
      v << json({{"text", "held out line " + std::to_string(i)}}).dump() << "\n";
    return f;
  }();
  return f;
}

json eval_json(std::vector<std::string> args) {
  args.insert(args.begin(), "eval");
  args.push_back("--json");
  const test::KeelRun r = test::run_keel(args, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 0) << r.output;
  return r.code == 0 ? json::parse(r.out) : json::object();
}

test::KeelRun train(const std::string& out, std::vector<std::string> sets,
                    const std::string& base = files().base) {
  const Files& f = files();
  std::vector<std::string> all = {
      "run.out_dir=" + out, "run.threads=1",        "model.path=" + base,
      "data.task=jsonl",    "data.path=" + f.train, "data.seq_len=40",
      "data.shuffle=false", "train.batch_size=8",   "log.tensorboard=false"};
  all.insert(all.end(), sets.begin(), sets.end());
  return test::run_keel(test::with_sets({"train"}, all), {"OMP_NUM_THREADS=1"});
}

std::vector<json> eval_records(const std::string& out) {
  return test::records_with(out, "eval_loss");
}

TEST(CliEval, EqualsTheTrainingLossOfTheSameBatchesAndTheRunsEvalRecords) {
  const Files& f = files();
  const std::string out = f.dir + "/run";
  const test::KeelRun r =
      train(out, {"train.max_steps=3", "train.eval_every=2", "data.eval_path=" + f.val});
  ASSERT_EQ(r.code, 0) << r.output;
  // Step 1's loss is the base model's on the one batch of all 8 examples.
  const auto steps = test::step_records(out);
  ASSERT_EQ(steps.size(), 3u);
  const json base = eval_json(
      {f.base, "--data", f.train, "--tokenizer", "byte", "--seq-len", "40", "--batch-size", "8"});
  EXPECT_NEAR(base["loss"].get<double>(), steps[0]["loss"].get<double>(),
              1e-6 * steps[0]["loss"].get<double>());
  EXPECT_NEAR(base["perplexity"].get<double>(), std::exp(base["loss"].get<double>()), 1e-9);
  EXPECT_GT(base["tokens"].get<int64_t>(), 8 * 7);
  // The validation split was evaluated at step 2 and at the end, printed and recorded; the
  // final record is `keel eval` of the checkpoint on the same file (the run's seq_len and batch).
  const auto evals = eval_records(out);
  ASSERT_EQ(evals.size(), 2u);
  EXPECT_EQ(evals[0]["step"], 2);
  EXPECT_EQ(evals[1]["step"], 3);
  EXPECT_CONTAINS(r.out, "eval step 2 | loss");
  const json last = eval_json({out, "--data", f.val});
  EXPECT_NEAR(last["loss"].get<double>(), evals[1]["eval_loss"].get<double>(),
              1e-9 * last["loss"].get<double>());
  EXPECT_EQ(last["tokens"], evals[1]["eval_tokens"]);
  // Plain output names the numbers.
  const test::KeelRun plain = test::run_keel({"eval", out, "--data", f.val});
  EXPECT_EQ(plain.code, 0) << plain.output;
  EXPECT_CONTAINS(plain.out, "perplexity");
}

// --per-example: each example's loss (a JSONL line naming its file and line), the parts adding
// up to the whole, the same whatever the batch (padding changes no example's loss), and the
// highest named: a line of another kind than the ones trained on stands out.
TEST(CliEval, PerExampleLossesAddUpAndNameTheHardestLine) {
  const Files& f = files();
  const std::string out = f.dir + "/per-example-run";
  const test::KeelRun r = train(out, {"train.max_steps=40", "optim.lr=1e-2"});
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string data = f.dir + "/mixed.jsonl";
  {
    std::ifstream in(f.train);
    std::ofstream d(data);
    std::string line;
    for (int i = 0; std::getline(in, line); ++i) {
      d << line << "\n";
      if (i == 4)  // line 6: nothing like the others
        d << json({{"prompt", "Q4: what is 28?"}, {"completion", " ~}{|`^%$#@!&*"}}).dump() << "\n";
    }
  }
  auto per_example = [&](const std::string& batch, const std::string& file) {
    const test::KeelRun e = test::run_keel(
        {"eval", out, "--data", data, "--batch-size", batch, "--per-example", file, "--json"},
        {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(e.code, 0) << e.output;
    std::vector<json> lines;
    std::ifstream in(file);
    for (std::string l; std::getline(in, l);) lines.push_back(json::parse(l));
    return std::pair{e.code == 0 ? json::parse(e.out) : json::object(), lines};
  };
  const auto [total, rows] = per_example("4", f.dir + "/losses.jsonl");
  ASSERT_EQ(rows.size(), 9u);
  double loss_sum = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].at("example"), i);
    EXPECT_EQ(rows[i].at("where"), data + ":" + std::to_string(i + 1));
    loss_sum += rows[i].at("loss_sum").get<double>();
    tokens += rows[i].at("tokens").get<int64_t>();
    EXPECT_NEAR(rows[i].at("loss").get<double>(),
                rows[i].at("loss_sum").get<double>() / rows[i].at("tokens").get<double>(), 1e-12);
  }
  EXPECT_EQ(tokens, total.at("tokens").get<int64_t>());
  EXPECT_NEAR(loss_sum, total.at("loss_sum").get<double>(), 1e-5 * loss_sum);
  const auto [total1, rows1] = per_example("1", f.dir + "/losses1.jsonl");
  ASSERT_EQ(rows1.size(), rows.size());
  for (size_t i = 0; i < rows.size(); ++i)
    EXPECT_NEAR(rows1[i].at("loss").get<double>(), rows[i].at("loss").get<double>(),
                1e-5 * rows[i].at("loss").get<double>())
        << i;
  size_t hardest = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    if (rows[i].at("loss").get<double>() > rows[hardest].at("loss").get<double>()) hardest = i;
  EXPECT_EQ(hardest, 5u);
  const test::KeelRun plain =
      test::run_keel({"eval", out, "--data", data, "--per-example", f.dir + "/losses2.jsonl"},
                     {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(plain.code, 0) << plain.output;
  EXPECT_CONTAINS(plain.err, "per-example losses of 9 examples written to " + f.dir +
                                 "/losses2.jsonl; the highest: " + data + ":6 (");
  // Refused before the model loads: over the data it reads, in a directory that is not there.
  const test::KeelRun over = test::run_keel({"eval", out, "--data", data, "--per-example", data});
  EXPECT_EQ(over.code, 2) << over.output;
  EXPECT_CONTAINS(over.err, "--per-example " + data + " is the --data file");
  const test::KeelRun nowhere =
      test::run_keel({"eval", out, "--data", data, "--per-example", f.dir + "/no/such/l.jsonl"});
  EXPECT_EQ(nowhere.code, 2) << nowhere.output;
  EXPECT_CONTAINS(nowhere.err, "the directory " + f.dir + "/no/such does not exist");
}

TEST(CliEval, CheckpointEqualsBasePlusAdapterAndFractionSplitEvaluates) {
  const Files& f = files();
  const std::string out = f.dir + "/lora";
  ASSERT_EQ(train(out, {"train.max_steps=2", "model.adapter.kind=lora", "optim.lr=0.05",
                        "data.eval_fraction=0.25", "train.eval_every=1"})
                .code,
            0);
  const json ck = eval_json({out, "--data", f.val, "--task", "text"});
  const json pair = eval_json({f.base, "--adapter", out + "/adapter", "--data", f.val, "--task",
                               "text", "--tokenizer", "byte", "--seq-len", "40"});
  EXPECT_EQ(ck["loss"], pair["loss"]);
  const json plain = eval_json(
      {f.base, "--data", f.val, "--task", "text", "--tokenizer", "byte", "--seq-len", "40"});
  EXPECT_NE(ck["loss"], plain["loss"]);  // the adapter trained
  // eval_fraction 0.25 of 8 examples: 2 held out, evaluated after each step, the last once (the
  // end of the run evaluated step 2 again: two records of it).
  const auto evals = eval_records(out);
  ASSERT_EQ(evals.size(), 2u);
  for (size_t i = 0; i < evals.size(); ++i) {
    EXPECT_EQ(evals[i]["step"], static_cast<int64_t>(i + 1));
    EXPECT_GT(evals[i]["eval_tokens"].get<int64_t>(), 0);
  }
}

// `keel eval BASE --adapter OUT_DIR/adapter` evaluated in rows of the base's max_seq_len (64),
// unpacked, at batch 8, its base in f32, and asked for --tokenizer: 5.2523 against the run's
// eval_loss 5.3105 on a packed text run. The PEFT directory of a run now evaluates as that run
// did (its data options, tokenizer and base dtype), the run's own eval_loss bit for bit.
TEST(CliEval, ARunsAdapterDirectoryIsEvaluatedWithTheRunsDataOptions) {
  const Files& f = files();
  const std::string text = f.dir + "/prose.txt";
  {
    std::ofstream o(text);
    for (int i = 0; i < 12; ++i)
      o << "paragraph " << i << " says the cat sat on the mat " << i * 3 << " times\n\n";
  }
  const std::string out = f.dir + "/text-lora";
  const test::KeelRun r =
      train(out, {"data.task=text", "data.path=" + text, "data.pack=true", "data.seq_len=16",
                  "train.batch_size=4", "train.max_steps=3", "model.adapter.kind=lora",
                  "model.base_dtype=bf16", "optim.lr=0.05", "data.eval_path=" + text});
  ASSERT_EQ(r.code, 0) << r.output;
  const auto evals = eval_records(out);
  ASSERT_EQ(evals.size(), 1u);
  const json pair = eval_json({f.base, "--adapter", out + "/adapter/", "--data", text});
  EXPECT_EQ(pair["loss"].get<double>(), evals[0]["eval_loss"].get<double>());
  EXPECT_EQ(pair["tokens"], evals[0]["eval_tokens"]);
  EXPECT_EQ(pair["seq_len"], 16);
  EXPECT_EQ(pair["batch_size"], 4);
  // A flag still wins.
  EXPECT_EQ(eval_json({f.base, "--adapter", out + "/adapter", "--data", text, "--seq-len", "20"})
                .at("seq_len"),
            20);
  // A PEFT directory of no run (an export) keeps the data defaults: its run's config is unknown
  // (its tokenizer and precision are recorded in its files).
  const std::string peft = f.dir + "/text-lora-peft";
  ASSERT_EQ(test::run_keel({"export", out, "--out", peft, "--adapter-only"}).code, 0);
  const json bare = eval_json({f.base, "--adapter", peft, "--data", text});
  EXPECT_NE(bare.at("seq_len"), 16);
}

// An adapter trained with model.path = the checkpoint of a model.base_dtype = bf16 run: the pair
// (the checkpoint, its adapters merged, under the second run's adapter) held its base in bf16 as
// the first run did, while the second held it in f32: 5.0813941 against its eval_loss 5.0813833.
TEST(CliEval, AnAdapterOnACheckpointIsEvaluatedWithItsOwnRunsBaseDtype) {
  const Files& f = files();
  const std::string first = f.dir + "/bf16-first", second = f.dir + "/f32-second";
  ASSERT_EQ(train(first, {"train.max_steps=2", "model.adapter.kind=lora", "model.base_dtype=bf16",
                          "optim.lr=0.05"})
                .code,
            0);
  const test::KeelRun r =
      train(second, {"model.path=" + first + "/checkpoints/last", "train.max_steps=2",
                     "model.adapter.kind=lora", "optim.lr=0.05", "data.eval_path=" + f.val});
  ASSERT_EQ(r.code, 0) << r.output;
  const auto evals = eval_records(second);
  ASSERT_EQ(evals.size(), 1u);
  const json pair =
      eval_json({first + "/checkpoints/last", "--adapter", second + "/adapter", "--data", f.val});
  EXPECT_EQ(pair["loss"].get<double>(), evals[0]["eval_loss"].get<double>());
  // A run started in f.dir with a relative model.path names its base relatively: from any other
  // directory the pair was refused ("already carries the lora adapters it was trained with").
  const std::string cfg = second + "/adapter/adapter_config.json";
  json c = json::parse(test::slurp(cfg));
  c["base_model_name_or_path"] = "bf16-first/checkpoints/last/";
  std::ofstream(cfg) << c.dump();
  const json relative =
      eval_json({first + "/checkpoints/last", "--adapter", second + "/adapter", "--data", f.val});
  EXPECT_EQ(relative["loss"], pair["loss"]);
}

// model.base_dtype = bf16: the run holds its frozen base in bf16 and computes the base products
// from it; `keel eval` of its checkpoint loaded that base into f32 and computed them in f32, so
// its loss was not the run's own eval_loss (5.4812229 vs 5.4812346 on a 4-step Llama LoRA run).
TEST(CliEval, ARunWithABf16BaseIsEvaluatedAsItTrained) {
  const Files& f = files();
  for (const std::string precision : {"32-true", "bf16-mixed"}) {
    SCOPED_TRACE(precision);
    const std::string out = f.dir + "/bf16-base-" + precision;
    const test::KeelRun r =
        train(out, {"train.max_steps=2", "model.adapter.kind=lora", "model.base_dtype=bf16",
                    "optim.lr=0.05", "train.precision=" + precision, "data.eval_path=" + f.val});
    ASSERT_EQ(r.code, 0) << r.output;
    const auto evals = eval_records(out);
    ASSERT_EQ(evals.size(), 1u);
    const json e = eval_json({out, "--data", f.val, "--precision", precision});
    EXPECT_EQ(e["loss"].get<double>(), evals[0]["eval_loss"].get<double>());
    // Without --precision eval runs under the run's train.precision (32-true gave a bf16-mixed
    // run's eval 11.889515 against its eval_loss 11.888892), and says so.
    const test::KeelRun d =
        test::run_keel({"eval", out, "--data", f.val, "--json"}, {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(d.code, 0) << d.output;
    EXPECT_CONTAINS(d.err, "note: --precision " + precision + ", the run's train.precision");
    EXPECT_EQ(json::parse(d.out)["loss"].get<double>(), evals[0]["eval_loss"].get<double>());
    // Another precision than the run's is said to move the loss by rounding.
    const std::string other = precision == "32-true" ? "bf16-mixed" : "32-true";
    const test::KeelRun o =
        test::run_keel({"eval", out, "--data", f.val, "--precision", other}, {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(o.code, 0) << o.output;
    EXPECT_CONTAINS(o.err, "note: the run trained and computed its eval_loss under " + precision +
                               "; this evaluation is under --precision " + other);
    EXPECT_CONTAINS(o.err, "--precision " + precision + " evaluates as the run did");
    // generate too: a run's model decodes under the run's precision unless told otherwise.
    auto decode = [&](std::vector<std::string> more) {
      std::vector<std::string> args = {"generate", out, "12+", "--max-new-tokens", "6", "--json"};
      args.insert(args.end(), more.begin(), more.end());
      const test::KeelRun g = test::run_keel(args, {"OMP_NUM_THREADS=1"});
      EXPECT_EQ(g.code, 0) << g.output;
      return g.code == 0 ? json::parse(g.out) : json::object();
    };
    const json by_default = decode({}), as_run = decode({"--precision", precision});
    EXPECT_EQ(by_default["precision"], precision);
    EXPECT_EQ(by_default["tokens"], as_run["tokens"]);
    const test::KeelRun same = test::run_keel(
        {"eval", out, "--data", f.val, "--precision", precision}, {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(same.err.find("note: the run trained"), std::string::npos) << same.err;
  }
}

// files().base stored in bf16 (as Llama-3.1's torch_dtype says), once per binary.
const std::string& bf16_base() {
  static const std::string base = [] {
    const std::string b = files().dir + "/bf16-stored";
    const test::KeelRun r =
        test::run_keel({"init-model", "--family", "llama", "--out", b, "--n-layer", "2", "--n-embd",
                        "32", "--n-head", "4", "--n-kv-head", "2", "--max-seq-len", "64",
                        "--init-std", "0.1", "--dtype", "bf16"});
    EXPECT_EQ(r.code, 0) << r.output;
    return b;
  }();
  return base;
}

// An HF directory stored in bf16 (Llama-3.1-8B's torch_dtype) computes by default under bf16-true
// from its files as they are (transformers' dtype="auto"), which is how a bf16-mixed fine-tune with
// model.base_dtype = bf16 computes its frozen base (PEFT's way): its loss is that run's before the
// adapter moves. An adapter that records no keel run (PEFT's own) goes on it under the same
// default. Under 32-true by default an 8B base was held in f32 (32 GB) and refused on the 24 GB
// machine its adapter trained on.
TEST(CliEval, AModelStoredInBf16ComputesAsABf16FineTuneOfItDoes) {
  const Files& f = files();
  const std::string& base = bf16_base();
  test::KeelRun r;
  const std::vector<std::string> lora = {"model.adapter.kind=lora", "model.base_dtype=bf16",
                                         "train.precision=bf16-mixed", "data.eval_path=" + f.val};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), lora.begin(), lora.end());
    return more;
  };
  // lr 1e-30: the adapter moves by ~1e-30 (B starts at 0), below any ulp of the base products,
  // so the run's eval_loss is its base's.
  const std::string still = f.dir + "/bf16-stored-lr0";
  r = train(still, with({"train.max_steps=1", "optim.lr=1e-30"}), base);
  ASSERT_EQ(r.code, 0) << r.output;
  const double at_start = eval_records(still).at(0)["eval_loss"].get<double>();
  r = test::run_keel({"eval", base, "--data", f.val, "--tokenizer", "byte", "--json"},
                     {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "note: --precision bf16-true, " + base + "'s weights as stored");
  EXPECT_EQ(json::parse(r.out)["loss"].get<double>(), at_start);
  // 32-true is still one flag away, and says nothing about the default.
  r = test::run_keel(
      {"eval", base, "--data", f.val, "--tokenizer", "byte", "--precision", "32-true"},
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.err.find("note: --precision"), std::string::npos) << r.err;

  // The trained adapter as PEFT would write it: no record of keel's run.
  const std::string trained = f.dir + "/bf16-stored-lora", copied = f.dir + "/bf16-copied";
  r = train(trained, with({"train.max_steps=2", "optim.lr=0.05"}), base);
  ASSERT_EQ(r.code, 0) << r.output;
  const double after = eval_records(trained).back()["eval_loss"].get<double>();
  EXPECT_NE(after, at_start);
  std::filesystem::copy(trained + "/adapter", copied);
  const std::string file = copied + "/adapter_model.safetensors";
  io::Safetensors st = io::read_safetensors(file);
  ASSERT_EQ(st.metadata.count("keel.precision"), 1u);
  io::write_safetensors(file + ".tmp", st.tensors, {{"format", "pt"}});
  std::filesystem::rename(file + ".tmp", file);
  r = test::run_keel(
      {"eval", base, "--adapter", copied, "--data", f.val, "--tokenizer", "byte", "--json"},
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "note: --precision bf16-true, " + base + "'s weights as stored");
  const json peft = json::parse(r.out);
  EXPECT_EQ(peft["precision"], "bf16-true");
  EXPECT_NEAR(peft["loss"].get<double>(), after, 1e-2 * after);  // bf16's rounding, not the run's
  // generate decodes under the same default.
  r = test::run_keel(
      {"generate", base, "12+", "--tokenizer", "byte", "--max-new-tokens", "3", "--json"},
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(json::parse(r.out)["precision"], "bf16-true");
}

// A run's adapter used away from its run (copied, or exported with --adapter-only) computes as the
// run did: adapter_model.safetensors records the run's precision and base dtype. Without them a
// copy computed under the default for its base (32-true, or bf16-mixed over a bf16 base): another
// loss than the run's eval_loss for each of these runs.
TEST(CliEval, AnAdapterUsedAwayFromItsRunComputesAsTheRunDid) {
  const Files& f = files();
  const std::string& base = bf16_base();
  for (const auto& [precision, base_dtype] : std::vector<std::pair<std::string, std::string>>{
           {"32-true", "bf16"}, {"bf16-mixed", "f32"}, {"bf16-true", "f32"}}) {
    SCOPED_TRACE(precision + ", base " + base_dtype);
    const std::string out = f.dir + "/away-" + precision + "-" + base_dtype;
    test::KeelRun r = train(out,
                            {"train.max_steps=2", "optim.lr=0.05", "model.adapter.kind=lora",
                             "model.base_dtype=" + base_dtype, "train.precision=" + precision,
                             "data.eval_path=" + f.val},
                            base);
    ASSERT_EQ(r.code, 0) << r.output;
    const double run_loss = eval_records(out).back()["eval_loss"].get<double>();
    const std::string copied = out + "-copied", exported = out + "-exported";
    std::filesystem::copy(out + "/adapter", copied);
    r = test::run_keel({"export", out, "--out", exported, "--adapter-only"});
    ASSERT_EQ(r.code, 0) << r.output;
    for (const std::string& adapter : {copied, exported}) {
      SCOPED_TRACE(adapter);
      // No --tokenizer: the base has no tokenizer files, the adapter records its run's.
      r = test::run_keel({"eval", base, "--adapter", adapter, "--data", f.val, "--json"},
                         {"OMP_NUM_THREADS=1"});
      ASSERT_EQ(r.code, 0) << r.output;
      EXPECT_CONTAINS(r.err, "note: --precision " + precision +
                                 ", the train.precision recorded in " + adapter +
                                 "/adapter_model.safetensors");
      EXPECT_EQ(json::parse(r.out)["loss"].get<double>(), run_loss);
    }
    // Another --precision is said to move the loss, as for the run's own adapter.
    const std::string other = precision == "32-true" ? "bf16-mixed" : "32-true";
    r = test::run_keel({"eval", base, "--adapter", copied, "--data", f.val, "--precision", other},
                       {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_CONTAINS(r.err, "note: the run trained and computed its eval_loss under " + precision +
                               " (recorded in " + copied + "/adapter_model.safetensors)");
  }
  // A record changed by hand is named with its file, not taken for a --precision given.
  const std::string changed = f.dir + "/away-32-true-bf16-copied";
  const std::string file = changed + "/adapter_model.safetensors";
  const io::Safetensors written = io::read_safetensors(file);
  for (const auto& [key, value, fix] : std::vector<std::array<std::string, 3>>{
           {"keel.precision", "bf17-mixed", "give --precision"},
           {"keel.base_dtype", "i64", "copy the adapter again from its run's OUT_DIR/adapter"},
           {"keel.tokenizer", "hf:/no/such/tokenizer.json",
            "or give --tokenizer to use another"}}) {
    io::Safetensors st = written;
    st.metadata[key] = value;
    io::write_safetensors(file + ".tmp", st.tensors, st.metadata);
    std::filesystem::rename(file + ".tmp", file);
    const test::KeelRun r = test::run_keel({"eval", base, "--adapter", changed, "--data", f.val});
    EXPECT_EQ(r.code, 2) << r.output;
    if (key == "keel.tokenizer") {  // a tokenizer that is not here is named as the run's
      EXPECT_CONTAINS(r.err, "/no/such/tokenizer.json");
      EXPECT_CONTAINS(r.err, "the data.tokenizer recorded in " + file);
    } else {
      EXPECT_CONTAINS(r.err, file + ": its __metadata__ " + key + " is \"" + value + "\", not a");
      EXPECT_CONTAINS(r.err, "(the file was changed after keel wrote it); ");
    }
    EXPECT_CONTAINS(r.err, fix);
  }
}

// A NaN loss was printed with exit 0, and as null in --json (JSON has no NaN): now "nan", exit 1
// and what to try. Weights initialized with std 20 overflow f16's activations.
TEST(CliEval, ANonFiniteLossIsShownAndIsAnError) {
  const Files& f = files();
  const std::string d = f.dir + "/wide";
  ASSERT_EQ(test::run_keel({"init-model", "--family", "gpt2", "--out", d, "--n-layer", "2",
                            "--n-embd", "64", "--n-head", "2", "--init-std", "20"})
                .code,
            0);
  test::KeelRun r = test::run_keel(
      {"eval", d, "--data", f.val, "--tokenizer", "byte", "--precision", "16-true", "--json"},
      {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 1) << r.output;
  const json j = json::parse(r.out);
  EXPECT_EQ(j.at("loss"), "nan");
  EXPECT_EQ(j.at("perplexity"), "nan");
  EXPECT_CONTAINS(r.err, "the loss on " + f.val + " is nan: 1 of 1 batches are non-finite; ");
  // Localized: each example alone is non-finite too, so the model is the cause, not the data.
  EXPECT_CONTAINS(r.err, "every example of the first is non-finite alone (" + f.val + ":1, ");
  EXPECT_CONTAINS(r.err, "): the model, not these examples");
  EXPECT_CONTAINS(r.err, "try --precision bf16-mixed or 32-true");
  r = test::run_keel({"eval", d, "--data", f.val, "--tokenizer", "byte", "--json"},
                     {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(json::parse(r.out).at("loss").is_number()) << r.out;
}

// `keel eval --data <(zcat val.jsonl.gz)`: a pipe is read like a file (it was "no such file").
TEST(CliEval, DataFromAPipeIsRead) {
  const Files& f = files();
  const std::string fifo = test::temp_dir("eval-fifo") + "/val";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // The writer waits for keel to open the pipe (ENXIO until a reader has), at most 60 s: if keel
  // never reads it, the test fails instead of hanging.
  const std::string content = test::slurp(f.val);
  std::thread writer([&] {
    for (int tries = 0; tries < 6000; ++tries) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd < 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      ::fcntl(fd, F_SETFL, 0);  // blocking writes from here: the reader drains as it goes
      EXPECT_EQ(::write(fd, content.data(), content.size()), static_cast<ssize_t>(content.size()));
      ::close(fd);
      return;
    }
    ADD_FAILURE() << "keel never opened " << fifo;
  });
  const test::KeelRun piped = test::run_keel(
      {"eval", f.base, "--data", fifo, "--task", "jsonl", "--tokenizer", "byte", "--json"});
  writer.join();
  ASSERT_EQ(piped.code, 0) << piped.output;
  const test::KeelRun file =
      test::run_keel({"eval", f.base, "--data", f.val, "--tokenizer", "byte", "--json"});
  ASSERT_EQ(file.code, 0) << file.output;
  EXPECT_EQ(json::parse(piped.out).at("loss"), json::parse(file.out).at("loss"));
}

// A JSONL file named .json was scored as plain text without a word (its braces and quotes the
// tokens): it is read as JSONL, as HF datasets' "json" loader reads it, and --task text still
// reads it as text.
TEST(CliEval, ADotJsonFileIsReadAsJsonl) {
  const Files& f = files();
  const std::string named_json = test::temp_dir("eval-dot-json") + "/val.json";
  std::ofstream(named_json) << test::slurp(f.val);
  const json as_jsonl = eval_json({f.base, "--data", f.val, "--tokenizer", "byte"});
  const json as_json = eval_json({f.base, "--data", named_json, "--tokenizer", "byte"});
  const json as_text =
      eval_json({f.base, "--data", named_json, "--tokenizer", "byte", "--task", "text"});
  ASSERT_TRUE(as_jsonl.contains("loss")) << as_jsonl;
  EXPECT_EQ(as_json.value("loss", json()), as_jsonl.at("loss"));
  EXPECT_NE(as_text.value("loss", json()), as_jsonl.at("loss"));
}

// Examples longer than a row are cut to it; they were scored cut without a word. The count is on
// stderr with the flag that changes it, and in --json.
TEST(CliEval, TruncatedExamplesAreCountedAndTheFlagNamed) {
  const Files& f = files();
  const std::string data = f.dir + "/long.jsonl";
  {
    std::ofstream o(data);
    o << json({{"text", "short"}}).dump() << "\n";                // 6 tokens with eos
    o << json({{"text", std::string(20, 'x')}}).dump() << "\n";   // 21
    o << json({{"text", std::string(100, 'y')}}).dump() << "\n";  // 101: past max_seq_len
  }
  auto eval = [&](const std::string& seq_len) {
    return test::run_keel(
        {"eval", f.base, "--data", data, "--tokenizer", "byte", "--seq-len", seq_len, "--json"},
        {"OMP_NUM_THREADS=1"});
  };
  test::KeelRun r = eval("16");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(json::parse(r.out).at("truncated_examples"), 2);
  EXPECT_CONTAINS(r.err, "note: 2 of 3 examples of " + data +
                             " are longer than 16 tokens (--seq-len) and were truncated to 16");
  EXPECT_CONTAINS(r.err,
                  "--seq-len N scores up to N tokens of each (at most the model's "
                  "max_seq_len, 64)");
  r = eval("64");  // the model's whole context: the long one still does not fit
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(json::parse(r.out).at("truncated_examples"), 1);
  EXPECT_CONTAINS(r.err, "note: 1 of 3 examples");
  EXPECT_CONTAINS(r.err, "the model's max_seq_len is 64, so no --seq-len scores them whole");
  // Nothing cut, nothing said.
  r = test::run_keel({"eval", f.base, "--data", f.val, "--tokenizer", "byte", "--json"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(json::parse(r.out).at("truncated_examples"), 0);
  EXPECT_NOT_CONTAINS(r.err, "truncated");
}

// A JSONL prompt that leaves no completion token in a row is refused with eval's own fix: it said
// "raise data.seq_len" (a key of no file eval read), even at the model's max_seq_len.
TEST(CliEval, APromptLongerThanARowNamesSeqLenOrTheModelsLimit) {
  const Files& f = files();
  const std::string data = f.dir + "/long_prompt.jsonl";
  std::ofstream(data) << json({{"prompt", std::string(50, 'p')}, {"completion", "c"}}).dump()
                      << "\n";
  auto eval = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"eval", f.base, "--data", data, "--tokenizer", "byte"};
    args.insert(args.end(), extra.begin(), extra.end());
    return test::run_keel(args, {"OMP_NUM_THREADS=1"});
  };
  test::KeelRun r = eval({"--seq-len", "32"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, data + ": line 1: the prompt is 50 tokens, so with seq_len 32");
  EXPECT_CONTAINS(r.err,
                  "raise --seq-len (now 32, at most the model's max_seq_len 64) or shorten the "
                  "prompt");
  EXPECT_NOT_CONTAINS(r.err, "data.seq_len");
  std::ofstream(data) << json({{"prompt", std::string(70, 'p')}, {"completion", "c"}}).dump()
                      << "\n";
  r = eval({});  // the default row is the model's whole context: nothing to raise
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "shorten the prompt (the model's max_seq_len is 64)");
  EXPECT_NOT_CONTAINS(r.err, "raise");
}

// keel train cut the same examples without a word: a 100 MB paragraph trained as its first
// data.seq_len tokens, the run saying nothing about the rest.
TEST(CliEval, TrainingSaysHowManyExamplesAreCutToTheRowLength) {
  const std::string dir = test::temp_dir("train-cut");
  const std::string jsonl = dir + "/long.jsonl", text = dir + "/long.txt";
  {
    std::ofstream o(jsonl);
    o << json({{"text", "short"}}).dump() << "\n";                // 6 tokens with eos
    o << json({{"text", std::string(20, 'x')}}).dump() << "\n";   // 21
    o << json({{"text", std::string(100, 'y')}}).dump() << "\n";  // 101
    std::ofstream(text) << "short\n\n" << std::string(100, 'z') << "\n";
  }
  auto train = [&](const std::string& task, const std::string& path,
                   std::vector<std::string> more) {
    std::vector<std::string> sets = {"run.out_dir=" + dir + "/out-" + task,
                                     "run.overwrite=true",
                                     "data.task=" + task,
                                     "data.path=" + path,
                                     "data.seq_len=16",
                                     "train.max_steps=1",
                                     "log.tensorboard=false",
                                     "run.threads=1"};
    sets.insert(sets.end(), more.begin(), more.end());
    return test::run_keel(test::with_sets({"train"}, sets));
  };
  test::KeelRun r = train("jsonl", jsonl, {});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "note: 2 of 3 examples of " + jsonl +
                             " (data.path) are longer than data.seq_len = 16 tokens and are cut to "
                             "it: their tokens past it are not trained on; raise data.seq_len or "
                             "split the long lines");
  r = train("jsonl", jsonl, {"data.eval_fraction=0.5"});  // the last 2 lines hold out
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "note: 2 of 2 validation examples of " + jsonl +
                             " (data.path) are longer than data.seq_len = 16 tokens");
  EXPECT_CONTAINS(r.err, "not evaluated");
  EXPECT_NOT_CONTAINS(r.err, "not trained on");  // the training part is "short" alone
  r = train("text", text, {});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "note: 1 of 2 examples of " + text + " (data.path)");
  EXPECT_CONTAINS(r.err, "or set data.pack = true to train on the whole text in rows");
  // Packed rows are data.seq_len long: nothing is cut, nothing said.
  r = train("text", text, {"data.pack=true"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NOT_CONTAINS(r.err, "are cut");
  r = train("jsonl", jsonl, {"data.seq_len=128"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NOT_CONTAINS(r.err, "are cut");
}

// A run whose data.seq_len is longer than its model's max_seq_len (a Llama model.path, whose
// max_position_embeddings keel train does not bound) was told "--seq-len 128: use 2 to the
// model's max_seq_len 64" by keel eval, which had been given no --seq-len.
TEST(CliEval, ARunLongerThanItsModelNamesTheRunsSeqLen) {
  const Files& f = files();  // the base: max_position_embeddings = 64
  const std::string out = test::temp_dir("eval-long-run") + "/out";
  test::KeelRun r = test::run_keel(test::with_sets(
      {"train"},
      {"run.out_dir=" + out, "model.path=" + f.base, "data.task=jsonl", "data.path=" + f.train,
       "data.seq_len=128", "train.max_steps=1", "log.tensorboard=false", "run.threads=1"}));
  ASSERT_EQ(r.code, 0) << r.output;
  r = test::run_keel({"eval", out, "--data", f.val});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "the run's data.seq_len is 128, longer than the model takes: give "
                  "--seq-len from 2 to the model's max_seq_len 64");
  EXPECT_NOT_CONTAINS(r.err, "--seq-len 128");
  r = test::run_keel({"eval", out, "--data", f.val, "--seq-len", "100"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "--seq-len 100: use 2 to the model's max_seq_len 64");
  r = test::run_keel({"eval", out, "--data", f.val, "--seq-len", "64"});
  EXPECT_EQ(r.code, 0) << r.output;
}

// A text or JSONL file keel cannot use is bad input, as a token file is (exit 2, naming the key):
// each of these exited 1, and an empty or one-token file named neither the key nor the fix.
TEST(CliEval, ADataFileWithoutUsableExamplesIsBadInputNamingTheKey) {
  const Files& f = files();
  struct Case {
    std::string name, content, task, error;
    bool pack = false;
  };
  const std::vector<Case> cases = {
      {"empty.txt", "", "text", "holds no text (it is empty or holds only blank lines)"},
      {"blank.txt", " \n\t\r\n\n", "text", "holds no text"},
      {"empty-packed.txt", "", "text", "holds 0 tokens; packing needs at least 2 tokens", true},
      {"one.txt", "a", "text", "holds 1 token; packing needs at least 2 tokens", true},
      {"blank-packed.txt", " \n\t\r\n\n", "text", "holds no text (only spaces, tabs and newlines)",
       true},
      {"empty.jsonl", "\n \n", "jsonl", "holds no examples (it is empty"},
      {"bad.jsonl", "{\"text\": \"a\"}\n{\"text\": 5}\n", "jsonl", ": line 2: \"text\" must be"},
      {"comma.jsonl", "{\"text\": \"a\"},\n", "jsonl", ": line 1: invalid JSON at column 14"},
      {"missing.jsonl", "{\"prompt\": \"a\"}\n", "jsonl", ": line 1: missing \"completion\""},
  };
  for (const Case& c : cases) {
    const std::string path = f.dir + "/" + c.name;
    std::ofstream(path) << c.content;
    std::vector<std::string> args = {"eval",        f.base, "--data", path,
                                     "--tokenizer", "byte", "--task", c.task};
    if (c.pack) args.push_back("--pack");
    test::KeelRun r = test::run_keel(args, {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 2) << c.name << ": " << r.output;
    EXPECT_CONTAINS(r.err, path);
    EXPECT_CONTAINS(r.err, c.error);
    const bool a_line = c.error.rfind(": line", 0) == 0;  // else the whole file: named with its key
    if (!a_line) {
      EXPECT_CONTAINS(r.err, "dataset file " + path + " (--data): ");
    }
    r = train(f.dir + "/bad-data",
              {"data.task=" + c.task, "data.pack=" + std::string(c.pack ? "true" : "false"),
               "data.path=" + f.val, "data.tokenizer=byte", "data.eval_path=" + path,
               "train.max_steps=1", "run.overwrite=true"});
    EXPECT_EQ(r.code, 2) << c.name << ": " << r.output;
    EXPECT_CONTAINS(r.err, c.error);
    if (!a_line) {
      EXPECT_CONTAINS(r.err, "dataset file " + path + " (data.eval_path): ");
    }
  }
}

// A run's own OUT_DIR/adapter brings the run's tokenizer; when that tokenizer's files were gone,
// the error called it "BASE's tokenizer", as if the base directory named one. It names the run's
// data.tokenizer, and --tokenizer as the way out; generate says the same.
TEST(CliEval, AnAdapterRunsLostTokenizerIsNamedAsTheRunsDataTokenizer) {
  const Files& f = files();
  const std::string dir = f.dir + "/lost-tokenizer";
  const std::string base = dir + "/base", tok = dir + "/tok";
  ASSERT_EQ(test::run_keel({"init-model", "--family", "llama", "--out", base, "--n-layer", "1",
                            "--n-embd", "16", "--n-head", "2", "--vocab-size", "300",
                            "--max-seq-len", "32"})
                .code,
            0);
  std::filesystem::create_directories(tok);
  const std::string tiny = std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";
  for (const char* file : {"encoder.json", "vocab.bpe"})
    std::filesystem::copy_file(tiny + "/" + file, tok + "/" + file);
  const std::string out = dir + "/run", text = dir + "/train.txt";
  std::ofstream(text) << "the quick brown fox jumps over the lazy dog\n";
  const test::KeelRun r = test::run_keel(
      test::with_sets({"train"},
                      {"run.out_dir=" + out, "run.threads=1", "model.path=" + base,
                       "model.adapter.kind=lora", "data.task=text", "data.path=" + text,
                       "data.pack=true", "data.seq_len=8", "data.tokenizer=gpt2:" + tok,
                       "train.batch_size=1", "train.max_steps=1", "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  std::filesystem::remove_all(tok);
  for (const char* cmd : {"eval", "generate"}) {
    std::vector<std::string> args = {cmd, base, "--adapter", out + "/adapter"};
    if (std::string(cmd) == "eval")
      args.insert(args.end(), {"--data", f.val});
    else
      args.push_back("x");
    const test::KeelRun e = test::run_keel(args);
    EXPECT_EQ(e.code, 2) << e.output;
    EXPECT_CONTAINS(e.err, tok);
    EXPECT_CONTAINS(e.err, "the data.tokenizer of the --adapter's run " + out);
    EXPECT_CONTAINS(e.err, "; or give --tokenizer to use another");
    EXPECT_NOT_CONTAINS(e.err, base + "'s tokenizer");
  }
}

TEST(CliEval, BadInputNamesTheFlagKeyOrFile) {
  const Files& f = files();
  auto eval_err = [](std::vector<std::string> args) {
    args.insert(args.begin(), "eval");
    const test::KeelRun r = test::run_keel(args);
    EXPECT_EQ(r.code, 2) << r.output;
    return r.err;
  };
  EXPECT_CONTAINS(eval_err({f.base, "--data", "/no/file.jsonl"}),
                  "dataset file /no/file.jsonl does not exist; --data must name a file");
  EXPECT_CONTAINS(eval_err({f.base, "--data", f.dir}),
                  "dataset file " + f.dir + " is a directory; --data must name a file");
  EXPECT_CONTAINS(eval_err({f.base, "--data", "/dev/zero", "--task", "text"}),
                  "dataset file /dev/zero is a character device");
  EXPECT_CONTAINS(eval_err({f.base, "--data", f.val}), "give --tokenizer");
  EXPECT_CONTAINS(eval_err({f.base, "--data", f.val, "--tokenizer", "byte", "--seq-len", "999"}),
                  "--seq-len 999");
  EXPECT_CONTAINS(eval_err({f.base, "--data", f.val, "--tokenizer", "byte", "--task", "csv"}),
                  "--task csv");
  // --pad add and --pad eos gave the same loss to the last bit (padding is masked and carries no
  // label): a flag that changed nothing, now refused with the reason.
  for (const char* pad : {"add", "eos", "left"}) {
    const std::string err =
        eval_err({f.base, "--data", f.val, "--tokenizer", "byte", "--pad", pad});
    EXPECT_CONTAINS(err, "--pad: keel eval takes no padding choice: padded positions are masked");
    EXPECT_CONTAINS(err, "leave --pad out");
  }
  EXPECT_CONTAINS(eval_err({f.dir + "/none", "--data", f.val}), "no such directory");
  // A token file of another tokenizer named training's key, data.tokenizer, as the fix.
  const std::string gpt2 =
      "gpt2:" + std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";
  const std::string bin = f.dir + "/other-tokenizer.bin";
  std::ofstream(f.dir + "/other.txt") << "the quick brown fox jumps over the lazy dog\n";
  ASSERT_EQ(test::run_keel(
                {"tokenize", "--tokenizer", gpt2, "--file", f.dir + "/other.txt", "--output", bin})
                .code,
            0);
  const std::string other = eval_err({f.base, "--data", bin, "--tokenizer", "byte"});
  EXPECT_CONTAINS(other,
                  "the file was written with another tokenizer; use that one (--tokenizer "
                  "gpt2:DIR for llm.c's GPT-2 files, --tokenizer hf:PATH for Llama 3's)");
  EXPECT_NOT_CONTAINS(other, "data.tokenizer");
  // Flags that mean nothing for the data were taken without a word.
  EXPECT_CONTAINS(eval_err({f.base, "--data", bin, "--tokenizer", "byte", "--pack"}),
                  "--pack applies to text and JSONL files; " + bin +
                      " is read as tokens (a token file's rows are packed already)");
  // A packed row's loss is its examples': one loss a line needs one example a row.
  EXPECT_CONTAINS(eval_err({f.base, "--data", f.val, "--tokenizer", "byte", "--task", "jsonl",
                            "--pack", "--per-example", f.dir + "/per.jsonl"}),
                  "--pack with --per-example: one loss a line needs one example a row; leave "
                  "--pack out");
  // 0 was taken as "the default" without a word.
  for (const char* flag : {"--seq-len", "--batch-size"})
    EXPECT_CONTAINS(eval_err({f.base, "--data", f.val, "--tokenizer", "byte", flag, "0"}),
                    std::string(flag) + ": 0: use a whole number from 1 to 9223372036854775807");
  // A model with Llama-3's context: rows were its 131,072 positions by default (256 GB asked
  // for a 10-byte file, the error naming train.batch_size and data.seq_len); now at most 1024,
  // and a row length that does not fit names eval's own flags.
  const std::string wide = f.dir + "/long-context";
  ASSERT_EQ(test::run_keel({"init-model", "--family", "llama", "--out", wide, "--n-layer", "1",
                            "--n-embd", "32", "--n-head", "2", "--max-seq-len", "131072"})
                .code,
            0);
  std::ofstream(f.dir + "/ten.txt") << "abcdefghij";
  std::ofstream(f.dir + "/long.txt") << std::string(131072, 'a');
  test::KeelRun r =
      test::run_keel({"eval", wide, "--tokenizer", "byte", "--data", f.dir + "/ten.txt", "--json"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.out)["seq_len"], 1024);
  // A batch is padded to its longest row, not to --seq-len: ten bytes are scored at 131,072.
  r = test::run_keel({"eval", wide, "--tokenizer", "byte", "--data", f.dir + "/ten.txt",
                      "--seq-len", "131072", "--batch-size", "1", "--json"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.out)["tokens"], 10);
  r = test::run_keel({"eval", wide, "--tokenizer", "byte", "--data", f.dir + "/long.txt",
                      "--seq-len", "131072", "--batch-size", "1"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "a batch padded to its longest): lower --batch-size or --seq-len");
  EXPECT_NOT_CONTAINS(r.err, "train.batch_size");
  auto train_err = [&](std::vector<std::string> sets) {
    const test::KeelRun r = train(f.dir + "/bad", sets);
    EXPECT_EQ(r.code, 2) << r.output;
    return r.err;
  };
  EXPECT_CONTAINS(train_err({"data.eval_fraction=0.5", "data.eval_path=" + f.val}), "set one");
  EXPECT_CONTAINS(train_err({"data.eval_fraction=1"}), "data.eval_fraction");
  EXPECT_CONTAINS(train_err({"data.eval_fraction=0.95"}), "leaves no training example");
  EXPECT_CONTAINS(train_err({"data.task=arith", "data.eval_path=" + f.val}),
                  "apply to text, jsonl and tokens");
  EXPECT_CONTAINS(train_err({"data.eval_path=/no/val.jsonl"}),
                  "/no/val.jsonl does not exist; data.eval_path must name a file");
}

}  // namespace
}  // namespace keel
