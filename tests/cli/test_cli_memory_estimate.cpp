// `keel memory` through the binary: a published model's sizes (Llama-3.1-8B, grouped-query
// attention, untied head) give its real parameter count; bad sizes exit 2 naming the flag to fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

const std::string kLlama31_8b =
    "memory --family llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 "
    "--vocab 128256 --tie-embeddings false --precision bf16-true";

TEST(CliMemoryEstimate, Llama31_8bCountsItsPublishedParameters) {
  const test::KeelRun j = test::run_keel_sh(kLlama31_8b + " --json");
  ASSERT_EQ(j.code, 0) << j.output;
  const auto e = nlohmann::json::parse(j.out);
  EXPECT_EQ(e.at("params").get<int64_t>(), 8'030'261'248);
  // bf16 weights: every matrix is a multiple of 2 MiB and every norm (8 KiB) of 64 bytes, so
  // host_memory's blocks hold exactly 2 bytes a parameter.
  EXPECT_EQ(e.at("weights").get<int64_t>(), 2 * int64_t{8'030'261'248});
  const test::KeelRun t = test::run_keel_sh(kLlama31_8b);
  ASSERT_EQ(t.code, 0) << t.output;
  EXPECT_CONTAINS(t.out, "8030.26M parameters");
  // The same sizes with full-width k/v projections and a tied head: the count moves with both.
  const test::KeelRun mha = test::run_keel_sh(
      "memory --family llama --layers 32 --hidden 4096 --heads 32 --ffn 14336 --vocab 128256 "
      "--json");
  ASSERT_EQ(mha.code, 0) << mha.output;
  EXPECT_EQ(nlohmann::json::parse(mha.out).at("params").get<int64_t>(),
            8'030'261'248 + 32 * 2 * 4096 * (4096 - 1024) - 128256 * 4096);
}

// Qwen3-0.6B's config.json as published: heads of head_dim 128 over hidden_size 1024 / 16 heads
// (q_proj 1024 -> 2048, o_proj back), q/k norms of 128, a tied head. Its weights are not needed
// for the count.
TEST(CliMemoryEstimate, Qwen3_0_6bCountsItsPublishedParameters) {
  const std::string dir = test::temp_dir("cli-memory-qwen3");
  std::ofstream(dir + "/config.json") << R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
  "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";
  const test::KeelRun r = test::run_keel({"memory", "--model", dir, "--json"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("params").get<int64_t>(), 596'049'920);
  // --head-dim says the same as the file, or is refused as contradicting it.
  EXPECT_EQ(test::run_keel({"memory", "--model", dir, "--head-dim", "128"}).code, 0);
  const test::KeelRun other = test::run_keel({"memory", "--model", dir, "--head-dim", "64"});
  EXPECT_EQ(other.code, 2) << other.output;
  EXPECT_CONTAINS(other.err, "memory --head-dim 64: contradicts the model directory " + dir);
}

// The parameters `keel memory --model` counts for a published config.json kept in the fuzz corpus
// (tests/fuzz/corpus/hf_config/FILE): its weights are not needed for the count.
int64_t published_parameters(const std::string& file) {
  const std::string dir = test::temp_dir("cli-memory-published");
  std::filesystem::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/" + file,
                             dir + "/config.json");
  const test::KeelRun r = test::run_keel({"memory", "--model", dir, "--json"});
  EXPECT_EQ(r.code, 0) << r.output;
  return r.code == 0 ? nlohmann::json::parse(r.out).at("params").get<int64_t>() : -1;
}

// Phi-4-mini's config.json (tests/fuzz/corpus/hf_config/phi4_mini.json, its sizes as published;
// longrope factors of 48 values for the 96 of 128 channels its partial_rotary_factor turns): 3.84B
// parameters with its tied head, the fused qkv_proj (24 + 2 x 8 heads of 128) and gate_up_proj.
TEST(CliMemoryEstimate, Phi4MiniCountsItsPublishedParameters) {
  const int64_t per_layer =
      3072 * 40 * 128 + 3072 * 3072 + 3072 * 2 * 8192 + 8192 * 3072 + 2 * 3072;
  EXPECT_EQ(published_parameters("phi4_mini.json"), 200064 * 3072 + 32 * per_layer + 3072);
}

// SmolLM3-3B's config.json (tests/fuzz/corpus/hf_config/smollm3_3b.json): 3.08B parameters, its
// head tied to the embedding (SmolLM3Config's default: the file does not say).
TEST(CliMemoryEstimate, SmolLM3CountsItsPublishedParameters) {
  const int64_t per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 11008 + 2 * 2048;
  EXPECT_EQ(published_parameters("smollm3_3b.json"), 128256 * 2048 + 36 * per_layer + 2048);
}

// Granite-3.1-8B's config.json (tests/fuzz/corpus/hf_config/granite_3_1_8b.json): 8.17B
// parameters, its head tied; its multipliers change no count.
TEST(CliMemoryEstimate, GraniteCountsItsPublishedParameters) {
  const int64_t per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12800 + 2 * 4096;
  EXPECT_EQ(published_parameters("granite_3_1_8b.json"), 49155 * 4096 + 40 * per_layer + 4096);
}

// OLMo-2-1124-7B's config.json (tests/fuzz/corpus/hf_config/olmo2_7b.json): 7.30B parameters,
// its head untied, two norms a layer (after the attention and the MLP) and q/k norms over the
// whole projections.
TEST(CliMemoryEstimate, Olmo2CountsItsPublishedParameters) {
  const int64_t per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 4 * 4096;
  EXPECT_EQ(published_parameters("olmo2_7b.json"), 2 * 100352 * 4096 + 32 * per_layer + 4096);
}

// OLMo-3-7B's config.json shape (tests/fuzz/corpus/hf_config/olmo3_7b.json: written from the
// published file's fields, not downloaded here): OLMo-2-7B's layers over a vocabulary of 100278,
// three of every four sliding, YaRN on the full ones; neither changes a count.
TEST(CliMemoryEstimate, Olmo3CountsItsPublishedParameters) {
  const int64_t per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 4 * 4096;
  EXPECT_EQ(published_parameters("olmo3_7b.json"), 2 * 100278 * 4096 + 32 * per_layer + 4096);
}

// EXAONE-4.0-32B's config.json shape (tests/fuzz/corpus/hf_config/exaone4_32b.json, written from
// the published file's fields): 30.95B parameters besides its untied embedding and head, as
// published; its q/k norms are one head wide.
TEST(CliMemoryEstimate, Exaone4CountsItsPublishedParameters) {
  const int64_t per_layer =
      2 * 5120 * 5120 + 2 * 5120 * 1024 + 3 * 5120 * 27392 + 2 * 5120 + 2 * 128;
  EXPECT_EQ(published_parameters("exaone4_32b.json"), 2 * 102400 * 5120 + 64 * per_layer + 5120);
}

TEST(CliMemoryEstimate, KvHeadsThatDoNotDivideTheHeadsAreAUsageError) {
  const test::KeelRun r = test::run_keel_sh(
      "memory --family llama --layers 2 --hidden 256 --heads 8 --kv-heads 3 --batch 1 --seq 8");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "--kv-heads");
}

// A count beyond int64 was rounded to an unspecified value (a negative count, then "give the
// parameter count"); a layer count beyond model.n_layer's bound ran for minutes.
TEST(CliMemoryEstimate, CountsAndSizesBeyondTheirBoundsAreUsageErrors) {
  test::KeelRun r = test::run_keel_sh("memory --params 1e30");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "memory --params 1e30: at most 1e15 parameters");
  r = test::run_keel_sh("memory --layers 99999999 --hidden 64 --batch 1 --seq 8");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "layers = 99999999 (--layers): model.n_layer must be in [1, 1024]");
}

// A run's out_dir (what generate, eval and export take) as --model / model.path said only that it
// has no config.json; it names the run's model directory now.
TEST(CliMemoryEstimate, ARunsOutDirAsTheModelNamesItsCheckpoint) {
  const std::string run = test::temp_dir("cli-memory-outdir");
  std::filesystem::create_directories(run + "/checkpoints/last");
  std::ofstream(run + "/checkpoints/last/config.json") << "{}";
  const test::KeelRun r = test::run_keel({"memory", "--model", run});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err,
                  "this is a keel run's out_dir, whose model is " + run + "/checkpoints/last");
}

// Flags that do not apply to the step were taken and ignored: gpt2 with --tie-embeddings false,
// or --r 64 without an adapter, printed the estimate without them, exit 0.
TEST(CliMemoryEstimate, FlagsThatDoNotApplyToTheStepAreUsageErrors) {
  const std::string sizes = " --layers 2 --hidden 64 --batch 1 --seq 8";
  test::KeelRun r = test::run_keel_sh("memory --family gpt2 --tie-embeddings false" + sizes);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "memory --tie-embeddings: applies to llama");
  r = test::run_keel_sh("memory --kv-heads 1" + sizes);  // gpt2 by default
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "drop --kv-heads (or give --family llama)");
  r = test::run_keel_sh("memory --head-dim 128" + sizes);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "drop --head-dim (or give --family llama)");
  for (const std::string flag :
       {"--r 64", "--targets c_attn", "--adapter-dropout 0.1", "--base-dtype bf16"}) {
    r = test::run_keel_sh("memory " + flag + sizes);
    EXPECT_EQ(r.code, 2) << flag << ": " << r.output;
    EXPECT_CONTAINS(r.err, "memory " + flag.substr(0, flag.find(' ')) +
                               ": applies to an adapter, and the step has none");
  }
  // LoKr has no input dropout: keel train refuses the run that was estimated.
  r = test::run_keel_sh("memory --adapter lokr --targets c_attn --adapter-dropout 0.1" + sizes);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "(--adapter-dropout or model.adapter.dropout) with lokr: LoKr has no "
                  "input dropout");
  // With an adapter they apply.
  r = test::run_keel_sh("memory --adapter lora --targets c_attn --r 64 --base-dtype bf16" + sizes);
  EXPECT_EQ(r.code, 0) << r.output;
}

// keel train with lokr and model.adapter.dropout noted "no memory estimate before loading: ...
// (--adapter-dropout or model.adapter.dropout)", a keel memory flag the user never passed, before
// the run's own refusal. A config's run names its keys only.
TEST(CliMemoryEstimate, TrainsEstimateNamesTheConfigKeyNotKeelMemorysFlag) {
  const std::string dir = test::temp_dir("train-lokr-dropout");
  const auto r = test::run_keel(
      test::with_sets({"train"}, {"run.out_dir=" + dir + "/out", "model.adapter.kind=lokr",
                                  "model.adapter.dropout=0.1", "train.max_steps=1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "LoKr has no input dropout");
  EXPECT_NOT_CONTAINS(r.err, "--adapter-dropout");
  // One refusal, the adapter's, with the value as the config wrote it: a note "no memory
  // estimate before loading: ... LoKr has no input dropout" came first, and 0.1 read 0.100000.
  EXPECT_NOT_CONTAINS(r.output, "no memory estimate");
  EXPECT_CONTAINS(r.err, "dropout = 0.1 with kind = \"lokr\"");
}

// The estimate's 0 means "not given": --batch 0 or --seq 0 printed an estimate without the
// activations (exit 0) of a step keel train refuses.
TEST(CliMemoryEstimate, ABatchOrSequenceOfZeroIsAUsageError) {
  test::KeelRun r = test::run_keel_sh("memory --layers 2 --hidden 64 --batch 1 --seq 0");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "memory: --seq 0: data.seq_len must be in [2, 1048576], got 0");
  r = test::run_keel_sh("memory --params 1e6 --batch 0");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "memory: --batch 0: train.batch_size must be in [1, 65536], got 0");
  EXPECT_EQ(r.out, "");
}

// Targets that name no layer of the model are fixed with --targets, the flag that sets them: the
// default q_proj, v_proj on GPT-2 (and --targets q_proj) said to fix
// model.adapter.target_modules, a key of no file the user gave.
TEST(CliMemoryEstimate, TargetsThatNameNoLayerNameTheTargetsFlag) {
  const std::string sizes = " --layers 2 --hidden 64 --batch 1 --seq 8";
  for (const std::string flags : {"--adapter lokr", "--adapter lora --targets q_proj"}) {
    const test::KeelRun r = test::run_keel_sh("memory " + flags + sizes);
    EXPECT_EQ(r.code, 2) << flags << ": " << r.output;
    EXPECT_CONTAINS(r.err, "target module 'q_proj' matches no linear layer of this gpt2 model");
    EXPECT_CONTAINS(r.err, "(fix --targets)");
    EXPECT_EQ(r.err.find("model.adapter.target_modules"), std::string::npos) << r.err;
  }
  // Set by a config, the key is the fix.
  const test::KeelRun r = test::run_keel_sh(
      "memory --set model.adapter.kind=lokr --set model.n_layer=2 --set model.n_embd=64");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "(fix model.adapter.target_modules)");
}

// Under mpirun every rank on a machine checked its own estimate against all of MemAvailable: N
// ranks that each fitted alone were killed together by the OOM killer. Each rank has its share
// (OMPI_COMM_WORLD_LOCAL_SIZE, set by Open MPI's mpirun; here without one, so the run stays one
// process): a share too small for the built-in task refuses it, naming why.
TEST(CliMemoryEstimate, RanksOnOneMachineShareItsAvailableMemory) {
  const std::string dir = test::temp_dir("train-local-ranks");
  const auto r = test::run_keel(
      test::with_sets({"train"}, {"run.out_dir=" + dir + "/out", "train.max_steps=1"}),
      {"OMPI_COMM_WORLD_LOCAL_SIZE=100000"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "are available (a rank's share of MemAvailable in /proc/meminfo: 100000 "
                  "ranks run on this machine); nothing was loaded");
  EXPECT_FALSE(std::filesystem::exists(dir + "/out/checkpoints"));
  const auto alone = test::run_keel(
      test::with_sets({"train"}, {"run.out_dir=" + dir + "/alone", "train.max_steps=1"}),
      {"OMPI_COMM_WORLD_LOCAL_SIZE=1"});
  EXPECT_EQ(alone.code, 0) << alone.output;
}

}  // namespace
}  // namespace keel
