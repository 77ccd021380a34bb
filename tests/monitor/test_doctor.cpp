// The doctor's checks one by one (pad token on synthetic tokenizers, accumulation windows, the
// config rules, memory) and run_doctor end to end with its one-batch sanity pass.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "keel/backend/cuda_api.h"
#include "keel/data/tokenizer.h"
#include "keel/io/hf_weights.h"
#include "keel/monitor/doctor.h"
#include "tests/support/check.h"

namespace keel::monitor {
namespace {

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A Llama-3-like vocabulary described synthetically: 128256 ids, id 0 is "!", ids >= 128000 are
// special (128000 bos, 128001 eos, 128004 the reserved <|finetune_right_pad_id|>), no pad, and a
// hole at id 5000 (an id that names no token).
TokenizerFacts llama3_like() {
  TokenizerFacts t;
  t.name = "llama3-like";
  t.vocab_size = 128256;
  t.pad_id = -1;
  t.bos_id = 128000;
  t.eos_id = 128001;
  t.is_special = [](int64_t id) { return id >= 128000; };
  t.token_text = [](int64_t id) -> std::string {
    if (id == 0) return "!";
    if (id == 5000) return "";
    if (id == 128000) return "<|begin_of_text|>";
    if (id == 128001) return "<|end_of_text|>";
    if (id == 128004) return "<|finetune_right_pad_id|>";
    return "tok" + std::to_string(id);
  };
  return t;
}

TEST(DoctorPad, NoPadTokenSaysWhatKeelPadsWith) {
  TokenizerFacts t = llama3_like();
  DoctorCheck add = check_pad_token(t, "add", 128256);
  EXPECT_EQ(add.severity, "info");
  EXPECT_TRUE(has(add.message, "has no pad token")) << add.message;
  EXPECT_TRUE(has(add.message, "new id 128256")) << add.message;
  DoctorCheck eos = check_pad_token(t, "eos", 128256);
  EXPECT_EQ(eos.severity, "warning");
  EXPECT_TRUE(has(eos.message, "eos 128001 ('<|end_of_text|>')")) << eos.message;
  EXPECT_TRUE(has(eos.message, "never learns to stop")) << eos.message;
  t.eos_id = -1;
  EXPECT_EQ(check_pad_token(t, "eos", 128256).severity, "error");
}

TEST(DoctorPad, APadThatIsARealTokenCollides) {
  TokenizerFacts t = llama3_like();
  t.pad_id = 0;  // '!': ordinary text produces it
  DoctorCheck c = check_pad_token(t, "add", 128256);
  EXPECT_NE(c.severity, "ok");
  EXPECT_TRUE(has(c.message, "pad id 0 ('!')")) << c.message;
  EXPECT_TRUE(has(c.message, "ordinary token")) << c.message;
  t.pad_id = 128001;  // = eos
  c = check_pad_token(t, "eos", 128256);
  EXPECT_EQ(c.severity, "warning");
  EXPECT_TRUE(has(c.message, "also its eos token")) << c.message;
  t.pad_id = 128000;  // = bos
  EXPECT_TRUE(has(check_pad_token(t, "add", 128256).message, "also its bos token"));
}

TEST(DoctorPad, ADedicatedPadIsFine) {
  TokenizerFacts t = llama3_like();
  t.pad_id = 128004;  // a reserved special token
  DoctorCheck c = check_pad_token(t, "add", 128256);
  EXPECT_EQ(c.severity, "ok") << c.message;
  EXPECT_TRUE(has(c.message, "<|finetune_right_pad_id|>")) << c.message;
  t.pad_id = 5000;  // a hole in the vocabulary: no text produces it
  EXPECT_EQ(check_pad_token(t, "add", 128256).severity, "ok");
  t.pad_id = 128256;  // one past the vocabulary, but the embedding has that row
  EXPECT_EQ(check_pad_token(t, "add", 128257).severity, "ok");
  // ... and without the row it is an error naming the fix.
  DoctorCheck e = check_pad_token(t, "add", 128256);
  EXPECT_EQ(e.severity, "error");
  EXPECT_TRUE(has(e.message, "model.vocab_size to at least 128257")) << e.message;
}

TEST(DoctorPad, TheByteTokenizerHasADedicatedPad) {
  data::ByteTokenizer bt;
  const TokenizerFacts t = tokenizer_facts(bt, "byte");
  const DoctorCheck c = check_pad_token(t, "add", bt.vocab_size());
  EXPECT_EQ(c.severity, "ok") << c.message;
  EXPECT_TRUE(has(c.message, "pad id 256")) << c.message;
}

TEST(DoctorWindows, WindowLargerThanTheEpochRemainderAndLastBatch) {
  auto w = check_windows(20, 8, 4);  // 3 micro-batches per epoch, a window of 4
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].severity, "warning");
  EXPECT_TRUE(has(w[0].message, "larger than the epoch")) << w[0].message;
  EXPECT_TRUE(has(w[0].message, "at most 3")) << w[0].message;
  w = check_windows(64, 8, 3);  // 8 micro-batches: windows 3, 3, 2
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].severity, "info");
  EXPECT_TRUE(has(w[0].message, "remainder window of 2")) << w[0].message;
  w = check_windows(60, 8, 1);  // the last micro-batch holds 4 rows
  ASSERT_EQ(w.size(), 1u);
  EXPECT_TRUE(has(w[0].message, "4 of 8 rows")) << w[0].message;
  w = check_windows(64, 8, 2);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].severity, "ok");
  EXPECT_EQ(check_windows(0, 8, 1)[0].severity, "error");
}

// Under mpirun -np N a step's window is grad_accum x N micro-batches: doctor checked one rank's
// ("7 steps per epoch ..., no remainder" for a 2-rank run of 4 steps whose last leaves rank 1
// without data).
TEST(DoctorWindows, RanksMultiplyTheWindow) {
  auto w = check_windows(56, 8, 1, 2);  // 7 micro-batches in windows of 2: 2, 2, 2, 1
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].severity, "info");
  EXPECT_TRUE(has(w[0].message,
                  "remainder window of 1 micro-batch instead of 2 (step 4 of 4; "
                  "rank 1 has no micro-batch there"))
      << w[0].message;
  w = check_windows(56, 8, 2, 3);  // windows of 6: 6, 1
  ASSERT_EQ(w.size(), 1u);
  EXPECT_TRUE(has(w[0].message, "ranks 1 to 2 have no micro-batch there")) << w[0].message;
  w = check_windows(64, 8, 1, 2);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].severity, "ok");
  EXPECT_TRUE(has(w[0].message, "4 steps per epoch of 2 ranks x 1 x 8 examples")) << w[0].message;
  w = check_windows(20, 8, 2, 2);  // 3 micro-batches, a window of 4
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].severity, "warning");
  EXPECT_TRUE(has(w[0].message, "train.grad_accum = 2 x 2 ranks = 4 is larger than the epoch"))
      << w[0].message;
  EXPECT_TRUE(has(w[0].message, "not 32;")) << w[0].message;
}

// examples/remainder-window said "(1 examples = 1 micro-batches of 1)".
TEST(DoctorWindows, OneExampleAndOneMicroBatchAreSingular) {
  const auto w = check_windows(1, 1, 4);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_TRUE(has(w[0].message, "(1 example = 1 micro-batch of 1)")) << w[0].message;
  EXPECT_TRUE(has(w[0].message, "remainder window of 1 micro-batch,")) << w[0].message;
  EXPECT_TRUE(has(w[0].message, "effective batch is 1 example,")) << w[0].message;
  EXPECT_TRUE(has(check_windows(8, 8, 1)[0].message, "1 step per epoch"))
      << check_windows(8, 8, 1)[0].message;
}

std::string find(const std::vector<DoctorCheck>& cs, const std::string& check,
                 const std::string& severity) {
  for (const auto& c : cs)
    if (c.check == check && c.severity == severity) return c.message;
  return "";
}

TEST(DoctorConfig, PrecisionScalerAndLearningRateRules) {
  Config c;
  c.train.precision = "16-mixed";
  c.scaler.enabled = false;
  EXPECT_TRUE(has(find(check_config(c), "scaler", "warning"), "scaler.enabled = true"));
  c.train.precision = "16-true";
  EXPECT_TRUE(has(find(check_config(c), "scaler", "warning"), "16-true"));
  c.train.precision = "bf16-true";
  EXPECT_TRUE(has(find(check_config(c), "precision", "warning"), "without f32 masters"));
  c.train.precision = "fp8";
  EXPECT_TRUE(has(find(check_config(c), "precision", "error"), "fp8"));
  c.train.precision = "auto";
  EXPECT_TRUE(has(find(check_config(c), "precision", "info"), "resolves to"));
  c.train.precision = "32-true";
  c.run.device = "cuda:0";
  if (!cuda::status().usable) {  // keel train falls back to the CPU: a warning, not a block
    EXPECT_TRUE(has(find(check_config(c), "precision", "warning"), "no usable CUDA device"));
  }
  c.run.device = "cpu";
  c.optim.lr = 1000;  // (1 - 1000 * 0.01) = -9
  const std::string lr = find(check_config(c), "optimizer", "error");
  EXPECT_TRUE(has(lr, "(1 - lr*wd) = -9")) << lr;
  c.optim.weight_decay = 0;
  EXPECT_TRUE(has(find(check_config(c), "optimizer", "warning"), "far above"));
  c = Config();
  for (const auto& d : check_config(c)) EXPECT_NE(d.severity, "error") << d.message;
}

// The weight decay, not the learning rate, when it is the one out of range: lr 0.003 with
// weight_decay 500 was told "lower optim.lr (AdamW is usually run at 1e-5 to 1e-2)"; weight_decay
// 100 (each step x 0.7) held the loss at 4.05 for 120 steps under "nothing blocks training".
TEST(DoctorConfig, AWeightDecayOutOfRangeIsNamedNotTheLearningRate) {
  Config c;
  c.optim.lr = 0.003;
  c.optim.weight_decay = 500;
  const std::string flip = find(check_config(c), "optimizer", "error");
  EXPECT_CONTAINS(flip, "(1 - lr*wd) = -0.5");
  EXPECT_CONTAINS(flip, "lower optim.weight_decay (AdamW usually takes 0 to 0.1)");
  EXPECT_NOT_CONTAINS(flip, "lower optim.lr");
  c.optim.weight_decay = 100;
  const std::string shrink = find(check_config(c), "optimizer", "warning");
  EXPECT_CONTAINS(shrink,
                  "optim.lr x optim.weight_decay = 0.3: AdamW's decoupled decay "
                  "multiplies every decayed weight by 0.7 each step, halving it every 2 "
                  "steps");
  EXPECT_CONTAINS(shrink, "lower optim.weight_decay");
  c.optim.weight_decay = 0.1;  // a usual product (3e-4): nothing said
  EXPECT_EQ(find(check_config(c), "optimizer", "warning"), "");
}

TEST(DoctorMemory, EstimateAgainstAvailable) {
  MemoryEstimate e;
  e.total = 900;
  EXPECT_EQ(check_memory(e, 800).severity, "error");
  EXPECT_EQ(check_memory(e, 1000).severity, "warning");
  EXPECT_EQ(check_memory(e, 10000).severity, "ok");
  EXPECT_EQ(check_memory(e, -1).severity, "info");
}

Config small(const std::string& tag) {
  Config c;
  c.run.out_dir = test::temp_dir(tag);
  c.run.threads = 1;
  c.model.n_layer = 1;
  c.model.n_embd = 32;
  c.model.n_head = 2;
  c.data.num_examples = 64;
  c.data.eval_examples = 0;
  c.data.seq_len = 16;
  c.train.batch_size = 8;
  return c;
}

TEST(Doctor, HealthyConfigPassesWithTheSanityTable) {
  const DoctorReport r = run_doctor(small("doctor-ok"));
  EXPECT_FALSE(r.blocking) << format_doctor(r);
  // configured (eager), math, flash: 32-true needs no separate row.
  ASSERT_EQ(r.sanity.size(), 3u);
  EXPECT_EQ(r.sanity[0].label, "configured");
  EXPECT_EQ(r.sanity[1].label, "attention=math");
  EXPECT_EQ(r.sanity[2].label, "attention=flash");
  for (const auto& s : r.sanity) {
    EXPECT_TRUE(s.ran && s.finite) << s.label << ": " << s.error;
    // The three backends agree in f32 (DESIGN §5).
    EXPECT_NEAR(s.loss, r.sanity[0].loss, 1e-5 * std::fabs(r.sanity[0].loss)) << s.label;
    EXPECT_NEAR(s.grad_norm, r.sanity[0].grad_norm, 1e-4 * r.sanity[0].grad_norm) << s.label;
  }
  EXPECT_GT(r.memory.total, 0);
  const std::string text = format_doctor(r);
  EXPECT_TRUE(has(text, "verdict: nothing blocks training")) << text;
  const auto j = doctor_to_json(r);
  EXPECT_FALSE(j.at("blocking").get<bool>());
  EXPECT_EQ(j.at("sanity").size(), 3u);
}

// At 1B each sanity pass builds the run and runs a batch for minutes, and the doctor said nothing
// until its report. A model from progress_params parameters up is told of each pass first; a
// smaller one is not (here the threshold is lowered to this model's size, then raised past it).
TEST(Doctor, EachSanityPassOfALargeModelIsAnnouncedFirst) {
  std::vector<std::string> said;
  DoctorOptions opt;
  opt.progress = [&](const std::string& m) { said.push_back(m); };
  opt.progress_params = 1;
  const DoctorReport r = run_doctor(small("doctor-progress"), opt);
  ASSERT_EQ(r.sanity.size(), 3u);
  ASSERT_EQ(said.size(), 3u);
  EXPECT_TRUE(has(said[0], "sanity pass 1 of 3 (configured): builds the ")) << said[0];
  EXPECT_TRUE(has(said[0], "-parameter run and runs one batch forward and backward")) << said[0];
  EXPECT_TRUE(has(said[0], "--no-sanity skips these passes")) << said[0];
  EXPECT_TRUE(has(said[2], "sanity pass 3 of 3 (attention=flash)")) << said[2];
  said.clear();
  opt.progress_params = r.memory.params + 1;
  run_doctor(small("doctor-progress-small"), opt);
  EXPECT_TRUE(said.empty()) << said[0];
}

// The adapter check counted tensors and called them parameters ("4 trainable lora parameters"
// for 4 tensors of 64 to 512 values each), beside keel memory's count of values.
TEST(Doctor, TheAdapterCheckCountsTensorsAndParameters) {
  Config c = small("doctor-adapter");
  c.model.adapter.kind = "lora";
  c.model.adapter.r = 4;
  c.model.adapter.target_modules = {"c_attn", "c_fc"};
  DoctorOptions opt;
  opt.sanity = false;
  const DoctorReport r = run_doctor(c, opt);
  // c_attn 32 -> 96 and c_fc 32 -> 128 at r = 4: A is [4, 32] twice, B [96, 4] and [128, 4].
  EXPECT_EQ(find(r.checks, "adapter", "ok"),
            "4 trainable lora tensors (1152 parameters), all f32; frozen base stored in f32")
      << format_doctor(r);
}

TEST(Doctor, MixedPrecisionIsComparedWith32True) {
  Config c = small("doctor-mixed");
  c.train.precision = "bf16-mixed";
  const DoctorReport r = run_doctor(c);
  EXPECT_FALSE(r.blocking) << format_doctor(r);
  ASSERT_EQ(r.sanity.size(), 4u);
  EXPECT_EQ(r.sanity[1].label, "32-true");
  EXPECT_EQ(r.sanity[1].precision, "32-true");
  EXPECT_NE(r.sanity[0].loss, r.sanity[1].loss) << "bf16 rounding is real";
  EXPECT_NEAR(r.sanity[0].loss, r.sanity[1].loss, 0.02 * r.sanity[1].loss);
  EXPECT_TRUE(has(find(r.checks, "sanity", "ok"), "relative difference"));
}

// With a bf16 frozen base the 32-true reference keeps the base in bf16 (an f32 copy would double
// it): the comparison says so, as "relative difference 0" alone read as bf16 costing nothing.
TEST(Doctor, TheReferenceOfABf16BaseSaysItsProductsAreBf16Too) {
  Config c = small("doctor-bf16-base");
  c.train.precision = "bf16-mixed";
  c.model.adapter.kind = "lora";
  c.model.adapter.r = 4;
  c.model.adapter.target_modules = {"c_attn", "c_fc"};
  c.model.base_dtype = "bf16";
  const DoctorReport r = run_doctor(c);
  EXPECT_FALSE(r.blocking) << format_doctor(r);
  EXPECT_TRUE(has(find(r.checks, "sanity", "ok"),
                  "(32-true with the base still bf16 (model.base_dtype), so its products are "
                  "rounded alike in both: loss "))
      << format_doctor(r);
  c.model.base_dtype = "f32";
  const DoctorReport f = run_doctor(c);
  EXPECT_TRUE(has(find(f.checks, "sanity", "ok"), "(32-true: loss ")) << format_doctor(f);
}

// The f16 MLP overflow of tests/cli (a): the first batch is non-finite under 16-true and finite
// under 32-true, which blocks training and says where to look.
TEST(Doctor, FirstBatchOverflowBlocks) {
  Config c = small("doctor-overflow");
  c.model.n_layer = 2;
  c.model.n_embd = 64;
  c.model.n_head = 4;
  c.model.init_std = 10;
  c.model.intermediate_size = 16384;
  c.data.seq_len = 32;
  c.train.precision = "16-true";
  const DoctorReport r = run_doctor(c);
  EXPECT_TRUE(r.blocking);
  ASSERT_GE(r.sanity.size(), 2u);
  EXPECT_FALSE(r.sanity[0].finite);
  EXPECT_TRUE(r.sanity[1].finite);  // 32-true
  const std::string m = find(r.checks, "sanity", "error");
  EXPECT_TRUE(has(m, "finite under 32-true")) << format_doctor(r);
}

// A weight of 1e5 in model.path under 16-mixed: the sanity pass said only "the precision is the
// cause"; a check of its own names the tensor and the value.
TEST(Doctor, AWeightBeyondF16IsAnErrorNamingIt) {
  const std::string dir = test::temp_dir("doctor-huge-weight") + "/llama";
  {
    models::ModelSpec spec;
    spec.family = "llama";
    spec.vocab_size = 259;
    auto m = models::make_causal_lm(spec, 1);
    for (auto& [name, p] : m->named_parameters())
      if (name == "model.layers.1.self_attn.o_proj.weight") p.data_as<float>()[3] = -2e5f;
    io::save_hf_model(*m, dir);
  }
  Config c = small("doctor-huge-weight");
  c.model = ModelConfig{};  // the file's shape
  c.model.path = dir;
  c.train.precision = "16-mixed";
  const DoctorReport r = run_doctor(c);
  EXPECT_TRUE(r.blocking);
  const std::string m = find(r.checks, "weights", "error");
  EXPECT_TRUE(has(m,
                  "model.layers.1.self_attn.o_proj.weight holds 1 value beyond f16's largest "
                  "finite 65504 (the first -200000 at [0, 3] in " +
                      dir + "/model.safetensors)"))
      << format_doctor(r);
  c.train.precision = "32-true";
  EXPECT_EQ(find(run_doctor(c).checks, "weights", "error"), "");
}

TEST(Doctor, BrokenSetupBlocksWithoutASanityPass) {
  Config c = small("doctor-setup");
  c.data.task = "jsonl";
  c.data.path = "/nonexistent/data.jsonl";
  const DoctorReport r = run_doctor(c);
  EXPECT_TRUE(r.blocking);
  EXPECT_TRUE(has(find(r.checks, "setup", "error"), "/nonexistent/data.jsonl"));
  EXPECT_TRUE(r.sanity.empty());
}

}  // namespace
}  // namespace keel::monitor
