// The run factory (train/run.h): every option of a config section reaches the object it
// configures, a run is the same whoever builds it, and what cannot be built is said.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "keel/data/token_file.h"
#include "keel/io/hf_weights.h"
#include "keel/optim/adamw.h"
#include "keel/optim/sgd.h"
#include "keel/train/run.h"
#include "keel/train/trainer.h"
#include "tests/support/check.h"

namespace keel {
namespace {

Config tiny(const std::string& tag, std::vector<std::string> sets = {}) {
  std::vector<std::string> all = {"run.out_dir=" + test::temp_dir(tag),
                                  "model.n_layer=1",
                                  "model.n_embd=16",
                                  "model.n_head=2",
                                  "data.num_examples=32",
                                  "data.eval_examples=4",
                                  "data.seq_len=16",
                                  "train.batch_size=8",
                                  "train.max_steps=3",
                                  "log.console=false",
                                  "log.metrics=false",
                                  "log.tensorboard=false"};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config("", all);
}

// A run on the HF directory `dir` (its shape from config.json), with `sets`.
Config of_model_dir(const std::string& dir, std::vector<std::string> sets) {
  std::vector<std::string> all = {"run.out_dir=" + test::temp_dir("model-dir-run"),
                                  "model.path=" + dir,
                                  "train.max_steps=1",
                                  "log.console=false",
                                  "log.metrics=false",
                                  "log.tensorboard=false"};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config("", all);
}

// What building the run of `cfg` said (its notices and warnings), a line each.
std::string said_by_build(const Config& cfg) {
  std::string said;
  RunOptions opt;
  opt.say = [&](const std::string& m) { said += m + "\n"; };
  build_run(cfg, opt);
  return said;
}

TEST(RunFactory, EveryScalerKeyReachesTheScaler) {
  keel::Run r =
      build_run(tiny("scaler", {"train.precision=16-mixed", "scaler.init_scale=1024",
                                "scaler.hysteresis=3", "scaler.consecutive_hysteresis=true",
                                "scaler.min_scale=2", "scaler.max_scale=4096"}));
  ASSERT_NE(r.scaler, nullptr);
  const GradScalerOptions& o = r.scaler->options();
  EXPECT_EQ(o.init_scale, 1024);
  EXPECT_EQ(o.hysteresis, 3);
  EXPECT_TRUE(o.consecutive_hysteresis);
  EXPECT_EQ(o.min_scale, 2);
  EXPECT_EQ(o.max_scale, 4096);
  EXPECT_EQ(build_run(tiny("noscaler", {"train.precision=bf16-mixed"})).scaler, nullptr);
}

TEST(RunFactory, EveryOptimizerKeyReachesTheOptimizer) {
  keel::Run a = build_run(
      tiny("adamw", {"optim.beta1=0.8", "optim.eps=1e-6", "optim.stochastic_rounding=true",
                     "train.precision=bf16-true", "run.seed=77"}));
  const auto* adamw = dynamic_cast<const optim::AdamW*>(a.optimizer.get());
  ASSERT_NE(adamw, nullptr);
  EXPECT_EQ(adamw->options().beta1, 0.8);
  EXPECT_EQ(adamw->options().eps, 1e-6);
  EXPECT_TRUE(adamw->options().stochastic_rounding);
  EXPECT_EQ(adamw->options().seed, 77u);  // the rounding's stream is the run's
  keel::Run s =
      build_run(tiny("sgd", {"optim.name=sgd", "optim.momentum=0.5", "optim.nesterov=true"}));
  const auto* sgd = dynamic_cast<const optim::SGD*>(s.optimizer.get());
  ASSERT_NE(sgd, nullptr);
  EXPECT_EQ(sgd->options().momentum, 0.5);
  EXPECT_TRUE(sgd->options().nesterov);
}

TEST(RunFactory, StochasticRoundingChangesBf16TrueUpdatesDeterministically) {
  auto losses = [](bool sr) {
    Config c = tiny(sr ? "sr" : "nosr",
                    {"train.precision=bf16-true", "optim.lr=1e-3",
                     sr ? "optim.stochastic_rounding=true" : "optim.stochastic_rounding=false"});
    std::vector<double> out;
    TrainerHooks h;
    h.on_step = [&](const StepResult& r) { out.push_back(r.loss); };
    Trainer t(c, h);
    EXPECT_EQ(t.fit(), 0);
    return out;
  };
  const std::vector<double> nearest = losses(false), sr1 = losses(true), sr2 = losses(true);
  ASSERT_EQ(sr1.size(), 3u);
  EXPECT_EQ(sr1, sr2);                    // seeded from (run seed, step, parameter): replayable
  EXPECT_EQ(sr1[0], nearest[0]);          // the first loss is before any update
  EXPECT_NE(sr1.back(), nearest.back());  // the updates round differently
}

TEST(RunFactory, AdapterDefaultsAreOneAndTheSame) {
  // The config's [model.adapter] is nn::AdapterOptions itself: no second set of defaults.
  EXPECT_EQ(Config{}.model.adapter.kind, nn::AdapterOptions{}.kind);
  EXPECT_EQ(Config{}.model.adapter.kind, "none");
  keel::Run r = build_run(tiny("noadapter"));
  EXPECT_EQ(r.trainable.size(), r.model->named_parameters().size());
}

TEST(RunFactory, Gpt2WithAnUntiedHeadIsRefusedNotIgnored) {
  const std::string msg =
      test::error_of([] { build_run(tiny("untied", {"model.tie_embeddings=false"})); });
  EXPECT_CONTAINS(msg, "model.tie_embeddings = false");
  EXPECT_CONTAINS(msg, "model.family = \"llama\"");
  keel::Run llama =
      build_run(tiny("untied-llama", {"model.family=llama", "model.tie_embeddings=false"}));
  EXPECT_FALSE(llama.model->spec().tie_embeddings);
}

// Llama's keys under GPT-2 built GPT-2 without them, without a word: rope_theta (GPT-2 has learned
// positions) and a grouped-query n_kv_head (GPT-2 has one key/value head per query head).
TEST(RunFactory, Gpt2WithLlamasKeysIsRefusedNotIgnored) {
  std::string msg = test::error_of([] {
    build_run(tiny("gpt2-rope", {"model.rope_theta=500000", "model.n_kv_head=1"}));
  });
  EXPECT_CONTAINS(msg,
                  "model.rope_theta = 5e+05 and model.n_kv_head = 1 with model.family = "
                  "\"gpt2\": GPT-2 has learned position embeddings (no RoPE) and one key/value "
                  "head per query head (no grouped-query attention), each n_embd / n_head wide; "
                  "remove them, or use "
                  "model.family = \"llama\"");
  msg = test::error_of([] { build_run(tiny("gpt2-gqa", {"model.n_kv_head=1"})); });
  EXPECT_CONTAINS(msg, "model.n_kv_head = 1 with model.family = \"gpt2\"");
  EXPECT_CONTAINS(msg, "remove it, or use model.family = \"llama\"");
  // n_kv_head = n_head is GPT-2's own attention; llama takes both keys.
  EXPECT_NO_THROW(build_run(tiny("gpt2-mha", {"model.n_kv_head=2"})));
  keel::Run llama = build_run(
      tiny("llama-gqa", {"model.family=llama", "model.n_kv_head=1", "model.rope_theta=500000"}));
  EXPECT_EQ(llama.model->spec().rope_theta, 500000);
  // A head width of its own is llama's (Qwen3-0.6B's); GPT-2's heads are n_embd / n_head wide.
  msg = test::error_of([] { build_run(tiny("gpt2-hd", {"model.head_dim=16"})); });
  EXPECT_CONTAINS(msg, "model.head_dim = 16 with model.family = \"gpt2\"");
  EXPECT_NO_THROW(build_run(tiny("gpt2-hd-same", {"model.head_dim=8"})));  // 16 / 2: its own
  keel::Run wide = build_run(tiny("llama-hd", {"model.family=llama", "model.head_dim=6"}));
  EXPECT_EQ(wide.model->spec().head_dim(), 6);
  EXPECT_EQ(wide.model->find_parameter("model.layers.0.self_attn.q_proj.weight").shape(),
            (Shape{2 * 6, 16}));
  EXPECT_EQ(wide.model->find_parameter("model.layers.0.self_attn.o_proj.weight").shape(),
            (Shape{16, 2 * 6}));
}

// model.path's config.json fixes the shape: a shape key set to another value was not read, and the
// run trained the file's model without a word (--set model.n_layer=7 on a 2-layer file).
TEST(RunFactory, AShapeKeyThatDisagreesWithModelPathIsRefusedNotIgnored) {
  const std::string dir = test::temp_dir("shape-keys") + "/llama";
  {
    keel::Run base = build_run(tiny("shape-keys-base", {"model.family=llama", "model.n_layer=3"}));
    io::save_hf_model(*base.model, dir);
  }
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"model.n_layer=7", "model.n_layer = 7 but model.path (" + dir + "/config.json) gives 3"},
      {"model.family=gpt2", ""},  // the default: says nothing either way
      {"model.n_head=8", "model.n_head = 8 but model.path"},
      {"model.max_seq_len=64", "model.max_seq_len = 64 but model.path"},
      {"model.rope_theta=500000", "model.rope_theta = 500000 but model.path"},
      {"model.norm_eps=1e-6", "model.norm_eps = 1e-06 but model.path"},
      {"model.head_dim=4", "model.head_dim = 4 but model.path (" + dir + "/config.json) gives 8"},
      {"model.n_layer=3", ""},   // the file's own value
      {"model.head_dim=8", ""},  // the file's 16 / 2
  };
  for (const auto& [set, expected] : cases) {
    SCOPED_TRACE(set);
    const Config cfg =
        load_config("", {"run.out_dir=" + test::temp_dir("shape-keys-run"), "model.path=" + dir,
                         set, "data.seq_len=16", "train.max_steps=1", "log.console=false",
                         "log.metrics=false", "log.tensorboard=false"});
    if (expected.empty()) {
      EXPECT_EQ(build_run(cfg).model->spec().n_layer, 3);
    } else {
      const std::string msg = test::error_of([&] { build_run(cfg); });
      EXPECT_CONTAINS(msg, expected);
      EXPECT_CONTAINS(msg, "remove " + set.substr(0, set.find('=')));
    }
  }
}

// Set shorter than data.seq_len, model.max_seq_len was raised to it without a word; left at its
// default it follows data.seq_len.
TEST(RunFactory, AModelMaxSeqLenShorterThanTheRowsIsRefusedNotRaised) {
  const std::string msg = test::error_of([] {
    build_run(tiny("short-max-seq", {"model.max_seq_len=8", "data.seq_len=16"}));
  });
  EXPECT_CONTAINS(msg, "model.max_seq_len = 8 is shorter than data.seq_len = 16");
  keel::Run run = build_run(tiny("long-rows", {"data.seq_len=200"}));
  EXPECT_EQ(run.model->spec().max_seq_len, 200);
}

// A Llama model.path trains past max_position_embeddings (RoPE has no table to run off), and says
// so.
TEST(RunFactory, RowsLongerThanALlamaFilesContextAreSaid) {
  const std::string dir = test::temp_dir("llama-context") + "/llama";
  {
    keel::Run base =
        build_run(tiny("llama-context-base", {"model.family=llama", "model.max_seq_len=16"}));
    io::save_hf_model(*base.model, dir);
  }
  EXPECT_CONTAINS(
      said_by_build(of_model_dir(dir, {"data.seq_len=32"})),
      "data.seq_len = 32 exceeds " + dir + "/config.json's max_position_embeddings = 16");
  EXPECT_NOT_CONTAINS(said_by_build(of_model_dir(dir, {"data.seq_len=16"})),
                      "max_position_embeddings");
}

// A weight of 1e5 in model.path (a checkpoint whose weights grew) under 16-mixed: its f16 copy in
// the matmul is inf and the first step is non-finite, with nothing named. The run now says which
// tensor, the value, where, and the fix; bf16-mixed and 32-true hold it and say nothing.
TEST(RunFactory, AWeightBeyondF16IsNamedUnderTheF16Policies) {
  const std::string dir = test::temp_dir("huge-weight") + "/llama";
  {
    keel::Run base = build_run(tiny("huge-weight-base", {"model.family=llama"}));
    for (auto& [name, p] : base.model->named_parameters())
      if (name == "model.layers.0.mlp.down_proj.weight") p.data_as<float>()[17] = 1e5f;
    io::save_hf_model(*base.model, dir);
  }
  auto said = [&](const std::string& precision) {
    return said_by_build(of_model_dir(dir, {"train.precision=" + precision, "data.seq_len=16"}));
  };
  const std::string mixed = said("16-mixed");
  EXPECT_CONTAINS(mixed,
                  "warning: model.layers.0.mlp.down_proj.weight holds 1 value beyond f16's "
                  "largest finite 65504 (the first 100000 at [0, 17] in " +
                      dir + "/model.safetensors): train.precision = 16-mixed");
  EXPECT_CONTAINS(mixed, "switch train.precision to bf16-mixed");
  // The file's value, not the f16 parameter's inf.
  EXPECT_CONTAINS(said("16-true"), "(the first 100000 at [0, 17] in " + dir +
                                       "/model.safetensors): train.precision = 16-true");
  EXPECT_NOT_CONTAINS(said("bf16-mixed"), "beyond f16");
  EXPECT_NOT_CONTAINS(said("32-true"), "beyond f16");
}

// The same for GPT-2, whose HF files store the Conv1D weights [in, out] (transposed on load), under
// a bf16 base: 1e5 at [0, 77] of the file's transformer.h.0.mlp.c_fc.weight was named as "the first
// 99840 at [77, 0]", keel's transposed index and the bf16 base's rounding, a value and a place the
// user's file does not hold. A keel checkpoint keeps keel's layout: its index stays.
TEST(RunFactory, AGpt2WeightBeyondF16IsNamedAtTheFilesIndexAndValue) {
  const std::string dir = test::temp_dir("huge-weight-gpt2") + "/gpt2";
  {
    keel::Run base = build_run(tiny("huge-weight-gpt2-base", {"model.n_embd=64"}));
    for (auto& [name, p] : base.model->named_parameters())
      if (name == "transformer.h.0.mlp.c_fc.weight") {
        ASSERT_EQ(p.shape(), (Shape{256, 64}));
        p.data_as<float>()[77 * 64 + 0] = 1e5f;  // keel's [77, 0]: the file's [0, 77]
      }
    io::save_hf_model(*base.model, dir);
  }
  const std::string said = said_by_build(
      of_model_dir(dir, {"model.adapter.kind=lora", "model.adapter.target_modules=[\"c_attn\"]",
                         "model.base_dtype=bf16", "train.precision=16-mixed", "data.seq_len=16"}));
  EXPECT_CONTAINS(said,
                  "warning: transformer.h.0.mlp.c_fc.weight holds 1 value beyond f16's largest "
                  "finite 65504 (the first 100000 at [0, 77] in " +
                      dir + "/model.safetensors): train.precision = 16-mixed");
  EXPECT_NOT_CONTAINS(said, "99840");
}

// A warmup as long as the run never reaches optim.lr nor decays: said (it ran without a word).
TEST(RunFactory, AWarmupAsLongAsTheRunIsSaid) {
  EXPECT_CONTAINS(
      said_by_build(tiny("warmup-long", {"sched.warmup_steps=10", "train.max_steps=3"})),
      "note: the warmup (10 steps, sched.warmup_steps / sched.warmup_ratio) is not shorter than "
      "the run (3 steps): the learning rate peaks at");
  EXPECT_NOT_CONTAINS(
      said_by_build(tiny("warmup-short", {"sched.warmup_steps=2", "train.max_steps=3"})), "warmup");
}

// Adapter keys without an adapter kind trained every parameter without a word.
TEST(RunFactory, AdapterKeysWithoutAnAdapterKindAreSaid) {
  EXPECT_CONTAINS(
      said_by_build(tiny("adapter-none", {"model.adapter.r=32", "model.adapter.dropout=0.05"})),
      "note: [model.adapter] r, dropout set, but model.adapter.kind = \"none\": this run trains "
      "every parameter");
  EXPECT_NOT_CONTAINS(
      said_by_build(tiny("adapter-lora",
                         {"model.family=llama", "model.adapter.kind=lora", "model.adapter.r=32"})),
      "[model.adapter]");
}

// data.task = "tokens" with GPT-2's tokenizer (no pad token) grew the embeddings by a pad row
// (data.pad = "add") that packed rows never use: their only padding, the last row's tail, is
// masked by position; packed text is cut the same way (CliTokenize.OutputTrainsAsTheTextPacked).
// Unpacked text still adds it (CliExport.AnAdapterOfARunThatGrewTheVocabulary...).
TEST(RunFactory, PackedTokenRowsDoNotGrowTheVocabularyForAPad) {
  const std::string dir = test::temp_dir("tokens-pad");
  const std::string tokenizer =
      "gpt2:" + std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";
  const std::string text = "the quick brown fox jumps over the lazy dog, then it ran again\n";
  const auto tok = data::load_tokenizer(tokenizer);
  ASSERT_LT(tok->pad_id(), 0);
  std::ofstream(dir + "/corpus.bin", std::ios::binary)
      << data::token_file_bytes(tok->encode(text), tok->vocab_size());
  auto build = [&](const std::string& task, const std::string& file, std::string* said) {
    RunOptions opt;
    opt.say = [&](const std::string& m) { *said += m + "\n"; };
    return build_run(tiny("tokens-pad-" + task,
                          {"data.task=" + task, "data.path=" + dir + file,
                           "data.tokenizer=" + tokenizer, "data.seq_len=8", "train.batch_size=2"}),
                     opt);
  };
  std::string said;
  keel::Run tokens = build("tokens", "/corpus.bin", &said);
  EXPECT_EQ(tokens.model->spec().vocab_size, tok->vocab_size()) << said;
  EXPECT_NOT_CONTAINS(said, "embeddings resized");
  EXPECT_GE(tokens.data.pad_id, 0);
  EXPECT_LT(tokens.data.pad_id, tok->vocab_size());
  // A checkpoint of a keel that gave packed rows data.pad = "add"'s row is resumed with it: its
  // tensors have the row (the resume failed on [288, 64] against [287, 64]).
  Config resumed =
      tiny("tokens-pad-resume",
           {"data.task=tokens", "data.path=" + dir + "/corpus.bin", "data.tokenizer=" + tokenizer,
            "data.seq_len=8", "train.batch_size=2", "run.resume=true"});
  fs::create_directories(resumed.run.out_dir + "/checkpoints/last");
  std::ofstream(resumed.run.out_dir + "/checkpoints/last/config.json")
      << R"({"model_type": "gpt2", "vocab_size": )" << tok->vocab_size() + 1 << "}";
  said.clear();
  RunOptions opt;
  opt.say = [&](const std::string& m) { said += m + "\n"; };
  keel::Run old = build_run(resumed, opt);
  EXPECT_EQ(old.model->spec().vocab_size, tok->vocab_size() + 1) << said;
  EXPECT_EQ(old.data.pad_id, tok->vocab_size());
}

// data.eval_path naming data.path's file (also by another spelling) validated on the training
// data without a word: said, as HF Trainer users expect a warning.
TEST(RunFactory, AnEvalPathThatIsTheTrainingFileIsSaid) {
  const std::string dir = test::temp_dir("eval-is-train");
  const std::string txt = dir + "/corpus.txt", other = dir + "/held-out.txt";
  std::ofstream(txt) << "the quick brown fox jumps over the lazy dog\n\nanother paragraph\n";
  std::ofstream(other) << "a held-out paragraph\n";
  auto said = [&](const std::string& eval_path) {
    return said_by_build(
        tiny("eval-is-train-run", {"data.task=text", "data.tokenizer=byte", "data.path=" + txt,
                                   "data.eval_path=" + eval_path}));
  };
  for (const std::string& same : {txt, dir + "/./corpus.txt"})
    EXPECT_CONTAINS(said(same), "note: data.eval_path = " + same +
                                    " is the training file data.path = " + txt +
                                    ": the eval loss is measured on the data the run trains on");
  EXPECT_NOT_CONTAINS(said(other), "is the training file");
}

// Keys the run's other choices leave unread trained as without them, without a word: [scaler]
// under a precision without a scaler (or with it disabled), the arith task's keys under another
// task, a base dtype without an adapter, allow_cpu_bf16 beside an explicit precision, and fault
// injection keys without a module (or a factor without kind = "scale").
TEST(RunFactory, KeysTheRunsOtherChoicesLeaveUnreadAreSaid) {
  EXPECT_CONTAINS(
      said_by_build(tiny("scaler-bf16", {"train.precision=bf16-mixed", "scaler.init_scale=1024",
                                         "scaler.hysteresis=2"})),
      "note: scaler.init_scale = 1024.0, scaler.hysteresis = 2 set, but this run's "
      "precision, bf16-mixed, has no loss scaler (16-mixed alone has one), so "
      "[scaler] does nothing");
  EXPECT_CONTAINS(
      said_by_build(tiny("scaler-off", {"train.precision=16-mixed", "scaler.enabled=false",
                                        "scaler.growth_interval=10"})),
      "note: scaler.growth_interval = 10 set, but scaler.enabled = false turns the "
      "loss scaler off, so the rest of [scaler] does nothing");
  const std::string dir = test::temp_dir("unread-keys");
  { std::ofstream(dir + "/t.txt") << "one paragraph\n\nanother paragraph\n"; }
  EXPECT_CONTAINS(
      said_by_build(
          tiny("arith-keys", {"data.task=text", "data.path=" + dir + "/t.txt", "data.digits=4"})),
      "note: data.num_examples = 32, data.eval_examples = 4, data.digits = 4 set, but data.task = "
      "\"text\": these keys "
      "shape the built-in arith task only (this task's validation split is data.eval_path or "
      "data.eval_fraction)");
  EXPECT_CONTAINS(said_by_build(tiny("base-dtype", {"model.base_dtype=bf16"})),
                  "note: model.base_dtype = \"bf16\" set, but model.adapter.kind = \"none\": it "
                  "stores a base frozen under an adapter; every parameter of this run trains in "
                  "f32");
  EXPECT_CONTAINS(said_by_build(tiny("cpu-bf16", {"train.allow_cpu_bf16=true"})),
                  "note: train.allow_cpu_bf16 = true set, but train.precision = \"32-true\": it "
                  "lets precision = \"auto\" alone pick bf16-mixed");
  EXPECT_CONTAINS(said_by_build(tiny("inject-none", {"debug.inject.step=2"})),
                  "note: debug.inject.step = 2 set, but debug.inject.module = \"\": nothing is "
                  "injected");
  EXPECT_CONTAINS(
      said_by_build(tiny("inject-nan", {"debug.inject.module=transformer.h.0",
                                        "debug.inject.step=2", "debug.inject.factor=3"})),
      "note: debug.inject.factor = 3.0 set, but debug.inject.kind = \"nan\": the factor "
      "multiplies the output under kind = \"scale\" only");
  // The tracer's keys without the tracer (abort_after_batch_num = 2 ran to the end), and
  // train.epochs beside a train.max_steps that sets the length: both trained as without them.
  EXPECT_CONTAINS(
      said_by_build(tiny("tracer-off", {"debug.underflow_overflow.abort_after_batch_num=2",
                                        "debug.underflow_overflow.trace_batch_nums=[1]"})),
      "note: debug.underflow_overflow.trace_batch_nums = [1], "
      "debug.underflow_overflow.abort_after_batch_num = 2 set, but "
      "debug.underflow_overflow.enabled = false: the tracer is off, so it neither "
      "traces nor stops the run");
  // The byte tokenizer has a pad token of its own (256): data.pad has nothing to decide.
  EXPECT_CONTAINS(said_by_build(tiny("pad-unread", {"data.pad=eos"})),
                  "note: data.pad = \"eos\" set, but the tokenizer has a pad token of its own "
                  "(id 256), which padding uses");
  EXPECT_CONTAINS(said_by_build(tiny("force-alone", {"run.resume_force=true"})),
                  "note: run.resume_force = true set, but run.resume = false: nothing is resumed");
  EXPECT_CONTAINS(said_by_build(tiny("epochs-unread", {"train.max_steps=3", "train.epochs=5"})),
                  "note: train.epochs = 5 set, but train.max_steps = 3 sets the run's length");
  EXPECT_NOT_CONTAINS(
      said_by_build(tiny("tracer-on", {"debug.underflow_overflow.enabled=true",
                                       "debug.underflow_overflow.abort_after_batch_num=2",
                                       "train.max_steps=0", "train.epochs=2"})),
      "set, but");
  // Where they act, nothing is said.
  EXPECT_NOT_CONTAINS(
      said_by_build(
          tiny("acting", {"train.precision=16-mixed", "scaler.init_scale=1024", "data.digits=3",
                          "debug.inject.module=transformer.h.0", "debug.inject.step=2",
                          "debug.inject.kind=scale", "debug.inject.factor=3"})),
      "set, but");
  EXPECT_NOT_CONTAINS(
      said_by_build(tiny("acting-auto", {"train.precision=auto", "train.allow_cpu_bf16=true"})),
      "set, but");
}

// model.init_std beside model.path: the weights are the file's, and a run that set it to study a
// wider init trained the file's weights without a word.
TEST(RunFactory, InitStdBesideAModelPathIsSaid) {
  const std::string dir = test::temp_dir("init-std-path") + "/base";
  {
    keel::Run base = build_run(tiny("init-std-base"));
    io::save_hf_model(*base.model, dir);
  }
  EXPECT_CONTAINS(said_by_build(tiny("init-std-run", {"model.path=" + dir, "model.init_std=0.5"})),
                  "note: model.init_std = 0.5 set, but model.path's weights are loaded, not "
                  "drawn: it scales a random init only");
  EXPECT_NOT_CONTAINS(said_by_build(tiny("init-std-random", {"model.init_std=0.5"})), "set, but");
}

// debug.inject.step past the run's last step injected nothing, without a word.
TEST(RunFactory, AnInjectionPastTheLastStepIsSaid) {
  EXPECT_CONTAINS(said_by_build(tiny("inject-late", {"debug.inject.module=transformer.h.0",
                                                     "debug.inject.step=100"})),
                  "note: debug.inject.step = 100 is past the run's last step (3): nothing is "
                  "injected; set it to a step from 1 to 3");
  EXPECT_NOT_CONTAINS(said_by_build(tiny("inject-in-run", {"debug.inject.module=transformer.h.0",
                                                           "debug.inject.step=3"})),
                      "debug.inject.step");
}

// The tracer's batch numbers past the run's last step neither stopped nor traced, without a word
// (said as the injection's step is, by the same code).
TEST(RunFactory, TracerBatchNumbersPastTheLastStepAreSaid) {
  const std::string on = "debug.underflow_overflow.enabled=true";
  EXPECT_CONTAINS(
      said_by_build(tiny("abort-late", {on, "debug.underflow_overflow.abort_after_batch_num=50"})),
      "note: debug.underflow_overflow.abort_after_batch_num = 50 is past the run's last step (3): "
      "the run ends at its last step without the tracer's stop; set it to a step from 1 to 3");
  EXPECT_CONTAINS(
      said_by_build(
          tiny("trace-late", {on, "debug.underflow_overflow.trace_batch_nums=[2, 7, 9]"})),
      "note: debug.underflow_overflow.trace_batch_nums holds 7, 9, past the run's last step (3): "
      "those batches are never traced; set steps from 1 to 3");
  EXPECT_NOT_CONTAINS(
      said_by_build(tiny("tracer-in-run", {on, "debug.underflow_overflow.abort_after_batch_num=2",
                                           "debug.underflow_overflow.trace_batch_nums=[1, 3]"})),
      "past the run's last step");
}

TEST(RunFactory, KeepCheckpointsWithoutCheckpointEveryIsSaid) {
  EXPECT_CONTAINS(said_by_build(tiny("keep-none", {"log.keep_checkpoints=3"})),
                  "note: log.keep_checkpoints = 3 keeps the newest checkpoints/step-N "
                  "directories, but log.checkpoint_every = 0 writes none");
  EXPECT_NOT_CONTAINS(
      said_by_build(tiny("keep-every", {"log.keep_checkpoints=3", "log.checkpoint_every=10"})),
      "log.keep_checkpoints");
}

TEST(RunFactory, MissingTrainingDataIsNamedWhenOptionalAndAnErrorOtherwise) {
  const std::string dir = test::temp_dir("nodata");
  const std::string text = dir + "/corpus.txt";
  std::ofstream(text) << "one line of text to train on\nand another\n";
  Config c = tiny("nodata-run", {"data.task=text", "data.path=" + text});
  std::filesystem::remove(text);
  EXPECT_CONTAINS(test::error_of([&] { build_run(c); }), text);
  RunOptions o;
  o.data_optional = true;
  keel::Run r = build_run(c, o);
  ASSERT_EQ(r.not_rebuilt.size(), 1u);
  EXPECT_CONTAINS(r.not_rebuilt[0], "data.path = " + text);
  EXPECT_EQ(r.loader, nullptr);
  ASSERT_NE(r.model, nullptr);  // the model does not depend on the data
}

TEST(RunFactory, TrainerOverABuiltRunTrainsAsTrainerOverItsConfig) {
  auto losses = [](Trainer& t) {
    std::vector<double> out;
    for (int64_t s = 0; s < 3; ++s) out.push_back(t.train_step({t.loader().batch(0, s)}, 0).loss);
    return out;
  };
  Trainer a(tiny("same-a"));
  Trainer b(build_run(tiny("same-b")), TrainerHooks{});
  EXPECT_EQ(losses(a), losses(b));
}

}  // namespace
}  // namespace keel
