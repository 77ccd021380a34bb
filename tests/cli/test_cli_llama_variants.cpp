// The HF architectures keel reads as Llama's layers. A Mistral (MistralForCausalLM, a sliding
// window): evaluated as the same weights under Llama's name are, trained within its window and
// refused beyond it, generated up to the window, and written back as a Mistral by checkpoints and
// export. A Qwen2 (Qwen2ForCausalLM, q/k/v biases): `init-model --family qwen2` writes one, a LoRA
// run on its biased projections merges into an export that computes as the run did, and a sliding
// window it would use is refused. A Qwen3 (Qwen3ForCausalLM, q/k norms): the same, with heads of
// n_embd / n_head channels or of a width of their own (Qwen3-0.6B's head_dim 128 over 1024 / 16),
// and a head_dim its weights do not have is refused. A Phi-3 (Phi3ForCausalLM, fused qkv_proj and
// gate_up_proj), a SmolLM3 (NoPE layers), a Granite (multipliers), an OLMo-2 (norms after each
// sublayer): below. (PyTorch's forward of
// their exports: CliExport.PyTorch*.)
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "keel/io/hf_weights.h"
#include "keel/io/safetensors.h"
#include "keel/ops/elementwise.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"
#include "tests/support/tiny_models.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct MistralFiles {
  std::string dir, llama, mistral, text;
};

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

// keel eval's loss of `model` on the byte-tokenized text file `data` (-1 when eval failed).
double eval_loss(const std::string& model, const std::string& data,
                 const std::vector<std::string>& more = {}) {
  std::vector<std::string> args = {"eval", model, "--data", data, "--tokenizer", "byte", "--json"};
  args.insert(args.end(), more.begin(), more.end());
  const test::KeelRun r = test::run_keel(args, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 0) << r.output;
  return r.code == 0 ? json::parse(r.out).at("loss").get<double>() : -1.0;
}

// keel eval's loss of DIR/base on DIR/t.txt once its config.json is `cfg` (left so), and of `cfg`
// with `fields` changed.
double eval_with(const std::string& dir, const json& cfg, const json& fields = json::object()) {
  json changed = cfg;
  changed.update(fields);
  std::ofstream(dir + "/base/config.json") << changed.dump(2);
  return eval_loss(dir + "/base", dir + "/t.txt");
}

// A tiny Llama, the same weights as a Mistral with a 32-position window over 64 positions, and a
// text.
const MistralFiles& mistral_files() {
  static const MistralFiles f = [] {
    MistralFiles f;
    f.dir = test::temp_dir("cli-mistral");
    f.llama = f.dir + "/llama";
    f.mistral = f.dir + "/mistral";
    const test::KeelRun r = test::run_keel(
        {"init-model", "--family", "llama", "--out", f.llama, "--n-layer", "1", "--n-embd", "32",
         "--n-head", "4", "--n-kv-head", "2", "--max-seq-len", "64", "--init-std", "0.1"});
    EXPECT_EQ(r.code, 0) << r.output;
    fs::copy(f.llama, f.mistral);
    json cfg = read_json_file(f.llama + "/config.json");
    cfg["model_type"] = "mistral";
    cfg["architectures"] = {"MistralForCausalLM"};
    cfg["sliding_window"] = 32;
    std::ofstream(f.mistral + "/config.json") << cfg.dump(2);
    f.text = f.dir + "/t.txt";
    std::ofstream t(f.text);
    for (int i = 0; i < 12; ++i) t << "the quick brown fox " << i << " jumps over the dog\n\n";
    return f;
  }();
  return f;
}

// Within its window a Mistral is a Llama under another name; past it, its attention slides over
// the last sliding_window positions (the ops and model tests check how), another loss.
TEST(CliMistral, EvaluatesAsTheSameWeightsUnderLlamasNameWithinItsWindow) {
  const MistralFiles& f = mistral_files();
  EXPECT_EQ(eval_loss(f.mistral, f.text, {"--seq-len", "32"}),
            eval_loss(f.llama, f.text, {"--seq-len", "32"}));
  EXPECT_NE(eval_loss(f.mistral, f.text, {"--seq-len", "48"}),
            eval_loss(f.llama, f.text, {"--seq-len", "48"}));
}

TEST(CliMistral, TrainsPastItsWindowAndIsWrittenBackAsAMistral) {
  const MistralFiles& f = mistral_files();
  auto train = [&](const std::string& out, int64_t seq_len) {
    return test::run_keel(
        test::with_sets({"train"},
                        {"run.out_dir=" + out, "run.threads=1", "model.path=" + f.mistral,
                         "data.task=text", "data.path=" + f.text, "data.tokenizer=byte",
                         "data.seq_len=" + std::to_string(seq_len), "train.batch_size=4",
                         "train.max_steps=3", "log.tensorboard=false"}),
        {"OMP_NUM_THREADS=1"});
  };
  // Rows past the window train with the window's attention (on the CPU; CUDA's does not slide).
  const std::string out = f.dir + "/run";
  const test::KeelRun run = train(out, 48);
  ASSERT_EQ(run.code, 0) << run.output;
  const auto steps = test::step_records(out);
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_LT(steps.back().at("loss").get<double>(), steps.front().at("loss").get<double>());
  // The checkpoint and the export are Mistrals with the file's window and positions.
  const test::KeelRun ex = test::run_keel({"export", out, "--out", f.dir + "/exported"});
  ASSERT_EQ(ex.code, 0) << ex.output;
  for (const std::string& dir : {out + "/checkpoints/last", f.dir + "/exported"}) {
    const json cfg = read_json_file(dir + "/config.json");
    EXPECT_EQ(cfg.at("model_type"), "mistral") << dir;
    EXPECT_EQ(cfg.at("architectures"), json::array({"MistralForCausalLM"})) << dir;
    EXPECT_EQ(cfg.at("sliding_window"), 32) << dir;
    EXPECT_EQ(cfg.at("max_position_embeddings"), 64) << dir;
  }
  // A decode runs past the window (its cache's queries slide too) to max_position_embeddings.
  const test::KeelRun g =
      test::run_keel({"generate", f.dir + "/exported", "the quick", "--tokenizer", "byte",
                      "--max-new-tokens", "100", "--json"},
                     {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(g.code, 0) << g.output;
  const json r = json::parse(g.out);
  EXPECT_EQ(r.at("stop"), "max_seq_len");
  EXPECT_EQ(r.at("prompt_tokens").get<size_t>() + r.at("tokens").size(), 64u);
}

// init-model's tiny `family` model (1 layer, 32 wide, 4 heads, 2 kv heads, 32 positions) at `out`.
void init_tiny(const std::string& family, const std::string& out) {
  const test::KeelRun init =
      test::run_keel({"init-model", "--family", family, "--out", out, "--n-layer", "1", "--n-embd",
                      "32", "--n-head", "4", "--n-kv-head", "2", "--max-seq-len", "32"});
  ASSERT_EQ(init.code, 0) << init.output;
}

// A short run of DIR/base on DIR/t.txt into DIR/out with `sets` (a LoRA's keys, a learning
// rate): 8 steps whose loss falls. Returns the checkpoint's config.json.
json train_falls(const std::string& dir, const std::vector<std::string>& sets) {
  std::vector<std::string> all = {"run.out_dir=" + dir + "/out", "run.threads=1",
                                  "model.path=" + dir + "/base", "data.seq_len=24",
                                  "train.max_steps=8",           "log.every=1",
                                  "log.tensorboard=false"};
  all.insert(all.end(), sets.begin(), sets.end());
  const test::KeelRun run = test::run_keel(test::with_sets({"train"}, all), {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(run.code, 0) << run.output;
  const std::vector<json> steps = test::step_records(dir + "/out");
  EXPECT_EQ(steps.size(), 8u) << run.output;
  if (steps.size() == 8u) {
    EXPECT_LT(steps.back().at("loss").get<double>(), steps.front().at("loss").get<double>());
  }
  return read_json_file(dir + "/out/checkpoints/last/config.json");
}

// The run's adapter alone (DIR/peft, as PEFT writes one) applies to the base as the run's
// checkpoint computes.
void expect_adapter_applies(const std::string& dir) {
  const test::KeelRun ex =
      test::run_keel({"export", dir + "/out", "--out", dir + "/peft", "--adapter-only"});
  ASSERT_EQ(ex.code, 0) << ex.output;
  EXPECT_NEAR(eval_loss(dir + "/base", dir + "/t.txt", {"--adapter", dir + "/peft"}),
              eval_loss(dir + "/out", dir + "/t.txt"), 1e-5);
}

// DIR/base with config.json `bad` is refused by keel eval (exit 2) with `message`.
void expect_config_refused(const std::string& dir, const json& bad, const std::string& message) {
  std::ofstream(dir + "/base/config.json") << bad.dump(2);
  const test::KeelRun r =
      test::run_keel({"eval", dir + "/base", "--data", dir + "/t.txt", "--tokenizer", "byte"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, message);
}

// DIR/base/model.safetensors with the buffers `names` beside its weights (older HF files hold
// causal masks and rotary frequencies): keel eval reads past them, its loss still `loss`.
void expect_buffers_skipped(const std::string& dir, const std::vector<std::string>& names,
                            double loss) {
  const std::string file = dir + "/base/model.safetensors";
  io::Safetensors st = io::read_safetensors(file);
  for (const std::string& name : names) st.tensors.emplace_back(name, Tensor::full({1, 4}, 1.0f));
  io::write_safetensors(file, st.tensors, st.metadata);
  EXPECT_EQ(eval_loss(dir + "/base", dir + "/t.txt"), loss);
}

// DIR/base with `cfg` changed by `fields` fails keel eval (exit 1) naming `tensor` as missing.
void expect_missing_tensor(const std::string& dir, json cfg, const json& fields,
                           const std::string& tensor) {
  cfg.update(fields);
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  const test::KeelRun r =
      test::run_keel({"eval", dir + "/base", "--data", dir + "/t.txt", "--tokenizer", "byte"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "tensor '" + tensor + "' is missing");
}

// DIR/base's config `cfg` with attention sinks (use_sinks) is refused naming the field.
void expect_sinks_refused(const std::string& dir, json cfg, const std::string& family) {
  cfg["use_sinks"] = true;
  expect_config_refused(dir, cfg,
                        dir +
                            "/base/config.json: use_sinks = true (attention sinks) is not "
                            "supported by keel's " +
                            family + " model");
}

TEST(CliQwen2, InitModelWritesOneAndALoraOnItsBiasedProjectionsExports) {
  const std::string dir = test::temp_dir("cli-qwen2");
  init_tiny("qwen2", dir + "/base");
  const json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("model_type"), "qwen2");
  EXPECT_EQ(cfg.at("architectures"), json::array({"Qwen2ForCausalLM"}));
  EXPECT_EQ(cfg.at("use_sliding_window"), false);
  EXPECT_FALSE(cfg.contains("attention_bias"));
  const test::KeelRun run = test::run_keel(
      test::with_sets({"train"}, {"run.out_dir=" + dir + "/out", "run.threads=1",
                                  "model.path=" + dir + "/base", "model.adapter.kind=lora",
                                  "model.adapter.target_modules=[\"q_proj\", "
                                  "\"k_proj\", \"v_proj\"]",
                                  "data.seq_len=24", "train.max_steps=4", "optim.lr=5e-2",
                                  "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(run.code, 0) << run.output;
  const test::KeelRun ex = test::run_keel({"export", dir + "/out", "--out", dir + "/merged"});
  ASSERT_EQ(ex.code, 0) << ex.output;
  EXPECT_EQ(read_json_file(dir + "/merged/config.json").at("model_type"), "qwen2");
  // The merged export evaluates as the run's checkpoint does.
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  EXPECT_NEAR(eval_loss(dir + "/merged", dir + "/t.txt"), eval_loss(dir + "/out", dir + "/t.txt"),
              1e-5);
  // A Qwen2 that slides (use_sliding_window): its layers from max_window_layers on see the last
  // sliding_window positions (ModelParity's qwen2_w3 checks how against PyTorch), another loss
  // on rows past the window; an export writes the three fields back.
  const double full = eval_loss(dir + "/base", dir + "/t.txt");
  json sliding = cfg;
  sliding["use_sliding_window"] = true;
  sliding["sliding_window"] = 3;
  sliding["max_window_layers"] = 0;
  std::ofstream(dir + "/base/config.json") << sliding.dump(2);
  EXPECT_NE(eval_loss(dir + "/base", dir + "/t.txt"), full);
  const test::KeelRun slid = test::run_keel({"export", dir + "/base", "--out", dir + "/slid"});
  ASSERT_EQ(slid.code, 0) << slid.output;
  const json back = read_json_file(dir + "/slid/config.json");
  EXPECT_EQ(back.at("use_sliding_window"), true);
  EXPECT_EQ(back.at("sliding_window"), 3);
  EXPECT_EQ(back.at("max_window_layers"), 0);
  // layer_types other than full layers then sliding ones (max_window_layers' layout) are refused.
  sliding["layer_types"] = {"sliding_attention", "full_attention"};
  std::ofstream(dir + "/base/config.json") << sliding.dump(2);
  const test::KeelRun refused =
      test::run_keel({"eval", dir + "/base", "--data", dir + "/t.txt", "--tokenizer", "byte"});
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_CONTAINS(refused.err,
                  "layer_types [\"sliding_attention\",\"full_attention\"] (keel "
                  "slides the layers from max_window_layers on");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

TEST(CliQwen3, InitModelWritesOneItsNormsTrainAndAWrongHeadDimIsRefused) {
  const std::string dir = test::temp_dir("cli-qwen3");
  init_tiny("qwen3", dir + "/base");
  json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("model_type"), "qwen3");
  EXPECT_EQ(cfg.at("architectures"), json::array({"Qwen3ForCausalLM"}));
  EXPECT_EQ(cfg.at("head_dim"), 8);
  const test::KeelRun run =
      test::run_keel(test::with_sets({"train"}, {"run.out_dir=" + dir + "/out", "run.threads=1",
                                                 "model.path=" + dir + "/base", "data.seq_len=24",
                                                 "train.max_steps=3", "log.tensorboard=false"}),
                     {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(run.code, 0) << run.output;
  EXPECT_EQ(read_json_file(dir + "/out/checkpoints/last/config.json").at("model_type"), "qwen3");
  const test::KeelRun ex = test::run_keel({"export", dir + "/out", "--out", dir + "/hf"});
  ASSERT_EQ(ex.code, 0) << ex.output;
  EXPECT_EQ(read_json_file(dir + "/hf/config.json").at("architectures"),
            json::array({"Qwen3ForCausalLM"}));
  // A config.json whose head_dim its weights do not have (32 / 4 = 8 wide).
  cfg["head_dim"] = 16;
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  std::ofstream(dir + "/t.txt") << "12+34=46\n";
  const test::KeelRun refused =
      test::run_keel({"eval", dir + "/base", "--data", dir + "/t.txt", "--tokenizer", "byte"});
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_CONTAINS(refused.err, dir + "/base/config.json: head_dim = 16 but the weights in " + dir +
                                   "/base hold a q_proj of 32 rows, not num_attention_heads 4 x "
                                   "head_dim 16; config.json does not describe these weights");
}

// Qwen3-0.6B's and -4B's heads are wider than hidden_size / num_attention_heads (128 beside
// 1024 / 16): q_proj maps the hidden size to heads x head_dim and o_proj back. Fine-tuned, the
// loss falls; a LoRA on both projections merges into an export that evaluates as the run did; keel
// memory counts the model's parameters from its config.json as init-model built them.
TEST(CliQwen3, HeadsWiderThanTheHiddenSizeOverTheHeadsTrainAndExport) {
  const std::string dir = test::temp_dir("cli-qwen3-wide");
  const test::KeelRun init = test::run_keel(
      {"init-model", "--family", "qwen3", "--out", dir + "/base", "--n-layer", "2", "--n-embd",
       "32", "--n-head", "4", "--n-kv-head", "2", "--head-dim", "16", "--max-seq-len", "32"});
  ASSERT_EQ(init.code, 0) << init.output;
  const json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("head_dim"), 16);
  EXPECT_EQ(cfg.at("hidden_size"), 32);
  const test::KeelRun mem = test::run_keel({"memory", "--model", dir + "/base", "--json"});
  ASSERT_EQ(mem.code, 0) << mem.output;
  // Embedding 259 x 32 (tied) and the final norm, and per layer: q_proj 32 -> 64, k_proj and
  // v_proj 32 -> 32, o_proj 64 -> 32, q/k norms of 16, two norms of 32 and the MLP (3 x 32 x 96).
  const int64_t per_layer = 32 * 64 + 2 * 32 * 32 + 64 * 32 + 2 * 16 + 2 * 32 + 3 * 32 * 96;
  EXPECT_EQ(json::parse(mem.out).at("params").get<int64_t>(), 259 * 32 + 32 + 2 * per_layer);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  auto train = [&](const std::string& out, std::vector<std::string> sets) {
    sets.insert(sets.end(), {"run.out_dir=" + out, "run.threads=1", "model.path=" + dir + "/base",
                             "data.seq_len=24", "log.every=1", "log.tensorboard=false"});
    const test::KeelRun r = test::run_keel(test::with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
    return r;
  };
  // Fine-tuned whole, the loss falls.
  const test::KeelRun full = train(dir + "/full", {"train.max_steps=12", "optim.lr=1e-2"});
  const std::vector<json> steps = test::step_records(dir + "/full");
  ASSERT_EQ(steps.size(), 12u) << full.output;
  EXPECT_LT(steps.back().at("loss").get<double>(), 0.8 * steps.front().at("loss").get<double>())
      << full.output;
  // A LoRA on the projections into and out of the wide heads.
  train(dir + "/out",
        {"model.adapter.kind=lora", "model.adapter.target_modules=[\"q_proj\", \"o_proj\"]",
         "train.max_steps=3", "optim.lr=5e-2"});
  const test::KeelRun ex = test::run_keel({"export", dir + "/out", "--out", dir + "/merged"});
  ASSERT_EQ(ex.code, 0) << ex.output;
  EXPECT_EQ(read_json_file(dir + "/merged/config.json").at("head_dim"), 16);
  EXPECT_NEAR(eval_loss(dir + "/merged", dir + "/t.txt"), eval_loss(dir + "/out", dir + "/t.txt"),
              1e-5);
}

// A Phi-3 (Phi3ForCausalLM: Phi-3-mini/medium, Phi-3.5-mini, Phi-4) holds Llama's q/k/v as one
// qkv_proj and gate/up as one gate_up_proj, so a LoRA on those is PEFT's LoRA on them: init-model
// writes one, keel memory counts the fused tensors, a LoRA on both trains and its PEFT adapter
// directory names them and applies to the base as the run's checkpoint computes (ModelParity's
// phi3_w3 and CliExport.PyTorchForwardOfTheExportAgrees check the forward against PyTorch), its
// sliding window slides, and what keel's model cannot compute is refused naming the field.
TEST(CliPhi3, InitModelWritesOneAndALoraOnItsFusedProjectionsIsPefts) {
  const std::string dir = test::temp_dir("cli-phi3");
  init_tiny("phi3", dir + "/base");
  const json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("model_type"), "phi3");
  EXPECT_EQ(cfg.at("architectures"), json::array({"Phi3ForCausalLM"}));
  EXPECT_TRUE(cfg.at("sliding_window").is_null());
  EXPECT_FALSE(cfg.contains("attention_bias"));
  const test::KeelRun mem = test::run_keel({"memory", "--model", dir + "/base", "--json"});
  ASSERT_EQ(mem.code, 0) << mem.output;
  // Embedding 259 x 32 (tied) and the final norm, and per layer: qkv_proj 32 -> (4 + 2 x 2) x 8,
  // o_proj 32 -> 32, gate_up_proj 32 -> 2 x 96, down_proj 96 -> 32, two norms of 32.
  const int64_t per_layer = 32 * 64 + 32 * 32 + 32 * 192 + 96 * 32 + 2 * 32;
  EXPECT_EQ(json::parse(mem.out).at("params").get<int64_t>(), 259 * 32 + 32 + per_layer);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  const json saved = train_falls(
      dir, {"model.adapter.kind=lora",
            "model.adapter.target_modules=[\"qkv_proj\", \"gate_up_proj\"]", "optim.lr=5e-2"});
  EXPECT_EQ(saved.at("model_type"), "phi3");
  // The adapter alone, as PEFT writes one for a Phi-3: its targets are the fused modules, and it
  // applies to the base as the run's checkpoint computes.
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  std::vector<std::string> targets =
      read_json_file(dir + "/peft/adapter_config.json").at("target_modules");
  std::sort(targets.begin(), targets.end());
  EXPECT_EQ(targets, (std::vector<std::string>{"gate_up_proj", "qkv_proj"}));
  // Its sliding window (Phi-3-mini-4k's 2047 of 4096) slides: rows past it score otherwise.
  const double full = eval_loss(dir + "/base", dir + "/t.txt");
  json sliding = cfg;
  sliding["sliding_window"] = 3;
  std::ofstream(dir + "/base/config.json") << sliding.dump(2);
  EXPECT_NE(eval_loss(dir + "/base", dir + "/t.txt"), full);
  // Phi-4-mini's partial rotary embedding turns 6 of the 8 channels: rows score otherwise.
  json partial = cfg;
  partial["partial_rotary_factor"] = 0.75;
  std::ofstream(dir + "/base/config.json") << partial.dump(2);
  EXPECT_NE(eval_loss(dir + "/base", dir + "/t.txt"), full);
  // A share of channels that is not pairs, and key/value heads the fused weights do not hold.
  partial["partial_rotary_factor"] = 0.4;
  expect_config_refused(
      dir, partial,
      dir +
          "/base/config.json: partial_rotary_factor = 0.4 of a head of 8 channels "
          "turns 3; RoPE turns pairs");
  partial["partial_rotary_factor"] = 1.5;
  expect_config_refused(
      dir, partial, dir + "/base/config.json: partial_rotary_factor must be a number in (0, 1]");
  json heads = cfg;
  heads["num_key_value_heads"] = 4;
  expect_config_refused(dir, heads,
                        dir + "/base/config.json: num_attention_heads = 4 but the weights in " +
                            dir +
                            "/base hold a qkv_proj of 64 rows, not (num_attention_heads 4 + 2 x "
                            "num_key_value_heads 4) x head_dim 8");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// A `layers`-layer `family` base in DIR/base from init-model (32 wide, 4 heads, 2 kv, init std
// 0.1), whose config.json names `family` and HF class `arch`. Returns its config.json.
json init_family(const std::string& family, const std::string& arch, const std::string& dir,
                 const std::string& layers) {
  // (GPT-NeoX's and GPT-J's key/value heads are their query heads; Falcon's 2 of 4 its
  // new_decoder_architecture.)
  const test::KeelRun init =
      test::run_keel({"init-model", "--family", family, "--out", dir + "/base", "--n-layer", layers,
                      "--n-embd", "32", "--n-head", "4", "--n-kv-head",
                      family == "gpt_neox" || family == "gptj" || family == "codegen" ? "4" : "2",
                      "--max-seq-len", "32", "--init-std", "0.1"});
  EXPECT_EQ(init.code, 0) << init.output;
  json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("model_type"), family);
  EXPECT_EQ(cfg.at("architectures"), json::array({arch}));
  return cfg;
}

// The greedy tokens keel generate continues "12+3" with from DIR/out, with and without its KV
// cache: the same 8.
void expect_cached_decode_agrees(const std::string& dir) {
  std::vector<std::string> tokens[2];
  std::string output;
  for (const bool cache : {true, false}) {
    std::vector<std::string> argv = {"generate",         dir + "/out", "12+3",
                                     "--max-new-tokens", "8",          "--json"};
    if (!cache) argv.push_back("--no-cache");
    const test::KeelRun g = test::run_keel(argv, {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(g.code, 0) << g.output;
    const json out = json::parse(g.out);  // (held: a range-for over a temporary's at() dangles)
    for (const json& t : out.at("tokens")) tokens[cache].push_back(t.dump());
    output = g.output;
  }
  EXPECT_EQ(tokens[0].size(), 8u) << output;
  EXPECT_EQ(tokens[0], tokens[1]);
}

// A SmolLM3 (SmolLM3ForCausalLM): init-model writes one whose every 4th layer has no RoPE, a LoRA
// on it trains and its adapter applies to the base as the run's checkpoint computes, the NoPE
// layers compute without rotation (a list with none scores otherwise; ModelParity's smollm3 checks
// how against PyTorch), and a list keel's model cannot follow, or its sliding window, is refused
// naming the field.
TEST(CliSmolLM3, InitModelWritesOneItsNoPeLayersComputeAndALoraTrains) {
  const std::string dir = test::temp_dir("cli-smollm3");
  const json cfg = init_family("smollm3", "SmolLM3ForCausalLM", dir, "4");
  EXPECT_EQ(cfg.at("no_rope_layers"), json::array({1, 1, 1, 0}));
  EXPECT_EQ(cfg.at("no_rope_layer_interval"), 4);
  EXPECT_EQ(cfg.at("tie_word_embeddings"), true);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  const json saved = train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"});
  EXPECT_EQ(saved.at("no_rope_layers"), json::array({1, 1, 1, 0}));
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  // Layer 3 rotates when the list says so: another loss.
  const double nope = eval_loss(dir + "/base", dir + "/t.txt");
  json rotating = cfg;
  rotating["no_rope_layers"] = {1, 1, 1, 1};
  std::ofstream(dir + "/base/config.json") << rotating.dump(2);
  EXPECT_NE(eval_loss(dir + "/base", dir + "/t.txt"), nope);
  json irregular = cfg;
  irregular["no_rope_layers"] = {1, 0, 1, 1};
  expect_config_refused(dir, irregular,
                        dir +
                            "/base/config.json: no_rope_layers [1,0,1,1] (keel's SmolLM3 leaves "
                            "RoPE out of every Nth layer");
  json sliding = cfg;
  sliding["use_sliding_window"] = true;
  sliding["sliding_window"] = 8;
  expect_config_refused(dir, sliding,
                        dir +
                            "/base/config.json: use_sliding_window = true (SmolLM3's window on its "
                            "NoPE layers) is not supported");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// An OLMo-2 (Olmo2ForCausalLM): init-model writes one without input norms and with q/k norms over
// the whole projections, a LoRA on it trains and its PEFT adapter applies to the base as the run's
// checkpoint computes (ModelParity's olmo2 checks the layers against PyTorch), and attention
// sinks are refused naming the field.
TEST(CliOlmo2, InitModelWritesOneAndALoraTrains) {
  const std::string dir = test::temp_dir("cli-olmo2");
  init_tiny("olmo2", dir + "/base");
  const json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("model_type"), "olmo2");
  EXPECT_EQ(cfg.at("architectures"), json::array({"Olmo2ForCausalLM"}));
  const test::KeelRun mem = test::run_keel({"memory", "--model", dir + "/base", "--json"});
  ASSERT_EQ(mem.code, 0) << mem.output;
  // Embedding 259 x 32 (tied), the final norm, and per layer: q_proj 32 -> 32, k_proj and v_proj
  // 32 -> 16, o_proj, gate/up 32 -> 96, down 96 -> 32, q_norm 32, k_norm 16, two norms of 32.
  const int64_t per_layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 96 + 32 + 16 + 2 * 32;
  EXPECT_EQ(json::parse(mem.out).at("params").get<int64_t>(), 259 * 32 + 32 + per_layer);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"}).at("model_type"),
            "olmo2");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  expect_sinks_refused(dir, cfg, "olmo2");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// Cohere (CohereForCausalLM): init-model writes one with CohereConfig's names (layer_norm_eps,
// logit_scale, use_qk_norm), keel memory counts one norm a layer (its MLP shares the attention's),
// a LoRA trains and its PEFT adapter applies as the checkpoint computes, and a decode with the
// cache gives the tokens a decode without it gives (its keys cached reordered for the
// adjacent-pair RoPE).
TEST(CliCohere, InitModelWritesOneALoraTrainsAndTheCacheDecodesAsTheWholeSequence) {
  const std::string dir = test::temp_dir("cli-cohere");
  const json cfg = init_family("cohere", "CohereForCausalLM", dir, "2");
  EXPECT_EQ(cfg.at("logit_scale"), 0.0625);
  EXPECT_EQ(cfg.at("layer_norm_eps"), 1e-5);
  EXPECT_EQ(cfg.at("use_qk_norm"), false);
  EXPECT_EQ(cfg.at("tie_word_embeddings"), true);
  EXPECT_FALSE(cfg.contains("rms_norm_eps"));
  const test::KeelRun mem = test::run_keel({"memory", "--model", dir + "/base", "--json"});
  ASSERT_EQ(mem.code, 0) << mem.output;
  // Embedding 259 x 32 (tied), the final norm, and per layer: q_proj and o_proj 32 x 32, k_proj
  // and v_proj 16 x 32, gate/up/down 3 x 32 x 96, one norm of 32.
  const int64_t per_layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 96 + 32;
  EXPECT_EQ(json::parse(mem.out).at("params").get<int64_t>(), 259 * 32 + 32 + 2 * per_layer);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"}).at("model_type"),
            "cohere");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
}

// Phi (PhiForCausalLM: Phi-1, Phi-1.5, Phi-2): the attention and a gelu MLP side by side on one
// LayerNorm with a bias, biases on every projection and the head, RoPE on half of each head
// (PhiConfig's default; Phi-2's 0.4). init-model writes one, keel memory counts its biases, a LoRA
// trains and its PEFT adapter applies, the cached decode equals the uncached, its file's residual
// dropout is said not to be applied, and what keel's model cannot compute is refused.
TEST(CliPhi, InitModelWritesOneALoraTrainsAndItsResidualDropoutIsSaid) {
  const std::string dir = test::temp_dir("cli-phi");
  json cfg = init_family("phi", "PhiForCausalLM", dir, "2");
  EXPECT_EQ(cfg.at("partial_rotary_factor"), 0.5);
  EXPECT_EQ(cfg.at("hidden_act"), "gelu_new");
  EXPECT_EQ(cfg.at("layer_norm_eps"), 1e-5);
  EXPECT_EQ(cfg.at("tie_word_embeddings"), false);
  EXPECT_EQ(cfg.at("qk_layernorm"), false);
  const test::KeelRun mem = test::run_keel({"memory", "--model", dir + "/base", "--json"});
  ASSERT_EQ(mem.code, 0) << mem.output;
  // The embedding and lm_head 259 x 32 (with a bias), the final norm's weight and bias; per
  // layer: one norm's 2 x 32, q_proj and dense 32 x 32, k_proj and v_proj 16 x 32, fc1 and fc2
  // 32 x 96, each with its bias.
  const int64_t per_layer =
      64 + 2 * (32 * 32 + 32) + 2 * (32 * 16 + 16) + 32 * 96 + 96 + 96 * 32 + 32;
  EXPECT_EQ(json::parse(mem.out).at("params").get<int64_t>(),
            2 * 259 * 32 + 259 + 64 + 2 * per_layer);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  cfg["resid_pdrop"] = 0.1;  // Phi-2's
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  const json saved = train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"});
  EXPECT_EQ(saved.at("model_type"), "phi");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
  const test::KeelRun said = test::run_keel(
      test::with_sets({"train"}, {"model.path=" + dir + "/base", "run.out_dir=" + dir + "/said",
                                  "train.max_steps=1", "data.seq_len=24", "run.threads=1",
                                  "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(said.code, 0) << said.output;
  EXPECT_CONTAINS(said.output,
                  "resid_pdrop = 0.1 (HF trains with it) differs from model.dropout = 0.0 (no "
                  "dropout); set model.dropout = 0.1 to train as HF does");
  // With it, the run drops the attention's and the MLP's outputs (another loss, the same at each
  // repeat: the masks come from run.seed), and the export says the dropout it trained with.
  auto dropped_run = [&](const std::string& out, double p) {
    const test::KeelRun r = test::run_keel(
        test::with_sets({"train"}, {"model.path=" + dir + "/base", "run.out_dir=" + dir + out,
                                    "train.max_steps=2", "data.seq_len=24", "run.threads=1",
                                    "log.tensorboard=false", "model.dropout=" + std::to_string(p)}),
        {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
    const std::vector<json> steps = test::step_records(dir + out);
    return steps.empty() ? -1.0 : steps.front().at("loss").get<double>();
  };
  const double plain = dropped_run("/p0", 0), dropped = dropped_run("/p1", 0.1);
  EXPECT_NE(dropped, plain);
  EXPECT_EQ(dropped_run("/p1b", 0.1), dropped);
  const test::KeelRun ex = test::run_keel({"export", dir + "/p1", "--out", dir + "/p1-hf"});
  ASSERT_EQ(ex.code, 0) << ex.output;
  EXPECT_EQ(read_json_file(dir + "/p1-hf/config.json").at("resid_pdrop"), 0.1);
  // RoPE on another share of each head computes otherwise; one that is not pairs, or a q/k norm,
  // is refused naming the field.
  const double half = eval_with(dir, cfg);
  EXPECT_NE(eval_with(dir, cfg, {{"partial_rotary_factor", 0.25}}), half);
  json quarter = cfg;
  quarter["partial_rotary_factor"] = 0.4;
  expect_config_refused(dir, quarter,
                        dir +
                            "/base/config.json: partial_rotary_factor = 0.4 of a head of 8 "
                            "channels turns 3; RoPE turns pairs");
  // With qk_layernorm its attention reads q_layernorm and k_layernorm, which these files lack.
  expect_missing_tensor(dir, cfg, {{"qk_layernorm", true}},
                        "model.layers.0.self_attn.q_layernorm.weight");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// GPT-NeoX (GPTNeoXForCausalLM: Pythia, GPT-NeoX-20B): Phi's sublayers under its own names, q, k
// and v one query_key_value whose rows go head by head, a norm for each branch, RoPE on a quarter
// of each head, and the branches side by side or (use_parallel_residual = false) in sequence.
// init-model writes one, a LoRA on query_key_value (PEFT's target for it) trains and its adapter
// applies, the cached decode equals the uncached, both layouts compute, and the causal-mask and
// rotary buffers Pythia's files hold are skipped.
TEST(CliGptNeox, InitModelWritesOneALoraOnQueryKeyValueTrainsAndBothResidualsCompute) {
  const std::string dir = test::temp_dir("cli-gpt-neox");
  const json cfg = init_family("gpt_neox", "GPTNeoXForCausalLM", dir, "2");
  EXPECT_EQ(cfg.at("rotary_pct"), 0.25);
  EXPECT_EQ(cfg.at("rotary_emb_base"), 10000.0);
  EXPECT_EQ(cfg.at("hidden_act"), "gelu");
  EXPECT_EQ(cfg.at("use_parallel_residual"), true);
  EXPECT_EQ(cfg.at("attention_bias"), true);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  const double parallel = eval_loss(dir + "/base", dir + "/t.txt");
  // Pythia's buffers beside its weights: read past, the model unchanged
  expect_buffers_skipped(
      dir,
      {"gpt_neox.layers.0.attention.bias", "gpt_neox.layers.0.attention.masked_bias",
       "gpt_neox.layers.0.attention.rotary_emb.inv_freq"},
      parallel);
  const json saved =
      train_falls(dir, {"model.adapter.kind=lora",
                        "model.adapter.target_modules=[\"query_key_value\"]", "optim.lr=5e-2"});
  EXPECT_EQ(saved.at("model_type"), "gpt_neox");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
  // keel's default targets (q_proj, v_proj) name no layer of it: said with the names it has.
  const test::KeelRun wrong = test::run_keel(
      test::with_sets({"train"}, {"model.path=" + dir + "/base", "run.out_dir=" + dir + "/wrong",
                                  "model.adapter.kind=lora", "train.max_steps=1"}),
      {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(wrong.code, 2) << wrong.output;
  EXPECT_CONTAINS(wrong.err, "query_key_value, dense, dense_h_to_4h, dense_4h_to_h");
  // The branches in sequence compute otherwise than side by side.
  EXPECT_NE(eval_with(dir, cfg, {{"use_parallel_residual", false}}), parallel);
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// Falcon (FalconForCausalLM): GPT-NeoX's sublayers without biases under its names, q, k and v
// one query_key_value whose rows go key/value group by group. init-model writes Falcon-40B's
// layout for 2 key/value heads of 4 (new_decoder_architecture, ln_attn and ln_mlp) and Falcon-7B's
// for one (multi_query, one norm), a LoRA on query_key_value trains and its adapter applies, the
// cached decode equals the uncached, its hidden_dropout is model.dropout's (on the branches' sum),
// and what HF's FalconDecoderLayer cannot run, ALiBi and biases are refused naming the field.
TEST(CliFalcon, InitModelWritesBothLayoutsALoraOnQueryKeyValueTrainsAndRefusalsNameTheField) {
  const std::string dir = test::temp_dir("cli-falcon");
  const json cfg = init_family("falcon", "FalconForCausalLM", dir, "2");
  EXPECT_EQ(cfg.at("new_decoder_architecture"), true);
  EXPECT_EQ(cfg.at("num_kv_heads"), 2);
  EXPECT_EQ(cfg.at("num_ln_in_parallel_attn"), 2);
  EXPECT_EQ(cfg.at("parallel_attn"), true);
  EXPECT_EQ(cfg.at("activation"), "gelu");
  EXPECT_EQ(cfg.at("layer_norm_epsilon"), 1e-5);
  EXPECT_EQ(cfg.at("tie_word_embeddings"), true);
  EXPECT_EQ(cfg.at("bias"), false);
  EXPECT_FALSE(cfg.contains("head_dim"));  // (a property of FalconConfig: a key would not load)
  const io::Safetensors st = io::read_safetensors(dir + "/base/model.safetensors");
  std::vector<std::string> names;
  for (const auto& [name, t] : st.tensors) names.push_back(name);
  for (const char* name :
       {"transformer.word_embeddings.weight", "transformer.h.1.ln_attn.bias",
        "transformer.h.1.ln_mlp.weight", "transformer.h.0.self_attention.query_key_value.weight",
        "transformer.h.0.mlp.dense_4h_to_h.weight", "transformer.ln_f.weight"})
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  const double plain = eval_loss(dir + "/base", dir + "/t.txt");
  EXPECT_EQ(
      train_falls(dir, {"model.adapter.kind=lora",
                        "model.adapter.target_modules=[\"query_key_value\"]", "optim.lr=5e-2"})
          .at("model_type"),
      "falcon");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
  // Its hidden_dropout drops the branches' sum while training: another loss, and the export
  // writes it back.
  auto first_loss = [&](const std::string& out, const std::vector<std::string>& sets) {
    std::vector<std::string> all = {"model.path=" + dir + "/base",
                                    "run.out_dir=" + dir + out,
                                    "train.max_steps=1",
                                    "data.seq_len=24",
                                    "run.threads=1",
                                    "log.tensorboard=false"};
    all.insert(all.end(), sets.begin(), sets.end());
    const test::KeelRun r = test::run_keel(test::with_sets({"train"}, all), {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
    const std::vector<json> steps = test::step_records(dir + out);
    return steps.empty() ? -1.0 : steps.front().at("loss").get<double>();
  };
  EXPECT_NE(first_loss("/d1", {"model.dropout=0.1"}), first_loss("/d0", {}));
  const test::KeelRun ex = test::run_keel({"export", dir + "/d1", "--out", dir + "/d1-hf"});
  ASSERT_EQ(ex.code, 0) << ex.output;
  EXPECT_EQ(read_json_file(dir + "/d1-hf/config.json").at("hidden_dropout"), 0.1);
  // A parallel Falcon drops no attention output or probabilities (HF's): the key is refused.
  const test::KeelRun attn = test::run_keel(
      test::with_sets({"train"}, {"model.path=" + dir + "/base", "run.out_dir=" + dir + "/ad",
                                  "train.max_steps=1", "model.attention_dropout=0.1"}),
      {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(attn.code, 2) << attn.output;
  EXPECT_CONTAINS(attn.err, "falcon's parallel blocks drop no attention output or probabilities");
  // One norm a block (num_ln_in_parallel_attn 1, Falcon2-11B's) reads input_layernorm, which
  // these files do not hold: named.
  expect_missing_tensor(dir, cfg, {{"num_ln_in_parallel_attn", 1}},
                        "transformer.h.0.input_layernorm.weight");
  json refused = cfg;
  refused["alibi"] = true;
  expect_config_refused(dir, refused,
                        dir +
                            "/base/config.json: alibi = true (Falcon-RW's ALiBi position "
                            "biases in place of RoPE) is not supported by keel's falcon model");
  refused = cfg;
  refused["bias"] = true;
  expect_config_refused(dir, refused, dir + "/base/config.json: bias = true (Falcon-RW's");
  refused = cfg;
  refused["parallel_attn"] = false;
  expect_config_refused(dir, refused,
                        "parallel_attn = false with new_decoder_architecture = true (HF's "
                        "FalconDecoderLayer then has no input for its MLP)");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  EXPECT_EQ(eval_loss(dir + "/base", dir + "/t.txt"), plain);
  // Falcon-7B's layout: one key/value head (multi_query), one norm a block.
  const std::string seven = test::temp_dir("cli-falcon-7b");
  const test::KeelRun init = test::run_keel({"init-model", "--family", "falcon", "--out", seven,
                                             "--n-layer", "1", "--n-embd", "32", "--n-head", "4",
                                             "--n-kv-head", "1", "--max-seq-len", "32"});
  ASSERT_EQ(init.code, 0) << init.output;
  const json mq = read_json_file(seven + "/config.json");
  EXPECT_EQ(mq.at("new_decoder_architecture"), false);
  EXPECT_EQ(mq.at("multi_query"), true);
  const io::Safetensors mq_st = io::read_safetensors(seven + "/model.safetensors");
  for (const auto& [name, t] : mq_st.tensors) {
    if (name == "transformer.h.0.self_attention.query_key_value.weight") {
      EXPECT_EQ(t.shape(), (Shape{(4 + 2) * 8, 32}));
    }
    EXPECT_EQ(name.find("ln_mlp"), std::string::npos) << name;
  }
  EXPECT_GT(eval_loss(seven, dir + "/t.txt"), 0.0);
}

// StableLM (StableLmForCausalLM: StableLM-2-1.6B, StableLM-3B-4E1T): Llama's layers with biased
// LayerNorms, q/k/v biases (use_qkv_bias) and RoPE on a quarter of each head. init-model writes
// StableLM-2-1.6B's layout, a LoRA trains and its adapter applies, the cached decode equals the
// uncached, and the 12B's use_parallel_residual computes (its per-head qk_layernorm reads norms
// these files lack: named).
TEST(CliStableLm, InitModelWritesOneALoraTrainsAndTheParallelBlockComputes) {
  const std::string dir = test::temp_dir("cli-stablelm");
  const json cfg = init_family("stablelm", "StableLmForCausalLM", dir, "2");
  EXPECT_EQ(cfg.at("partial_rotary_factor"), 0.25);
  EXPECT_EQ(cfg.at("use_qkv_bias"), true);
  EXPECT_EQ(cfg.at("use_parallel_residual"), false);
  EXPECT_EQ(cfg.at("layer_norm_eps"), 1e-5);
  EXPECT_EQ(cfg.at("hidden_act"), "silu");
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"}).at("model_type"),
            "stablelm");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
  // The parallel block reads post_attention_layernorm no more: its weights are then refused as
  // unexpected, and without them the block computes otherwise.
  const double sequential = eval_loss(dir + "/base", dir + "/t.txt");
  json parallel = cfg;
  parallel["use_parallel_residual"] = true;
  std::ofstream(dir + "/base/config.json") << parallel.dump(2);
  const test::KeelRun r =
      test::run_keel({"eval", dir + "/base", "--data", dir + "/t.txt", "--tokenizer", "byte"});
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "post_attention_layernorm");
  // The 12B's qk_layernorm reads a norm per head, which these files lack.
  expect_missing_tensor(dir, cfg, {{"qk_layernorm", true}},
                        "model.layers.0.self_attn.q_layernorm.norms.0.weight");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  EXPECT_EQ(eval_loss(dir + "/base", dir + "/t.txt"), sequential);
}

// OLMo (OlmoForCausalLM: OLMo-1B, OLMo-7B): Llama's layers with LayerNorms that have no
// parameters. init-model writes one without norm tensors, a LoRA trains and its adapter applies,
// the cached decode equals the uncached, and OLMo-1.7's clamp of q, k and v (clip_qkv) computes
// (a bound below the projections' values otherwise than none; one not positive is refused).
TEST(CliOlmo, InitModelWritesOneWithoutNormWeightsAndALoraTrains) {
  const std::string dir = test::temp_dir("cli-olmo");
  const json cfg = init_family("olmo", "OlmoForCausalLM", dir, "2");
  EXPECT_TRUE(cfg.at("clip_qkv").is_null());
  const test::KeelRun mem = test::run_keel({"memory", "--model", dir + "/base", "--json"});
  ASSERT_EQ(mem.code, 0) << mem.output;
  // The embedding 259 x 32 (tied) and per layer q_proj and o_proj 32 x 32, k_proj and v_proj
  // 16 x 32, gate/up/down 3 x 32 x 96: no norm holds a parameter.
  EXPECT_EQ(json::parse(mem.out).at("params").get<int64_t>(),
            259 * 32 + 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 96));
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"}).at("model_type"),
            "olmo");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
  const double unclipped = eval_with(dir, cfg);
  // (8: above every value here, the same loss)
  EXPECT_EQ(eval_with(dir, cfg, {{"clip_qkv", 8.0}}), unclipped);
  EXPECT_NE(eval_with(dir, cfg, {{"clip_qkv", 0.05}}), unclipped);
  json clip = cfg;
  clip["clip_qkv"] = 0;
  expect_config_refused(dir, clip,
                        dir +
                            "/base/config.json: clip_qkv = 0 must be a positive bound "
                            "(OLMo-1.7's 8), or null for none");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// GLM (GlmForCausalLM: GLM-4-9B) and GLM-4-0414 (Glm4ForCausalLM, GLM-Z1): q/k/v biases, gate and
// up as one gate_up_proj, RoPE on adjacent pairs of half of each head; GLM-4-0414 adds a norm after
// the attention and one after the MLP under its names. init-model writes each, a LoRA on q_proj and
// gate_up_proj trains and its adapter applies, the cached decode equals the uncached, and another
// share of turned channels computes otherwise.
TEST(CliGlm, InitModelWritesEachALoraOnGateUpTrainsAndTheCacheDecodesAsTheWholeSequence) {
  for (const auto& [family, arch] :
       {std::pair{"glm", "GlmForCausalLM"}, std::pair{"glm4", "Glm4ForCausalLM"}}) {
    SCOPED_TRACE(family);
    const std::string dir = test::temp_dir(std::string("cli-") + family);
    const json cfg = init_family(family, arch, dir, "2");
    EXPECT_EQ(cfg.at("partial_rotary_factor"), 0.5);
    EXPECT_EQ(cfg.at("attention_bias"), true);
    std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
    EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora",
                                "model.adapter.target_modules=[\"q_proj\", \"gate_up_proj\"]",
                                "optim.lr=5e-2"})
                  .at("model_type"),
              family);
    ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
    ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
    const double half = eval_with(dir, cfg);
    EXPECT_NE(eval_with(dir, cfg, {{"partial_rotary_factor", 1.0}}), half);
    std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  }
}

// A 4-layer `family` base in DIR/base from init-model: three sliding layers and a full one over
// its config's default window (4096) under HF architecture `arch`. Returns its config.json.
json init_three_of_four_sliding(const std::string& family, const std::string& arch,
                                const std::string& dir) {
  json cfg = init_family(family, arch, dir, "4");
  EXPECT_EQ(cfg.at("layer_types"), json::array({"sliding_attention", "sliding_attention",
                                                "sliding_attention", "full_attention"}));
  EXPECT_EQ(cfg.at("sliding_window"), 4096);
  return cfg;
}

// DIR/base's config `cfg` with its full layer first (a layout no period gives) is refused naming
// layer_types and `family`'s layout.
void expect_full_layer_first_refused(const std::string& dir, json cfg, const std::string& family) {
  cfg["layer_types"] = {"full_attention", "sliding_attention", "sliding_attention",
                        "sliding_attention"};
  expect_config_refused(dir, cfg,
                        dir +
                            "/base/config.json: layer_types [\"full_attention\","
                            "\"sliding_attention\",\"sliding_attention\",\"sliding_attention\"] "
                            "(keel's " +
                            family + " slides all layers but every Nth");
}

// Cohere2 (Command-R7B): init-model writes three sliding layers and a full one, a LoRA trains and
// its PEFT adapter applies; a full layer first is refused naming layer_types.
TEST(CliCohere, Cohere2WritesItsSlidingLayersAndALoraTrains) {
  const std::string dir = test::temp_dir("cli-cohere2");
  const json cfg = init_three_of_four_sliding("cohere2", "Cohere2ForCausalLM", dir);
  EXPECT_EQ(cfg.at("sliding_window_pattern"), 4);
  EXPECT_EQ(cfg.at("logit_scale"), 0.0625);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"}).at("model_type"),
            "cohere2");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  expect_full_layer_first_refused(dir, cfg, "cohere2");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// EXAONE-4 (Exaone4ForCausalLM): OLMo-2's norms after each sublayer with a q/k norm per head;
// three of every four layers slide, and where the model slides its full layers take no RoPE (HF's
// global NoPE).
TEST(CliExaone4, InitModelWritesOneItsFullLayersTakeNoRopeAndALoraTrains) {
  const std::string dir = test::temp_dir("cli-exaone4");
  json cfg = init_three_of_four_sliding("exaone4", "Exaone4ForCausalLM", dir);
  const json types = cfg.at("layer_types");
  EXPECT_EQ(cfg.at("sliding_window_pattern"), 4);
  cfg["sliding_window"] = 6;  // a window the rows (24 tokens) outgrow
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  std::ofstream(dir + "/t.txt") << "12+34=46 and 5+7=12\n\n90+9=99 and 1+2=3\n";
  const json saved = train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"});
  EXPECT_EQ(saved.at("layer_types"), types);
  EXPECT_EQ(saved.at("sliding_window"), 6);
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  // What the window and the NoPE change: a window wider than the rows still leaves the full layer
  // without RoPE, and without a window (null) every layer rotates and sees every key.
  const double exaone4 = eval_loss(dir + "/base", dir + "/t.txt");
  json wide = cfg;
  wide["sliding_window"] = 4096;
  std::ofstream(dir + "/base/config.json") << wide.dump(2);
  const double wide_loss = eval_loss(dir + "/base", dir + "/t.txt");
  EXPECT_NE(wide_loss, exaone4) << "the window";
  json no_window = cfg;
  no_window["sliding_window"] = nullptr;
  std::ofstream(dir + "/base/config.json") << no_window.dump(2);
  EXPECT_NE(eval_loss(dir + "/base", dir + "/t.txt"), wide_loss) << "the full layer's NoPE";
  // The pattern without layer_types (Exaone4Config's "LLLG" form) reads as the list does.
  json letters = cfg;
  letters.erase("layer_types");
  letters["sliding_window_pattern"] = "LLLG";
  std::ofstream(dir + "/base/config.json") << letters.dump(2);
  EXPECT_EQ(eval_loss(dir + "/base", dir + "/t.txt"), exaone4);
  json listed = cfg;  // beside layer_types a pattern is not read (HF's Exaone4Config)
  listed["sliding_window_pattern"] = "LLG";
  std::ofstream(dir + "/base/config.json") << listed.dump(2);
  EXPECT_EQ(eval_loss(dir + "/base", dir + "/t.txt"), exaone4);
  json odd = letters;
  odd["sliding_window_pattern"] = "LLG";  // 4 layers: its last one would slide
  expect_config_refused(dir, odd,
                        dir +
                            "/base/config.json: sliding_window_pattern \"LLG\" (keel's exaone4 "
                            "slides all layers but every Nth");
  expect_full_layer_first_refused(dir, cfg, "exaone4");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// An OLMo-3 (Olmo3ForCausalLM): init-model writes one whose layers slide three of every four
// (Olmo3Config's layer_types), a LoRA on it trains and its adapter applies to the base as the
// run's checkpoint computes; its sliding layers rotate without the file's YaRN and its full ones
// with it (ModelParity's olmo3 checks how against PyTorch, the export test that PyTorch reads
// the export so), and a pattern keel's model cannot follow is refused naming the field.
TEST(CliOlmo3, InitModelWritesOneItsSlidingLayersRotateUnscaledAndALoraTrains) {
  const std::string dir = test::temp_dir("cli-olmo3");
  json cfg = init_three_of_four_sliding("olmo3", "Olmo3ForCausalLM", dir);
  const json types = cfg.at("layer_types");
  // keel writes its RoPE in both forms (rope_theta per layer type for transformers 5): the older
  // alone is edited here. A window the rows outgrow (24 tokens), and OLMo-3's YaRN (its factor 8
  // over 8192).
  EXPECT_EQ(cfg.at("rope_parameters").at("sliding_attention").at("rope_type"), "default");
  cfg.erase("rope_parameters");
  cfg["sliding_window"] = 6;
  cfg["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  std::ofstream(dir + "/t.txt") << "12+34=46 and 5+7=12\n\n90+9=99 and 1+2=3\n";  // > 6
  const json saved = train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"});
  EXPECT_EQ(saved.at("layer_types"), types);
  EXPECT_EQ(saved.at("sliding_window"), 6);
  EXPECT_EQ(saved.at("rope_parameters").at("full_attention").at("rope_type"), "yarn");
  EXPECT_EQ(saved.at("rope_parameters").at("sliding_attention").at("rope_type"), "default");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  // What the window and the scaling change: the layers that slide see fewer keys, and only the
  // full layer rotates by YaRN (no scaling scores otherwise).
  const double olmo3 = eval_loss(dir + "/base", dir + "/t.txt");
  json wide = cfg;
  wide["sliding_window"] = 4096;
  std::ofstream(dir + "/base/config.json") << wide.dump(2);
  EXPECT_NE(eval_loss(dir + "/base", dir + "/t.txt"), olmo3) << "the window";
  json unscaled = cfg;
  unscaled.erase("rope_scaling");
  std::ofstream(dir + "/base/config.json") << unscaled.dump(2);
  EXPECT_NE(eval_loss(dir + "/base", dir + "/t.txt"), olmo3) << "the full layer's YaRN";
  // With a window wider than the rows and no scaling, the same weights score as an OLMo-2.
  wide.erase("rope_scaling");
  std::ofstream(dir + "/base/config.json") << wide.dump(2);
  const double wide_unscaled = eval_loss(dir + "/base", dir + "/t.txt");
  json as_olmo2 = wide;
  as_olmo2["model_type"] = "olmo2";
  as_olmo2["architectures"] = {"Olmo2ForCausalLM"};
  for (const char* k : {"sliding_window", "layer_types"}) as_olmo2.erase(k);
  std::ofstream(dir + "/base/config.json") << as_olmo2.dump(2);
  EXPECT_EQ(eval_loss(dir + "/base", dir + "/t.txt"), wide_unscaled);
  json no_window = cfg;
  no_window["sliding_window"] = nullptr;
  expect_config_refused(dir, no_window,
                        dir +
                            "/base/config.json: sliding_window = null (transformers' Olmo3 needs "
                            "a window; an OLMo-3 whose layers all see every key is an OLMo-2");
  expect_full_layer_first_refused(dir, cfg, "olmo3");
  expect_sinks_refused(dir, cfg, "olmo3");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// A Granite (GraniteForCausalLM): init-model writes one with Granite-3's multipliers, it trains
// whole and its checkpoint and export are Granites, the multipliers change what it computes
// (ModelParity's granite checks how against PyTorch), and one that is not a positive number is
// refused naming the field.
TEST(CliGranite, InitModelWritesOneItsMultipliersComputeAndItTrains) {
  const std::string dir = test::temp_dir("cli-granite");
  init_tiny("granite", dir + "/base");
  const json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("model_type"), "granite");
  EXPECT_EQ(cfg.at("architectures"), json::array({"GraniteForCausalLM"}));
  EXPECT_EQ(cfg.at("embedding_multiplier"), 12.0);
  EXPECT_EQ(cfg.at("residual_multiplier"), 0.22);
  EXPECT_EQ(cfg.at("attention_multiplier"), 0.125);  // 1 / head_dim 8
  EXPECT_EQ(cfg.at("logits_scaling"), 8.0);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  const json saved = train_falls(dir, {"optim.lr=1e-2"});
  EXPECT_EQ(saved.at("model_type"), "granite");
  EXPECT_EQ(saved.at("logits_scaling"), 8.0);
  // Each multiplier at 1 (GraniteConfig's default) scores otherwise.
  const double granite = eval_loss(dir + "/base", dir + "/t.txt");
  for (const char* field :
       {"embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"}) {
    json plain = cfg;
    plain[field] = 1.0;
    std::ofstream(dir + "/base/config.json") << plain.dump(2);
    EXPECT_NE(eval_loss(dir + "/base", dir + "/t.txt"), granite) << field;
  }
  json bad = cfg;
  bad["residual_multiplier"] = -0.5;
  expect_config_refused(dir, bad,
                        dir +
                            "/base/config.json: residual_multiplier must be a positive number, "
                            "got -0.5");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// A Gemma (GemmaForCausalLM) and a Gemma-2 (Gemma2ForCausalLM): init-model writes them, keel
// memory counts a Gemma-2's four norms a layer, a Gemma trains whole (its tied head on the scaled
// embedding), a Gemma-2's LoRA trains and its PEFT adapter applies to the base as the run's
// checkpoint computes, its window and soft caps change what rows past them score (ModelParity's
// gemma and gemma2 check how against PyTorch), and what keel's model cannot compute is refused
// naming the field.
TEST(CliGemma, InitModelWritesBothAndTheyTrainAndExport) {
  const std::string dir = test::temp_dir("cli-gemma");
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n\n1+1=2\n";
  auto train = [&](const std::string& base, const std::string& out, std::vector<std::string> sets) {
    sets.insert(sets.end(), {"run.out_dir=" + out, "run.threads=1", "model.path=" + base,
                             "data.seq_len=24", "log.every=1", "log.tensorboard=false"});
    const test::KeelRun r = test::run_keel(test::with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
    const std::vector<json> steps = test::step_records(out);
    EXPECT_FALSE(steps.empty()) << r.output;
    if (!steps.empty()) {
      EXPECT_LT(steps.back().at("loss").get<double>(), steps.front().at("loss").get<double>())
          << r.output;
    }
  };
  init_tiny("gemma", dir + "/gemma");
  const json g1 = read_json_file(dir + "/gemma/config.json");
  EXPECT_EQ(g1.at("architectures"), json::array({"GemmaForCausalLM"}));
  EXPECT_EQ(g1.at("hidden_activation"), "gelu_pytorch_tanh");
  EXPECT_EQ(g1.at("tie_word_embeddings"), true);
  train(dir + "/gemma", dir + "/gemma-run", {"train.max_steps=8", "optim.lr=1e-2"});
  EXPECT_EQ(read_json_file(dir + "/gemma-run/checkpoints/last/config.json").at("model_type"),
            "gemma");

  init_tiny("gemma2", dir + "/base");
  const json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("architectures"), json::array({"Gemma2ForCausalLM"}));
  EXPECT_EQ(cfg.at("attn_logit_softcapping"), 50.0);
  EXPECT_EQ(cfg.at("final_logit_softcapping"), 30.0);
  EXPECT_EQ(cfg.at("query_pre_attn_scalar"), 8.0);  // the head width: 32 / 4
  EXPECT_EQ(cfg.at("sliding_window"), 4096);
  const test::KeelRun mem = test::run_keel({"memory", "--model", dir + "/base", "--json"});
  ASSERT_EQ(mem.code, 0) << mem.output;
  // Embedding 259 x 32 (tied), the final norm; per layer q 32 -> 32, k and v 32 -> 16, o 32 -> 32,
  // gate, up and down 32 x 96, four norms of 32.
  const int64_t per_layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 96 + 4 * 32;
  EXPECT_EQ(json::parse(mem.out).at("params").get<int64_t>(), 259 * 32 + 32 + per_layer);
  train(dir + "/base", dir + "/out",
        {"model.adapter.kind=lora",
         "model.adapter.target_modules=[\"q_proj\", \"v_proj\", \"down_proj\"]",
         "train.max_steps=8", "optim.lr=5e-2"});
  const test::KeelRun ex =
      test::run_keel({"export", dir + "/out", "--out", dir + "/peft", "--adapter-only"});
  ASSERT_EQ(ex.code, 0) << ex.output;
  EXPECT_NEAR(eval_loss(dir + "/base", dir + "/t.txt", {"--adapter", dir + "/peft"}),
              eval_loss(dir + "/out", dir + "/t.txt"), 1e-5);
  // Its window (every other layer from the first) and its caps change what rows score.
  const double plain = eval_loss(dir + "/base", dir + "/t.txt");
  auto with = [&](const char* key, const json& value) {
    json c = cfg;
    c[key] = value;
    std::ofstream(dir + "/base/config.json") << c.dump(2);
    const double loss = eval_loss(dir + "/base", dir + "/t.txt");
    std::ofstream(dir + "/base/config.json") << cfg.dump(2);
    return loss;
  };
  EXPECT_NE(with("sliding_window", 3), plain);
  EXPECT_NE(with("attn_logit_softcapping", 0.05), plain);
  EXPECT_NE(with("final_logit_softcapping", 0.5), plain);
  EXPECT_EQ(with("final_logit_softcapping", nullptr), with("final_logit_softcapping", 1e9));
  // What keel's Gemma cannot compute, named with its field.
  auto refused = [&](const char* key, const json& value, const std::string& message) {
    json c = cfg;
    c[key] = value;
    std::ofstream(dir + "/base/config.json") << c.dump(2);
    const test::KeelRun r =
        test::run_keel({"eval", dir + "/base", "--data", dir + "/t.txt", "--tokenizer", "byte"});
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, dir + "/base/config.json: " + message);
    std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  };
  refused("hidden_activation", "gelu",
          "hidden_activation 'gelu' (keel's Gemma MLP is GeGLU with the tanh gelu");
  refused("layer_types", json::array({"full_attention"}),
          "layer_types [\"full_attention\"] (keel's gemma2 slides every other layer");
  refused("query_pre_attn_scalar", -1.0,
          "query_pre_attn_scalar must be a positive number (or null: none), got -1.0");
  // A Gemma-3 (one layer: a sliding one, five of every six): its sliding layers rotate by
  // rope_local_base_freq, not rope_theta; its layer pattern is read from layer_types.
  init_tiny("gemma3", dir + "/g3");
  const json g3 = read_json_file(dir + "/g3/config.json");
  EXPECT_EQ(g3.at("architectures"), json::array({"Gemma3ForCausalLM"}));
  EXPECT_EQ(g3.at("model_type"), "gemma3_text");
  EXPECT_EQ(g3.at("layer_types"), json::array({"sliding_attention"}));
  EXPECT_EQ(g3.at("sliding_window_pattern"), 6);
  EXPECT_EQ(g3.at("rope_local_base_freq"), 10000.0);
  train(dir + "/g3", dir + "/g3-run", {"train.max_steps=8", "optim.lr=1e-2"});
  auto g3_loss = [&](const json& fields) {
    json c = g3;
    c.update(fields);
    std::ofstream(dir + "/g3/config.json") << c.dump(2);
    const double loss = eval_loss(dir + "/g3", dir + "/t.txt");
    std::ofstream(dir + "/g3/config.json") << g3.dump(2);
    return loss;
  };
  const double g3_plain = eval_loss(dir + "/g3", dir + "/t.txt");
  EXPECT_NE(g3_loss({{"rope_local_base_freq", 100.0}}), g3_plain);
  EXPECT_EQ(g3_loss({{"rope_theta", 1e6}}), g3_plain);  // no full layer reads it
  // As a full layer it reads rope_theta, not the local base.
  const json full = {{"layer_types", {"full_attention"}}, {"rope_local_base_freq", 100.0}};
  EXPECT_EQ(g3_loss(full), g3_plain);
  EXPECT_NE(g3_loss({{"layer_types", {"full_attention"}}, {"rope_theta", 100.0}}), g3_plain);
  // Its capped attention runs on the CPU: CUDA is refused before the first step.
  const test::KeelRun cuda = test::run_keel(test::with_sets(
      {"train"}, {"run.out_dir=" + dir + "/cuda", "run.device=cuda", "model.path=" + dir + "/base",
                  "data.seq_len=24", "train.max_steps=1", "log.tensorboard=false"}));
  EXPECT_EQ(cuda.code, 2) << cuda.output;
  EXPECT_CONTAINS(cuda.err, dir +
                                "/base/config.json's attn_logit_softcapping = 50 caps the "
                                "attention's scores, which keel's CUDA attention does not do yet");
}

// A 2-layer `family` mixture in DIR/base from init-model: 32 wide, 4 heads (2 kv), 6 experts 16
// wide a layer, 2 a token, and `more` flags.
void init_moe(const std::string& family, const std::string& dir,
              const std::vector<std::string>& more = {}) {
  std::vector<std::string> argv = {
      "init-model", "--family",      family, "--out",         dir + "/base", "--n-layer",
      "2",          "--n-embd",      "32",   "--n-head",      "4",           "--n-kv-head",
      "2",          "--max-seq-len", "32",   "--num-experts", "6",           "--experts-per-token",
      "2",          "--expert-size", "16"};
  argv.insert(argv.end(), more.begin(), more.end());
  const test::KeelRun init = test::run_keel(argv);
  ASSERT_EQ(init.code, 0) << init.output;
}

// The mixtures of experts (Qwen3MoeForCausalLM, OlmoeForCausalLM, MixtralForCausalLM): init-model
// writes one of each with its configs' names, a LoRA on the experts' projections (and Mixtral's
// router) trains and its PEFT adapter applies as the checkpoint computes, a generation runs, keel
// memory counts the experts' parameters, and what keel's layer does not do is refused naming
// the field: a negative load-balancing weight, Mixtral's router noise, OLMoE's q/k/v clamp, experts
// in a dense model_type, more experts a token than the layer has, and a config whose router or
// experts disagree with the weights.
TEST(CliMoe, InitModelWritesEachAndALoraOnItsExpertsTrains) {
  for (const std::string family : {"qwen3_moe", "olmoe", "mixtral"}) {
    SCOPED_TRACE(family);
    const std::string dir = test::temp_dir("cli-moe-" + family);
    ASSERT_NO_FATAL_FAILURE(init_moe(family, dir));
    const bool mixtral = family == "mixtral", qwen = family == "qwen3_moe";
    const json cfg = read_json_file(dir + "/base/config.json");
    EXPECT_EQ(cfg.at("model_type"), family);
    EXPECT_EQ(cfg.at(mixtral ? "num_local_experts" : "num_experts"), 6);
    EXPECT_EQ(cfg.at("num_experts_per_tok"), 2);
    EXPECT_EQ(cfg.at(qwen ? "moe_intermediate_size" : "intermediate_size"), 16);
    if (!mixtral) {
      EXPECT_EQ(cfg.at("norm_topk_prob"), qwen);
    }
    EXPECT_EQ(cfg.at("output_router_logits"), false);
    std::ofstream(dir + "/t.txt") << "12+34=46 and 5+7=12\n\n90+9=99 and 1+2=3\n";
    const std::string targets = mixtral ? "[\"q_proj\", \"w1\", \"w3\", \"w2\", \"gate\"]"
                                        : "[\"q_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"]";
    const json saved = train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2",
                                         "model.adapter.target_modules=" + targets});
    EXPECT_EQ(saved.at("model_type"), family);
    ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
    const json adapter = read_json_file(dir + "/peft/adapter_config.json");
    EXPECT_EQ(adapter.at("target_modules").size(), mixtral ? 5u : 4u);
    const test::KeelRun g =
        test::run_keel({"generate", dir + "/out", "12+3", "--max-new-tokens", "6", "--json"},
                       {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(g.code, 0) << g.output;
    EXPECT_EQ(json::parse(g.out).at("tokens").size(), 6u);
    // Per layer: q and o 32 x 32, k and v 16 x 32, the q/k norms (Qwen3-MoE's per head, 8 each;
    // OLMoE's over the projections, 32 and 16), 2 norms, 6 experts of 3 x 32 x 16 and a router of
    // 6 x 32; the head tied to the embedding (259 x 32), the final norm. keel memory's count is
    // the model's.
    const test::KeelRun mem = test::run_keel({"memory", "--model", dir + "/base", "--json"});
    ASSERT_EQ(mem.code, 0) << mem.output;
    const int64_t qk_norms = qwen ? 2 * 8 : family == "olmoe" ? 32 + 16 : 0;
    const int64_t layer = 2 * 32 * 32 + 2 * 16 * 32 + qk_norms + 2 * 32 + 6 * 3 * 32 * 16 + 6 * 32;
    EXPECT_EQ(json::parse(mem.out).at("params").get<int64_t>(), 2 * layer + 259 * 32 + 32)
        << mem.out;
    // Refused, naming the field.
    const std::string file = dir + "/base/config.json: ";
    json bad = cfg;
    bad["output_router_logits"] = true;
    bad["router_aux_loss_coef"] = -1;
    expect_config_refused(dir, bad, file + "router_aux_loss_coef = -1 must be a weight >= 0");
    bad = cfg;
    bad["num_experts_per_tok"] = 7;
    expect_config_refused(dir, bad,
                          file + "num_experts_per_tok = 7 must be from 1 to " +
                              (mixtral ? "num_local_experts" : "num_experts") + " (6)");
    bad = cfg;
    bad[mixtral ? "num_local_experts" : "num_experts"] = 5;
    expect_config_refused(
        dir, bad,
        std::string(mixtral ? "num_local_experts" : "num_experts") + " = 5 but the weights in " +
            dir + "/base hold a router (model.layers.0." + (mixtral ? "block_sparse_moe" : "mlp") +
            ".gate.weight) of 6 experts");
    bad = cfg;
    bad[qwen ? "moe_intermediate_size" : "intermediate_size"] = 24;
    expect_config_refused(dir, bad, "experts 16 wide");
    if (qwen) {  // an expert width past intermediate_size's bounds, in a config without weights
      bad = cfg;
      bad["moe_intermediate_size"] = int64_t{1} << 40;
      fs::create_directories(dir + "/sizes");
      std::ofstream(dir + "/sizes/config.json") << bad.dump(2);
      const test::KeelRun m = test::run_keel({"memory", "--model", dir + "/sizes"});
      EXPECT_EQ(m.code, 2) << m.output;
      EXPECT_CONTAINS(m.err, "expert width = 1099511627776");
      EXPECT_CONTAINS(m.err, "must be in [0, 1048576]");
    }
    if (mixtral) {
      bad = cfg;
      bad["router_jitter_noise"] = 0.1;
      expect_config_refused(dir, bad, file + "router_jitter_noise = 0.1");
    }
    if (family == "olmoe") {  // (its clip_qkv is read, as OLMo's: a bound of 0 is refused)
      bad = cfg;
      bad["clip_qkv"] = 0;
      expect_config_refused(dir, bad, file + "clip_qkv = 0 must be a positive bound");
    }
    std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  }
  // Experts in a model_type keel reads as dense, and init-model's flags that do not fit.
  const std::string dir = test::temp_dir("cli-moe-dense");
  init_tiny("qwen3", dir + "/base");
  std::ofstream(dir + "/t.txt") << "12+34=46\n";
  json dense = read_json_file(dir + "/base/config.json");
  dense["num_experts"] = 8;
  expect_config_refused(dir, dense,
                        "num_experts = 8 (experts in a model_type keel reads as dense; keel's "
                        "mixtures of experts are qwen3_moe, qwen2_moe, olmoe and mixtral)");
  for (const auto& [args, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--family", "olmoe", "--num-experts", "2", "--experts-per-token", "3"},
            "init-model --experts-per-token 3 exceeds --num-experts 2"},
           {{"--family", "llama", "--num-experts", "8"},
            "--num-experts, --experts-per-token and --expert-size are for the mixtures of experts "
            "(--family qwen3_moe, qwen2_moe, olmoe or mixtral); drop them for llama"}}) {
    std::vector<std::string> argv = {"init-model", "--out", dir + "/x"};
    argv.insert(argv.end(), args.begin(), args.end());
    const test::KeelRun r = test::run_keel(argv);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, message);
  }
}

// Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE): Qwen2's q/k/v biases, each layer's experts and
// a shared expert behind its sigmoid gate. init-model writes one with its config's names, keel
// memory counts every parameter, a LoRA on the attention and every expert's and the shared
// expert's projections (PEFT matches both by name) trains and its adapter applies, and a config
// whose shared expert disagrees with the weights, or the flag on another family, is refused.
TEST(CliMoe, Qwen2MoeSharedExpertTrainsAndIsCheckedAgainstItsWeights) {
  const std::string dir = test::temp_dir("cli-qwen2-moe");
  ASSERT_NO_FATAL_FAILURE(init_moe("qwen2_moe", dir, {"--shared-expert-size", "48"}));
  const json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("architectures"), json::array({"Qwen2MoeForCausalLM"}));
  EXPECT_EQ(cfg.at("shared_expert_intermediate_size"), 48);
  EXPECT_EQ(cfg.at("moe_intermediate_size"), 16);
  EXPECT_EQ(cfg.at("norm_topk_prob"), false);
  const test::KeelRun mem = test::run_keel({"memory", "--model", dir + "/base", "--json"});
  ASSERT_EQ(mem.code, 0) << mem.output;
  // Per layer: q and o 32 x 32, k and v 16 x 32 with their biases (32, 16, 16), 2 norms, a router
  // of 6 x 32, 6 experts of 3 x 32 x 16, the shared expert 3 x 32 x 48 and its gate 32; the tied
  // embedding 259 x 32 and the final norm.
  const int64_t layer =
      2 * 32 * 32 + 2 * 16 * 32 + 64 + 2 * 32 + 6 * 32 + 6 * 3 * 32 * 16 + 3 * 32 * 48 + 32;
  EXPECT_EQ(json::parse(mem.out).at("params").get<int64_t>(), 2 * layer + 259 * 32 + 32);
  std::ofstream(dir + "/t.txt") << "12+34=46 and 5+7=12\n\n90+9=99 and 1+2=3\n";
  EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2",
                              "model.adapter.target_modules=[\"q_proj\", \"gate_proj\", "
                              "\"up_proj\", \"down_proj\"]"})
                .at("model_type"),
            "qwen2_moe");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  // (Four names, matching q_proj and every expert's and the shared expert's projections.)
  const json adapter = read_json_file(dir + "/peft/adapter_config.json");
  EXPECT_EQ(adapter.at("target_modules").size(), 4u);
  json bad = cfg;
  bad["shared_expert_intermediate_size"] = 40;
  expect_config_refused(dir, bad,
                        "shared_expert_intermediate_size = 40 but the weights in " + dir +
                            "/base hold a shared expert 48 wide");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  const test::KeelRun misuse = test::run_keel(
      {"init-model", "--family", "qwen2", "--out", dir + "/x", "--shared-expert-size", "64"});
  EXPECT_EQ(misuse.code, 2) << misuse.output;
  EXPECT_CONTAINS(misuse.err,
                  "init-model --shared-expert-size is Qwen2-MoE's shared expert "
                  "(--family qwen2_moe); drop it for qwen2");
}

// An expert no token is routed to runs nothing: debug.inject into it corrupts nothing, and the run
// says so instead of finishing as if the fault had been tried. A router of zeros gives every
// expert the same probability, and the ties go to the lowest: experts 0 and 1 take every token
// (the router frozen under a LoRA on q_proj).
TEST(CliMoe, AnInjectionIntoAnExpertThatDidNotRunIsSaid) {
  const std::string dir = test::temp_dir("cli-moe-inject");
  models::ModelSpec s = test::tiny_model_spec("olmoe");
  s.vocab_size = 259;
  s.max_seq_len = 32;
  auto m = models::make_causal_lm(s, 3);
  for (auto& [name, p] : m->named_parameters())
    if (name.ends_with("mlp.gate.weight")) p.zero();
  io::save_hf_model(*m, dir + "/base");
  auto train = [&](const std::string& module) {
    return test::run_keel(
        test::with_sets(
            {"train"},
            {"run.out_dir=" + dir + "/out", "run.overwrite=true", "run.threads=1",
             "model.path=" + dir + "/base", "data.seq_len=16", "train.max_steps=3",
             "model.adapter.kind=lora", "model.adapter.target_modules=[\"q_proj\"]",
             "debug.inject.module=" + module, "debug.inject.step=2", "log.tensorboard=false"}),
        {"OMP_NUM_THREADS=1"});
  };
  const test::KeelRun unrouted = train("model.layers.1.mlp.experts.3");
  EXPECT_EQ(unrouted.code, 0) << unrouted.output;
  // metrics.jsonl says so of every step: 2 of each layer's 4 experts took no token, and the busiest
  // took twice a layer's mean (its experts / top_k: all a token's choices it could).
  for (const json& step : test::step_records(dir + "/out")) {
    EXPECT_EQ(step.at("moe/unused_experts"), 4) << step;
    EXPECT_EQ(step.at("moe/max_load"), 2.0) << step;
  }
  EXPECT_CONTAINS(unrouted.err,
                  "note: debug.inject: model.layers.1.mlp.experts.3 did not run at step 2 (an "
                  "expert no token was routed to runs nothing), so nothing was injected");
  const test::KeelRun routed = train("model.layers.1.mlp.experts.1");
  EXPECT_EQ(routed.code, 3) << routed.output;  // the NaN stopped the run, captured
  EXPECT_NOT_CONTAINS(routed.err, "nothing was injected");
  EXPECT_CONTAINS(routed.err, "debug.inject put nan into model.layers.1.mlp.experts.1's output");
}

// The tiny model `s` (vocabulary 259, 32 positions) trained with `sets` while debug.inject puts a
// NaN into `module`'s output at step 2: the run stops with a capture (exit 3), and keel replay
// reproduces the step bit for bit.
void expect_injected_nan_replays(const std::string& dir, models::ModelSpec s,
                                 const std::string& module, const std::vector<std::string>& sets) {
  s.vocab_size = 259;
  s.max_seq_len = 32;
  io::save_hf_model(*models::make_causal_lm(s, 5), dir + "/base");
  std::vector<std::string> all = {"run.out_dir=" + dir + "/out",
                                  "run.threads=1",
                                  "model.path=" + dir + "/base",
                                  "data.seq_len=16",
                                  "train.max_steps=4",
                                  "train.grad_accum=2",
                                  "debug.inject.module=" + module,
                                  "debug.inject.step=2",
                                  "log.tensorboard=false"};
  all.insert(all.end(), sets.begin(), sets.end());
  const test::KeelRun r = test::run_keel(test::with_sets({"train"}, all), {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_CONTAINS(r.err, "debug.inject put nan into " + module + "'s output");
  const std::string capture = dir + "/out/debug/nan_capture/rank0";
  ASSERT_TRUE(fs::exists(capture + "/capture.json")) << r.err;
  const test::KeelRun rep = test::run_keel({"replay", capture, "--json"}, {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(rep.code, 0) << rep.output;
  const json j = json::parse(rep.out);
  EXPECT_TRUE(j.at("bit_exact").get<bool>()) << rep.out;
  EXPECT_TRUE(j.at("reproduced").get<bool>()) << rep.out;
}

// A NaN in a mixture's router (a layer's gate): the replay reproduces the routing, the experts
// each token went to, and the load-balancing loss's gradient at the routers.
TEST(CliMoe, ANanInARouterIsCapturedAndReplaysBitForBit) {
  expect_injected_nan_replays(test::temp_dir("cli-moe-replay"), test::tiny_model_spec("mixtral"),
                              "model.layers.1.block_sparse_moe.gate",
                              {"model.router_aux_loss_coef=0.02", "model.attention_dropout=0.1"});
}

// A NaN in a GPT-NeoX's attention output (debug.inject at step 2) under its sublayer dropout
// (model.dropout: HF's hidden_dropout on the embedding and both branches) and the attention
// probabilities': captured, and keel replay reproduces the step bit for bit, every dropout mask
// drawn again from the step's seed and the module's path.
TEST(CliGptNeox, ANanUnderItsDropoutsIsCapturedAndReplaysBitForBit) {
  expect_injected_nan_replays(test::temp_dir("cli-neox-replay"), test::tiny_model_spec("gpt_neox"),
                              "gpt_neox.layers.1.attention.dense",
                              {"model.dropout=0.1", "model.attention_dropout=0.1"});
}

// GPT-J (GPTJForCausalLM: GPT-J-6B): Phi's block under GPT-2's names, RoPE on adjacent pairs of
// the first rotary_dim channels of each head. init-model writes one, a LoRA trains and its adapter
// applies, the cached decode equals the uncached, the causal-mask buffers older files hold are
// skipped, its embd_pdrop is model.dropout's (a difference said as one to follow), and another
// rotary_dim computes otherwise.
TEST(CliGptj, InitModelWritesOneALoraTrainsAndItsRotaryDimComputes) {
  const std::string dir = test::temp_dir("cli-gptj");
  const json cfg = init_family("gptj", "GPTJForCausalLM", dir, "2");
  EXPECT_EQ(cfg.at("rotary_dim"), 2);  // a quarter of 8 (init-model's GPT-J-6B share)
  EXPECT_EQ(cfg.at("n_embd"), 32);
  EXPECT_EQ(cfg.at("n_inner"), 96);  // (init-model's default width, written out)
  EXPECT_EQ(cfg.at("activation_function"), "gelu_new");
  EXPECT_EQ(cfg.at("tie_word_embeddings"), false);
  EXPECT_FALSE(cfg.contains("hidden_size"));
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  const double plain = eval_loss(dir + "/base", dir + "/t.txt");
  // the buffers of older GPT-J files beside its weights: read past, the model unchanged
  expect_buffers_skipped(dir, {"transformer.h.0.attn.bias", "transformer.h.0.attn.masked_bias"},
                         plain);
  EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora", "optim.lr=5e-2"}).at("model_type"),
            "gptj");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
  EXPECT_NE(eval_with(dir, cfg, {{"rotary_dim", 8}}), plain);
  json dropped = cfg;
  dropped["embd_pdrop"] = 0.1;
  std::ofstream(dir + "/base/config.json") << dropped.dump(2);
  const test::KeelRun said = test::run_keel(
      test::with_sets({"train"}, {"model.path=" + dir + "/base", "run.out_dir=" + dir + "/said",
                                  "train.max_steps=1", "data.seq_len=24", "run.threads=1",
                                  "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(said.code, 0) << said.output;
  EXPECT_CONTAINS(said.output,
                  "embd_pdrop = 0.1 (HF trains with it) differs from model.dropout = 0.0 (no "
                  "dropout); set model.dropout = 0.1 to train as HF does");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  EXPECT_EQ(eval_loss(dir + "/base", dir + "/t.txt"), plain);
}

// CodeGen (CodeGenForCausalLM: CodeGen-350M-mono and up): GPT-J's block with q, v and k one
// qkv_proj in 4 blocks of heads. init-model writes one, a LoRA on qkv_proj (PEFT's target for it)
// trains and its adapter applies, the cached decode equals the uncached, and the causal-mask
// buffers its files hold are skipped.
TEST(CliCodegen, InitModelWritesOneALoraOnQkvProjTrainsAndItsBuffersAreSkipped) {
  const std::string dir = test::temp_dir("cli-codegen");
  const json cfg = init_family("codegen", "CodeGenForCausalLM", dir, "2");
  EXPECT_EQ(cfg.at("n_ctx"), 32);
  EXPECT_EQ(cfg.at("rotary_dim"), 2);
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  const double plain = eval_loss(dir + "/base", dir + "/t.txt");
  expect_buffers_skipped(
      dir, {"transformer.h.0.attn.causal_mask", "transformer.h.1.attn.masked_bias"}, plain);
  EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora",
                              "model.adapter.target_modules=[\"qkv_proj\"]", "optim.lr=5e-2"})
                .at("model_type"),
            "codegen");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
}

// StarCoder2 (Starcoder2ForCausalLM): Llama's layers with biased LayerNorms and projections and a
// gelu MLP (c_fc, c_proj). init-model writes one, a LoRA on its MLP trains and its adapter
// applies, the cached decode equals the uncached, a window computes otherwise than none, and the
// file's residual_dropout and embedding_dropout are said as model.dropout's to follow.
TEST(CliStarcoder2, InitModelWritesOneALoraTrainsAndItsWindowAndDropoutsApply) {
  const std::string dir = test::temp_dir("cli-starcoder2");
  const json cfg = init_family("starcoder2", "Starcoder2ForCausalLM", dir, "2");
  EXPECT_EQ(cfg.at("use_bias"), true);
  EXPECT_EQ(cfg.at("hidden_act"), "gelu_pytorch_tanh");
  EXPECT_EQ(cfg.at("norm_epsilon"), 1e-5);
  EXPECT_TRUE(cfg.at("sliding_window").is_null());
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  const double plain = eval_loss(dir + "/base", dir + "/t.txt");
  EXPECT_NE(eval_with(dir, cfg, {{"sliding_window", 4}}), plain);
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  EXPECT_EQ(
      train_falls(dir, {"model.adapter.kind=lora",
                        "model.adapter.target_modules=[\"c_fc\", \"c_proj\"]", "optim.lr=5e-2"})
          .at("model_type"),
      "starcoder2");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
  json dropped = cfg;
  dropped["residual_dropout"] = 0.1;
  dropped["embedding_dropout"] = 0.1;
  std::ofstream(dir + "/base/config.json") << dropped.dump(2);
  const test::KeelRun said = test::run_keel(
      test::with_sets({"train"}, {"model.path=" + dir + "/base", "run.out_dir=" + dir + "/said",
                                  "train.max_steps=1", "data.seq_len=24", "run.threads=1",
                                  "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(said.code, 0) << said.output;
  for (const char* field : {"residual_dropout", "embedding_dropout"})
    EXPECT_CONTAINS(said.output,
                    std::string(field) +
                        " = 0.1 (HF trains with it) differs from model.dropout = "
                        "0.0 (no dropout); set model.dropout = 0.1 to train as HF does");
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
}

// GPT-BigCode (GPTBigCodeForCausalLM: StarCoder, SantaCoder): GPT-2's blocks with nn.Linear
// weights and multi_query. init-model writes one, a LoRA on c_attn trains, its adapter (not
// fan_in_fan_out: no Conv1D here) applies to the base, and the cached decode equals the uncached.
TEST(CliGptBigCode, InitModelWritesOneALoraOnItsMultiQueryAttentionTrainsAndApplies) {
  const std::string dir = test::temp_dir("cli-bigcode");
  const test::KeelRun init = test::run_keel(
      {"init-model", "--family", "gpt_bigcode", "--out", dir + "/base", "--n-layer", "2",
       "--n-embd", "32", "--n-head", "4", "--n-kv-head", "1", "--max-seq-len", "32"});
  ASSERT_EQ(init.code, 0) << init.output;
  const json cfg = read_json_file(dir + "/base/config.json");
  EXPECT_EQ(cfg.at("model_type"), "gpt_bigcode");
  EXPECT_EQ(cfg.at("architectures"), json::array({"GPTBigCodeForCausalLM"}));
  EXPECT_EQ(cfg.at("multi_query"), true);
  const io::Safetensors weights = io::read_safetensors(dir + "/base/model.safetensors");
  const Tensor* c_attn = weights.find("transformer.h.0.attn.c_attn.weight");
  ASSERT_NE(c_attn, nullptr);
  EXPECT_EQ(c_attn->shape(), (Shape{32 + 2 * 8, 32}));  // nn.Linear's [out, in]
  std::ofstream(dir + "/t.txt") << "12+34=46\n\n5+7=12\n\n90+9=99\n";
  EXPECT_EQ(train_falls(dir, {"model.adapter.kind=lora",
                              "model.adapter.target_modules=[\"c_attn\"]", "optim.lr=5e-2"})
                .at("model_type"),
            "gpt_bigcode");
  ASSERT_NO_FATAL_FAILURE(expect_adapter_applies(dir));
  EXPECT_EQ(read_json_file(dir + "/peft/adapter_config.json").at("fan_in_fan_out"), false);
  ASSERT_NO_FATAL_FAILURE(expect_cached_decode_agrees(dir));
  // GPT-2's key/value heads are its query heads: 2 of 4 is refused naming the flag.
  const test::KeelRun bad = test::run_keel({"init-model", "--family", "gpt_bigcode", "--out",
                                            dir + "/bad", "--n-head", "4", "--n-kv-head", "2"});
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_CONTAINS(bad.err, "--n-kv-head");
}

// A NaN in a Falcon's attention output under its hidden_dropout (on the branches' sum): captured,
// and keel replay reproduces the step bit for bit.
TEST(CliFalcon, ANanUnderItsDropoutIsCapturedAndReplaysBitForBit) {
  expect_injected_nan_replays(test::temp_dir("cli-falcon-replay"),
                              test::tiny_model_spec("falcon40b"),
                              "transformer.h.1.self_attention.dense", {"model.dropout=0.1"});
}

// The load-balancing loss (model.router_aux_loss_coef, HF's router_aux_loss_coef where
// output_router_logits is set): with one micro-batch a step, the loss is the cross-entropy plus
// the weight times moe/aux_loss (the same forward: step 1 of two runs differs by exactly that);
// a router of large weights (its initial ones times 40), which full fine-tuning at lr 1e-2 drives
// onto a few experts, keeps its tokens spread under it (the natural collapse, and its cure); the
// file's coefficient, when
// it differs from the key, is said; checkpoints and exports write the one trained with; and on a
// dense model the key is an error naming it.
TEST(CliMoe, TheLoadBalancingLossIsAddedAndSpreadsTheTokens) {
  const std::string dir = test::temp_dir("cli-moe-balance");
  models::ModelSpec s = test::tiny_model_spec("mixtral");
  s.vocab_size = 259;
  s.max_seq_len = 32;
  s.moe.experts = 6;
  auto m = models::make_causal_lm(s, 11);
  for (auto& [name, p] : m->named_parameters())
    if (name.ends_with("gate.weight")) Tensor(p).copy_from(ops::scale(p, 40.0f));
  io::save_hf_model(*m, dir + "/base");
  auto train = [&](const std::string& out, double coef, int64_t steps) {
    const test::KeelRun r = test::run_keel(
        test::with_sets(
            {"train"},
            {"run.out_dir=" + dir + "/" + out, "run.threads=1", "model.path=" + dir + "/base",
             "data.seq_len=16", "train.batch_size=8", "train.max_steps=" + std::to_string(steps),
             "optim.lr=1e-2", "log.tensorboard=false",
             "model.router_aux_loss_coef=" + std::to_string(coef)}),
        {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
    return std::make_pair(r, test::step_records(dir + "/" + out));
  };
  const auto [plain_run, plain] = train("plain", 0, 30);
  const auto [balanced_run, balanced] = train("balanced", 0.5, 30);
  ASSERT_EQ(plain.size(), 30u);
  ASSERT_EQ(balanced.size(), 30u);
  const double aux1 = balanced[0].at("moe/aux_loss").get<double>();
  EXPECT_EQ(plain[0].at("moe/aux_loss").get<double>(), aux1);
  EXPECT_NEAR(balanced[0].at("loss").get<double>() - plain[0].at("loss").get<double>(), 0.5 * aux1,
              1e-5);
  const double plain_end = plain.back().at("moe/aux_loss").get<double>();
  const double balanced_end = balanced.back().at("moe/aux_loss").get<double>();
  std::printf("moe/aux_loss: start %.4f, after 30 steps %.4f without the loss, %.4f with it\n",
              aux1, plain_end, balanced_end);
  // (Measured: 2.10 at the start; 3.71 after 30 steps without the loss, 1.98 with it.)
  EXPECT_GT(plain_end, 1.5 * aux1);  // collapsing onto few experts
  EXPECT_LT(balanced_end, 1.05 * aux1);
  EXPECT_LT(balanced_end, 0.6 * plain_end);
  // The advisor says the collapse once, with the fix: the loss the other run added.
  auto routing_findings = [&](const std::string& out) {
    std::vector<json> found;
    std::ifstream in(dir + "/" + out + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const json rec = json::parse(line);
      if (rec.value("kind", "") == "advisor" && rec.value("trend", "") == "routing")
        found.push_back(rec);
    }
    return found;
  };
  const std::vector<json> said = routing_findings("plain");
  ASSERT_EQ(said.size(), 1u) << plain_run.output;
  EXPECT_CONTAINS(said[0].at("cause").get<std::string>(),
                  "the routers send most tokens to a few experts on the last 5 steps");
  EXPECT_CONTAINS(said[0].at("cause").get<std::string>(), "the updates concentrated it");
  EXPECT_CONTAINS(said[0].at("action").get<std::string>(),
                  "set model.router_aux_loss_coef = 0.001");
  EXPECT_CONTAINS(plain_run.out, "routing: the routers send most tokens to a few experts");
  EXPECT_TRUE(routing_findings("balanced").empty()) << balanced_run.output;
  EXPECT_EQ(plain_run.err.find("router_aux_loss_coef"), std::string::npos) << plain_run.err;
  // What it trained with, written back: HF's training of the checkpoint adds the same loss.
  const json saved = read_json_file(dir + "/balanced/checkpoints/last/config.json");
  EXPECT_EQ(saved.at("output_router_logits"), true);
  EXPECT_EQ(saved.at("router_aux_loss_coef"), 0.5);
  EXPECT_EQ(read_json_file(dir + "/plain/checkpoints/last/config.json").at("output_router_logits"),
            false);
  // A file that trains with it (HF's) beside a run that does not: said, with the key to set.
  json cfg = read_json_file(dir + "/base/config.json");
  cfg["output_router_logits"] = true;
  cfg["router_aux_loss_coef"] = 0.02;
  std::ofstream(dir + "/base/config.json") << cfg.dump(2);
  const auto [noted, noted_steps] = train("noted", 0, 1);
  EXPECT_CONTAINS(noted.err, dir +
                                 "/base/config.json's output_router_logits = true with "
                                 "router_aux_loss_coef = 0.02 (HF trains with the router's "
                                 "load-balancing loss) differs from model.router_aux_loss_coef = "
                                 "0.0; set model.router_aux_loss_coef = 0.02 to train as HF does");
  // On a dense model: an error naming the key, before anything is loaded.
  init_tiny("qwen3", dir + "/dense");
  const test::KeelRun dense = test::run_keel(
      test::with_sets({"train"}, {"run.out_dir=" + dir + "/d", "model.path=" + dir + "/dense",
                                  "model.router_aux_loss_coef=0.01", "log.tensorboard=false"}));
  EXPECT_EQ(dense.code, 2) << dense.output;
  EXPECT_CONTAINS(dense.err,
                  "model.router_aux_loss_coef = 0.01 weighs a mixture of experts' "
                  "load-balancing loss, but " +
                      dir + "/dense/config.json is");
  EXPECT_CONTAINS(dense.err, "a dense model (no router); remove model.router_aux_loss_coef");
}

}  // namespace
}  // namespace keel
