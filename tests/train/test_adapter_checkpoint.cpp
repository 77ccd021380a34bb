// Checkpoints of adapter runs over a base from files (issue 25): a LoRA/DoRA run whose frozen bf16
// base came from a sharded HF directory saves only its trained tensors and a fingerprinted
// reference to that directory; resume continues bit-identically, the checkpoint loads (with its
// base) for generate/eval/export and as model.path, and a base that moved or changed is an error
// naming the checkpoint, the base and the file. A random base is still saved whole.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "keel/io/atomic_file.h"
#include "keel/io/hf_model.h"
#include "keel/io/safetensors.h"
#include "keel/io/trained_model.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/train/trainer.h"
#include "tests/io/tiny_specs.h"
#include "tests/support/check.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// A small random Llama (vocab 259: the byte tokenizer) saved as bf16 in 3+ shards.
void write_base(const std::string& dir, uint64_t seed) {
  models::ModelSpec s = io::test_specs::llama_spec(false);
  s.vocab_size = 259;
  s.max_seq_len = 64;
  auto m = models::make_causal_lm(s, seed);
  io::HfSaveOptions o;
  o.dtype = DType::BF16;
  o.max_shard_bytes = 24 << 10;
  io::save_hf_model(*m, dir, o);
}

const std::string& base_dir() {
  static const std::string d = [] {
    const std::string dir = test::temp_dir("adck-base") + "/llama";
    write_base(dir, 3);
    return dir;
  }();
  return d;
}

Config adapter_config(const std::string& tag, const std::string& kind) {
  Config c;
  c.run.out_dir = test::temp_dir(tag);
  c.run.seed = 7;
  c.model.path = base_dir();
  c.model.base_dtype = "bf16";
  c.model.attention = "eager";
  c.model.adapter.kind = kind;
  c.model.adapter.r = 4;
  c.model.adapter.alpha = 8;
  c.model.adapter.dropout = kind == "lokr" ? 0.0 : 0.1;  // dropout masks must replay too
  c.model.adapter.target_modules = {"q_proj", "v_proj", "up_proj"};
  c.data.digits = 2;
  c.data.num_examples = 128;
  c.data.eval_examples = 16;
  c.data.seq_len = 16;
  c.train.batch_size = 8;
  c.train.max_steps = 6;
  c.optim.lr = 1e-2;
  c.log.checkpoint_every = 3;
  c.log.tensorboard = false;
  c.log.metrics = false;
  c.log.console = false;
  return c;
}

struct StopHere {};

std::vector<double> losses_of(Config c, int64_t stop_after, bool resume) {
  c.run.resume = resume;
  std::vector<double> losses;
  TrainerHooks h;
  h.on_step = [&](const StepResult& r) {
    if (stop_after > 0 && r.step > stop_after) throw StopHere{};
    losses.push_back(r.loss);
  };
  Trainer t(c, h);
  try {
    t.fit();
  } catch (const StopHere&) {
  }
  return losses;
}

TEST(AdapterCheckpoint, HoldsOnlyTrainedTensorsAndResumesBitIdentically) {
  for (const char* kind : {"lora", "dora", "lokr"}) {
    SCOPED_TRACE(kind);
    Config c = adapter_config(std::string("adck-resume-") + kind, kind);
    Config straight = c;
    straight.run.out_dir = test::temp_dir(std::string("adck-straight-") + kind);
    const auto full = losses_of(straight, 0, false);
    ASSERT_EQ(full.size(), 6u);
    const auto first = losses_of(c, 3, false);  // "crashes" in step 4, after step 3's checkpoint
    ASSERT_EQ(first.size(), 3u);

    // checkpoints/step-3 holds the trained tensors only, and references the base.
    const std::string ck = c.run.out_dir + "/checkpoints/step-3";
    Config pc = c;
    pc.run.out_dir = test::temp_dir(std::string("adck-probe-") + kind);
    Trainer probe(pc);
    std::set<std::string> trained;
    for (auto& [name, p] : probe.model().named_parameters())
      if (p.requires_grad()) trained.insert(name);
    ASSERT_FALSE(trained.empty());
    std::set<std::string> saved;
    for (auto& [name, t] : io::read_safetensors(ck + "/model.safetensors").tensors)
      saved.insert(name);
    EXPECT_EQ(saved, trained);
    const json ref = json::parse(io::read_file(ck + "/config.json"))["keel_checkpoint"]["base"];
    EXPECT_EQ(ref["path"], base_dir());
    EXPECT_EQ(ref["resolved"], fs::canonical(base_dir()).string());
    EXPECT_EQ(ref["dtype"], "bf16");
    ASSERT_GE(ref["files"].size(), 5u) << ref.dump();  // config, index, >= 3 shards
    EXPECT_EQ(ref["files"][0]["file"], "config.json");
    EXPECT_EQ(ref["files"][1]["file"], "model.safetensors.index.json");

    const auto rest = losses_of(c, 0, true);
    ASSERT_EQ(rest.size(), 3u);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(first[i], full[i]) << "step " << i + 1;
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(rest[i], full[i + 3]) << "step " << i + 4 << " after resume";
  }
}

TEST(AdapterCheckpoint, LoadsWithItsBaseForGenerateEvalExportAndAsModelPath) {
  Config c = adapter_config("adck-load", "dora");
  c.log.checkpoint_every = 0;
  Trainer t(c);
  ASSERT_EQ(t.fit(), 0) << t.stop_message();
  const std::string ck = c.run.out_dir + "/checkpoints/last";

  // What generate/eval/export load: the base from the reference (held in bf16 by the run, read
  // back in f32 exactly), the trained tensors from the checkpoint, the adapters unmerged.
  io::TrainedModel m = io::load_trained_model(c.run.out_dir);
  ASSERT_TRUE(m.checkpoint);
  ASSERT_TRUE(m.adapter.has_value());
  EXPECT_EQ(m.adapter->kind, "dora");
  EXPECT_EQ(m.base_model, base_dir());
  std::map<std::string, Tensor> trained;
  for (auto& [name, p] : t.model().named_parameters()) trained[name] = p;
  size_t n = 0;
  for (auto& [name, p] : m.model->named_parameters()) {
    ASSERT_TRUE(trained.count(name)) << name;
    test::expect_bitwise_equal(p, trained[name].to_dtype(p.dtype()), name);
    ++n;
  }
  EXPECT_EQ(n, trained.size());

  // model.path = checkpoints/last: the adapted model merged (a full fine-tune from it).
  auto merged = io::load_hf_model(ck);
  nn::merge_adapters(*m.model);
  std::map<std::string, Tensor> expect;
  for (auto& [name, p] : m.model->named_parameters()) expect[name] = p;
  for (auto& [name, p] : merged->named_parameters()) {
    ASSERT_TRUE(expect.count(name)) << name;
    test::expect_bitwise_equal(p, expect[name], "merged " + name);
  }
  Config ft = adapter_config("adck-from-ck", "none");
  ft.model.path = ck;
  ft.model.base_dtype = "f32";
  ft.train.max_steps = 1;
  Trainer from_ck(ft);
  EXPECT_EQ(from_ck.fit(), 0) << from_ck.stop_message();
}

TEST(AdapterCheckpoint, AMovedOrChangedBaseIsAClearError) {
  const std::string root = test::temp_dir("adck-moved");
  const std::string base = root + "/llama";
  fs::copy(base_dir(), base);
  Config c = adapter_config("adck-moved-run", "lora");
  c.model.path = base;
  c.train.max_steps = 3;
  ASSERT_EQ(Trainer(c).fit(), 0);
  const std::string ck = c.run.out_dir + "/checkpoints/last";

  // Moved: loading names the checkpoint and the missing base; resuming from the new place works
  // (model.path changed: run.resume_force).
  const std::string moved = root + "/moved";
  fs::rename(base, moved);
  std::string e = test::error_of([&] { io::load_trained_model(ck); });
  EXPECT_CONTAINS(e, ck);
  EXPECT_CONTAINS(e, base);
  EXPECT_CONTAINS(e, "does not exist");
  EXPECT_CONTAINS(e, "put the base model the run was trained on back at");
  EXPECT_CONTAINS(e, "or name its new place with --base DIR");
  // --base DIR: the base's new place, checked against the reference; the model is the same.
  {
    io::TrainedModel at_new =
        io::load_trained_model(ck, "", DType::F32, ops::AttentionBackend::kEager, {}, moved);
    EXPECT_EQ(at_new.base_model, moved);
    const std::string elsewhere = root + "/elsewhere";
    write_base(elsewhere, 5);
    e = test::error_of([&] {
      io::load_trained_model(ck, "", DType::F32, ops::AttentionBackend::kEager, {}, elsewhere);
    });
    EXPECT_CONTAINS(e, elsewhere + "/model-0000");
    EXPECT_CONTAINS(e, "differs");
    EXPECT_CONTAINS(e, "give --base the directory of the base model the run was trained on");
    // --base where nothing references a base: an HF directory.
    e = test::error_of([&] {
      io::load_trained_model(moved, "", DType::F32, ops::AttentionBackend::kEager, {}, moved);
    });
    EXPECT_CONTAINS(e, "--base " + moved + ": " + moved + " is a model directory");
  }
  Config r = c;
  r.run.resume = true;
  r.run.resume_force = true;
  r.train.max_steps = 4;
  r.model.path = moved;
  EXPECT_EQ(Trainer(r).fit(), 0);

  // Changed: the same shapes with other values (another seed) differ in a shard's sampled bytes.
  // The resume above re-saved the checkpoint: its reference is now `moved`.
  const std::string other = root + "/other";
  write_base(other, 4);
  r.model.path = other;
  e = test::error_of([&] { Trainer(r).fit(); });
  EXPECT_CONTAINS(e, ck);
  EXPECT_CONTAINS(e, other + "/model-0000");
  EXPECT_CONTAINS(e, "differs");
  EXPECT_CONTAINS(e, "point model.path at the base model the run was trained on");
  fs::remove_all(moved);
  fs::rename(other, moved);
  e = test::error_of([&] { io::load_trained_model(ck); });
  EXPECT_CONTAINS(e, ck);
  EXPECT_CONTAINS(e, fs::weakly_canonical(moved).string() + "/model-0000");
  EXPECT_CONTAINS(e, "differs");
  r.model.path = "";  // a random Llama of the sizes' defaults: the reference is checked first
  r.model.family = "llama";
  e = test::error_of([&] { Trainer(r).fit(); });
  EXPECT_CONTAINS(e, "model.path is empty");
}

// The reference is the base the run loaded: a base directory replaced while the run trains (same
// shapes, other values) is not what its checkpoints describe, so resuming over it is refused.
TEST(AdapterCheckpoint, ABaseReplacedDuringTheRunDoesNotPassForTheLoadedOne) {
  const std::string base = test::temp_dir("adck-replaced") + "/llama";
  fs::copy(base_dir(), base);
  Config c = adapter_config("adck-replaced-run", "lora");
  c.model.path = base;
  c.train.max_steps = 3;
  TrainerHooks h;
  h.on_step = [&](const StepResult& r) {
    if (r.step == 1) write_base(base, 4);  // before any checkpoint is written
  };
  ASSERT_EQ(Trainer(c, h).fit(), 0);
  Config r = c;
  r.run.resume = true;
  r.train.max_steps = 4;
  const std::string e = test::error_of([&] { Trainer(r).fit(); });
  EXPECT_CONTAINS(e, c.run.out_dir + "/checkpoints/last");
  EXPECT_CONTAINS(e, base + "/model-0000");
  EXPECT_CONTAINS(e, "differs");
}

TEST(AdapterCheckpoint, ARandomBaseIsSavedWhole) {
  Config c = adapter_config("adck-random", "lora");
  c.model.path = "";
  c.model.family = "llama";
  c.model.n_layer = 1;
  c.model.n_embd = 32;
  c.model.n_head = 2;
  c.train.max_steps = 1;
  Trainer t(c);
  ASSERT_EQ(t.fit(), 0) << t.stop_message();
  const std::string ck = c.run.out_dir + "/checkpoints/last";
  EXPECT_EQ(io::read_safetensors(ck + "/model.safetensors").tensors.size(),
            t.model().named_parameters().size());
  EXPECT_FALSE(json::parse(io::read_file(ck + "/config.json"))["keel_checkpoint"].contains("base"));
}

}  // namespace
}  // namespace keel
