// Replay of NaN captures in process: bit-exact reproduction (loss bits and every gradient bit),
// the producing module, another precision converting the captured parameters, the original run
// left untouched, bisect on a broken state, and a malformed capture's errors naming the file.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "keel/autograd/node.h"
#include "keel/io/safetensors.h"
#include "keel/monitor/nan_capture.h"
#include "keel/monitor/replay.h"
#include "keel/train/trainer.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel::monitor {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using test::slurp;

// Trains two healthy steps, then a step with one NaN weight element in `module`.weight; returns
// the capture directory.
std::string make_capture(const std::string& tag, const std::string& module,
                         const std::string& precision = "32-true",
                         const std::string& text_file = "",
                         const std::function<void(Config&)>& edit = {}) {
  Config c;
  c.run.out_dir = test::temp_dir(tag);
  c.run.seed = 9;
  c.run.threads = 1;
  c.model.n_layer = 2;
  c.model.n_embd = 32;
  c.model.n_head = 2;
  c.model.dropout = 0.1;  // masks must be regenerated from the captured step seed
  c.data.num_examples = 96;
  c.data.eval_examples = 0;
  c.data.seq_len = 16;
  c.train.batch_size = 4;
  c.train.grad_accum = 2;  // a window of two micro-batches
  c.train.precision = precision;
  c.train.max_steps = 6;
  c.log.tensorboard = false;
  c.log.metrics = false;
  c.log.console = false;
  if (!text_file.empty()) {
    c.data.task = "text";
    c.data.path = text_file;
  }
  if (edit) edit(c);
  Trainer* tp = nullptr;
  std::string path;
  TrainerHooks h;
  h.on_capture = [&](const NonfiniteEvent& ev) { return path = write_nan_capture(*tp, ev); };
  h.on_step = [&](const StepResult& r) {
    if (r.step == 2) {
      NoGradGuard g;
      Tensor w = tp->model().find_parameter(module + ".weight");
      EXPECT_TRUE(w.defined()) << module;
      w.data_as<float>()[1] = std::numeric_limits<float>::quiet_NaN();
      w.bump_version();
    }
  };
  Trainer t(c, h);
  tp = &t;
  EXPECT_EQ(t.fit(), 3);
  EXPECT_FALSE(path.empty());
  return path;
}

TEST(Replay, ReproducesBitExactlyAndNamesTheProducer) {
  const std::string dir = make_capture("replay-exact", "transformer.h.1.mlp.c_fc");
  const json meta = json::parse(slurp(dir + "/capture.json"));
  ASSERT_EQ(meta.at("step"), 3);
  const ReplayResult r = replay_capture(dir);
  EXPECT_TRUE(r.reproduced);
  EXPECT_TRUE(r.loss_bit_exact) << r.loss_bits << " vs " << r.recorded_loss_bits;
  EXPECT_TRUE(r.grads_bit_exact) << r.grads_fingerprint << " vs " << r.recorded_grads_fingerprint;
  EXPECT_TRUE(r.bit_exact);
  EXPECT_EQ(r.step, 3);
  EXPECT_EQ(r.precision, "32-true");
  EXPECT_EQ(r.nonfinite_params, meta.at("nonfinite_params").get<std::vector<std::string>>());
  EXPECT_EQ(r.first_nonfinite_param, meta.at("first_nonfinite_param").get<std::string>());
  EXPECT_EQ(r.first_nonfinite_param, r.recorded_first_nonfinite_param);
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.first_module, "transformer.h.1.mlp.c_fc");
  EXPECT_EQ(r.first_module_type, "Linear");
  EXPECT_EQ(r.first_tensor, "weight");
  EXPECT_EQ(r.first_phase, "forward");
  EXPECT_EQ(r.out_dir, dir + "/replay");
  EXPECT_TRUE(fs::exists(r.tracer_log)) << r.tracer_log;
  EXPECT_FALSE(r.bisected);
  // The report and the JSON say the same.
  const json j = replay_to_json(r);
  EXPECT_TRUE(j.at("reproduced").get<bool>());
  EXPECT_TRUE(j.at("bit_exact").get<bool>());
  EXPECT_EQ(j.at("first_module"), "transformer.h.1.mlp.c_fc");
  EXPECT_FALSE(j.contains("bisect"));
  const std::string text = format_replay(r);
  EXPECT_NE(text.find("reproduced   yes"), std::string::npos) << text;
  EXPECT_NE(text.find("bit-exact    yes"), std::string::npos) << text;
}

TEST(Replay, ATrainingFileThatIsGoneIsNamedAndTheStepStillReplaysBitExactly) {
  // The run factory rebuilds the model from the capture's config; the step's micro-batches are in
  // the capture, so a moved or deleted training file costs nothing but a note naming it.
  const std::string data_dir = test::temp_dir("replay-gone-data");
  const std::string corpus = data_dir + "/corpus.txt";
  {
    std::ofstream f(corpus);
    for (int i = 0; i < 64; ++i) f << "line " << i << ": twelve plus " << i % 7 << "\n";
  }
  const std::string dir =
      make_capture("replay-gone", "transformer.h.0.mlp.c_fc", "32-true", corpus);
  fs::remove_all(data_dir);
  const ReplayResult r = replay_capture(dir);
  EXPECT_TRUE(r.reproduced);
  EXPECT_TRUE(r.bit_exact) << r.loss_bits << " vs " << r.recorded_loss_bits;
  std::string notes;
  for (const std::string& n : r.notes) notes += n + "\n";
  EXPECT_CONTAINS(notes, "not rebuilt: the training data (data.path = " + corpus);
  EXPECT_CONTAINS(format_replay(r), corpus);
}

// A training file rewritten after the capture: the step still replays bit for bit from the
// captured micro-batches, but the example ids it names index the file as it was, and the replay
// said nothing of the change. A validation file that is gone is named as such (the note said "the
// training data (data.path = FILE)" of a training file that was there).
TEST(Replay, ADataFileChangedOrGoneSinceTheCaptureIsNamed) {
  const std::string data_dir = test::temp_dir("replay-changed-data");
  const std::string corpus = data_dir + "/corpus.txt", held_out = data_dir + "/eval.txt";
  for (const std::string& f : {corpus, held_out}) {
    std::ofstream o(f);
    for (int i = 0; i < 64; ++i) o << "line " << i << ": twelve plus " << i % 7 << "\n";
  }
  const std::string dir = make_capture("replay-changed", "transformer.h.0.mlp.c_fc", "32-true",
                                       corpus, [&](Config& c) { c.data.eval_path = held_out; });
  std::ofstream(corpus, std::ios::app) << "a line added after the capture\n";
  ReplayResult r = replay_capture(dir);
  EXPECT_TRUE(r.bit_exact) << r.loss_bits << " vs " << r.recorded_loss_bits;
  std::string notes;
  for (const std::string& n : r.notes) notes += n + "\n";
  EXPECT_CONTAINS(notes, "data.path = " + corpus + " changed since the capture");
  EXPECT_CONTAINS(notes, "the step replays from the captured micro-batches");

  fs::remove(held_out);
  r = replay_capture(dir);
  EXPECT_TRUE(r.bit_exact);
  notes.clear();
  for (const std::string& n : r.notes) notes += n + "\n";
  EXPECT_CONTAINS(notes, "data.eval_path = " + held_out + "): ");
  EXPECT_CONTAINS(notes, held_out + " does not exist");
}

TEST(Replay, TwiceGivesTheSameBitsAndLeavesTheRunUntouched) {
  const std::string dir = make_capture("replay-untouched", "transformer.h.0.attn.c_attn");
  const std::string run = fs::path(dir).parent_path().parent_path().parent_path().string();
  std::map<std::string, std::string> before;
  for (auto& e : fs::recursive_directory_iterator(run))
    if (e.is_regular_file()) before[e.path().string()] = slurp(e.path().string());
  const std::string out = test::temp_dir("replay-out");
  ReplayOptions o;
  o.out_dir = out;
  const ReplayResult a = replay_capture(dir, o);
  const ReplayResult b = replay_capture(dir, o);
  EXPECT_EQ(a.loss_bits, b.loss_bits);
  EXPECT_EQ(a.grads_fingerprint, b.grads_fingerprint);
  EXPECT_TRUE(a.bit_exact && b.bit_exact);
  for (auto& [path, content] : before) EXPECT_EQ(slurp(path), content) << path << " changed";
  for (auto& e : fs::recursive_directory_iterator(run))
    if (e.is_regular_file()) {
      EXPECT_TRUE(before.count(e.path().string())) << e.path();
    }
}

// Another policy re-runs the same state: f32 masters become bf16 parameters (rounded), the NaN
// stays a NaN, and the loss bits differ.
TEST(Replay, AnotherPrecisionConvertsTheCapturedParameters) {
  const std::string dir = make_capture("replay-precision", "transformer.h.0.mlp.c_proj");
  ReplayOptions o;
  o.precision = "bf16-true";
  o.attention = "math";
  const ReplayResult r = replay_capture(dir, o);
  EXPECT_EQ(r.precision, "bf16-true");
  EXPECT_EQ(r.attention, "math");
  EXPECT_EQ(r.captured_precision, "32-true");
  EXPECT_TRUE(r.reproduced);
  EXPECT_FALSE(r.loss_bit_exact && r.grads_bit_exact);
  EXPECT_FALSE(r.bit_exact);
  EXPECT_EQ(r.first_module, "transformer.h.0.mlp.c_proj");
  bool noted = false;
  for (auto& n : r.notes) noted |= n.find("converted") != std::string::npos;
  EXPECT_TRUE(noted) << "the conversion is reported";
}

TEST(Replay, BisectOfABrokenStateBlamesTheParameters) {
  const std::string dir = make_capture("replay-bisect", "transformer.h.0.attn.c_proj");
  ReplayOptions o;
  o.bisect = true;
  const ReplayResult r = replay_capture(dir, o);
  ASSERT_TRUE(r.bisected);
  // From 32-true / eager the one alternative is attention=math (no precision below 32-true to
  // leave, no adapter, no injection).
  ASSERT_EQ(r.bisect.size(), 1u);
  EXPECT_EQ(r.bisect[0].change, "attention=math");
  EXPECT_FALSE(r.bisect[0].finite);
  EXPECT_EQ(r.cause, "nonfinite-parameters");
  EXPECT_EQ(r.nonfinite_param_values,
            std::vector<std::string>{"transformer.h.0.attn.c_proj.weight"});
  EXPECT_EQ(r.nonfinite_rows, std::vector<int64_t>{0});  // element 1 lies in row 0
  EXPECT_NE(r.explanation.find("transformer.h.0.attn.c_proj.weight, rows 0"), std::string::npos)
      << r.explanation;
}

TEST(Replay, BisectOfAFiniteReplayHasNothingToBisect) {
  const std::string dir = make_capture("replay-finite", "transformer.h.0.mlp.c_fc");
  // Replaying the capture under a state that is finite: remove the NaN from the captured weights.
  {
    io::Safetensors st = io::read_safetensors(dir + "/model.safetensors");
    for (auto& [n, t] : st.tensors)
      if (n == "transformer.h.0.mlp.c_fc.weight") {
        Tensor c = t.clone();
        c.data_as<float>()[1] = 0.f;
        t = c;
      }
    io::write_safetensors(dir + "/model.safetensors", st.tensors, st.metadata);
  }
  ReplayOptions o;
  o.bisect = true;
  const ReplayResult r = replay_capture(dir, o);
  EXPECT_FALSE(r.reproduced);
  EXPECT_FALSE(r.bit_exact);
  EXPECT_TRUE(r.first_module.empty());
  EXPECT_EQ(r.cause, "not-reproduced");
  EXPECT_TRUE(r.bisect.empty());
}

// A bisect trial changes the config (adapter=none, another precision); what the run factory says
// of that changed config is not about the user's run. The adapter=none trial of a LoRA capture
// printed "note: [model.adapter] target_modules set, but model.adapter.kind = "none": this run
// trains every parameter" under the replay's report.
TEST(Replay, BisectTrialsSayNothingAboutTheirChangedConfigs) {
  const std::string dir =
      make_capture("replay-bisect-quiet", "transformer.h.0.mlp.c_fc", "32-true", "", [](Config& c) {
        c.model.adapter.kind = "lora";
        c.model.adapter.target_modules = {"c_attn"};
      });
  ReplayOptions o;
  o.bisect = true;
  testing::internal::CaptureStderr();
  const ReplayResult r = replay_capture(dir, o);
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(r.bisected);
  bool tried = false;
  for (const BisectTrial& t : r.bisect) tried |= t.change == "adapter=none";
  EXPECT_TRUE(tried) << format_replay(r);
  EXPECT_EQ(err.find("model.adapter"), std::string::npos) << err;
  EXPECT_EQ(format_replay(r).find("model.adapter.kind = \"none\""), std::string::npos)
      << format_replay(r);
}

std::string error_of(const std::string& dir) {
  try {
    replay_capture(dir);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind, Error::kUsage) << e.what();
    return e.what();
  }
  return "no error";
}

TEST(Replay, MalformedCapturesNameTheFileAndTheFix) {
  const std::string good = make_capture("replay-bad", "transformer.h.0.mlp.c_fc");
  auto copy = [&](const std::string& tag) {
    const std::string d = test::temp_dir(tag) + "/rank0";
    fs::copy(good, d, fs::copy_options::recursive);
    fs::remove_all(d + "/replay");
    return d;
  };
  {
    const std::string d = copy("replay-bad-opt");
    fs::remove(d + "/optimizer.safetensors");
    const std::string m = error_of(d);
    EXPECT_NE(m.find(d + "/optimizer.safetensors: missing"), std::string::npos) << m;
    EXPECT_NE(m.find("re-run the training"), std::string::npos) << m;
  }
  {
    const std::string d = copy("replay-bad-format");
    json meta = json::parse(slurp(d + "/capture.json"));
    meta["format"] = "something-else";
    std::ofstream(d + "/capture.json") << meta.dump();
    const std::string m = error_of(d);
    EXPECT_NE(m.find(d + "/capture.json: not a keel NaN capture"), std::string::npos) << m;
  }
  {
    const std::string d = copy("replay-bad-version");
    json meta = json::parse(slurp(d + "/capture.json"));
    meta["format_version"] = 99;
    std::ofstream(d + "/capture.json") << meta.dump();
    const std::string m = error_of(d);
    EXPECT_NE(m.find("format_version 99 is newer"), std::string::npos) << m;
  }
  {
    const std::string d = copy("replay-bad-type");
    json meta = json::parse(slurp(d + "/capture.json"));
    // A thread count that is not one, or that would overflow libgomp's stacks (100000).
    for (const json& bad : {json("two"), json(100000), json(0)}) {
      meta["threads"] = bad;
      std::ofstream(d + "/capture.json") << meta.dump();
      const std::string m = error_of(d);
      EXPECT_NE(m.find(d + "/capture.json: \"threads\" = " + bad.dump() +
                       " is not a thread count in [1, 4096]"),
                std::string::npos)
          << m;
    }
    // A "format" of the wrong type names the file, not a raw JSON exception.
    meta = json::parse(slurp(copy("replay-format") + "/capture.json"));
    meta["format"] = 5;
    std::ofstream(d + "/capture.json") << meta.dump();
    const std::string m = error_of(d);
    EXPECT_NE(m.find(d + "/capture.json: not a keel NaN capture"), std::string::npos) << m;
    EXPECT_EQ(m.find("json.exception"), std::string::npos) << m;
  }
  {
    // Edited settings: a step that is none, a precision or attention that is no policy or
    // backend, or that is not the captured config's. They replayed as "bit-exact yes" (and an
    // edited config_toml as "reproduced no").
    const std::string d = copy("replay-edited");
    const json base = json::parse(slurp(d + "/capture.json"));
    auto edited = [&](const char* key, const json& v) {
      json meta = base;
      meta[key] = v;
      std::ofstream(d + "/capture.json") << meta.dump();
      return error_of(d);
    };
    EXPECT_CONTAINS(edited("step", -1), d + "/capture.json: \"step\" = -1 is not a step");
    EXPECT_CONTAINS(edited("precision", "fp8"), "\"precision\" = \"fp8\" is not a precision");
    const std::string other =
        base["precision"] == "32-true" ? std::string("bf16-mixed") : std::string("32-true");
    EXPECT_CONTAINS(edited("precision", other), "but its config_toml trains in");
    EXPECT_CONTAINS(edited("attention", "xx"), "\"attention\" = \"xx\" is not the attention");
    std::string toml = base["config_toml"].get<std::string>();
    const size_t at = toml.find("attention = \"eager\"");
    ASSERT_NE(at, std::string::npos) << toml;
    toml.replace(at, std::string("attention = \"eager\"").size(), "attention = \"math\"");
    EXPECT_CONTAINS(edited("config_toml", toml),
                    "is not the attention backend its config_toml names (math)");
    // Edited numbers replayed as "bit-exact yes": a negative loss scale, a step seed of -1
    // (read as 2^64 - 1), a negative count.
    EXPECT_CONTAINS(edited("loss_scale", "x"), "\"loss_scale\" has the wrong type");
    for (const json& bad : {json(-5), json(0)})
      EXPECT_CONTAINS(edited("loss_scale", bad),
                      d + "/capture.json: \"loss_scale\" = " + bad.dump() +
                          " is not a loss scale (a positive finite number); the capture is "
                          "corrupt (re-run the training to write a new one)");
    json rng = base["rng"];
    rng["step_seed"] = -1;
    EXPECT_CONTAINS(edited("rng", rng), "\"rng.step_seed\" = -1 is not a seed");
    rng = base["rng"];
    rng["seed"] = 9223372036854775808ull;
    EXPECT_CONTAINS(edited("rng", rng), "\"rng.seed\" = 9223372036854775808 is not a seed");
    EXPECT_CONTAINS(edited("window_tokens", -1), "\"window_tokens\" = -1 is not a count");
    json mbs = base["micro_batches"];
    mbs[0]["n_targets"] = -3;
    EXPECT_CONTAINS(edited("micro_batches", mbs), "\"micro_batches[0].n_targets\" = -3 is not");
    mbs = base["micro_batches"];
    mbs[1]["example_ids"] = json::array({0, -1});
    EXPECT_CONTAINS(edited("micro_batches", mbs), "\"micro_batches[1].example_ids\" = [0,-1]");
    std::ofstream(d + "/capture.json") << base.dump();
  }
  {
    // One rank of several: a rank outside the world, a missing local loss, a global window with
    // fewer tokens than the rank's own micro-batches.
    const std::string d = copy("replay-bad-rank");
    const json base = json::parse(slurp(d + "/capture.json"));
    json meta = base;
    meta["world_size"] = 2;
    meta["rank"] = 5;
    std::ofstream(d + "/capture.json") << meta.dump();
    std::string m = error_of(d);
    EXPECT_CONTAINS(m, d + "/capture.json: \"rank\" = 5 is not a rank of \"world_size\" = 2");
    meta["rank"] = 1;
    std::ofstream(d + "/capture.json") << meta.dump();
    m = error_of(d);
    EXPECT_CONTAINS(m, d + "/capture.json: missing \"local_loss_bits\"");
    meta["local_loss_bits"] = "0x0";
    meta["local_grads_fingerprint"] = "";
    meta["window_tokens"] = 1;
    std::ofstream(d + "/capture.json") << meta.dump();
    m = error_of(d);
    EXPECT_CONTAINS(m, d + "/capture.json: \"window_tokens\" = 1 is fewer than the captured");
    meta["window_tokens"] = "many";
    std::ofstream(d + "/capture.json") << meta.dump();
    m = error_of(d);
    EXPECT_CONTAINS(m, d + "/capture.json: \"window_tokens\" has the wrong type");
  }
  {
    const std::string d = copy("replay-bad-model");
    io::Safetensors st = io::read_safetensors(d + "/model.safetensors");
    std::vector<std::pair<std::string, Tensor>> fewer;
    for (auto& [n, t] : st.tensors)
      if (n != "transformer.ln_f.bias") fewer.emplace_back(n, t);
    io::write_safetensors(d + "/model.safetensors", fewer);
    const std::string m = error_of(d);
    EXPECT_NE(m.find(d + "/model.safetensors: tensor 'transformer.ln_f.bias' is missing"),
              std::string::npos)
        << m;
  }
  {
    const std::string d = copy("replay-bad-batches");
    io::Safetensors st = io::read_safetensors(d + "/microbatches.safetensors");
    for (auto& [n, t] : st.tensors)
      if (n == "mb1.labels") t = Tensor::from_floats(std::vector<float>(t.numel(), 1.f), t.shape());
    io::write_safetensors(d + "/microbatches.safetensors", st.tensors);
    const std::string m = error_of(d);
    EXPECT_NE(m.find(d + "/microbatches.safetensors: mb1.input_ids / labels must be i64"),
              std::string::npos)
        << m;
  }
  {
    const std::string d = copy("replay-bad-truncated");
    const std::string text = slurp(d + "/capture.json");
    std::ofstream(d + "/capture.json") << text.substr(0, text.size() / 2);
    const std::string m = error_of(d);
    EXPECT_NE(m.find(d + "/capture.json: not valid JSON"), std::string::npos) << m;
  }
  {
    const std::string d = copy("replay-bad-overflow");  // out_of_range, not parse_error
    std::ofstream(d + "/capture.json") << "{\"format\": \"keel-nan-capture\", \"step\": 1e400}";
    const std::string m = error_of(d);
    EXPECT_NE(m.find(d + "/capture.json: not valid JSON (number overflow"), std::string::npos) << m;
  }
}

// A capture's safetensors file cut short (a full disk, a partial copy) or a micro-batch that
// capture.json lists and microbatches.safetensors lacks: the error named the file but not the fix
// (exit 1), and the missing micro-batch asked "was it written for another model?".
TEST(Replay, ATruncatedCaptureFileNamesItAndTheFix) {
  const std::string good = make_capture("replay-cut", "transformer.h.0.mlp.c_fc");
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "microbatches.safetensors"}) {
    const std::string d = test::temp_dir(std::string("replay-cut-") + f) + "/rank0";
    fs::copy(good, d, fs::copy_options::recursive);
    fs::resize_file(d + "/" + f, fs::file_size(d + "/" + f) / 2);
    const std::string m = error_of(d);
    EXPECT_CONTAINS(m, d + "/" + f + ": not a valid safetensors file");
    EXPECT_CONTAINS(m, "re-run the training to write a new one");
  }
  const std::string d = test::temp_dir("replay-cut-mbs") + "/rank0";
  fs::copy(good, d, fs::copy_options::recursive);
  json meta = json::parse(slurp(d + "/capture.json"));
  meta["micro_batches"].push_back(meta["micro_batches"][0]);
  std::ofstream(d + "/capture.json") << meta.dump();
  const std::string m = error_of(d);
  EXPECT_CONTAINS(m, d + "/microbatches.safetensors: mb2.input_ids is missing, but " + d +
                         "/capture.json lists 3 micro-batches");
  EXPECT_NOT_CONTAINS(m, "another model");
}

// A micro-batch whose mask or ids were damaged (or taken from another model's capture): they
// reached attention, the embedding and the loss, whose errors named no file (exit 1).
TEST(Replay, DamagedMicroBatchTensorsNameTheCaptureFile) {
  const std::string good = make_capture("replay-mbs", "transformer.h.0.mlp.c_fc");
  auto damaged = [&](const std::string& tag, const std::string& name, const Tensor& value) {
    const std::string d = test::temp_dir("replay-mbs-" + tag) + "/rank0";
    fs::copy(good, d, fs::copy_options::recursive);
    io::Safetensors st = io::read_safetensors(d + "/microbatches.safetensors");
    std::vector<std::pair<std::string, Tensor>> ts;
    for (auto& [n, t] : st.tensors)
      if (n != name) ts.emplace_back(n, t.clone());
    ts.emplace_back(name, value);
    io::write_safetensors(d + "/microbatches.safetensors", ts);
    return d;
  };
  const Shape shape =
      io::read_safetensors(good + "/microbatches.safetensors").at("mb0.input_ids").shape();
  auto ints = [&](int64_t v) {
    return Tensor::from_ints(std::vector<int64_t>(static_cast<size_t>(shape[0] * shape[1]), v),
                             shape);
  };
  std::string d = damaged("mask", "mb0.attention_mask", Tensor::zeros(shape, DType::F32));
  std::string m = error_of(d);
  EXPECT_CONTAINS(m, d + "/microbatches.safetensors: mb0.attention_mask is f32");
  EXPECT_CONTAINS(m, "re-run the training to write a new one");
  d = damaged("ids", "mb0.input_ids", ints(1000000));
  m = error_of(d);
  EXPECT_CONTAINS(m, d + "/microbatches.safetensors: mb0.input_ids holds 1000000 at [0, 0]");
  EXPECT_CONTAINS(m, "re-run the training to write a new one");
  d = damaged("labels", "mb0.labels", ints(-7));
  m = error_of(d);
  EXPECT_CONTAINS(m, d + "/microbatches.safetensors: mb0.labels holds -7 at [0, 0]");
}

// A capture written on a GPU and replayed on the CPU runs other kernels: not bit-exact, and the
// report said only "bit-exact no" (the capture did not record where it ran). Simulated: a CPU
// capture relabelled as a GPU's, with the GPU's other loss bits.
TEST(Replay, AnotherDevicesCaptureIsNamedWhenItIsNotBitExact) {
  const std::string d = make_capture("replay-device", "transformer.h.0.mlp.c_fc");
  json meta = json::parse(slurp(d + "/capture.json"));
  EXPECT_EQ(meta.at("device"), "cpu");
  const ReplayResult same = replay_capture(d);
  EXPECT_TRUE(same.bit_exact);
  for (const std::string& n : same.notes) EXPECT_NOT_CONTAINS(n, "round differently");
  meta["device"] = "cuda:0";
  meta["loss_bits"] = "0x7ff8000000000001";
  std::ofstream(d + "/capture.json") << meta.dump();
  const ReplayResult r = replay_capture(d);
  EXPECT_FALSE(r.bit_exact);
  std::string notes;
  for (const std::string& n : r.notes) notes += n + "\n";
  EXPECT_CONTAINS(notes, "the capture was written on cuda:0, this replay ran on cpu");
}

// A capture whose config does not load (edited, or written by a keel with other keys): the error
// named the line of config_toml and not what to do; an error of the replay's own --set is not the
// capture's.
TEST(Replay, ACaptureConfigThatDoesNotLoadSaysWhyAndWhatToDo) {
  const std::string d = make_capture("replay-config", "transformer.h.0.mlp.c_fc");
  json meta = json::parse(slurp(d + "/capture.json"));
  std::string toml = meta.at("config_toml").get<std::string>();
  toml.insert(toml.find("[model]\n") + 8, "some_future_key = 3\n");
  meta["config_toml"] = toml;
  std::ofstream(d + "/capture.json") << meta.dump();
  const std::string m = error_of(d);
  EXPECT_CONTAINS(m, "unknown key model.some_future_key (" + d + "/capture.json's config_toml:");
  EXPECT_CONTAINS(m, "replay it with the keel that wrote it, or re-run the training");

  const std::string good = make_capture("replay-config-set", "transformer.h.0.mlp.c_fc");
  ReplayOptions o;
  o.sets = {"train.bogus=1"};
  try {
    replay_capture(good, o);
    ADD_FAILURE() << "an unknown --set key replayed";
  } catch (const Error& e) {
    EXPECT_CONTAINS(e.what(), "train.bogus");
    EXPECT_NOT_CONTAINS(e.what(), "re-run the training");
  }
}

// The run's out_dir or its debug/nan_capture passed instead of the capture: the error said where
// keel writes captures, not that this one holds one.
TEST(Replay, ARunDirectoryPassedForItsCaptureNamesTheCapture) {
  const std::string d = make_capture("replay-parent", "transformer.h.0.mlp.c_fc");
  const fs::path captures = fs::path(d).parent_path();
  for (const fs::path& p : {captures, captures.parent_path().parent_path()})
    EXPECT_CONTAINS(error_of(p.string()), "it holds the capture " + d + ": pass that directory");
}

// A 16-mixed capture whose "scaler" lacks a key: the scaler's own message named no file.
TEST(Replay, ABrokenScalerStateNamesTheCaptureFile) {
  const std::string d = make_capture("replay-scaler", "transformer.h.0.mlp.c_fc", "16-mixed");
  json meta = json::parse(slurp(d + "/capture.json"));
  ASSERT_TRUE(meta.at("scaler").is_object()) << meta.dump(2);
  meta["scaler"].erase("scale");
  std::ofstream(d + "/capture.json") << meta.dump();
  const std::string m = error_of(d);
  EXPECT_CONTAINS(m, d + "/capture.json: \"scaler\": the loss scaler's state: missing key 'scale'");
  EXPECT_CONTAINS(m, "re-run the training");
}

// A capture another keel wrote that does not replay bit-exactly says so (the report said only
// "bit-exact no"); one that does needs no word.
TEST(Replay, AnotherKeelVersionsCaptureIsNamedWhenItIsNotBitExact) {
  const std::string dir = make_capture("replay-version", "transformer.h.1.mlp.c_fc");
  json meta = json::parse(slurp(dir + "/capture.json"));
  meta["keel_version"] = "0.0.1";
  std::ofstream(dir + "/capture.json") << meta.dump();
  auto notes = [](const ReplayResult& r) {
    std::string all;
    for (const std::string& n : r.notes) all += n + "\n";
    return all;
  };
  const ReplayResult same = replay_capture(dir);
  EXPECT_TRUE(same.bit_exact);
  EXPECT_NOT_CONTAINS(notes(same), "keel 0.0.1");
  meta["loss_bits"] = "0x0000000000000001";  // what another build's kernels might have computed
  std::ofstream(dir + "/capture.json") << meta.dump();
  const ReplayResult other = replay_capture(dir);
  EXPECT_FALSE(other.bit_exact);
  EXPECT_CONTAINS(notes(other), "the capture was written by keel 0.0.1, this is keel ");
  EXPECT_CONTAINS(format_replay(other), "replay it with the keel that wrote it");
}

// A NaN's sign bit says nothing to the user: the report printed "grad norm    -nan".
TEST(Replay, TheReportPrintsANanGradNormWithoutItsSign) {
  const std::string dir = make_capture("replay-sign", "transformer.h.1.mlp.c_fc");
  const ReplayResult r = replay_capture(dir);
  ASSERT_TRUE(std::isnan(r.grad_norm));
  const std::string text = format_replay(r);
  EXPECT_CONTAINS(text, "grad norm    nan (unscaled");
  EXPECT_NOT_CONTAINS(text, " -nan");
}

// A non-finite loss makes every gradient non-finite on the way back: the report named the first
// of them "first produced by backward" (transformer.ln_f.weight, 16-true's flushed AdamW moments)
// beside a first module the tracer found in the forward.
TEST(Replay, TheGradientsOfANonFiniteLossAreNotNamedAsBackwardsProducer) {
  ReplayResult r;
  r.loss = std::nan("");
  r.grad_norm = std::nan("");
  r.nonfinite_params = {"transformer.wte.weight", "transformer.ln_f.weight"};
  r.first_nonfinite_param = "transformer.ln_f.weight";
  std::string text = format_replay(r);
  EXPECT_CONTAINS(text,
                  "non-finite gradients in 2 parameters, carried back from the loss's own "
                  "nan: the forward produced it, not backward");
  EXPECT_NOT_CONTAINS(text, "first produced by backward");
  r.loss = 2.5;  // a finite loss: backward made them, and its first is named
  text = format_replay(r);
  EXPECT_CONTAINS(text, "first produced by backward: transformer.ln_f.weight");
}

}  // namespace
}  // namespace keel::monitor
