// `keel export` round trips for both families and every adapter kind: checkpoint -> HF directory
// (adapters merged) -> io::load_hf_model gives the checkpoint's logits (f32: to rounding; bf16:
// within bf16's precision), sharded or not; --adapter-only -> base + PEFT directory gives them
// bit for bit; PyTorch's reference forward of the export (tests/fixtures/hf_forward.py, when
// python3-torch is installed) agrees; tokenizer files and ids travel; bad flags are usage errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "keel/autograd/node.h"
#include "keel/io/hf_model.h"
#include "keel/io/trained_model.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::vector<int64_t> kIds = {49, 50, 43, 51, 52, 61, 10, 7, 200};

// A tiny HF base of `family` (vocab 259) and a 6-step fine-tune of it with `kind` adapters;
// `bf16_base`: its base held in bf16 (model.base_dtype) under bf16-mixed. "qwen3-wide": a Qwen3
// whose heads are 16 wide over 32 / 4 (Qwen3-0.6B's head_dim).
std::string trained_run(const std::string& family, const std::string& kind,
                        bool bf16_base = false) {
  const std::string dir =
      test::temp_dir("export-" + family + "-" + kind + (bf16_base ? "-bf16" : ""));
  const bool wide = family == "qwen3-wide", phi4_mini = family == "phi4m";
  const bool yarn = family == "llama-yarn", falcon_7b = family == "falcon-7b";
  const bool qk = family.ends_with("-qk");  // with --qk-layernorm
  std::vector<std::string> init = {"init-model", "--family",
                                   wide        ? "qwen3"
                                   : phi4_mini ? "phi3"
                                   : yarn      ? "llama"
                                   : falcon_7b ? "falcon"
                                   : qk        ? family.substr(0, family.size() - 3)
                                               : family,
                                   "--out", dir + "/base"};
  if (qk) init.push_back("--qk-layernorm");
  init.insert(init.end(),
              {"--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--max-seq-len", "32"});
  // (GPT-NeoX's and GPT-J's key/value heads are their query heads; Falcon-7B's one is its
  // multi_query)
  if (family != "gpt2" && family != "gpt_neox" && family != "gptj" && family != "codegen")
    init.insert(init.end(), {"--n-kv-head", falcon_7b || family == "gpt_bigcode" ? "1" : "2"});
  // (Gemma, Phi-4-mini and Falcon-7B tie their head)
  if (family != "gpt2" && !family.starts_with("gemma") && !phi4_mini && family != "smollm3" &&
      !family.starts_with("cohere") && !falcon_7b && family != "starcoder2" &&
      family != "gpt_bigcode")
    init.push_back("--untied");
  if (wide) init.insert(init.end(), {"--head-dim", "16"});
  const test::KeelRun b = test::run_keel(init);
  EXPECT_EQ(b.code, 0) << b.output;
  if (phi4_mini) {  // its RoPE turns 6 of each head's 8 channels, longrope past 4 positions
    json cfg = json::parse(test::slurp(dir + "/base/config.json"));
    cfg["partial_rotary_factor"] = 0.75;
    cfg["rope_scaling"] = {
        {"type", "longrope"}, {"short_factor", {1.0, 1.25, 1.5}}, {"long_factor", {2.0, 3.0, 7.0}}};
    cfg["original_max_position_embeddings"] = 4;
    std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  }
  if (yarn) {  // factor 4 over max_position_embeddings 32: pair 0 kept, 1 to 3 interpolated
    json cfg = json::parse(test::slurp(dir + "/base/config.json"));
    cfg["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
    std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  }
  if (family == "olmo3") {  // layer 0 sliding over 5 positions, unscaled; layer 1 full, YaRN's
    json cfg = json::parse(test::slurp(dir + "/base/config.json"));
    cfg.erase("rope_parameters");  // (keel's own: the older form alone is edited here)
    cfg["sliding_window"] = 5;
    cfg["layer_types"] = {"sliding_attention", "full_attention"};
    cfg["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
    std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  }
  // layer 0 sliding over 5 positions and rotating; layer 1 full, NoPE
  if (family == "exaone4" || family == "cohere2") {
    json cfg = json::parse(test::slurp(dir + "/base/config.json"));
    cfg["sliding_window"] = 5;
    cfg["layer_types"] = {"sliding_attention", "full_attention"};
    std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  }
  if (family == "smollm3") {  // its second layer without RoPE (its every 4th of 36)
    json cfg = json::parse(test::slurp(dir + "/base/config.json"));
    cfg["no_rope_layers"] = {1, 0};
    cfg["no_rope_layer_interval"] = 2;
    std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  }
  // (Mixtral's experts name their down projection w2; a mixture's down_proj are its experts')
  const std::string targets =
      family == "gpt2" || family == "gpt_bigcode" ? "[\"c_attn\", \"c_fc\"]"
      : family == "glm4"                          ? "[\"q_proj\", \"v_proj\", \"gate_up_proj\"]"
      : family == "phi3" || phi4_mini ? "[\"qkv_proj\", \"gate_up_proj\", \"down_proj\"]"
      : family == "phi"               ? "[\"q_proj\", \"v_proj\", \"fc2\"]"
      : family == "gptj"              ? "[\"q_proj\", \"out_proj\", \"fc_in\"]"
      : family == "codegen"           ? "[\"qkv_proj\", \"fc_out\"]"
      : family == "starcoder2"        ? "[\"q_proj\", \"v_proj\", \"c_fc\"]"
      : family == "gpt_neox" || family == "falcon" ? "[\"query_key_value\", \"dense_4h_to_h\"]"
      : family == "mixtral"                        ? "[\"q_proj\", \"v_proj\", \"w2\", \"gate\"]"
                                                   : "[\"q_proj\", \"v_proj\", \"down_proj\"]";
  std::ofstream(dir + "/c.toml") << "[run]\nout_dir = \"" << dir
                                 << "/out\"\nthreads = 1\n[model]\npath = \"" << dir << "/base\"\n"
                                 << (bf16_base ? "base_dtype = \"bf16\"\n" : "")
                                 << "[model.adapter]\nkind = \"" << kind
                                 << "\"\nr = 4\ntarget_modules = " << targets
                                 << "\n[data]\nnum_examples = 64\neval_examples = 4\nseq_len = "
                                    "24\n[train]\nbatch_size = 8\nmax_steps = 6\n"
                                 << (bf16_base ? "precision = \"bf16-mixed\"\n" : "")
                                 << "[optim]\nlr = 5e-2\n[log]\ntensorboard = false\n";
  const test::KeelRun r = test::run_keel({"train", dir + "/c.toml"}, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 0) << r.output;
  return dir;
}

std::vector<float> logits_of(models::CausalLM& m) {
  NoGradGuard g;
  m.train(false);
  return m.forward(Tensor::from_ints(kIds, {1, static_cast<int64_t>(kIds.size())}), Tensor())
      .to_floats();
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double scale = max_abs(want);
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (std::fabs(got[i] - want[i]) > tol * scale && ++bad <= 5)
      ADD_FAILURE() << what << " [" << i << "]: " << got[i] << " vs " << want[i];
}

void keel_export(const std::vector<std::string>& args) {
  std::vector<std::string> a = {"export"};
  a.insert(a.end(), args.begin(), args.end());
  const test::KeelRun r = test::run_keel(a);
  ASSERT_EQ(r.code, 0) << r.output;
}

class CliExport : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(CliExport, MergedAndAdapterOnlyExportsGiveTheCheckpointsLogits) {
  const auto& [family, kind] = GetParam();
  const std::string dir = trained_run(family, kind), ckpt = dir + "/out/checkpoints/last";
  io::TrainedModel t = io::load_trained_model(ckpt);
  ASSERT_TRUE(t.adapter);
  const std::vector<float> want = logits_of(*t.model);  // the adapted model, unmerged

  // Merged, f32, one file and sharded.
  keel_export({ckpt, "--out", dir + "/f32"});
  keel_export({dir + "/out", "--out", dir + "/sharded", "--max-shard-size", "20KB"});
  const std::vector<float> f32 = logits_of(*io::load_hf_model(dir + "/f32"));
  expect_close(f32, want, 1e-5, family + " " + kind + " merged f32");
  EXPECT_EQ(logits_of(*io::load_hf_model(dir + "/sharded")), f32);
  EXPECT_TRUE(fs::exists(dir + "/sharded/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir + "/sharded/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/f32/adapter_config.json"));
  const json cfg = json::parse(test::slurp(dir + "/f32/config.json"));
  EXPECT_EQ(cfg["eos_token_id"], 258);  // the byte tokenizer's ids travel
  EXPECT_FALSE(cfg.contains("keel_checkpoint"));

  // Merged, bf16: the weights rounded once.
  keel_export({ckpt, "--out", dir + "/bf16", "--dtype", "bf16"});
  EXPECT_EQ(json::parse(test::slurp(dir + "/bf16/config.json"))["torch_dtype"], "bfloat16");
  expect_close(logits_of(*io::load_hf_model(dir + "/bf16")), want, 3e-2,
               family + " " + kind + " merged bf16");
  expect_close(logits_of(*io::load_hf_model(dir + "/bf16", DType::BF16)), want, 6e-2,
               family + " " + kind + " merged bf16 loaded as bf16");

  // Unmerged: the PEFT directory on the base is the checkpoint's model, bit for bit.
  keel_export({ckpt, "--out", dir + "/peft", "--adapter-only"});
  io::TrainedModel p = io::load_trained_model(dir + "/base", dir + "/peft");
  EXPECT_EQ(logits_of(*p.model), want);
  EXPECT_EQ(json::parse(test::slurp(dir + "/peft/adapter_config.json"))["base_model_name_or_path"],
            dir + "/base");
  // ... and exporting that pair merged equals exporting the checkpoint.
  keel_export({dir + "/base", "--adapter", dir + "/peft", "--out", dir + "/pair"});
  EXPECT_EQ(logits_of(*io::load_hf_model(dir + "/pair")), f32);
}

// A run that held its base in bf16: a bf16 export merges into that base as held (an 8B base is
// never built in f32 for it), and each weight is the f32 export's rounded once, bit for bit.
TEST_P(CliExport, ABf16BaseMergedInBf16IsTheF32MergeRoundedOnce) {
  const auto& [family, kind] = GetParam();
  const std::string dir = trained_run(family, kind, /*bf16_base=*/true);
  keel_export({dir + "/out", "--out", dir + "/f32"});
  keel_export({dir + "/out", "--out", dir + "/bf16", "--dtype", "bf16"});
  const io::Safetensors f32 = io::read_safetensors(dir + "/f32/model.safetensors");
  const io::Safetensors bf16 = io::read_safetensors(dir + "/bf16/model.safetensors");
  ASSERT_EQ(f32.tensors.size(), bf16.tensors.size());
  for (const auto& [name, want] : f32.tensors) {
    const Tensor* got = bf16.find(name);
    ASSERT_TRUE(got) << name;
    ASSERT_EQ(got->dtype(), DType::BF16) << name;
    const Tensor rounded = want.to_dtype(DType::BF16);
    ASSERT_EQ(got->nbytes(), rounded.nbytes()) << name;
    EXPECT_EQ(std::memcmp(got->data(), rounded.data(), rounded.nbytes()), 0)
        << family << " " << kind << ": " << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Adapters, CliExport,
                         ::testing::Combine(::testing::Values("gpt2", "llama"),
                                            ::testing::Values("lora", "dora", "lokr")),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param);
                         });

// An adapter run whose model.path is an adapter run's checkpoint trains on that checkpoint with
// its adapters merged; its PEFT export names the checkpoint as base_model_name_or_path. Loading
// that pair was refused ("already carries the lora adapters it was trained with"): the export
// could not be used at all. It now gives the second run's logits bit for bit, as for an HF base.
TEST(CliExport, AnAdapterTrainedOnAnAdapterCheckpointExportsAndLoadsOnIt) {
  const std::string dir = trained_run("gpt2", "lora"), first = dir + "/out/checkpoints/last";
  std::ofstream(dir + "/c2.toml") << "[run]\nout_dir = \"" << dir
                                  << "/out2\"\nthreads = 1\n[model]\npath = \"" << first
                                  << "\"\n[model.adapter]\nkind = \"dora\"\nr = 2\n"
                                     "target_modules = [\"c_attn\", \"c_proj\"]\n[data]\n"
                                     "num_examples = 32\neval_examples = 0\nseq_len = 24\n[train]\n"
                                     "batch_size = 8\nmax_steps = 2\n[optim]\nlr = 5e-2\n[log]\n"
                                     "tensorboard = false\n";
  const test::KeelRun r = test::run_keel({"train", dir + "/c2.toml"}, {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  io::TrainedModel second = io::load_trained_model(dir + "/out2");
  ASSERT_TRUE(second.adapter);
  const std::vector<float> want = logits_of(*second.model);

  keel_export({dir + "/out2", "--out", dir + "/peft2", "--adapter-only"});
  EXPECT_EQ(json::parse(test::slurp(dir + "/peft2/adapter_config.json"))["base_model_name_or_path"],
            first);
  io::TrainedModel pair = io::load_trained_model(first, dir + "/peft2");
  ASSERT_TRUE(pair.adapter);
  EXPECT_EQ(pair.adapter->kind, "dora");
  EXPECT_EQ(logits_of(*pair.model), want);
  keel_export({first, "--adapter", dir + "/peft2", "--out", dir + "/pair"});
  keel_export({dir + "/out2", "--out", dir + "/merged"});
  EXPECT_EQ(logits_of(*io::load_hf_model(dir + "/pair")),
            logits_of(*io::load_hf_model(dir + "/merged")));
  // An adapter trained on another base is still refused on a checkpoint that has its own.
  const std::string m =
      test::error_of([&] { io::load_trained_model(dir + "/out2", dir + "/out/adapter"); });
  EXPECT_CONTAINS(m, "already carries the dora adapters");
  // The pair's --adapter-only export is the same adapter on the same base: it named the first
  // run's HF base, where it is another model (and the checkpoint refused it).
  keel_export({first, "--adapter", dir + "/peft2", "--adapter-only", "--out", dir + "/peft3"});
  EXPECT_EQ(json::parse(test::slurp(dir + "/peft3/adapter_config.json"))["base_model_name_or_path"],
            first);
  EXPECT_EQ(logits_of(*io::load_trained_model(first, dir + "/peft3").model), want);
  // The checkpoint is read once for the pair (it was loaded with its adapters, then again to
  // merge them), so --base reaches that one read: the second ignored it and refused a base that
  // had moved, though --base said where it is.
  fs::rename(dir + "/base", dir + "/moved");
  const io::TrainedModel moved = io::load_trained_model(
      first, dir + "/peft2", DType::F32, ops::AttentionBackend::kEager, {}, dir + "/moved");
  EXPECT_EQ(logits_of(*moved.model), want);
}

// A tokenizer without a pad token (data.pad = "add") grows the adapter run's vocabulary by a pad
// row the base lacks. The PEFT directory held only the adapters: on its base the model computed
// logits one row short, and keel eval of the pair gave another loss than the run (5.5736 vs
// 5.5770). It now carries the embedding as PEFT's save_embedding_layers does, and the pair is the
// run's model bit for bit.
TEST(CliExport, AnAdapterOfARunThatGrewTheVocabularyGivesItsLogitsOnItsBase) {
  const std::string dir = test::temp_dir("export-pad-add");
  fs::create_directories(dir + "/tok");
  fs::copy_file(
      std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny/llama_style/tokenizer.json",
      dir + "/tok/tokenizer.json");
  std::ofstream(dir + "/tok/tokenizer_config.json") << R"({"eos_token": "<|eot|>"})";
  std::ofstream(dir + "/text.txt") << "the quick brown fox\n\njumps over the lazy dog\n";
  for (const bool untied : {false, true}) {
    SCOPED_TRACE(untied ? "untied" : "tied");
    const std::string d = dir + (untied ? "/untied" : "/tied");
    std::vector<std::string> init = {
        "init-model", "--family", "llama",    "--out", d + "/base",    "--n-layer", "1",
        "--n-embd",   "16",       "--n-head", "2",     "--vocab-size", "290"};
    if (untied) init.push_back("--untied");
    ASSERT_EQ(test::run_keel(init).code, 0);
    const test::KeelRun r = test::run_keel(
        test::with_sets({"train"},
                        {"run.out_dir=" + d + "/out", "run.threads=1", "model.path=" + d + "/base",
                         "data.tokenizer=hf:" + dir + "/tok", "model.adapter.kind=lora",
                         "data.task=text", "data.path=" + dir + "/text.txt", "data.seq_len=8",
                         "train.max_steps=2", "optim.lr=5e-2", "log.tensorboard=false"}),
        {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_CONTAINS(r.output, "embeddings resized from 290 to 291 rows");
    io::TrainedModel run = io::load_trained_model(d + "/out");
    const std::vector<float> want = logits_of(*run.model);
    keel_export({d + "/out", "--out", d + "/peft", "--adapter-only"});
    for (const std::string& peft : {d + "/peft", d + "/out/adapter"}) {
      io::TrainedModel pair = io::load_trained_model(d + "/base", peft);
      EXPECT_EQ(pair.model->spec().vocab_size, 291) << peft;
      EXPECT_EQ(logits_of(*pair.model), want) << peft;
    }
  }
}

TEST(CliExport, PyTorchForwardOfTheExportAgrees) {
  std::string ids;
  for (int64_t id : kIds) ids += (ids.empty() ? "" : ",") + std::to_string(id);
  std::vector<std::string> argv = {
      "/usr/bin/python3", std::string(KEEL_SOURCE_DIR) + "/tests/fixtures/hf_forward.py", ids};
  std::vector<std::pair<std::string, std::vector<float>>> cases;  // (export, checkpoint logits)
  // Qwen2 and Qwen3 fine-tuned whole, so that Qwen2's q/k/v biases and Qwen3's q/k norms are
  // trained away from their init (0, 1); a Phi-3's LoRA on its fused qkv_proj and gate_up_proj
  // merged into them, a Phi-4-mini's (its partial rotary and longrope, its tied head); a Gemma
  // whole (its 1 + w norms, the tied head of its scaled embedding) and a Gemma-2's LoRA (its
  // sandwich norms and soft caps), a Gemma-3 whole (its q/k norms), a SmolLM3's LoRA (a NoPE
  // layer of its 2), a Granite whole (its multipliers), an OLMo-2's LoRA (its norms), a Llama's
  // LoRA under YaRN rope_scaling, an OLMo-3's (a sliding layer rotating unscaled, a full one by
  // YaRN), an EXAONE-4's (its per-head q/k norms after OLMo-2's, a full layer without RoPE), the
  // mixtures of experts: a Qwen3-MoE's LoRA (its experts' down_proj), an OLMoE whole (its router
  // and experts trained), a Mixtral's LoRA (its experts' w2 and its router), a Cohere's LoRA (its
  // parallel blocks, LayerNorms without bias, adjacent-pair RoPE and logit_scale), a Phi's LoRA
  // (its biased q/v and fc2), a GPT-NeoX whole (its per-head query_key_value, biases trained), a
  // StableLM's LoRA (its biased LayerNorms and q/k/v, a quarter of each head turned), an OLMo's
  // LoRA (its LayerNorms without parameters), a GLM-4-0414's LoRA (its gate_up_proj, biased q/k/v,
  // adjacent-pair RoPE on half of each head and norms after each sublayer), a Falcon-40B-layout
  // LoRA (its query_key_value by key/value group, ln_attn and ln_mlp, an untied head) and a
  // Falcon-7B whole (its one key/value head, one norm a block, the tied head), a GPT-J's LoRA (its
  // adjacent-pair RoPE on a quarter of each head, the biased fc_in and lm_head), a Command-R+
  // layout's LoRA (its q/k norms a weight per head), a StableLM and a Phi with q/k LayerNorms
  // trained whole (their norms trained away from 1), a CodeGen's LoRA (on its qkv_proj of 4
  // blocks), a StarCoder2's LoRA (its biased projections and gelu MLP, the tied head), a
  // GPT-BigCode's LoRA (its multi_query c_attn in nn.Linear's layout).
  for (const auto& [family, kind] : std::vector<std::pair<std::string, std::string>>{
           {"gpt2", "lora"},       {"llama", "lora"},       {"phi3", "lora"},
           {"phi4m", "lora"},      {"gemma", "none"},       {"gemma2", "lora"},
           {"gemma3", "none"},     {"qwen2", "none"},       {"qwen3", "none"},
           {"qwen3-wide", "none"}, {"smollm3", "lora"},     {"granite", "none"},
           {"olmo2", "lora"},      {"llama-yarn", "lora"},  {"olmo3", "lora"},
           {"exaone4", "lora"},    {"qwen3_moe", "lora"},   {"olmoe", "none"},
           {"mixtral", "lora"},    {"cohere", "lora"},      {"qwen2_moe", "lora"},
           {"cohere2", "lora"},    {"phi", "lora"},         {"gpt_neox", "none"},
           {"stablelm", "lora"},   {"olmo", "lora"},        {"glm4", "lora"},
           {"falcon", "lora"},     {"falcon-7b", "none"},   {"gptj", "lora"},
           {"cohere-qk", "lora"},  {"stablelm-qk", "none"}, {"phi-qk", "none"},
           {"codegen", "lora"},    {"starcoder2", "lora"},  {"gpt_bigcode", "lora"}}) {
    const std::string dir = trained_run(family, kind);
    const std::vector<float> want =
        logits_of(*io::load_trained_model(dir + "/out/checkpoints/last").model);
    for (const std::string dtype : {"f32", "bf16"}) {
      const std::string out = dir + "/hf-" + dtype;
      keel_export({dir + "/out", "--out", out, "--dtype", dtype, "--max-shard-size", "30KB"});
      argv.push_back(out);
      cases.emplace_back(out, want);
    }
  }
  const test::KeelRun r = test::run_command(argv);  // one interpreter for every export
  if (r.code == 77)
    GTEST_SKIP() << "python3-torch is not installed (KEEL_WITH_TORCH=1 scripts/install-deps.sh)";
  ASSERT_EQ(r.code, 0) << r.output;
  const json all = json::parse(r.out);
  for (const auto& [out, want] : cases) {
    std::vector<float> torch_logits;
    for (auto& row : all.at(out))
      for (auto& v : row) torch_logits.push_back(v.get<float>());
    // PyTorch reads the same stored weights as keel: they agree to rounding, and to the
    // checkpoint within the export's rounding (none for f32).
    expect_close(torch_logits, logits_of(*io::load_hf_model(out)), 1e-5, out + ": torch vs keel");
    const bool bf16 = out.size() > 4 && out.substr(out.size() - 4) == "bf16";
    // (OLMo-2's norms after each sublayer scale a sublayer's small outputs, bf16's weight
    // rounding with them: up to 4% of the largest logit in this tiny model, against 3% for the
    // pre-norm models.)
    const bool post_norms = out.find("export-olmo2") != std::string::npos ||
                            out.find("export-olmo3") != std::string::npos ||
                            out.find("export-exaone4") != std::string::npos;
    expect_close(torch_logits, want, bf16 ? (post_norms ? 6e-2 : 3e-2) : 1e-5,
                 out + ": torch vs the checkpoint");
  }
}

// A run on OpenAI's GPT-2 files (encoder.json + vocab.bpe) exported them under those names, which
// transformers' GPT-2 tokenizer does not read (vocab.json + merges.txt: the same bytes).
// A short text run into DIR/out with data.tokenizer = `tokenizer` (keel's "gpt2:DIR" / "hf:DIR").
void train_on_text(const std::string& dir, const std::string& tokenizer, int steps) {
  std::ofstream(dir + "/text.txt") << std::string(40, 'x') + " the quick brown fox jumps\n";
  const test::KeelRun r = test::run_keel(
      test::with_sets({"train"}, {"run.out_dir=" + dir + "/out", "run.threads=1", "data.task=text",
                                  "data.path=" + dir + "/text.txt", "data.tokenizer=" + tokenizer,
                                  "data.seq_len=8", "train.max_steps=" + std::to_string(steps),
                                  "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
}

TEST(CliExport, Gpt2TokenizerFilesGetTransformersNames) {
  const std::string dir = test::temp_dir("export-gpt2-tok");
  const std::string tiny = dir + "/tok";  // the parity test's files, with an eos token
  const std::string src = std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";
  fs::create_directories(tiny);
  fs::copy_file(src + "/vocab.bpe", tiny + "/vocab.bpe");
  json enc = json::parse(test::slurp(src + "/encoder.json"));
  enc["<|endoftext|>"] = enc.size();
  std::ofstream(tiny + "/encoder.json") << enc.dump();
  ASSERT_NO_FATAL_FAILURE(train_on_text(dir, "gpt2:" + tiny, 1));
  keel_export({dir + "/out", "--out", dir + "/hf"});
  EXPECT_EQ(test::slurp(dir + "/hf/vocab.json"), test::slurp(tiny + "/encoder.json"));
  EXPECT_EQ(test::slurp(dir + "/hf/merges.txt"), test::slurp(tiny + "/vocab.bpe"));
  EXPECT_FALSE(fs::exists(dir + "/hf/encoder.json"));
  EXPECT_FALSE(fs::exists(dir + "/hf/vocab.bpe"));
  const test::KeelRun g = test::run_keel({"generate", dir + "/hf", "the", "--max-new-tokens", "2"});
  EXPECT_EQ(g.code, 0) << g.output;
}

TEST(CliExport, TokenizerFilesAreCopiedAndBadFlagsAreUsageErrors) {
  const std::string dir = test::temp_dir("export-tok");
  const std::string tiny = dir + "/tok";  // a tiny BPE tokenizer.json with an eos token
  fs::create_directories(tiny);
  fs::copy_file(
      std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny/llama_style/tokenizer.json",
      tiny + "/tokenizer.json");
  std::ofstream(tiny + "/tokenizer_config.json") << R"({"eos_token": "<|eot|>"})";
  ASSERT_NO_FATAL_FAILURE(train_on_text(dir, "hf:" + tiny, 2));
  keel_export({dir + "/out", "--out", dir + "/hf"});
  for (const char* f : {"/tokenizer.json", "/tokenizer_config.json"})
    EXPECT_EQ(test::slurp(dir + "/hf" + f), test::slurp(tiny + f)) << f;
  EXPECT_EQ(json::parse(test::slurp(dir + "/hf/config.json"))["eos_token_id"], 287);
  // The export names its tokenizer: `keel generate` finds it without --tokenizer.
  const test::KeelRun g = test::run_keel({"generate", dir + "/hf", "the", "--max-new-tokens", "2"});
  EXPECT_EQ(g.code, 0) << g.output;

  auto err = [&](std::vector<std::string> args) {
    args.insert(args.begin(), "export");
    const test::KeelRun e = test::run_keel(args);
    EXPECT_EQ(e.code, 2) << e.output;
    return e.err;
  };
  EXPECT_CONTAINS(err({dir + "/out", "--out", dir + "/x", "--dtype", "f16"}), "--dtype f16");
  EXPECT_CONTAINS(err({dir + "/out", "--out", dir + "/x", "--max-shard-size", "lots"}),
                  "--max-shard-size lots");
  for (const char* huge : {"inf", "99999999999999999999", "9EiB", "1e300GB"})
    EXPECT_CONTAINS(err({dir + "/out", "--out", dir + "/x", "--max-shard-size", huge}),
                    "--max-shard-size " + std::string(huge) + ": ");
  // A size below one byte was truncated to 0, one file: the opposite of shards.
  for (const char* tiny_size : {"0.5", "1e-9KB"})
    EXPECT_CONTAINS(err({dir + "/out", "--out", dir + "/x", "--max-shard-size", tiny_size}),
                    "--max-shard-size " + std::string(tiny_size) + ": below one byte");
  EXPECT_CONTAINS(err({dir + "/out", "--out", dir + "/x", "--adapter-only"}),
                  "has no adapters to export");
  EXPECT_CONTAINS(err({dir + "/nothing", "--out", dir + "/x"}), "no such directory");
  // The merged model's --dtype and --max-shard-size were taken and ignored with --adapter-only
  // (an f32 adapter in one file, exit 0).
  EXPECT_CONTAINS(err({dir + "/out", "--out", dir + "/x", "--adapter-only", "--dtype", "bf16"}),
                  "--dtype bf16 applies to the merged model; --adapter-only writes the adapter's "
                  "weights in f32");
  EXPECT_CONTAINS(
      err({dir + "/out", "--out", dir + "/x", "--adapter-only", "--max-shard-size", "1KB"}),
      "--max-shard-size 1KB applies to the merged model; --adapter-only writes the adapter as one "
      "file");
  EXPECT_FALSE(fs::exists(dir + "/x"));

  // An export of a byte-tokenizer run over it removes those tokenizer files: they stayed, and
  // `keel generate` then took the 287-id tokenizer.json for the new 259-row model's.
  const test::KeelRun bytes =
      test::run_keel(test::with_sets({"train"}, {"run.out_dir=" + dir + "/bytes", "run.threads=1",
                                                 "train.max_steps=2", "log.tensorboard=false"}),
                     {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(bytes.code, 0) << bytes.output;
  // A run without adapters said "0 adapted modules merged", as if a merge had failed.
  const test::KeelRun plain = test::run_keel({"export", dir + "/bytes", "--out", dir + "/hf"});
  ASSERT_EQ(plain.code, 0) << plain.output;
  EXPECT_CONTAINS(plain.out, ", no adapters to merge, f32, ");
  EXPECT_FALSE(fs::exists(dir + "/hf/tokenizer.json"));
  EXPECT_FALSE(fs::exists(dir + "/hf/tokenizer_config.json"));
}

// A run on hf:DIR whose tokenizer_config.json is `pad` bytes longer (whitespace), trained into
// DIR/out; returns DIR.
std::string run_with_tokenizer(const std::string& tag, size_t pad) {
  const std::string dir = test::temp_dir(tag), tok = dir + "/tok";
  fs::create_directories(tok);
  fs::copy_file(
      std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny/llama_style/tokenizer.json",
      tok + "/tokenizer.json");
  std::ofstream(tok + "/tokenizer_config.json")
      << R"({"eos_token": "<|eot|>"})" << std::string(pad, ' ');
  train_on_text(dir, "hf:" + tok, 1);
  return dir;
}

// The tokenizer files were copied into the export (fs::copy_file) and never fsynced before it was
// renamed into place: a crash could leave complete weights beside an empty tokenizer.json. Now
// each is written as the weights are; an fsync that fails on it (KEEL_TEST_FAIL_FSYNC=N: the
// Nth and later) is an error naming it in --out.
TEST(CliExport, TokenizerFilesAreFsyncedLikeTheWeights) {
  std::string dir;
  ASSERT_NO_FATAL_FAILURE(dir = run_with_tokenizer("export-tok-fsync", 0));
  const std::string out = fs::canonical(dir).string() + "/hf";
  std::string failures;
  for (int n = 1; n < 64; ++n) {
    const test::KeelRun r = test::run_keel({"export", dir + "/out", "--out", dir + "/hf"},
                                           {"KEEL_TEST_FAIL_FSYNC=" + std::to_string(n)});
    if (r.code == 0) break;
    failures += r.err;
  }
  EXPECT_CONTAINS(failures, "cannot write " + out + "/tokenizer.json: fsync failed");
  EXPECT_CONTAINS(failures, "cannot write " + out + "/tokenizer_config.json: fsync failed");
}

// A full disk under --out while the tokenizer files were copied was reported as "cannot write
// TOK/tokenizer_config.json", the source (filesystem_error's path1). Now the file of --out. Needs
// root (mount: a tmpfs with room for the weights, not the 4 MB tokenizer_config.json).
TEST(CliExport, AFullDiskWhileCopyingTheTokenizerNamesTheExportsFile) {
  std::string dir;
  ASSERT_NO_FATAL_FAILURE(dir = run_with_tokenizer("export-tok-enospc", 4 << 20));
  keel_export({dir + "/out", "--out", dir + "/probe"});
  uintmax_t weights = 0;
  for (const auto& e : fs::directory_iterator(dir + "/probe"))
    if (e.path().filename().string().rfind("tokenizer", 0) != 0) weights += e.file_size();
  const std::string mnt = fs::canonical(dir).string() + "/mnt";
  fs::create_directories(mnt);
  const std::string size = std::to_string(weights / 1024 + 1024) + "k";
  if (::geteuid() != 0 ||
      std::system(("mount -t tmpfs -o size=" + size + " tmpfs '" + mnt + "' 2>/dev/null").c_str()))
    GTEST_SKIP() << "needs root and mount (a small tmpfs)";
  struct Unmount {
    std::string dir;
    ~Unmount() { std::system(("umount -l '" + dir + "'").c_str()); }
  } unmount{mnt};
  const test::KeelRun r = test::run_keel({"export", dir + "/out", "--out", mnt + "/hf"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "cannot write " + mnt + "/hf/tokenizer_config.json: No space left");
  EXPECT_EQ(r.err.find(dir + "/tok/"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(mnt + "/hf"));
}

// --out was written without a look: `keel export RUN --out RUN/checkpoints/last` replaced the
// checkpoint it read (resume and generate failed after it), `--out BASE` an adapter run's frozen
// base, a file as --out gave std::filesystem's raw text, and a failed sharded export left its
// first shards beside the previous export. Now refused, or staged beside --out and moved in whole.
// An export or init-model killed while writing left its staging directory, .OUT.tmp-PID with a
// whole model's weights, beside --out for good: a later write removed only its own. Now a write
// removes those whose process is gone, and leaves a live one (another write in progress).
TEST(CliExport, AStagingDirectoryOfAKilledWriteIsRemovedByTheNext) {
  const std::string dir = test::temp_dir("export-stale-stage");
  const int dead = test::dead_pid();
  ASSERT_GT(dead, 0);
  const std::string stale = dir + "/.m.tmp-" + std::to_string(dead);
  const std::string live = dir + "/.m.tmp-" + std::to_string(::getpid());
  fs::create_directories(stale);
  std::ofstream(stale + "/model.safetensors") << "half a model";
  fs::create_directories(live);
  const test::KeelRun r = test::run_keel(
      {"init-model", "--out", dir + "/m", "--n-layer", "1", "--n-embd", "32", "--n-head", "2"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(dir + "/m/model.safetensors"));
}

TEST(CliExport, OutNeverReplacesWhatItReadsAndAFailedExportChangesNothing) {
  const std::string dir = trained_run("llama", "lora");
  const std::string out = dir + "/out", last = out + "/checkpoints/last";
  const std::string ckpt_weights = test::slurp(last + "/model.safetensors");
  auto err = [&](std::vector<std::string> args) {
    const test::KeelRun e = test::run_keel(args);
    EXPECT_EQ(e.code, 2) << e.output;
    return e.err;
  };
  EXPECT_CONTAINS(err({"export", out, "--out", last}), "holds a keel run");
  EXPECT_CONTAINS(err({"export", out, "--out", out + "/checkpoints"}), "holds the model's weights");
  EXPECT_CONTAINS(err({"export", out, "--out", dir + "/base"}),
                  "is the model the run started from");
  EXPECT_CONTAINS(err({"export", dir + "/base", "--adapter", out + "/adapter", "--out",
                       out + "/adapter", "--adapter-only"}),
                  "is the --adapter directory");
  EXPECT_CONTAINS(err({"init-model", "--out", last}), "holds a keel run");
  std::ofstream(dir + "/file") << "x";
  EXPECT_CONTAINS(err({"export", out, "--out", dir + "/file"}), "exists and is not a directory");
  EXPECT_CONTAINS(err({"export", out, "--out", dir + "/file/sub"}),
                  "cannot be created: " + dir + "/file is not a directory");
  EXPECT_EQ(test::slurp(last + "/model.safetensors"), ckpt_weights);

  // A failed export (a file-size limit of 4 KB: the first shard does not fit) leaves the
  // previous export, and the user's own file beside it, as they were, and no staging directory.
  keel_export({out, "--out", dir + "/hf"});
  std::ofstream(dir + "/hf/NOTES.md") << "mine";
  const std::string weights = test::slurp(dir + "/hf/model.safetensors");
  const test::KeelRun failed =
      test::run_command({"/bin/sh", "-c",
                         "ulimit -f 8; exec " + test::keel_binary() + " export '" + out +
                             "' --out '" + dir + "/hf' --max-shard-size 2KB"});
  EXPECT_EQ(failed.code, 1) << failed.output;
  EXPECT_CONTAINS(failed.err, "--out " + dir + "/hf: cannot write");
  EXPECT_EQ(test::slurp(dir + "/hf/model.safetensors"), weights);
  std::set<std::string> held, want = {"config.json", "model.safetensors", "NOTES.md"};
  for (const auto& e : fs::directory_iterator(dir + "/hf")) held.insert(e.path().filename());
  EXPECT_EQ(held, want);
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  // A sharded export over it replaces the single file, and keeps the user's.
  keel_export({out, "--out", dir + "/hf", "--max-shard-size", "20KB"});
  EXPECT_FALSE(fs::exists(dir + "/hf/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/hf/model.safetensors.index.json"));
  EXPECT_EQ(test::slurp(dir + "/hf/NOTES.md"), "mine");

  // A PEFT adapter and a model in one directory: transformers' from_pretrained applies the
  // adapter to the model it loads there (the merged model got its adapter twice), so each is
  // refused over the other, and nothing there changes.
  EXPECT_CONTAINS(err({"export", out, "--out", dir + "/hf", "--adapter-only"}),
                  "holds a model (config.json): a PEFT adapter written beside it would make "
                  "transformers' from_pretrained apply the adapter to that model");
  EXPECT_FALSE(fs::exists(dir + "/hf/adapter_config.json"));
  EXPECT_TRUE(fs::exists(dir + "/hf/model.safetensors.index.json"));

  // --adapter-only replaced --out whole: the user's notes and folders were deleted without a
  // word. Now the adapter's two files are added.
  fs::create_directories(dir + "/peft/sub");
  std::ofstream(dir + "/peft/NOTES.md") << "mine";
  std::ofstream(dir + "/peft/sub/data.txt") << "kept";
  keel_export({out, "--out", dir + "/peft", "--adapter-only"});
  EXPECT_EQ(test::slurp(dir + "/peft/NOTES.md"), "mine");
  EXPECT_EQ(test::slurp(dir + "/peft/sub/data.txt"), "kept");
  EXPECT_TRUE(fs::exists(dir + "/peft/adapter_config.json"));
  EXPECT_TRUE(fs::exists(dir + "/peft/adapter_model.safetensors"));
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  EXPECT_CONTAINS(err({"export", out, "--out", dir + "/peft"}),
                  "holds a PEFT adapter (adapter_config.json): a model written beside it");
  EXPECT_CONTAINS(err({"init-model", "--out", dir + "/peft"}), "holds a PEFT adapter");
  EXPECT_FALSE(fs::exists(dir + "/peft/config.json"));
}

}  // namespace
}  // namespace keel
