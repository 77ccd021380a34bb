// Fine-tuning end to end (issue 5): `keel init-model` writes a tiny Llama as an HF directory,
// `keel train` fine-tunes it with LoRA through model.path — the loss falls, the base stays
// bit-identical, and out_dir/adapter is the PEFT directory of the trained adapter; bf16-mixed with
// a bf16 base is finite from step 0 under every attention backend; a bad target module is a usage
// error listing the model's layers. Padding through the Trainer: a tokenizer without a usable pad
// token gets a dedicated id and resized embeddings (data.pad = "add") or pads with eos ("eos"),
// and extra padding does not change the loss. Checkpoints and NaN captures of these runs hold the
// adapters only and reference the base (issue 25); `keel replay` rebuilds it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "keel/io/hf_model.h"
#include "keel/io/safetensors.h"
#include "keel/io/trained_model.h"
#include "keel/train/trainer.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using Ran = test::KeelRun;

using test::slurp;

std::vector<double> losses(const std::string& out_dir) {
  std::vector<double> out;
  std::ifstream f(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

// A tiny "pretrained" Llama (vocab 259: keel's byte tokenizer), written once per test binary.
// (Named for this file: the unity build puts it in one translation unit with
// test_cli_generate.cpp.)
const std::string& lora_base_dir() {
  static const std::string dir = [] {
    const std::string d = test::temp_dir("lora-base") + "/tiny-llama";
    Ran r = test::run_keel_sh("init-model --family llama --out " + d +
                              " --n-layer 2 --n-embd 64 --n-head 4 --n-kv-head 2 --seed 3");
    EXPECT_EQ(r.code, 0) << r.output;
    return d;
  }();
  return dir;
}

std::string lora_config(const std::string& out_dir, const std::string& extra = "") {
  return "[run]\nout_dir = \"" + out_dir + "\"\nseed = 5\nthreads = 1\n" + "[model]\npath = \"" +
         lora_base_dir() + "\"\nattention = \"eager\"\n" +
         "[model.adapter]\nkind = \"lora\"\nr = 8\nalpha = 16.0\n" +
         "target_modules = [\"q_proj\", \"k_proj\", \"v_proj\", \"up_proj\", \"down_proj\"]\n" +
         "[data]\ntask = \"arith\"\nnum_examples = 256\neval_examples = 8\nseq_len = 24\n" +
         "digits = 2\n" + "[train]\nbatch_size = 8\nmax_steps = 40\nmax_grad_norm = 1.0\n" +
         "[optim]\nlr = 1e-2\nweight_decay = 0.0\n[sched]\nname = \"constant\"\n" +
         "[log]\nevery = 10\ntensorboard = false\n" + extra;
}

TEST(CliLora, FineTuneLowersTheLossKeepsTheBaseAndExportsPeft) {
  const std::string dir = test::temp_dir("lora-run");
  const std::string out = dir + "/out";
  std::ofstream(dir + "/lora.toml") << lora_config(out);
  Ran r = test::run_keel_sh("train " + dir + "/lora.toml");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("adapter (PEFT lora) written to " + out + "/adapter"), std::string::npos)
      << r.output;

  // The loss falls: the mean of the last 5 steps clearly below the first 5 (from ~ln 259 = 5.56;
  // a random base learns the byte statistics slowly through a rank-8 adapter).
  const std::vector<double> l = losses(out);
  ASSERT_EQ(l.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += l[i], last += l[l.size() - 1 - i];
  EXPECT_LT(last, 0.95 * first) << "first 5 mean " << first / 5 << ", last 5 mean " << last / 5;

  // The checkpoint holds the adapters only (the base is referenced, issue 25); loaded with its
  // base, the base is bit-identical to the HF checkpoint it was loaded from.
  io::Safetensors base = io::read_safetensors(lora_base_dir() + "/model.safetensors");
  io::Safetensors ck = io::read_safetensors(out + "/checkpoints/last/model.safetensors");
  for (auto& [name, t] : base.tensors) EXPECT_EQ(ck.find(name), nullptr) << name;
  EXPECT_EQ(ck.tensors.size(), 2u * 5 * 2);
  io::TrainedModel trained = io::load_trained_model(out);
  std::map<std::string, Tensor> loaded;
  for (auto& [name, p] : trained.model->named_parameters()) loaded[name] = p;
  for (auto& [name, t] : base.tensors) test::expect_bitwise_equal(loaded.at(name), t, name);

  // out_dir/adapter: PEFT's config and tensor names, the trained values.
  const json c = json::parse(slurp(out + "/adapter/adapter_config.json"));
  EXPECT_EQ(c["peft_type"], "LORA");
  EXPECT_EQ(c["task_type"], "CAUSAL_LM");
  EXPECT_EQ(c["r"], 8);
  EXPECT_EQ(c["lora_alpha"], 16.0);
  EXPECT_EQ(c["base_model_name_or_path"], lora_base_dir());
  EXPECT_EQ(c["target_modules"], json({"q_proj", "k_proj", "v_proj", "up_proj", "down_proj"}));
  io::Safetensors ad = io::read_safetensors(out + "/adapter/adapter_model.safetensors");
  EXPECT_EQ(ad.tensors.size(), 2u * 5 * 2);
  for (int layer = 0; layer < 2; ++layer)
    for (std::string m : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj",
                          "mlp.down_proj"})
      for (std::string ab : {"lora_A", "lora_B"}) {
        const std::string path = "model.layers." + std::to_string(layer) + "." + m + "." + ab;
        const std::string peft = "base_model.model." + path + ".weight";
        ASSERT_NE(ad.find(peft), nullptr) << peft;
        EXPECT_EQ(ad.at(peft).dtype(), DType::F32);
        test::expect_bitwise_equal(ad.at(peft), ck.at(path + ".weight"), peft);
      }
  double b_norm = 0;
  for (float v :
       ad.at("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight").to_floats())
    b_norm += std::abs(v);
  EXPECT_GT(b_norm, 0) << "lora_B starts at zero; training must move it";

  // The exported adapter on the base reproduces the trained model.
  auto model = io::load_hf_model(lora_base_dir());
  io::load_peft_adapter(*model, out + "/adapter");
  for (auto& [name, p] : model->named_parameters())
    test::expect_bitwise_equal(p, loaded.at(name), "base + adapter: " + name);
}

TEST(CliLora, Bf16MixedWithABf16BaseIsFiniteUnderEveryAttentionBackend) {
  for (const std::string backend : {"eager", "math", "flash"}) {
    const std::string dir = test::temp_dir("lora-bf16");
    const std::string out = dir + "/out";
    std::ofstream(dir + "/lora.toml") << lora_config(out);
    Ran r = test::run_keel_sh(
        "train " + dir +
        "/lora.toml --set train.precision=bf16-mixed --set model.base_dtype=bf16 "
        "--set model.attention=" +
        backend + " --set train.max_steps=3 --set optim.lr=3e-5 --set model.adapter.dropout=0.05");
    ASSERT_EQ(r.code, 0) << backend << ": " << r.output;
    const std::vector<double> l = losses(out);
    ASSERT_EQ(l.size(), 3u) << backend;
    for (double v : l) EXPECT_TRUE(std::isfinite(v)) << backend;
    // The frozen base was stored in bf16; the adapter in f32.
    io::Safetensors ck = io::read_safetensors(out + "/checkpoints/last/model.safetensors");
    EXPECT_EQ(ck.find("model.layers.0.self_attn.q_proj.weight"), nullptr);  // referenced
    EXPECT_EQ(json::parse(
                  slurp(out + "/checkpoints/last/config.json"))["keel_checkpoint"]["base"]["dtype"],
              "bf16");
    EXPECT_EQ(ck.at("model.layers.0.self_attn.q_proj.lora_A.weight").dtype(), DType::F32);
  }
}

// A NaN capture of an adapter run over an HF directory holds the trained tensors only, with the
// checkpoint's reference to the base (issue 25); `keel replay` rebuilds the base from it and
// reproduces the step.
TEST(CliLora, NanCaptureReferencesTheBaseAndReplays) {
  const std::string dir = test::temp_dir("lora-nan");
  const std::string out = dir + "/out";
  std::ofstream(dir + "/lora.toml") << lora_config(out);
  Ran r = test::run_keel_sh("train " + dir +
                            "/lora.toml --set train.max_steps=4 --set "
                            "debug.inject.module=model.layers.1.self_attn --set "
                            "debug.inject.step=2 --set debug.inject.kind=nan");
  ASSERT_EQ(r.code, 3) << r.output;
  const std::string capture = out + "/debug/nan_capture/rank0";
  io::Safetensors m = io::read_safetensors(capture + "/model.safetensors");
  EXPECT_EQ(m.find("model.layers.0.self_attn.q_proj.weight"), nullptr);
  EXPECT_NE(m.find("model.layers.0.self_attn.q_proj.lora_A.weight"), nullptr);
  EXPECT_EQ(m.tensors.size(), 2u * 5 * 2);
  const json meta = json::parse(slurp(capture + "/capture.json"));
  EXPECT_EQ(meta["base"]["path"], lora_base_dir());
  Ran rp = test::run_keel_sh("replay " + capture + " --json");
  ASSERT_EQ(rp.code, 0) << rp.output;
  EXPECT_CONTAINS(rp.output, "\"reproduced\":true");
}

TEST(CliLora, UnknownTargetModuleIsAUsageErrorListingTheLayers) {
  const std::string dir = test::temp_dir("lora-bad");
  std::ofstream(dir + "/lora.toml") << lora_config(dir + "/out");
  Ran r = test::run_keel_sh("train " + dir +
                            "/lora.toml --set 'model.adapter.target_modules=[\"qkv\"]'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("'qkv'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
            std::string::npos)
      << r.output;
}

// ---- padding through the Trainer ---------------------------------------------------------------

// A byte-level BPE tokenizer without a pad token (the tokenizers' tiny Llama-style fixture, with a
// tokenizer_config.json naming eos and, optionally, a pad that is a real token) and a JSONL file.
struct PadSetup {
  std::string dir, tokenizer, data;
  PadSetup(const std::string& pad_token) {
    dir = test::temp_dir("pad");
    fs::copy_file(std::string(KEEL_SOURCE_DIR) +
                      "/tests/data/tokenizer_parity/tiny/llama_style/tokenizer.json",
                  dir + "/tokenizer.json");
    json cfg = {{"eos_token", "<|eot|>"}, {"bos_token", nullptr}};
    cfg["pad_token"] = pad_token.empty() ? json(nullptr) : json(pad_token);
    std::ofstream(dir + "/tokenizer_config.json") << cfg.dump();
    tokenizer = "hf:" + dir + "/tokenizer.json";
    data = dir + "/data.jsonl";
    std::ofstream f(data);
    for (const char* t : {"the cat sat", "a dog ran far away", "hi", "numbers 12 and 345",
                          "the end", "some longer line of text to pad the others"})
      f << json({{"text", t}}).dump() << "\n";
  }
  Config config(const std::string& pad, int64_t seq_len) const {
    Config c = load_config("");
    c.run.out_dir = dir + "/out";
    c.model.family = "llama";
    c.model.n_layer = 1;
    c.model.n_embd = 32;
    c.model.n_head = 2;
    c.data.task = "jsonl";
    c.data.path = data;
    c.data.tokenizer = tokenizer;
    c.data.pad = pad;
    c.data.seq_len = seq_len;
    c.data.shuffle = false;
    c.train.batch_size = 6;
    c.train.max_steps = 1;
    return c;
  }
};

TEST(TrainerPadding, AddGivesADedicatedIdEosReusesEos) {
  for (const std::string pad_token : {"", "!"}) {  // no pad; a pad that is a real token
    PadSetup s(pad_token);
    TrainerHooks quiet;
    quiet.on_message = [](const std::string&) {};
    Trainer add(s.config("add", 32), quiet);
    const int64_t V = add.tokenizer().vocab_size();
    EXPECT_EQ(add.model().spec().vocab_size, V + 1) << "a new row for the pad id " << V;
    Trainer eos(s.config("eos", 32), quiet);
    EXPECT_EQ(eos.model().spec().vocab_size, V);
    const int64_t eos_id = eos.tokenizer().eos_id();
    ASSERT_GE(eos_id, 0);
    for (auto [t, want] : {std::pair<Trainer*, int64_t>{&add, V}, {&eos, eos_id}}) {
      data::Batch b = t->loader().batch(0, 0);
      const auto ids = b.input_ids.to_ints();
      const auto mask = b.attention_mask.to_ints();
      int64_t pads = 0;
      for (size_t i = 0; i < ids.size(); ++i)
        if (mask[i] == 0) {
          EXPECT_EQ(ids[i], want);
          ++pads;
        }
      EXPECT_GT(pads, 0);
    }
  }
}

TEST(TrainerPadding, ExtraPaddingLeavesTheLossUnchanged) {
  PadSetup s("");
  TrainerHooks quiet;
  quiet.on_message = [](const std::string&) {};
  Trainer a(s.config("add", 64), quiet);
  Trainer b(s.config("add", 96), quiet);
  const auto wa = std::vector<data::Batch>{a.loader().batch(0, 0)};
  const auto wb = std::vector<data::Batch>{b.loader().batch(0, 0)};
  ASSERT_EQ(wa[0].n_targets, wb[0].n_targets) << "no example is longer than 64 tokens";
  const double la = a.forward_backward(wa, 1, 1.0), lb = b.forward_backward(wb, 1, 1.0);
  EXPECT_NEAR(la, lb, 1e-5 * std::abs(la));
  // Same gradients too: pad positions feed nothing back.
  for (auto& [name, p] : a.trainable()) {
    Tensor q = b.model().find_parameter(name);
    ASSERT_TRUE(p.grad().defined() && q.grad().defined()) << name;
    test::expect_close(q.grad(), p.grad(), 1e-6, 1e-4, name);
  }
}

// The base of an adapter run moved after training: generate and export name --base DIR as the
// fix, and with it load the base from its new place (checked against the checkpoint's reference)
// and give what they gave before the move.
TEST(CliLora, AMovedBaseIsFoundWithTheBaseOption) {
  const std::string dir = test::temp_dir("lora-moved");
  const std::string out = dir + "/out", base = dir + "/base", moved = dir + "/moved";
  fs::copy(lora_base_dir(), base);
  std::ofstream(dir + "/lora.toml") << lora_config(out);
  Ran r = test::run_keel_sh("train " + dir +
                            "/lora.toml --set train.max_steps=3 --set model.path=" + base);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string gen = "generate " + out + " 12+34= --max-new-tokens 4";
  const Ran before = test::run_keel_sh(gen);
  ASSERT_EQ(before.code, 0) << before.output;
  fs::rename(base, moved);
  r = test::run_keel_sh(gen);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, base);
  EXPECT_CONTAINS(r.err, "or name its new place with --base DIR");
  const Ran after = test::run_keel_sh(gen + " --base " + moved);
  ASSERT_EQ(after.code, 0) << after.output;
  EXPECT_EQ(after.out, before.out);
  r = test::run_keel_sh("export " + out + " --out " + dir + "/peft --adapter-only --base " + moved);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(json::parse(slurp(dir + "/peft/adapter_config.json"))["base_model_name_or_path"],
            moved);
  r = test::run_keel_sh("export " + out + " --out " + dir + "/hf --base " + lora_base_dir());
  EXPECT_EQ(r.code, 0) << r.output;  // another copy of the same base passes the check
}

// A LoRA run over a base whose activations outgrow f16 (init_std 10, a wide MLP) in 16-true stops
// at step 1. Bisect's adapter=none trial trains the referenced base whole, as model.path holds it
// (it failed with "tensor ... is missing (the capture was written by another model config?)");
// a base moved since the capture is named with the capture and the fix before the run is rebuilt
// (the loader said "no config.json" of the old path alone, exit 1); with --set model.path at its
// new place the step replays bit for bit.
TEST(CliLora, ACaptureWithAMovedBaseNamesItAndBisectsWithoutTheAdapter) {
  const std::string dir = test::temp_dir("lora-nan-moved");
  const std::string base = dir + "/base", moved = dir + "/moved", out = dir + "/out";
  Ran r = test::run_keel_sh("init-model --family llama --out " + base +
                            " --init-std 10 --intermediate-size 4096 --seed 3");
  ASSERT_EQ(r.code, 0) << r.output;
  std::ofstream(dir + "/lora.toml") << lora_config(out);
  r = test::run_keel_sh("train " + dir + "/lora.toml --set model.path=" + base +
                        " --set train.precision=16-true --set train.max_steps=3");
  ASSERT_EQ(r.code, 3) << r.output;
  const std::string capture = out + "/debug/nan_capture/rank0";
  Ran b = test::run_keel_sh("replay " + capture + " --bisect --json");
  ASSERT_EQ(b.code, 0) << b.output;
  const json j = json::parse(b.out);
  EXPECT_TRUE(j["reproduced"].get<bool>());
  EXPECT_TRUE(j["bit_exact"].get<bool>());
  bool tried = false;
  for (const json& t : j["bisect"])
    if (t["change"] == "adapter=none") {
      tried = true;
      EXPECT_FALSE(t.contains("error")) << t.dump();
      EXPECT_FALSE(t["finite"].get<bool>()) << "the base overflows f16 with or without an adapter";
    }
  EXPECT_TRUE(tried) << j.dump(2);
  EXPECT_EQ(j["cause"], "precision=bf16-mixed") << j.dump(2);

  fs::rename(base, moved);
  r = test::run_keel_sh("replay " + capture);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, capture);
  EXPECT_CONTAINS(r.err, base + " is not a directory");
  EXPECT_CONTAINS(r.err, "--set model.path=DIR");
  r = test::run_keel_sh("replay " + capture + " --json --set model.path=" + moved);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.out, "\"bit_exact\":true");
}

// A bad weight in the base's file: a NaN in the embedding of a tiny Llama, loaded under
// model.allow_nonfinite_weights into a bf16 base under LoRA. The capture holds the adapters only;
// bisect names the parameters as the cause and says the base's file holds the value (it blamed
// "a corrupt checkpoint or initialization, or an earlier update" of a run that had applied none),
// and its adapter=none trial runs (it failed: "tensor ... is missing").
TEST(CliLora, ANanInTheBasesFileIsBisectedToTheBase) {
  const std::string dir = test::temp_dir("lora-nan-base");
  const std::string base = dir + "/base", out = dir + "/out";
  fs::copy(lora_base_dir(), base);
  {
    io::Safetensors st = io::read_safetensors(base + "/model.safetensors");
    for (auto& [name, t] : st.tensors)
      if (name == "model.embed_tokens.weight") {
        Tensor c = t.clone();
        c.data_as<float>()[7] = std::numeric_limits<float>::quiet_NaN();
        t = c;
      }
    io::write_safetensors(base + "/model.safetensors", st.tensors, st.metadata);
  }
  std::ofstream(dir + "/lora.toml") << lora_config(out);
  Ran r = test::run_keel_sh("train " + dir + "/lora.toml --set model.path=" + base +
                            " --set model.allow_nonfinite_weights=true --set "
                            "model.base_dtype=bf16 --set train.precision=bf16-mixed");
  ASSERT_EQ(r.code, 3) << r.output;
  Ran b = test::run_keel_sh("replay " + out + "/debug/nan_capture/rank0 --bisect --json");
  ASSERT_EQ(b.code, 0) << b.output;
  const json j = json::parse(b.out);
  EXPECT_TRUE(j["bit_exact"].get<bool>()) << j.dump(2);
  EXPECT_EQ(j["cause"], "nonfinite-parameters") << j.dump(2);
  EXPECT_CONTAINS(j["explanation"].get<std::string>(),
                  "model.embed_tokens.weight is a frozen tensor of the base model.path = " + base);
  for (const json& t : j["bisect"]) EXPECT_FALSE(t.contains("error")) << t.dump();
}

}  // namespace
}  // namespace keel
