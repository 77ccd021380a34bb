// HF model directories (keel/io/hf_model.h): tiny random GPT-2 and Llama checkpoints written here
// in HF's layout — by this test's own writer, not by save_hf_model — load bit-exactly, sharded or
// not, in f32 and bf16, and save back to the same tensors; GPT-2's Conv1D transposition is proven
// against a torch model in HF's layout (tests/fixtures/gen_adapters.py); PEFT adapter directories
// round-trip; every inconsistency is an Error naming the file and the tensor or field.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "keel/autograd/node.h"
#include "keel/io/atomic_file.h"
#include "keel/io/hf_config.h"
#include "keel/io/hf_model.h"
#include "keel/io/safetensors.h"
#include "keel/io/trained_model.h"
#include "keel/models/gpt2.h"
#include "keel/models/llama.h"
#include "keel/models/param_shapes.h"
#include "tests/io/tiny_specs.h"
#include "tests/support/check.h"
#include "tests/support/tiny_models.h"

namespace keel::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Named = std::vector<std::pair<std::string, Tensor>>;
using test::error_of;

// ---- an independent writer of HF directories ----------------------------------------------------

bool is_conv1d(const std::string& n) {
  for (const char* s :
       {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
    if (n.size() > std::strlen(s) && n.compare(n.size() - std::strlen(s), std::strlen(s), s) == 0)
      return true;
  return false;
}

// [R, C] -> [C, R] through floats (exact for every floating dtype).
Tensor transposed(const Tensor& t) {
  const int64_t R = t.size(0), C = t.size(1);
  const std::vector<float> v = t.to_floats();
  std::vector<float> o(v.size());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) o[c * R + r] = v[r * C + c];
  return Tensor::from_floats(o, {C, R}, t.dtype());
}

json config_of(const models::ModelSpec& s) {
  if (s.family == "gpt2")
    return {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"n_layer", s.n_layer},
            {"n_embd", s.n_embd},
            {"n_head", s.n_head},
            {"n_inner", nullptr},
            {"vocab_size", s.vocab_size},
            {"n_positions", s.max_seq_len},
            {"layer_norm_epsilon", 1e-5},
            {"activation_function", "gelu_new"},
            {"bos_token_id", 50256}};
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"num_hidden_layers", s.n_layer},
          {"hidden_size", s.n_embd},
          {"num_attention_heads", s.n_head},
          {"num_key_value_heads", s.kv_heads()},
          {"intermediate_size", s.ffn_dim()},
          {"vocab_size", s.vocab_size},
          {"max_position_embeddings", s.max_seq_len},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 10000.0},
          {"tie_word_embeddings", s.tie_embeddings},
          {"hidden_act", "silu"},
          {"torch_dtype", "bfloat16"}};
}

// HF's tensors of `model` stored in `dt`: GPT-2's Conv1D weights [in, out], names with or without
// GPT-2's `transformer.` prefix.
Named hf_tensors(models::CausalLM& model, DType dt, bool strip_prefix = false) {
  Named out;
  for (auto& [name, p] : model.named_parameters()) {
    Tensor t = p.to_dtype(dt);
    if (model.spec().family == "gpt2" && is_conv1d(name)) t = transposed(t);
    std::string n = name;
    if (strip_prefix && n.rfind("transformer.", 0) == 0) n = n.substr(12);
    out.emplace_back(n, t);
  }
  return out;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// config.json plus model.safetensors (shards == 0) or `shards` shards with their index.
void write_hf_dir(const std::string& dir, const json& config, const Named& tensors,
                  int shards = 0) {
  fs::create_directories(dir);
  write_text(dir + "/config.json", config.dump(2));
  if (shards == 0) {
    write_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
    return;
  }
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  std::vector<Named> parts(static_cast<size_t>(shards));
  for (size_t i = 0; i < tensors.size(); ++i) parts[i % shards].push_back(tensors[i]);
  for (int s = 0; s < shards; ++s) {
    const std::string file =
        "model-0000" + std::to_string(s + 1) + "-of-0000" + std::to_string(shards) + ".safetensors";
    write_safetensors(dir + "/" + file, parts[s]);
    for (auto& [n, t] : parts[s]) index["weight_map"][n] = file;
  }
  write_text(dir + "/model.safetensors.index.json", index.dump(2));
}

// Every tensor of an HF directory (single or sharded), by name.
std::map<std::string, Tensor> read_hf_tensors(const std::string& dir) {
  std::map<std::string, Tensor> out;
  if (fs::exists(dir + "/model.safetensors")) {
    for (auto& [n, t] : read_safetensors(dir + "/model.safetensors").tensors) out[n] = t;
    return out;
  }
  json index = json::parse(read_file(dir + "/model.safetensors.index.json"));
  std::set<std::string> files;
  for (auto& [n, f] : index["weight_map"].items()) files.insert(f.get<std::string>());
  for (const std::string& f : files)
    for (auto& [n, t] : read_safetensors(dir + "/" + f).tensors) out[n] = t;
  return out;
}

using test_specs::gpt2_spec;
using test_specs::llama_spec;

Tensor sample_ids() { return Tensor::from_ints({1, 5, 9, 2, 7, 3, 3, 8, 39, 0, 12, 6}, {2, 6}); }

// ---- lossless load and save ---------------------------------------------------------------------

struct LayoutCase {
  std::string family;
  bool tied;
  int shards;
  DType dt;
  bool strip_prefix;
};

class HfRoundTrip : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(HfRoundTrip, LoadsBitExactlyAndSavesTheSameTensors) {
  const LayoutCase c = GetParam();
  const models::ModelSpec spec = c.family == "gpt2" ? gpt2_spec() : llama_spec(c.tied);
  auto src = models::make_causal_lm(spec, 5);
  const Named written = hf_tensors(*src, c.dt, c.strip_prefix);
  const std::string dir = test::temp_dir("hf-in");
  write_hf_dir(dir, config_of(spec), written, c.shards);

  HfConfig cfg = read_hf_config(dir);
  EXPECT_EQ(cfg.spec.family, spec.family);
  EXPECT_EQ(cfg.spec.n_layer, spec.n_layer);
  EXPECT_EQ(cfg.spec.n_embd, spec.n_embd);
  EXPECT_EQ(cfg.spec.n_head, spec.n_head);
  EXPECT_EQ(cfg.spec.kv_heads(), spec.kv_heads());
  EXPECT_EQ(cfg.spec.ffn_dim(), spec.ffn_dim());
  EXPECT_EQ(cfg.spec.vocab_size, spec.vocab_size);
  EXPECT_EQ(cfg.spec.max_seq_len, spec.max_seq_len);
  EXPECT_EQ(cfg.spec.tie_embeddings, spec.tie_embeddings);

  auto loaded = load_hf_model(dir, DType::F32);
  // Every parameter holds exactly the stored values (bf16 -> f32 is exact), in keel's layout.
  for (auto& [name, p] : src->named_parameters()) {
    Tensor got = loaded->find_parameter(name);
    ASSERT_TRUE(got.defined()) << name;
    test::expect_bitwise_equal(got, p.to_dtype(c.dt).to_dtype(DType::F32), name);
  }
  if (c.dt == DType::F32) {
    NoGradGuard no_grad;
    test::expect_bitwise_equal(loaded->forward(sample_ids(), Tensor()),
                               src->forward(sample_ids(), Tensor()), "logits");
  }
  // Saving in the stored dtype and the same layout gives back the same tensors, bit for bit.
  const std::string out = test::temp_dir("hf-out");
  HfSaveOptions opt;
  opt.dtype = c.dt;
  opt.max_shard_bytes = c.shards ? 4096 : 0;
  save_hf_model(*loaded, out, opt);
  EXPECT_EQ(fs::exists(out + "/model.safetensors.index.json"), c.shards > 0);
  std::map<std::string, Tensor> saved = read_hf_tensors(out);
  EXPECT_EQ(saved.size(), written.size()) << "no lm_head for a tied model, nothing extra";
  for (auto& [name, t] : written) {
    const std::string keel_name =
        (c.strip_prefix && c.family == "gpt2") ? "transformer." + name : name;
    ASSERT_TRUE(saved.count(keel_name)) << keel_name;
    test::expect_bitwise_equal(saved[keel_name], t, keel_name);
  }
  // ... and a loadable directory whose config gives the same spec.
  HfConfig again = read_hf_config(out);
  EXPECT_EQ(again.spec.ffn_dim(), spec.ffn_dim());
  EXPECT_EQ(again.spec.kv_heads(), spec.kv_heads());
  EXPECT_EQ(again.spec.tie_embeddings, spec.tie_embeddings);
  EXPECT_EQ(again.dtype, c.dt);
  auto reloaded = load_hf_model(out, DType::F32);
  for (auto& [name, p] : loaded->named_parameters())
    test::expect_bitwise_equal(reloaded->find_parameter(name), p, "reloaded " + name);
}

INSTANTIATE_TEST_SUITE_P(Layouts, HfRoundTrip,
                         ::testing::Values(LayoutCase{"llama", true, 0, DType::F32, false},
                                           LayoutCase{"llama", false, 0, DType::BF16, false},
                                           LayoutCase{"llama", false, 3, DType::F32, false},
                                           LayoutCase{"llama", true, 2, DType::BF16, false},
                                           LayoutCase{"gpt2", true, 0, DType::F32, false},
                                           LayoutCase{"gpt2", true, 0, DType::BF16, true},
                                           LayoutCase{"gpt2", true, 3, DType::F32, true},
                                           LayoutCase{"gpt2", true, 2, DType::F16, false}),
                         [](const auto& info) {
                           const LayoutCase& c = info.param;
                           return c.family + (c.tied ? "_tied" : "_untied") + "_shards" +
                                  std::to_string(c.shards) + "_" + dtype_name(c.dt) +
                                  (c.strip_prefix ? "_noprefix" : "");
                         });

TEST(HfModel, Gpt2Conv1DLayoutMatchesTorch) {
  // A GPT2LMHeadModel computed by torch with HF's Conv1D (y = x @ W + b, W [in, out]) and the
  // original gpt2 file naming (no `transformer.` prefix): loading must transpose exactly the four
  // Conv1D weights and nothing else for the logits to match.
  const io::Safetensors& fx = test::fixture("adapters");
  const std::string pre = "gpt2_conv1d.";
  Named tensors;
  for (auto& [name, t] : fx.tensors)
    if (name.rfind(pre, 0) == 0 && name != pre + "input_ids" && name != pre + "logits")
      tensors.emplace_back(name.substr(pre.size()), t);
  ASSERT_EQ(tensors.size(), 2u + 2 * 12 + 2);
  const std::string dir = test::temp_dir("hf-gpt2");
  write_hf_dir(dir,
               {{"model_type", "gpt2"},
                {"n_layer", 2},
                {"n_embd", 16},
                {"n_head", 2},
                {"vocab_size", 19},
                {"n_positions", 8},
                {"layer_norm_epsilon", 1e-5}},
               tensors);
  auto model = load_hf_model(dir);
  NoGradGuard no_grad;
  Tensor logits = model->forward(fx.at(pre + "input_ids"), Tensor());
  test::expect_close(logits, fx.at(pre + "logits"), 1e-5, 1e-4, "GPT-2 logits vs torch");
  // The transposition is real: the stored c_attn weight is [16, 48] ([in, out]).
  EXPECT_EQ(fx.at(pre + "h.0.attn.c_attn.weight").shape(), (Shape{16, 48}));
  EXPECT_EQ(model->find_parameter("transformer.h.0.attn.c_attn.weight").shape(), (Shape{48, 16}));
}

TEST(HfModel, Llama31RopeScalingLoadsAndSavesBack) {
  // The rope_scaling block of Meta-Llama-3.1-8B's config.json, as published.
  models::ModelSpec spec = llama_spec(false);
  auto src = models::make_causal_lm(spec, 4);
  json cfg = config_of(spec);
  cfg["rope_theta"] = 500000.0;
  cfg["max_position_embeddings"] = 131072;
  cfg["rope_scaling"] = {{"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 8192},
                         {"rope_type", "llama3"}};
  const std::string dir = test::temp_dir("hf-llama31");
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::BF16));
  const HfConfig hc = read_hf_config(dir);
  const ops::RopeScaling& rs = hc.spec.rope_scaling;
  EXPECT_EQ(rs.kind, ops::RopeScaling::Kind::kLlama3);
  EXPECT_EQ(rs.factor, 8.0);
  EXPECT_EQ(rs.low_freq_factor, 1.0);
  EXPECT_EQ(rs.high_freq_factor, 4.0);
  EXPECT_EQ(rs.original_max_position, 8192);
  EXPECT_EQ(hc.spec.rope_theta, 500000.0);
  // The model's attention rotates with it.
  auto model = load_hf_model(dir);
  auto* attn =
      dynamic_cast<models::LlamaAttention*>(model->find_module("model.layers.1.self_attn"));
  ASSERT_NE(attn, nullptr);
  EXPECT_EQ(attn->rope_scaling, rs);
  // Older transformers spell the key "type"; "default" means no scaling.
  cfg["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::BF16));
  EXPECT_EQ(read_hf_config(dir).spec.rope_scaling.kind, ops::RopeScaling::Kind::kLinear);
  cfg["rope_scaling"] = {{"rope_type", "default"}};
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::BF16));
  EXPECT_EQ(read_hf_config(dir).spec.rope_scaling.kind, ops::RopeScaling::Kind::kNone);
  // Saving writes the scaling back, so the checkpoint reloads with the same angles.
  models::ModelSpec scaled = spec;
  scaled.rope_scaling = rs;
  auto with = models::make_causal_lm(scaled, 4);
  const std::string out = test::temp_dir("hf-llama31-save");
  save_hf_model(*with, out);
  EXPECT_EQ(read_hf_config(out).spec.rope_scaling, rs);
}

// YaRN rope_scaling as transformers reads it: the file's factor over rope_scaling's original
// context (Qwen2.5-Coder's factor 4 over 32768 beside max_position_embeddings 32768: YaRN all the
// same; transformers 4.50-4.55 made the factor their ratio, reverted), the original context
// max_position_embeddings when rope_scaling has none and a top-level one when the file has it, an
// attention factor from mscale and mscale_all_dim; written back so that it reads the same; bad
// fields refused naming them.
TEST(HfModel, YarnRopeScalingReadsAsTransformersDoes) {
  const models::ModelSpec spec = llama_spec(false);
  auto src = models::make_causal_lm(spec, 4);
  json cfg = config_of(spec);
  cfg["max_position_embeddings"] = 32768;
  const std::string dir = test::temp_dir("hf-yarn");
  auto read = [&](const json& rs) {
    json c = cfg;
    c["rope_scaling"] = rs;
    write_hf_dir(dir, c, hf_tensors(*src, DType::F32));
    return read_hf_config(dir).spec.rope_scaling;
  };
  const std::vector<double> plain = ops::rope_inv_freq(10000.0, spec.head_dim());
  ops::RopeScaling r =
      read({{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}});
  EXPECT_EQ(r.kind, ops::RopeScaling::Kind::kYarn);
  EXPECT_EQ(r.factor, 4.0);
  EXPECT_EQ(r.original_max_position, 32768);
  EXPECT_NEAR(r.attention_factor, 0.1 * std::log(4.0) + 1, 1e-15);
  EXPECT_EQ(r.beta_fast, 32.0);
  EXPECT_EQ(r.beta_slow, 1.0);
  EXPECT_NE(ops::rope_inv_freq(10000.0, spec.head_dim(), r), plain);
  // Qwen3's recipe: 32768 original positions beside max_position_embeddings 40960, factor 4.
  cfg["max_position_embeddings"] = 40960;
  r = read({{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}});
  EXPECT_EQ(r.factor, 4.0);
  EXPECT_EQ(r.original_max_position, 32768);
  // No original context: max_position_embeddings; a top-level one wins over rope_scaling's.
  r = read({{"rope_type", "yarn"}, {"factor", 4.0}});
  EXPECT_EQ(r.original_max_position, 40960);
  cfg["original_max_position_embeddings"] = 8192;
  r = read({{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}});
  EXPECT_EQ(r.original_max_position, 8192);
  cfg.erase("original_max_position_embeddings");
  cfg["max_position_embeddings"] = 32768;
  // DeepSeek-style: mscale 0.707 over mscale_all_dim 1 for the attention factor.
  r = read({{"rope_type", "yarn"},
            {"factor", 40.0},
            {"original_max_position_embeddings", 4096},
            {"mscale", 0.707},
            {"mscale_all_dim", 1.0},
            {"beta_fast", 16},
            {"truncate", false}});
  EXPECT_EQ(r.factor, 40.0);
  EXPECT_EQ(r.original_max_position, 4096);
  EXPECT_NEAR(r.attention_factor, (0.1 * 0.707 * std::log(40.0) + 1) / (0.1 * std::log(40.0) + 1),
              1e-15);
  EXPECT_EQ(r.beta_fast, 16.0);
  EXPECT_FALSE(r.truncate);
  // Saved back: the same scaling when read again.
  models::ModelSpec scaled = spec;
  scaled.max_seq_len = 32768;
  scaled.rope_scaling = r;
  const std::string out = test::temp_dir("hf-yarn-save");
  save_hf_model(*models::make_causal_lm(scaled, 4), out);
  EXPECT_EQ(read_hf_config(out).spec.rope_scaling, r);
  cfg["rope_scaling"] = {{"rope_type", "yarn"}};
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::F32));
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  dir + "/config.json: rope_scaling (yarn) needs a positive number 'factor'");
  cfg["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 4096.5}};
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::F32));
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  dir +
                      "/config.json: rope_scaling (yarn): original_max_position_embeddings "
                      "must be a whole number of positions from 1 to 2^30, got 4096.5");
  cfg["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_slow", "one"}};
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::F32));
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  dir +
                      "/config.json: rope_scaling (yarn): beta_slow must be a positive number, "
                      "got \"one\"");
}

// Phi-3-mini-128k-instruct's config.json, as published, at tiny sizes: its fused projections, a
// longrope rope_scaling in the three fields older Phi3Configs accept,
// original_max_position_embeddings beside max_position_embeddings (whose ratio gives the attention
// factor), a window past the context.
TEST(HfModel, Phi3LongRopeLoadsAndSavesBack) {
  models::ModelSpec spec = llama_spec(false);
  spec.hf_model_type = "phi3";
  auto src = models::make_causal_lm(spec, 4);
  json cfg = config_of(spec);
  cfg["architectures"] = {"Phi3ForCausalLM"};
  cfg["model_type"] = "phi3";
  cfg["max_position_embeddings"] = 131072;
  cfg["original_max_position_embeddings"] = 4096;
  cfg["sliding_window"] = 262144;
  cfg["rope_scaling"] = {{"type", "longrope"},
                         {"short_factor", {1.0, 1.1, 1.3, 2.0}},
                         {"long_factor", {1.1, 2.5, 9.0, 40.0}}};
  const std::string dir = test::temp_dir("hf-phi3-128k");
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::BF16));
  const HfConfig hc = read_hf_config(dir);
  const ops::RopeScaling& rs = hc.spec.rope_scaling;
  EXPECT_EQ(hc.spec.architecture(), "phi3");
  EXPECT_EQ(rs.kind, ops::RopeScaling::Kind::kLongRope);
  EXPECT_EQ(rs.original_max_position, 4096);
  EXPECT_EQ(rs.short_factor, (std::vector<double>{1.0, 1.1, 1.3, 2.0}));
  EXPECT_EQ(rs.long_factor, (std::vector<double>{1.1, 2.5, 9.0, 40.0}));
  // HF's sqrt(1 + ln(131072 / 4096) / ln(4096)).
  EXPECT_NEAR(rs.attention_factor, 1.1902380714238083, 1e-15);
  EXPECT_EQ(hc.spec.sliding_window, 262144);
  auto model = load_hf_model(dir);
  auto* attn =
      dynamic_cast<models::LlamaAttention*>(model->find_module("model.layers.1.self_attn"));
  ASSERT_NE(attn, nullptr);
  EXPECT_EQ(attn->rope_scaling, rs);
  EXPECT_NE(attn->qkv_proj, nullptr);
  // Saved back as Phi-3 reads it: three fields, the original context beside.
  const std::string out = test::temp_dir("hf-phi3-128k-save");
  save_hf_model(*model, out);
  const json back = json::parse(read_file(out + "/config.json"));
  EXPECT_EQ(back.at("rope_scaling").size(), 3u) << back.at("rope_scaling").dump();
  EXPECT_EQ(back.at("original_max_position_embeddings"), 4096);
  EXPECT_EQ(read_hf_config(out).spec.rope_scaling, rs);
  // Phi3Config's aliases of longrope: "su" (its first files) and "yarn" with factor lists.
  for (const char* alias : {"su", "yarn"}) {
    json aliased = cfg;
    aliased["rope_scaling"]["type"] = alias;
    write_hf_dir(dir, aliased, hf_tensors(*src, DType::BF16));
    EXPECT_EQ(read_hf_config(dir).spec.rope_scaling, rs) << alias;
  }
  // An attention factor of its own is kept, and written back.
  cfg["rope_scaling"]["attention_factor"] = 1.0;
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::BF16));
  EXPECT_EQ(read_hf_config(dir).spec.rope_scaling.attention_factor, 1.0);
  save_hf_model(*load_hf_model(dir), out);
  EXPECT_EQ(json::parse(read_file(out + "/config.json")).at("rope_scaling").at("attention_factor"),
            1.0);
  // Phi-4-mini's partial rotary: 3/4 of the head's 8 channels turn, 3 pairs, one factor each;
  // read, given to every layer's attention, written back.
  json partial = cfg;
  partial["partial_rotary_factor"] = 0.75;
  partial["rope_scaling"]["short_factor"] = {1.0, 1.1, 1.3};
  partial["rope_scaling"]["long_factor"] = {1.1, 2.5, 9.0};
  write_hf_dir(dir, partial, hf_tensors(*src, DType::BF16));
  EXPECT_EQ(read_hf_config(dir).spec.rotary_dim(), 6);
  const auto partial_model = load_hf_model(dir);
  auto* partial_attn =
      dynamic_cast<models::LlamaAttention*>(partial_model->find_module("model.layers.1.self_attn"));
  ASSERT_NE(partial_attn, nullptr);
  EXPECT_EQ(partial_attn->rotary_dim, 6);
  save_hf_model(*load_hf_model(dir), out);
  EXPECT_EQ(json::parse(read_file(out + "/config.json")).at("partial_rotary_factor"), 0.75);
  EXPECT_EQ(read_hf_config(out).spec.rotary_dim(), 6);
  // Factors that do not cover a head's 4 pairs (or 3 where 6 channels turn), and longrope
  // outside Phi-3, are refused.
  partial["rope_scaling"]["long_factor"] = {1.1, 2.5, 9.0, 40.0};
  write_hf_dir(dir, partial, hf_tensors(*src, DType::BF16));
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  dir +
                      "/config.json: rope_scaling's short_factor and long_factor hold 3 and 4 "
                      "values; a head that turns 6 channels needs 3 each");
  cfg["rope_scaling"]["short_factor"] = {1.0, 1.1, 1.3};
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::BF16));
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  dir +
                      "/config.json: rope_scaling's short_factor and long_factor hold 3 and 4 "
                      "values; a head that turns 8 channels needs 4 each");
  cfg["rope_scaling"]["short_factor"] = {1.0, 1.1, 1.3, -2.0};
  write_hf_dir(dir, cfg, hf_tensors(*src, DType::BF16));
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  dir +
                      "/config.json: rope_scaling (longrope) needs 'short_factor', a list of "
                      "positive numbers");
  cfg["rope_scaling"]["short_factor"] = {1.0, 1.1, 1.3, 2.0};
  cfg["architectures"] = {"LlamaForCausalLM"};
  cfg["model_type"] = "llama";
  const models::ModelSpec plain = llama_spec(false);
  write_hf_dir(dir, cfg, hf_tensors(*models::make_causal_lm(plain, 4), DType::BF16));
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  "rope_scaling type 'longrope' (keel runs it for Phi-3) is not supported by "
                  "keel's llama model");
}

// A Gemma config.json that leaves fields out gets HF's config classes' defaults: head_dim 256,
// Gemma-2's caps 50 and 30 (null: none), Gemma-3's RoPE base 1e6 and none of its caps.
TEST(HfModel, GemmaFieldsLeftOutTakeHfsDefaults) {
  const std::string dir = test::temp_dir("hf-gemma-defaults");
  auto read = [&](const json& cfg) {
    std::ofstream(dir + "/config.json") << cfg.dump();
    return read_hf_config(dir).spec;
  };
  json g2 = {{"architectures", {"Gemma2ForCausalLM"}},
             {"model_type", "gemma2"},
             {"num_hidden_layers", 2},
             {"hidden_size", 32},
             {"num_attention_heads", 2},
             {"num_key_value_heads", 1},
             {"intermediate_size", 64},
             {"vocab_size", 40}};
  models::ModelSpec s = read(g2);
  EXPECT_EQ(s.head_dim(), 256);
  EXPECT_EQ(s.attn_softcap, 50);
  EXPECT_EQ(s.final_softcap, 30);
  EXPECT_EQ(s.rope_theta, 10000);
  g2["attn_logit_softcapping"] = nullptr;
  g2["final_logit_softcapping"] = nullptr;
  s = read(g2);
  EXPECT_EQ(s.attn_softcap, 0);
  EXPECT_EQ(s.final_softcap, 0);
  json g3 = g2;
  g3.erase("attn_logit_softcapping");
  g3.erase("final_logit_softcapping");
  g3["architectures"] = {"Gemma3ForCausalLM"};
  g3["model_type"] = "gemma3_text";
  s = read(g3);
  EXPECT_EQ(s.attn_softcap, 0);
  EXPECT_EQ(s.final_softcap, 0);
  EXPECT_EQ(s.rope_theta, 1e6);
  EXPECT_EQ(s.rope_local_theta, 10000);
  EXPECT_EQ(s.sliding_period, 6);
  g3["rope_local_base_freq"] = 0;
  std::ofstream(dir + "/config.json") << g3.dump();
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  dir + "/config.json: rope_local_base_freq must be a positive number, got 0");
}

// A Gemma3ForConditionalGeneration (Gemma-3 4B, 12B, 27B): its config.json's text_config lists
// only the fields that differ from Gemma3TextConfig's, and its language model's tensors are under
// "language_model." (Google's files) or "model.language_model." (transformers >= 4.52), beside a
// vision tower and a projector. keel reads the language model: the logits of the same weights
// written as a Gemma3ForCausalLM, and it is written back as one.
TEST(HfModel, Gemma3MultimodalFilesLoadTheirLanguageModel) {
  models::ModelSpec spec = llama_spec(true);
  spec.hf_model_type = "gemma3_text";
  spec.head_width = 256;  // Gemma3TextConfig's head_dim, which text_config leaves out
  spec.sliding_window = 4096;
  spec.sliding_period = 6;
  spec.rope_local_theta = 10000;
  spec.rope_theta = 1e6;
  spec.query_pre_attn_scalar = 256;
  spec.norm_eps = 1e-6;
  auto src = models::make_causal_lm(spec, 6);
  const std::string text_dir = test::temp_dir("hf-gemma3-text");
  save_hf_model(*src, text_dir);
  const Tensor ids = Tensor::from_ints({1, 7, 3, 9, 2}, {1, 5});
  NoGradGuard no_grad;
  const Tensor want = load_hf_model(text_dir)->forward(ids, Tensor());
  const json cfg = {{"architectures", {"Gemma3ForConditionalGeneration"}},
                    {"model_type", "gemma3"},
                    {"torch_dtype", "float32"},
                    {"text_config",
                     {{"hidden_size", 32},
                      {"intermediate_size", 48},
                      {"num_hidden_layers", 2},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},
                      {"vocab_size", 40},
                      {"max_position_embeddings", 16},
                      {"model_type", "gemma3_text"}}},
                    {"vision_config", {{"hidden_size", 8}}}};
  for (const std::string prefix : {"language_model.", "model.language_model."}) {
    Named tensors;
    for (auto& [name, t] : hf_tensors(*src, DType::F32))
      tensors.emplace_back(prefix == "language_model." ? prefix + name : prefix + name.substr(6),
                           t);
    tensors.emplace_back(prefix.substr(0, prefix.size() - 15) + "vision_tower.patch.weight",
                         Tensor::zeros({4, 4}));
    tensors.emplace_back(
        prefix.substr(0, prefix.size() - 15) + "multi_modal_projector.mm_input_projection_weight",
        Tensor::zeros({8, 32}));
    const std::string dir = test::temp_dir("hf-gemma3-mm");
    write_hf_dir(dir, cfg, tensors);
    const HfConfig hc = read_hf_config(dir);
    EXPECT_EQ(hc.spec.architecture(), "gemma3_text") << prefix;
    EXPECT_EQ(hc.spec.head_dim(), 256) << prefix;
    EXPECT_EQ(hc.spec.sliding_period, 6) << prefix;
    EXPECT_EQ(hc.spec.rope_theta, 1e6) << prefix;
    auto model = load_hf_model(dir);
    test::expect_bitwise_equal(model->forward(ids, Tensor()), want, prefix);
    // Written back as the language model alone.
    const std::string out = test::temp_dir("hf-gemma3-back");
    save_hf_model(*model, out);
    const json back = json::parse(read_file(out + "/config.json"));
    EXPECT_EQ(back.at("architectures"), json::array({"Gemma3ForCausalLM"}));
    EXPECT_FALSE(back.contains("vision_config"));
  }
  // An adapter PEFT saved on the multimodal class: the language model's modules under
  // language_model., a vision tower's LoRA beside (text never runs it): it applies as saved on
  // the language model alone.
  nn::AdapterOptions lora;
  lora.kind = "lora";
  lora.r = 2;
  lora.alpha = 4;
  lora.dropout = 0;
  lora.target_modules = {"q_proj", "v_proj"};
  auto adapted = load_hf_model(text_dir);
  nn::apply_adapters(*adapted, lora);
  uint64_t seed = 40;
  for (auto& [n, t] : nn::peft_state_dict(*adapted)) {
    Tensor p = t;
    p.copy_from(test::randn(p.shape(), seed++, 0.05f));
  }
  const std::string peft = test::temp_dir("hf-gemma3-peft") + "/adapter";
  save_peft_adapter(*adapted, lora, peft, text_dir);
  Named renamed;
  for (auto& [n, t] : read_safetensors(peft + "/adapter_model.safetensors").tensors)
    renamed.emplace_back("base_model.model.language_model.model." + n.substr(23), t);
  renamed.emplace_back(
      "base_model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_A.weight",
      Tensor::zeros({2, 8}));
  write_safetensors(peft + "/adapter_model.safetensors", renamed, {{"format", "pt"}});
  auto fresh = load_hf_model(text_dir);
  load_peft_adapter(*fresh, peft);
  test::expect_bitwise_equal(fresh->forward(ids, Tensor()), adapted->forward(ids, Tensor()),
                             "a multimodal PEFT adapter on the language model");
  // A multimodal file without its text_config says so.
  const std::string bad = test::temp_dir("hf-gemma3-bad");
  json no_text = cfg;
  no_text.erase("text_config");
  write_hf_dir(bad, no_text, hf_tensors(*src, DType::F32));
  EXPECT_CONTAINS(
      error_of([&] { read_hf_config(bad); }),
      bad + "/config.json: a Gemma3ForConditionalGeneration needs a text_config object");
}

// ---- errors name the file and the tensor or field -----------------------------------------------

class HfErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    spec = llama_spec(false);
    src = models::make_causal_lm(spec, 9);
    tensors = hf_tensors(*src, DType::F32);
    dir = test::temp_dir("hf-bad");
  }
  models::ModelSpec spec;
  std::unique_ptr<models::CausalLM> src;
  Named tensors;
  std::string dir;
};

TEST_F(HfErrors, TruncatedFile) {
  write_hf_dir(dir, config_of(spec), tensors);
  const std::string file = dir + "/model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 100);
  const std::string m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, file);
  EXPECT_CONTAINS(m, "truncated");
  EXPECT_CONTAINS(m, "lm_head.weight");  // the last tensor, the one cut short
}

TEST_F(HfErrors, MissingTensor) {
  Named some;
  for (auto& nt : tensors)
    if (nt.first != "model.layers.1.mlp.down_proj.weight") some.push_back(nt);
  write_hf_dir(dir, config_of(spec), some);
  const std::string m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, "'model.layers.1.mlp.down_proj.weight' is missing");
  EXPECT_CONTAINS(m, dir + "/model.safetensors");
}

TEST_F(HfErrors, ShapeDisagreesWithConfig) {
  Named narrow = tensors;
  for (auto& [n, t] : narrow)
    if (n == "model.layers.1.mlp.gate_proj.weight") t = Tensor::zeros({40, 32});  // 48 in config
  write_hf_dir(dir, config_of(spec), narrow);
  const std::string m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, "'model.layers.1.mlp.gate_proj.weight' has shape [40, 32]");
  EXPECT_CONTAINS(m, "config.json implies [48, 32]");
}

TEST_F(HfErrors, UnknownAndNonFloatingDtypes) {
  // A header naming F64 (not a dtype keel reads).
  write_hf_dir(dir, config_of(spec), tensors);
  const std::string file = dir + "/model.safetensors";
  std::string bytes = read_file(file);
  const size_t at = bytes.find("\"F32\"");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 5, "\"F64\"");
  write_text(file, bytes);
  std::string m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, file);
  EXPECT_CONTAINS(m, "F64");
  EXPECT_CONTAINS(m, "tensor '");
  // An integer tensor where a weight belongs.
  Named ints = tensors;
  for (auto& [n, t] : ints)
    if (n == "model.norm.weight") t = Tensor::zeros(t.shape(), DType::I32);
  write_hf_dir(dir, config_of(spec), ints);
  m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, "'model.norm.weight' has dtype i32");
}

TEST_F(HfErrors, ConfigFieldsAndArchitecture) {
  json cfg = config_of(spec);
  cfg.erase("hidden_size");
  write_hf_dir(dir, cfg, tensors);
  std::string m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, dir + "/config.json: missing field 'hidden_size'");
  // rope_scaling: llama3 without its other fields, an unknown type, a non-object.
  cfg = config_of(spec);
  cfg["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  write_hf_dir(dir, cfg, tensors);
  m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, dir + "/config.json: rope_scaling (llama3) needs a positive number");
  // A position count that is no whole number: 0.5 was cut to 0 and refused by the rope op
  // without the file's name ("rope: llama3 rope_scaling needs ..."); 1e300 overflowed int64.
  for (const double orig : {0.5, 8192.5, 1e300}) {
    cfg["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", 8.0},
                           {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0},
                           {"original_max_position_embeddings", orig}};
    write_hf_dir(dir, cfg, tensors);
    m = error_of([&] { load_hf_model(dir); });
    EXPECT_CONTAINS(m, dir +
                           "/config.json: rope_scaling (llama3): "
                           "original_max_position_embeddings must be a whole number");
  }
  cfg["rope_scaling"]["original_max_position_embeddings"] = 8192.0;  // integral: as 8192
  write_hf_dir(dir, cfg, tensors);
  EXPECT_EQ(read_hf_config(dir).spec.rope_scaling.original_max_position, 8192);
  // Dynamic NTK is read (its original context the file's max_position_embeddings) and written
  // back; a type keel does not run is refused naming it.
  cfg["rope_scaling"] = {{"type", "dynamic"}, {"factor", 4.0}};
  write_hf_dir(dir, cfg, tensors);
  {
    const models::ModelSpec dyn = read_hf_config(dir).spec;
    EXPECT_EQ(dyn.rope_scaling.kind, ops::RopeScaling::Kind::kDynamic);
    EXPECT_EQ(dyn.rope_scaling.factor, 4.0);
    EXPECT_EQ(dyn.rope_scaling.original_max_position, dyn.max_seq_len);
    EXPECT_EQ(io::hf_config_json(dyn, DType::F32).at("rope_scaling"),
              json({{"rope_type", "dynamic"}, {"factor", 4.0}}));
  }
  cfg["rope_scaling"] = {{"type", "ntk-by-parts"}, {"factor", 4.0}};
  write_hf_dir(dir, cfg, tensors);
  m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m,
                  "rope_scaling type 'ntk-by-parts' is not supported by keel's RoPE (it runs "
                  "'default', 'linear', 'dynamic', 'llama3', 'yarn' and Phi-3's 'longrope'");
  cfg["rope_scaling"] = 8;
  write_hf_dir(dir, cfg, tensors);
  m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, "rope_scaling must be an object or null");
  cfg = config_of(spec);
  cfg["model_type"] = "bloom";
  cfg["architectures"] = {"BloomForCausalLM"};
  write_hf_dir(dir, cfg, tensors);
  m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, "BloomForCausalLM");
  EXPECT_CONTAINS(m, "unsupported model");
  EXPECT_CONTAINS(
      m,
      "keel reads GPT2LMHeadModel (gpt2), LlamaForCausalLM (llama), "
      "GemmaForCausalLM (gemma), Gemma2ForCausalLM (gemma2), Gemma3ForCausalLM "
      "(gemma3_text), GraniteForCausalLM (granite), MistralForCausalLM (mistral), "
      "MixtralForCausalLM (mixtral), Olmo2ForCausalLM (olmo2), Olmo3ForCausalLM (olmo3), "
      "OlmoeForCausalLM (olmoe), Exaone4ForCausalLM (exaone4), Phi3ForCausalLM (phi3), "
      "Qwen2ForCausalLM (qwen2), "
      "Qwen3ForCausalLM (qwen3), Qwen3MoeForCausalLM (qwen3_moe), "
      "Qwen2MoeForCausalLM (qwen2_moe), SmolLM3ForCausalLM (smollm3), CohereForCausalLM "
      "(cohere), Cohere2ForCausalLM (cohere2), PhiForCausalLM (phi), GPTNeoXForCausalLM "
      "(gpt_neox), StableLmForCausalLM (stablelm), OlmoForCausalLM (olmo), GlmForCausalLM (glm), "
      "Glm4ForCausalLM (glm4), FalconForCausalLM (falcon), GPTJForCausalLM (gptj), "
      "CodeGenForCausalLM (codegen), Starcoder2ForCausalLM (starcoder2), "
      "GPTBigCodeForCausalLM (gpt_bigcode)");
  // A Qwen2's q/k/v biases are its weights: a file without them is named.
  cfg["model_type"] = "qwen2";
  cfg["architectures"] = {"Qwen2ForCausalLM"};
  write_hf_dir(dir, cfg, tensors);
  m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m,
                  "tensor 'model.layers.0.self_attn.q_proj.bias' is missing (config.json "
                  "describes a qwen2 with 2 layers");
  cfg["model_type"] = "mistral";
  cfg["architectures"] = {"MistralForCausalLM"};
  cfg["sliding_window"] = -1;
  write_hf_dir(dir, cfg, tensors);
  m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, "field 'sliding_window' must be a non-negative integer, got -1");
  const std::string empty = test::temp_dir("hf-empty");
  m = error_of([&] { load_hf_model(empty); });
  EXPECT_CONTAINS(m, "no config.json");
  write_text(empty + "/config.json", config_of(spec).dump());
  m = error_of([&] { load_hf_model(empty); });
  EXPECT_CONTAINS(m, "no model.safetensors or model.safetensors.index.json");
}

// config.json's sizes are checked against the weights' headers before the model is built: a
// layer count of 10^9 used to allocate for minutes (10^8: killed by the OOM killer at 24 GB).
TEST_F(HfErrors, SizesAreCheckedAgainstTheWeightsBeforeBuilding) {
  for (auto [field, value, held] : std::vector<std::tuple<const char*, int64_t, const char*>>{
           {"num_hidden_layers", 1000000000, "2 blocks"},
           {"vocab_size", 1000000, "an embedding of 40 rows"},
           {"hidden_size", 4096, "an embedding 32 wide"},
           {"intermediate_size", 1048576, "an MLP 48 wide"}}) {
    json cfg = config_of(spec);
    cfg[field] = value;
    if (std::string(field) == "hidden_size") cfg["head_dim"] = 4096 / 4;
    write_hf_dir(dir, cfg, tensors);
    const std::string m = error_of([&] { load_hf_model(dir); });
    EXPECT_CONTAINS(m, dir + "/config.json: " + field + " = " + std::to_string(value));
    EXPECT_CONTAINS(m, held);
    EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }), field);
  }
  // A model_type of the wrong type names the file and the field (not a raw JSON exception).
  json cfg = config_of(spec);
  cfg["model_type"] = 5;
  write_hf_dir(dir, cfg, tensors);
  const std::string m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, dir + "/config.json: field 'model_type' must be a string");
  EXPECT_EQ(m.find("json.exception"), std::string::npos) << m;
  // A number beyond a double (nlohmann throws out_of_range, not parse_error, for it).
  write_text(dir + "/config.json", R"({"model_type": "llama", "num_hidden_layers": 1e400})");
  const std::string big = error_of([&] { read_hf_config(dir); });
  EXPECT_CONTAINS(big, dir + "/config.json: invalid JSON: number overflow parsing '1e400'");
  EXPECT_EQ(big.find("json.exception"), std::string::npos) << big;
  // A directory named config.json read as an empty file ("invalid JSON ... unexpected end").
  const std::string odd = test::temp_dir("hf-config-dir");
  std::filesystem::create_directory(odd + "/config.json");
  EXPECT_CONTAINS(error_of([&] { read_hf_config(odd); }),
                  "cannot read " + odd + "/config.json: it is a directory");
}

TEST_F(HfErrors, UnexpectedTensorAndBrokenShards) {
  Named extra = tensors;
  extra.emplace_back("model.layers.0.self_attn.q_proj.bias", Tensor::zeros({32}));
  write_hf_dir(dir, config_of(spec), extra);
  std::string m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'");

  const std::string sh = test::temp_dir("hf-shards");
  write_hf_dir(sh, config_of(spec), tensors, 2);
  fs::remove(sh + "/model-00002-of-00002.safetensors");
  m = error_of([&] { load_hf_model(sh); });
  EXPECT_CONTAINS(m, "shard 'model-00002-of-00002.safetensors'");
  EXPECT_CONTAINS(m, "does not exist");

  const std::string moved = test::temp_dir("hf-shards2");
  write_hf_dir(moved, config_of(spec), tensors, 2);
  json index = json::parse(read_file(moved + "/model.safetensors.index.json"));
  index["weight_map"]["model.norm.weight"] = index["weight_map"]["model.embed_tokens.weight"];
  write_text(moved + "/model.safetensors.index.json", index.dump());
  m = error_of([&] { load_hf_model(moved); });
  EXPECT_CONTAINS(m, "'model.norm.weight' is missing");
  EXPECT_CONTAINS(m, "places it in this shard");
}

// A symbolic link that leads back to itself (config.json, the weights, a shard, the directory)
// escaped as std::filesystem's "filesystem error: status: Too many levels of symbolic links
// [PATH]", which keel train printed as it was.
TEST_F(HfErrors, SymbolicLinkLoopsNameThePathAndTheFix) {
  auto expect_loop = [](const std::string& m, const std::string& path) {
    EXPECT_CONTAINS(m, "cannot look at " + path + ": ");
    EXPECT_CONTAINS(m, "leads back to itself; fix or remove it");
  };
  write_hf_dir(dir, config_of(spec), tensors);
  fs::remove(dir + "/model.safetensors");
  fs::create_symlink("model.safetensors", dir + "/model.safetensors");
  expect_loop(error_of([&] { load_hf_model(dir); }), dir + "/model.safetensors");
  fs::remove(dir + "/config.json");
  fs::create_symlink("config.json", dir + "/config.json");
  expect_loop(error_of([&] { read_hf_config(dir); }), dir + "/config.json");
  expect_loop(error_of([&] { load_trained_model(dir, "", DType::F32); }), dir + "/config.json");

  const std::string sh = test::temp_dir("hf-shard-loop");
  write_hf_dir(sh, config_of(spec), tensors, 2);
  const std::string shard = sh + "/model-00002-of-00002.safetensors";
  fs::remove(shard);
  fs::create_symlink("model-00002-of-00002.safetensors", shard);
  expect_loop(error_of([&] { load_hf_model(sh); }), shard);

  const std::string loop = test::temp_dir("hf-dir-loop") + "/model";
  fs::create_symlink("model", loop);
  expect_loop(error_of([&] { load_trained_model(loop, "", DType::F32); }), loop);
}

// ---- adapters: PEFT directories, merged saves
// ----------------------------------------------------

class PeftExport : public ::testing::TestWithParam<std::string> {};

TEST_P(PeftExport, AdapterDirectoryRoundTrips) {
  const std::string kind = GetParam();
  auto model = models::make_causal_lm(llama_spec(false), 3);
  nn::AdapterOptions opt;
  opt.kind = kind;
  opt.r = 4;
  opt.alpha = 8;
  opt.dropout = kind == "lokr" ? 0.0 : 0.05;
  opt.target_modules = {"q_proj", "k_proj", "v_proj", "up_proj", "down_proj"};
  nn::apply_adapters(*model, opt);
  uint64_t seed = 20;
  for (auto& [n, t] : nn::peft_state_dict(*model)) {  // a trained adapter
    Tensor p = t;
    p.copy_from(test::randn(p.shape(), seed++, 0.05f));
  }
  const std::string dir = test::temp_dir("peft") + "/adapter";
  save_peft_adapter(*model, opt, dir, "/models/tiny-llama");

  const json c = json::parse(read_file(dir + "/adapter_config.json"));
  EXPECT_EQ(c["task_type"], "CAUSAL_LM");
  EXPECT_EQ(c["base_model_name_or_path"], "/models/tiny-llama");
  EXPECT_EQ(c["r"], 4);
  EXPECT_EQ(c["target_modules"], json(opt.target_modules));
  if (kind == "lokr") {
    EXPECT_EQ(c["peft_type"], "LOKR");
    EXPECT_EQ(c["alpha"], 8.0);
  } else {
    EXPECT_EQ(c["peft_type"], "LORA");
    EXPECT_EQ(c["lora_alpha"], 8.0);
    EXPECT_EQ(c["lora_dropout"], 0.05);
    EXPECT_EQ(c["use_dora"], kind == "dora");
    EXPECT_EQ(c["fan_in_fan_out"], false);
  }
  Safetensors st = read_safetensors(dir + "/adapter_model.safetensors");
  EXPECT_EQ(st.metadata["format"], "pt");
  const auto want = nn::peft_state_dict(*model);
  ASSERT_EQ(st.tensors.size(), want.size());
  for (auto& [n, t] : want) {
    ASSERT_NE(st.find(n), nullptr) << n;
    EXPECT_EQ(st.at(n).dtype(), DType::F32) << n;
    test::expect_bitwise_equal(st.at(n), t, n);
  }
  const std::string first = kind == "lokr"
                                ? "base_model.model.model.layers.0.self_attn.q_proj.lokr_w1"
                                : "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
  EXPECT_NE(st.find(first), nullptr);
  if (kind == "dora") {
    EXPECT_NE(st.find("base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector"),
              nullptr);
  }

  // Loading it into a fresh copy of the base reproduces the adapted model exactly.
  auto fresh = models::make_causal_lm(llama_spec(false), 3);
  nn::AdapterOptions got = load_peft_adapter(*fresh, dir);
  EXPECT_EQ(got.kind, kind);
  EXPECT_EQ(got.r, 4);
  model->train(false);
  fresh->train(false);
  NoGradGuard no_grad;
  test::expect_bitwise_equal(fresh->forward(sample_ids(), Tensor()),
                             model->forward(sample_ids(), Tensor()), kind + " reloaded adapter");

  // A PEFT file with a wrong rank is an error naming the tensor.
  json bad = c;
  bad["r"] = 2;
  write_text(dir + "/adapter_config.json", bad.dump());
  auto other = models::make_causal_lm(llama_spec(false), 3);
  const std::string m = error_of([&] { load_peft_adapter(*other, dir); });
  EXPECT_CONTAINS(m, dir + "/adapter_model.safetensors");
  EXPECT_CONTAINS(m, "tensor 'base_model.model.model.layers.0.self_attn.q_proj.");

  // An adapter holding an inf is refused like a base holding one (it was loaded unchecked: keel
  // export wrote a model that did not load, keel eval blamed the weights of the base's policy).
  write_text(dir + "/adapter_config.json", c.dump());
  Safetensors held = read_safetensors(dir + "/adapter_model.safetensors");
  const std::string bad_name = held.tensors[1].first;
  Tensor bad_t = held.tensors[1].second.to_dtype(DType::F32);
  bad_t.data_as<float>()[2] = std::numeric_limits<float>::infinity();
  held.tensors[1].second = bad_t;
  write_safetensors(dir + "/adapter_model.safetensors", held.tensors, held.metadata);
  auto inf_model = models::make_causal_lm(llama_spec(false), 3);
  const std::string inf_m = error_of([&] { load_peft_adapter(*inf_model, dir); });
  EXPECT_CONTAINS(inf_m, dir + "/adapter_model.safetensors");
  EXPECT_CONTAINS(inf_m, "tensor '" + bad_name + "' holds 1 non-finite value");

  // PEFT fields keel does not apply are refused by name: alpha_pattern was ignored, and the
  // adapter computed another model without a word.
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, json>>{{"alpha_pattern", {{"q_proj", 4}}},
                                                 {"rank_pattern", {{"q_proj", 2}}},
                                                 {"layers_to_transform", json::array({0})},
                                                 {"modules_to_save", json::array({"lm_head"})},
                                                 // Were ignored: [[1, 2], [0, 1]] (the layers
                                                 // swapped) loaded on the base's own order.
                                                 {"layer_replication", {{1, 2}, {0, 1}}},
                                                 {"trainable_token_indices", json::array({1, 2})},
                                                 {"target_parameters", json::array({"mlp.w"})}}) {
    json with = c;
    with[field] = value;
    write_text(dir + "/adapter_config.json", with.dump());
    auto m2 = models::make_causal_lm(llama_spec(false), 3);
    const std::string e = error_of([&] { load_peft_adapter(*m2, dir); });
    EXPECT_CONTAINS(e, dir + "/adapter_config.json: " + field + " = " + value.dump());
    EXPECT_CONTAINS(e, "is not supported by keel");
  }
  write_text(dir + "/adapter_config.json", c.dump());
  // On a model of another family its targets match nothing: the error names the adapter's file
  // (it said to fix model.adapter.target_modules, a key of no file the user gave).
  auto gpt2 = models::make_causal_lm(gpt2_spec(), 3);
  const std::string family = error_of([&] { load_peft_adapter(*gpt2, dir); });
  EXPECT_CONTAINS(family, dir + "/adapter_config.json: target module 'q_proj' matches no linear");
  EXPECT_CONTAINS(family, "(fix target_modules in " + dir + "/adapter_config.json)");
  EXPECT_NOT_CONTAINS(family, "model.adapter");
  // A tensor adapter_config.json implies and the file lacks asked "was it written for another
  // model?": it names both files and the fix.
  held.tensors[1].second.data_as<float>()[2] = 0;  // the inf above, gone
  const std::string gone = held.tensors.back().first;
  held.tensors.pop_back();
  write_safetensors(dir + "/adapter_model.safetensors", held.tensors, held.metadata);
  auto lacking = models::make_causal_lm(llama_spec(false), 3);
  const std::string missing = error_of([&] { load_peft_adapter(*lacking, dir); });
  EXPECT_CONTAINS(missing, dir + "/adapter_model.safetensors: tensor '" + gone +
                               "' is missing (the file has " + std::to_string(held.tensors.size()) +
                               " tensors), though " + dir +
                               "/adapter_config.json adapts that module of this base model");
  EXPECT_CONTAINS(missing, "load it on the base it was trained on");
  EXPECT_NOT_CONTAINS(missing, "another model?");
}

TEST_P(PeftExport, MergedModelSavesAsAPlainHfModel) {
  const std::string kind = GetParam();
  for (const std::string family : {"llama", "gpt2"}) {
    auto model = models::make_causal_lm(family == "gpt2" ? gpt2_spec() : llama_spec(true), 4);
    nn::AdapterOptions opt;
    opt.kind = kind;
    opt.r = 4;
    opt.alpha = 8;
    opt.target_modules = family == "gpt2" ? std::vector<std::string>{"c_attn", "c_fc"}
                                          : std::vector<std::string>{"q_proj", "down_proj"};
    nn::apply_adapters(*model, opt);
    uint64_t seed = 40;
    for (auto& [n, t] : nn::peft_state_dict(*model)) {
      Tensor p = t;
      p.copy_from(test::randn(p.shape(), seed++, 0.05f));
    }
    NoGradGuard no_grad;
    Tensor adapted = model->forward(sample_ids(), Tensor());
    nn::merge_adapters(*model);
    const std::string dir = test::temp_dir("merged");
    save_hf_model(*model, dir);
    for (auto& [n, t] : read_hf_tensors(dir))
      EXPECT_EQ(n.find("lora_"), std::string::npos) << "adapter tensor in a plain model: " << n;
    auto plain = load_hf_model(dir);
    test::expect_close(plain->forward(sample_ids(), Tensor()), adapted, 2e-5, 2e-4,
                       kind + " " + family + " merged and reloaded");
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, PeftExport, ::testing::Values("lora", "dora", "lokr"));

// A PEFT directory's fields out of range are refused before anything is built, naming the file
// and the field (r = 1e8 used to end in "out of memory" advising train.batch_size, r = 2^63 - 1
// in a shape error, r = 0 in "model.adapter: r = 0", a key of a config the user never wrote).
TEST(PeftConfig, FieldsOutOfRangeNameTheFileAndTheField) {
  auto model = models::make_causal_lm(llama_spec(false), 3);
  nn::AdapterOptions opt;
  opt.kind = "lora";
  opt.r = 4;
  opt.target_modules = {"q_proj"};
  nn::apply_adapters(*model, opt);
  const std::string dir = test::temp_dir("peft-bad") + "/adapter";
  save_peft_adapter(*model, opt, dir, "");
  const std::string cfg_path = dir + "/adapter_config.json";
  const json good = json::parse(read_file(cfg_path));
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"r", 0}}, "field 'r' must be in [1, 65536], got 0"},
      {{{"r", 100000000}}, "field 'r' must be in [1, 65536], got 100000000"},
      {{{"r", INT64_MAX}}, "field 'r' must be in [1, 65536], got 9223372036854775807"},
      {{{"lora_alpha", -2.0}}, "field 'lora_alpha' must be > 0, got -2.0"},
      {{{"lora_dropout", 1.0}}, "field 'lora_dropout' must be in [0, 1), got 1.0"},
      {{{"target_modules", json::array()}}, "target_modules is empty"},
      {{{"peft_type", "LOKR"}, {"alpha", 0}}, "field 'alpha' must be > 0, got 0"},
      // It read "peft_type '' is not supported" for a file without the field.
      {{{"peft_type", nullptr}}, "has no peft_type; keel reads PEFT's LORA"},
      {{{"peft_type", "IA3"}}, "peft_type 'IA3' is not supported; keel reads PEFT's LORA"},
  };
  for (const auto& [change, want] : cases) {
    json bad = good;
    bad.update(change);
    write_text(cfg_path, bad.dump());
    auto fresh = models::make_causal_lm(llama_spec(false), 3);
    const std::string m = error_of([&] { load_peft_adapter(*fresh, dir); });
    EXPECT_CONTAINS(m, cfg_path + ": " + want) << change.dump();
    EXPECT_EQ(m.find("model.adapter"), std::string::npos) << m;
  }
  write_text(cfg_path, R"({"peft_type": "LORA", "r": 1e400})");
  EXPECT_CONTAINS(error_of([&] { read_peft_config(dir); }), cfg_path + ": invalid JSON: number");
  // The bound is model.adapter.r's: the largest rank loads as far as the weights' shapes.
  json big = good;
  big["r"] = nn::kMaxAdapterRank;
  write_text(cfg_path, big.dump());
  auto fresh = models::make_causal_lm(llama_spec(false), 3);
  EXPECT_CONTAINS(error_of([&] { load_peft_adapter(*fresh, dir); }),
                  "(r = " + std::to_string(nn::kMaxAdapterRank) + ")");
}

// generation_config.json's eos_token_id, an id or a list (Llama-3.1-Instruct's three), ends a
// reply; a bad file is named, never read as "no eos".
TEST(HfModel, GenerationConfigEosIdsAreReadAndBadOnesNamed) {
  const std::string dir = test::temp_dir("hf-gen-config");
  const std::string file = dir + "/generation_config.json";
  EXPECT_TRUE(io::generation_eos_ids(dir).empty());  // no file
  auto with = [&](const std::string& text) {
    std::ofstream(file) << text;
    return io::generation_eos_ids(dir);
  };
  EXPECT_EQ(with(R"({"eos_token_id": [128001, 128008, 128009], "temperature": 0.6})"),
            (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(with(R"({"eos_token_id": 50256})"), (std::vector<int64_t>{50256}));
  EXPECT_TRUE(with(R"({"eos_token_id": null})").empty());
  EXPECT_TRUE(with(R"({"do_sample": true})").empty());
  for (const char* bad : {R"({"eos_token_id": [1, "x"]})", R"({"eos_token_id": -3})",
                          R"({"eos_token_id": 1e30})", "{not json"}) {
    SCOPED_TRACE(bad);
    const std::string e = test::error_of([&] { with(bad); });
    EXPECT_CONTAINS(e, file);
    EXPECT_CONTAINS(e, "fix or remove it");
  }
}

// transformers 5 writes RoPE as rope_parameters (rope_theta inside it, a scaling's fields beside
// its rope_type; one such object per layer type for models with sliding layers) and no rope_theta
// or rope_scaling: keel read such a Llama-3.1 at rope_theta's default 10000 without scaling, and
// trained it so without a word. Both forms now read alike; where a file gives both they must
// agree; a RoPE per layer type keel's layers do not run is refused naming the field; keel writes
// the older form, which every transformers reads.
TEST(HfModel, Transformers5RopeParametersReadAsTheOlderFields) {
  const models::ModelSpec spec = llama_spec(false);
  auto src = models::make_causal_lm(spec, 4);
  const std::string dir = test::temp_dir("hf-rope-parameters");
  const json llama31 = {{"rope_type", "llama3"},
                        {"factor", 8.0},
                        {"low_freq_factor", 1.0},
                        {"high_freq_factor", 4.0},
                        {"original_max_position_embeddings", 8192}};
  json legacy = config_of(spec);
  legacy["rope_theta"] = 500000.0;
  legacy["max_position_embeddings"] = 131072;
  legacy["rope_scaling"] = llama31;
  json v5 = legacy;
  v5.erase("rope_theta");
  v5.erase("rope_scaling");
  v5["rope_parameters"] = llama31;
  v5["rope_parameters"]["rope_theta"] = 500000.0;
  auto write = [&](const json& cfg) { write_hf_dir(dir, cfg, hf_tensors(*src, DType::F32)); };
  auto spec_of = [&](const json& cfg) {
    write(cfg);
    return read_hf_config(dir).spec;
  };
  auto refusal = [&](const json& cfg) {
    write(cfg);
    return error_of([&] { read_hf_config(dir); });
  };
  const models::ModelSpec old_form = spec_of(legacy), new_form = spec_of(v5);
  EXPECT_EQ(new_form.rope_theta, 500000.0);
  EXPECT_EQ(new_form.rope_scaling.kind, ops::RopeScaling::Kind::kLlama3);
  EXPECT_EQ(new_form.rope_scaling.original_max_position, 8192);
  EXPECT_EQ(ops::rope_inv_freq(new_form.rope_theta, new_form.head_dim(), new_form.rope_scaling),
            ops::rope_inv_freq(old_form.rope_theta, old_form.head_dim(), old_form.rope_scaling));
  const Tensor ids = Tensor::from_ints({3, 1, 4, 1, 5, 9, 2, 6}, {1, 8});
  auto logits = [&] {
    NoGradGuard g;
    return load_hf_model(dir)->forward(ids, Tensor());
  };
  const Tensor from_new = logits();
  write(legacy);
  test::expect_bitwise_equal(from_new, logits(), "the two forms' logits");
  // Qwen3's form: a default RoPE by a base of its own.
  json qwen = v5;
  qwen["rope_parameters"] = {{"rope_theta", 1000000.0}, {"rope_type", "default"}};
  EXPECT_EQ(spec_of(qwen).rope_theta, 1000000.0);
  EXPECT_EQ(spec_of(qwen).rope_scaling.kind, ops::RopeScaling::Kind::kNone);
  // Both forms: read when they agree, refused naming both when they do not.
  json both = v5;
  both["rope_theta"] = 500000;
  both["rope_scaling"] = llama31;
  EXPECT_EQ(spec_of(both).rope_theta, 500000.0);
  both["rope_theta"] = 10000.0;
  EXPECT_CONTAINS(refusal(both), dir +
                                     "/config.json: rope_theta = 10000.0 and "
                                     "rope_parameters.rope_theta = 500000.0 disagree; keep one");
  both = v5;
  both["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  EXPECT_CONTAINS(refusal(both), dir + "/config.json: rope_scaling = ");
  EXPECT_CONTAINS(refusal(both), "and rope_parameters = ");
  json bad = v5;
  bad["rope_parameters"] = 5;
  EXPECT_CONTAINS(refusal(bad),
                  dir +
                      "/config.json: rope_parameters must be an object (rope_theta, rope_type, "
                      "...), got 5");
  bad["rope_parameters"] = {{"rope_type", "ntk-by-parts"}, {"factor", 2.0}};
  EXPECT_CONTAINS(refusal(bad), "type 'ntk-by-parts' is not supported");
  // A share of a head's channels where keel's Llama turns them all: refused, not ignored.
  bad["rope_parameters"] = {{"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}};
  EXPECT_CONTAINS(refusal(bad),
                  "partial_rotary_factor = 0.5 (keel's llama turns every channel of "
                  "a head) is not supported");
  // keel writes the older form, without the base's rope_parameters.
  const json written = hf_config_json(new_form, DType::F32, v5);
  EXPECT_FALSE(written.contains("rope_parameters"));
  EXPECT_EQ(written.at("rope_theta"), 500000.0);
  EXPECT_EQ(written.at("rope_scaling").at("rope_type"), "llama3");
}

// The per-layer-type form: a Gemma-3's sliding layers by their own base, an OLMo-3's without its
// full layers' YaRN, a Mistral's every layer alike; other pairs keel's layers would not run as
// the file says are refused naming the entry.
TEST(HfModel, Transformers5RopeParametersPerLayerType) {
  const std::string dir = test::temp_dir("hf-rope-parameters-layers");
  // `family`'s tiny model written by keel, its RoPE fields replaced by `rope_parameters`.
  auto write = [&](const std::string& family, const json& rope_parameters) {
    const models::ModelSpec spec = test::tiny_model_spec(family);
    auto m = models::make_causal_lm(spec, 5);
    json cfg = hf_config_json(spec, DType::F32, json::object());
    for (const char* k :
         {"rope_theta", "rope_scaling", "rope_local_base_freq", "original_max_position_embeddings"})
      cfg.erase(k);
    cfg["rope_parameters"] = rope_parameters;
    write_hf_dir(dir, cfg, hf_tensors(*m, DType::F32));
  };
  auto refusal = [&] { return error_of([&] { read_hf_config(dir); }); };
  const json plain = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  write("gemma3", {{"full_attention", plain},
                   {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 100.0}}}});
  models::ModelSpec s = read_hf_config(dir).spec;
  EXPECT_EQ(s.rope_theta, 10000.0);
  EXPECT_EQ(s.rope_local_theta, 100.0);
  EXPECT_EQ(s.layer_rope_theta(0), 100.0);
  const json yarn = {{"rope_type", "yarn"},
                     {"factor", 4.0},
                     {"original_max_position_embeddings", 1000},
                     {"rope_theta", 10000.0}};
  write("olmo3", {{"full_attention", yarn}, {"sliding_attention", plain}});
  s = read_hf_config(dir).spec;
  EXPECT_EQ(s.rope_scaling.kind, ops::RopeScaling::Kind::kYarn);
  EXPECT_EQ(s.layer_rope_scaling(0).kind, ops::RopeScaling::Kind::kNone);  // sliding
  EXPECT_EQ(s.layer_rope_scaling(1).kind, ops::RopeScaling::Kind::kYarn);  // full
  // One RoPE given for each layer type alike: a Mistral's.
  write("mistral_w3", {{"full_attention", plain}, {"sliding_attention", plain}});
  EXPECT_EQ(read_hf_config(dir).spec.rope_theta, 10000.0);
  // Phi-3's longrope with its original context inside (Phi3Config's default 4096 otherwise).
  write("phi3_lr", {{"rope_type", "longrope"},
                    {"short_factor", {1.0, 1.5}},
                    {"long_factor", {2.0, 7.0}},
                    {"original_max_position_embeddings", 4},
                    {"rope_theta", 10000.0}});
  s = read_hf_config(dir).spec;
  EXPECT_EQ(s.rope_scaling.kind, ops::RopeScaling::Kind::kLongRope);
  EXPECT_EQ(s.rope_scaling.original_max_position, 4);
  EXPECT_EQ(s.rope_scaling.long_factor, (std::vector<double>{2.0, 7.0}));
  // What keel's layers would not run as the file says.
  write("olmo3", {{"full_attention", yarn}, {"sliding_attention", yarn}});
  EXPECT_CONTAINS(refusal(),
                  dir +
                      "/config.json: rope_parameters.sliding_attention scales the sliding "
                      "layers (yarn), which keel's olmo3 rotates without scaling");
  write("mistral_w3", {{"full_attention", plain},
                       {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 100.0}}}});
  const std::string mistral = refusal();
  EXPECT_CONTAINS(mistral,
                  "rope_parameters.sliding_attention = {\"rope_theta\":100.0,\"rope_type\":"
                  "\"default\"} differs from rope_parameters.full_attention");
  EXPECT_CONTAINS(mistral, "keel's mistral rotates every layer alike");
  write("gemma3",
        {{"full_attention", plain},
         {"sliding_attention",
          {{"rope_type", "default"}, {"rope_theta", 100.0}, {"partial_rotary_factor", 0.5}}}});
  EXPECT_CONTAINS(refusal(),
                  "rope_parameters.sliding_attention turns another share of a head's channels");
  write("olmo3", {{"full_attention", yarn},
                  {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 500.0}}}});
  EXPECT_CONTAINS(refusal(),
                  "rope_parameters.sliding_attention.rope_theta = 500.0 differs from the full "
                  "layers' 10000.0; keel's olmo3 rotates its sliding layers by rope_theta");
  // Entries per layer type beside a flat RoPE say two things at once.
  json mixed = yarn;
  mixed["sliding_attention"] = plain;
  write("olmo3", mixed);
  EXPECT_CONTAINS(refusal(), "rope_parameters mixes entries per layer type with ");
  // transformers 5.0's flat form of an OLMo-3: its YaRN reaches the full layers only.
  write("olmo3", yarn);
  s = read_hf_config(dir).spec;
  EXPECT_EQ(s.layer_rope_scaling(0).kind, ops::RopeScaling::Kind::kNone);
  EXPECT_EQ(s.layer_rope_scaling(1).kind, ops::RopeScaling::Kind::kYarn);
  // A fault in a scaling read from rope_parameters names that field.
  write("olmo3", {{"full_attention", {{"rope_type", "yarn"}, {"rope_theta", 10000.0}}},
                  {"sliding_attention", plain}});
  EXPECT_CONTAINS(refusal(),
                  dir +
                      "/config.json: rope_parameters.full_attention (yarn) needs a positive "
                      "number 'factor'");
}

// OLMo-3-7B's config.json (tests/fuzz/corpus/hf_config/olmo3_7b.json), and the same in transformers
// 5's per-layer-type form: read alike, as the file says.
TEST(HfModel, Olmo3SevenBReadsItsWindowLayersAndYarn) {
  for (const char* name : {"olmo3_7b.json", "olmo3_7b_transformers5.json"}) {
    const std::string dir = test::temp_dir("hf-olmo3-7b");
    fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/" + name,
                  dir + "/config.json", fs::copy_options::overwrite_existing);
    const models::ModelSpec s = read_hf_config(dir).spec;
    EXPECT_EQ(s.architecture(), "olmo3") << name;
    EXPECT_EQ(s.sliding_window, 4096) << name;
    EXPECT_EQ(s.sliding_period, 4) << name;
    EXPECT_EQ(s.rope_theta, 500000.0) << name;
    EXPECT_EQ(s.norm_eps, 1e-6) << name;
    EXPECT_TRUE(s.post_norms()) << name;
    for (int64_t layer : {0, 1, 2, 4}) {
      EXPECT_EQ(s.layer_window(layer), 4096) << name << " layer " << layer;
      EXPECT_EQ(s.layer_rope_scaling(layer).kind, ops::RopeScaling::Kind::kNone) << name;
    }
    EXPECT_EQ(s.layer_window(3), 0) << name;
    const ops::RopeScaling r = s.layer_rope_scaling(3);
    EXPECT_EQ(r.kind, ops::RopeScaling::Kind::kYarn) << name;
    EXPECT_EQ(r.factor, 8.0) << name;
    EXPECT_EQ(r.original_max_position, 8192) << name;
    EXPECT_EQ(r.attention_factor, 1.2079441541679836) << name;
  }
}

// EXAONE-4.0-32B's config.json (tests/fuzz/corpus/hf_config/exaone4_32b.json, written from the
// published file's fields, not downloaded here): 64 layers, three of every four sliding over 4096
// positions and rotating by Llama-3's scaling, every fourth full and without RoPE; a q/k norm per
// head after OLMo-2's post-norms.
TEST(HfModel, Exaone4ThirtyTwoBReadsItsWindowLayersAndNope) {
  const std::string dir = test::temp_dir("hf-exaone4-32b");
  fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/exaone4_32b.json",
                dir + "/config.json", fs::copy_options::overwrite_existing);
  const models::ModelSpec s = read_hf_config(dir).spec;
  EXPECT_EQ(s.architecture(), "exaone4");
  EXPECT_EQ(s.n_layer, 64);
  EXPECT_EQ(s.head_dim(), 128);
  EXPECT_EQ(s.sliding_window, 4096);
  EXPECT_EQ(s.sliding_period, 4);
  EXPECT_TRUE(s.post_norms());
  EXPECT_TRUE(s.qk_norm());
  EXPECT_FALSE(s.qk_norm_over_projection());
  EXPECT_FALSE(s.tie_embeddings);
  EXPECT_EQ(s.rope_scaling.kind, ops::RopeScaling::Kind::kLlama3);
  for (int64_t layer : {0, 1, 2, 60, 62}) {
    EXPECT_EQ(s.layer_window(layer), 4096) << layer;
    EXPECT_TRUE(s.layer_rotates(layer)) << layer;
  }
  for (int64_t layer : {3, 7, 63}) {
    EXPECT_EQ(s.layer_window(layer), 0) << layer;
    EXPECT_FALSE(s.layer_rotates(layer)) << layer;
  }
  // Without a window (null) every layer sees every key and rotates (HF's Exaone4Attention).
  nlohmann::json j = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  j["sliding_window"] = nullptr;
  std::ofstream(dir + "/config.json") << j.dump();
  const models::ModelSpec full = read_hf_config(dir).spec;
  for (int64_t layer : {0, 3, 63}) {
    EXPECT_EQ(full.layer_window(layer), 0) << layer;
    EXPECT_TRUE(full.layer_rotates(layer)) << layer;
  }
}

// The published mixtures of experts (tests/fuzz/corpus/hf_config, written from their config.json
// fields, not downloaded here): Qwen3-30B-A3B (48 layers of 128 experts 768 wide, 8 a token,
// renormalized; 30.53B parameters, 3.3B of them a token's), OLMoE-1B-7B (16 layers of 64 experts
// 1024 wide, 8 a token, not renormalized, q/k norms over the projections; 6.92B) and
// Mixtral-8x7B (32 layers of 8 experts 14336 wide, 2 a token; 46.70B): each read with its sizes
// and counted as the models are published.
// Cohere's published configs (Aya-23-8B: grouped-query heads, Aya Expanse's shape; Aya-23-35B:
// Command-R's, rope_theta 8e6): the family, their LayerNorms' eps, logit_scale and the tied head,
// and the parameter count of a layer without post_attention_layernorm (8.03B and 34.98B).
// Command-R+'s per-head q/k LayerNorms are refused naming the field.
TEST(HfModel, CohereReadsItsPublishedConfigs) {
  struct Case {
    const char* file;
    int64_t C, F, L, H, Hkv;
    double theta;
  };
  for (const Case& c : {Case{"aya_23_8b.json", 4096, 14336, 32, 32, 8, 10000.0},
                        Case{"aya_23_35b.json", 8192, 22528, 40, 64, 64, 8e6}}) {
    SCOPED_TRACE(c.file);
    const std::string dir = test::temp_dir("hf-cohere");
    fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/" + c.file,
                  dir + "/config.json", fs::copy_options::overwrite_existing);
    const models::ModelSpec s = read_hf_config(dir).spec;
    EXPECT_EQ(s.architecture(), "cohere");
    EXPECT_TRUE(s.parallel_block() && s.centered_norms() && s.interleaved_rope());
    EXPECT_EQ(s.logit_scale, 0.0625);
    EXPECT_EQ(s.norm_eps, 1e-5);
    EXPECT_EQ(s.rope_theta, c.theta);
    EXPECT_TRUE(s.tie_embeddings);
    EXPECT_EQ(s.kv_heads(), c.Hkv);
    const int64_t D = c.C / c.H;
    const int64_t layer = 2 * c.C * c.C + 2 * c.C * c.Hkv * D + 3 * c.C * c.F + c.C;  // one norm
    EXPECT_EQ(models::parameter_count(s), c.L * layer + 256000 * c.C + c.C);
    // Written back as it was read.
    const nlohmann::json back = io::hf_config_json(s, DType::BF16);
    EXPECT_EQ(back.at("model_type"), "cohere");
    EXPECT_EQ(back.at("architectures")[0], "CohereForCausalLM");
    EXPECT_EQ(back.at("logit_scale"), 0.0625);
    EXPECT_EQ(back.at("layer_norm_eps"), 1e-5);
    EXPECT_FALSE(back.contains("rms_norm_eps"));
    EXPECT_EQ(back.at("use_qk_norm"), false);
  }
  EXPECT_NEAR(double(32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * int64_t{14336} + 4096) +
                     256000 * int64_t{4096} + 4096) /
                  1e9,
              8.03, 0.01);
  // Command-R7B (Cohere2ForCausalLM): three of four layers sliding over 4096 positions and
  // rotating, the fourth full without RoPE; logit_scale 0.25; 8.03B parameters.
  {
    const std::string dir = test::temp_dir("hf-cohere2");
    fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/command_r7b.json",
                  dir + "/config.json", fs::copy_options::overwrite_existing);
    const models::ModelSpec s = read_hf_config(dir).spec;
    EXPECT_EQ(s.architecture(), "cohere2");
    EXPECT_TRUE(s.parallel_block() && s.centered_norms() && s.interleaved_rope());
    EXPECT_EQ(s.logit_scale, 0.25);
    EXPECT_EQ(s.rope_theta, 50000.0);
    for (int64_t l = 0; l < 8; ++l) {
      EXPECT_EQ(s.layer_window(l), l % 4 == 3 ? 0 : 4096) << l;
      EXPECT_EQ(s.layer_rotates(l), l % 4 != 3) << l;
    }
    const int64_t layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * int64_t{14336} + 4096;
    EXPECT_EQ(models::parameter_count(s), 32 * layer + 256000 * int64_t{4096} + 4096);
    const nlohmann::json back = io::hf_config_json(s, DType::BF16);
    EXPECT_EQ(back.at("architectures")[0], "Cohere2ForCausalLM");
    EXPECT_EQ(back.at("sliding_window_pattern"), 4);
    EXPECT_EQ(back.at("layer_types")[3], "full_attention");
    EXPECT_FALSE(back.contains("use_qk_norm"));
    // Without a window HF's Cohere2 would turn no layer: refused naming the field.
    nlohmann::json j = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
    j["sliding_window"] = nullptr;
    std::ofstream(dir + "/config.json") << j.dump();
    EXPECT_CONTAINS(test::error_of([&] { read_hf_config(dir); }),
                    "sliding_window = null (HF's Cohere2 then turns no layer by RoPE)");
  }
  const std::string dir = test::temp_dir("hf-cohere-bad");
  nlohmann::json j = nlohmann::json::parse(
      std::ifstream(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/aya_23_8b.json"));
  j["logit_scale"] = 0;
  std::ofstream(dir + "/config.json") << j.dump();
  EXPECT_CONTAINS(test::error_of([&] { read_hf_config(dir); }),
                  "logit_scale = 0 must be a number > 0");
}

// Command-R+ (CohereForCausalLM with use_qk_norm): Cohere's layers with a LayerNorm over each
// head's query and key, a weight of each head's own ([96, 128] and [8, 128]); 104B parameters;
// written back with the field. StableLM-2-12B's and Phi's qk_layernorm read alike.
TEST(HfModel, PerHeadQueryAndKeyNormsAreRead) {
  const std::string dir = test::temp_dir("hf-qk-norms");
  const std::string corpus = std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/";
  fs::copy_file(corpus + "command_r_plus.json", dir + "/config.json",
                fs::copy_options::overwrite_existing);
  models::ModelSpec s = read_hf_config(dir).spec;
  EXPECT_TRUE(s.head_qk_layernorm() && s.parallel_block() && s.tie_embeddings);
  const int64_t C = 12288, H = 96, Hkv = 8, D = 128, F = 33792, V = 256000;
  const int64_t layer = C + 2 * C * H * D + 2 * C * Hkv * D + 3 * C * F + (H + Hkv) * D;
  EXPECT_EQ(models::parameter_count(s), 64 * layer + V * C + C);
  EXPECT_NEAR(double(models::parameter_count(s)) / 1e9, 103.8, 0.05);
  bool found = false;
  for (const models::ParamShape& p : models::parameter_shapes(s))
    if (p.name == "model.layers.63.self_attn.k_norm.weight") {
      found = true;
      EXPECT_EQ(p.shape, (Shape{Hkv, D}));
    }
  EXPECT_TRUE(found);
  EXPECT_EQ(io::hf_config_json(s, DType::BF16).at("use_qk_norm"), true);
  for (const char* file : {"stablelm_2_1_6b.json", "phi_2.json"}) {
    SCOPED_TRACE(file);
    nlohmann::json j = nlohmann::json::parse(test::slurp(corpus + file));
    const models::ModelSpec plain = [&] {
      std::ofstream(dir + "/config.json") << j.dump();
      return read_hf_config(dir).spec;
    }();
    j["qk_layernorm"] = true;
    std::ofstream(dir + "/config.json") << j.dump();
    s = read_hf_config(dir).spec;
    EXPECT_TRUE(s.qk_layernorm);
    // StableLM's a weight [D] per query and key head; Phi's a weight and a bias [D] each for q
    // and k.
    const int64_t d = s.head_dim(), added = s.stablelm() ? (s.n_head + s.kv_heads()) * d : 4 * d;
    EXPECT_EQ(models::parameter_count(s), models::parameter_count(plain) + s.n_layer * added);
    EXPECT_EQ(io::hf_config_json(s, DType::BF16).at("qk_layernorm"), true);
  }
}

// Phi-2 (PhiForCausalLM), Pythia / GPT-NeoX-20B (GPTNeoXForCausalLM), StableLM-2-1.6B
// (StableLmForCausalLM), OLMo-1B (OlmoForCausalLM) and GLM-4-9B-0414 (Glm4ForCausalLM) as
// published: their LayerNorms with biases,
// partial RoPE, gelu MLPs, parallel blocks and biases, counted to the parameter (Pythia-160M's
// 162,322,944 as EleutherAI lists it; Phi-2's 2.78B; GPT-NeoX-20B's 20.55B; StableLM-2's 1.64B),
// and written back as HF reads them.
TEST(HfModel, PhiGptNeoxStableLmOlmoAndGlmReadTheirPublishedConfigs) {
  auto read = [](const char* file) {
    const std::string dir = test::temp_dir("hf-phi-neox");
    fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/" + file,
                  dir + "/config.json", fs::copy_options::overwrite_existing);
    return read_hf_config(dir).spec;
  };
  // One block: two LayerNorms (one for Phi), q, k, v and dense with biases, fc1 and fc2 with them.
  auto block = [](int64_t C, int64_t F, int64_t norms) {
    return norms * 2 * C + 4 * C * C + 4 * C + 2 * C * F + F + C;
  };
  {
    const models::ModelSpec s = read("phi_2.json");
    EXPECT_EQ(s.architecture(), "phi");
    EXPECT_TRUE(s.parallel_block() && s.shared_block_norm() && s.biased_norms());
    EXPECT_EQ(s.rotary_dim(), 32);  // 0.4 of 80
    EXPECT_EQ(s.mlp_gelu, ops::GeluApprox::Tanh);
    EXPECT_FALSE(s.tie_embeddings);
    const int64_t C = 2560, V = 51200;
    EXPECT_EQ(models::parameter_count(s), 32 * block(C, 10240, 1) + 2 * V * C + V + 2 * C);
    EXPECT_NEAR(double(models::parameter_count(s)) / 1e9, 2.78, 0.005);
    const nlohmann::json back = io::hf_config_json(s, DType::BF16);
    EXPECT_EQ(back.at("architectures")[0], "PhiForCausalLM");
    EXPECT_EQ(back.at("partial_rotary_factor"), 0.4);
    EXPECT_EQ(back.at("hidden_act"), "gelu_new");
    EXPECT_EQ(back.at("layer_norm_eps"), 1e-5);
    EXPECT_EQ(back.at("qk_layernorm"), false);
    EXPECT_FALSE(back.contains("attention_bias"));
  }
  for (const char* file : {"pythia_160m.json", "gpt_neox_20b.json"}) {
    SCOPED_TRACE(file);
    const models::ModelSpec s = read(file);
    const bool pythia = std::string(file) == "pythia_160m.json";
    EXPECT_EQ(s.architecture(), "gpt_neox");
    EXPECT_TRUE(s.parallel_block() && !s.shared_block_norm() && s.grouped_qkv());
    EXPECT_EQ(s.rotary_dim(), pythia ? 16 : 24);  // 0.25 of 64, of 96
    EXPECT_EQ(s.mlp_gelu, pythia ? ops::GeluApprox::None : ops::GeluApprox::Tanh);  // gelu_fast
    const int64_t C = pythia ? 768 : 6144, V = pythia ? 50304 : 50432;
    EXPECT_EQ(models::parameter_count(s),
              (pythia ? 12 : 44) * block(C, 4 * C, 2) + 2 * V * C + 2 * C);
    if (pythia) {
      EXPECT_EQ(models::parameter_count(s), 162322944);
    } else {
      EXPECT_NEAR(double(models::parameter_count(s)) / 1e9, 20.55, 0.01);
    }
    const nlohmann::json back = io::hf_config_json(s, DType::F16);
    EXPECT_EQ(back.at("architectures")[0], "GPTNeoXForCausalLM");
    EXPECT_EQ(back.at("rotary_pct"), 0.25);
    EXPECT_EQ(back.at("rotary_emb_base"), 10000.0);
    EXPECT_EQ(back.at("use_parallel_residual"), true);
    EXPECT_EQ(back.at("attention_bias"), true);
    EXPECT_EQ(back.at("hidden_act"), pythia ? "gelu" : "gelu_new");
  }
  // StableLM-2-1.6B (StableLmForCausalLM): Llama's layers with biased LayerNorms, q/k/v biases and
  // RoPE on a quarter of each head; 1.64B parameters.
  {
    const models::ModelSpec s = read("stablelm_2_1_6b.json");
    EXPECT_EQ(s.architecture(), "stablelm");
    EXPECT_TRUE(s.biased_norms() && s.qkv_bias() && !s.out_bias() && !s.parallel_block());
    EXPECT_EQ(s.rotary_dim(), 16);  // 0.25 of 64
    const int64_t C = 2048, F = 5632, V = 100352;
    const int64_t layer = 4 * C + 4 * C * C + 3 * C + 3 * C * F;
    EXPECT_EQ(models::parameter_count(s), 24 * layer + 2 * V * C + 2 * C);
    EXPECT_NEAR(double(models::parameter_count(s)) / 1e9, 1.64, 0.005);
    const nlohmann::json back = io::hf_config_json(s, DType::BF16);
    EXPECT_EQ(back.at("architectures")[0], "StableLmForCausalLM");
    EXPECT_EQ(back.at("partial_rotary_factor"), 0.25);
    EXPECT_EQ(back.at("use_qkv_bias"), true);
    EXPECT_EQ(back.at("use_parallel_residual"), false);
    EXPECT_EQ(back.at("layer_norm_eps"), 1e-5);
  }
  // OLMo-1B (OlmoForCausalLM): Llama's layers, tied, with LayerNorms that have no parameters;
  // 1,176,764,416 parameters.
  {
    const models::ModelSpec s = read("olmo_1b.json");
    EXPECT_EQ(s.architecture(), "olmo");
    EXPECT_TRUE(s.centered_norms() && s.tie_embeddings);
    EXPECT_EQ(s.norm_eps, 1e-5);
    EXPECT_EQ(models::parameter_count(s),
              16 * (4 * 2048 * 2048 + 3 * 2048 * int64_t{8192}) + 50304 * 2048);
    const nlohmann::json back = io::hf_config_json(s, DType::F32);
    EXPECT_EQ(back.at("architectures")[0], "OlmoForCausalLM");
    EXPECT_TRUE(back.at("clip_qkv").is_null());
  }
  {  // OLMo-1.7's clamp, read and written back
    const std::string dir = test::temp_dir("hf-olmo-clip");
    nlohmann::json cfg = nlohmann::json::parse(
        test::slurp(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/olmo_1b.json"));
    cfg["clip_qkv"] = 8.0;
    std::ofstream(dir + "/config.json") << cfg.dump();
    const models::ModelSpec s = read_hf_config(dir).spec;
    EXPECT_EQ(s.clip_qkv, 8.0);
    EXPECT_EQ(io::hf_config_json(s, DType::F32).at("clip_qkv"), 8.0);
  }
  // GLM-4-9B-0414 (Glm4ForCausalLM): q/k/v biases, gate_up_proj, RoPE on adjacent pairs of half
  // of each 128-wide head, a norm after the attention and after the MLP; 9.40B parameters.
  {
    const models::ModelSpec s = read("glm4_9b_0414.json");
    EXPECT_EQ(s.architecture(), "glm4");
    EXPECT_TRUE(s.glm() && s.interleaved_rope() && s.fused_gate_up() && s.sandwich_norms());
    EXPECT_TRUE(s.qkv_bias() && !s.out_bias());
    EXPECT_EQ(s.head_dim(), 128);
    EXPECT_EQ(s.rotary_dim(), 64);
    const int64_t C = 4096, F = 13696, V = 151552, kv = 2 * 128;
    const int64_t layer = 2 * C * C + C + 2 * (C * kv + kv) + 3 * C * F + 4 * C;
    EXPECT_EQ(models::parameter_count(s), 40 * layer + 2 * V * C + C);
    EXPECT_NEAR(double(models::parameter_count(s)) / 1e9, 9.40, 0.01);
    const nlohmann::json back = io::hf_config_json(s, DType::BF16);
    EXPECT_EQ(back.at("architectures")[0], "Glm4ForCausalLM");
    EXPECT_EQ(back.at("partial_rotary_factor"), 0.5);
    EXPECT_EQ(back.at("attention_bias"), true);
    EXPECT_EQ(back.at("head_dim"), 128);
  }
  // What keel does not run is refused naming the field; use_parallel_residual = false and
  // attention_bias = false are read.
  const std::string dir = test::temp_dir("hf-neox-fields");
  auto with = [&](const char* file, const nlohmann::json& fields) {
    nlohmann::json cfg = nlohmann::json::parse(
        test::slurp(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/" + file));
    cfg.update(fields);
    std::ofstream(dir + "/config.json") << cfg.dump();
  };
  with("pythia_160m.json", {{"use_parallel_residual", false}, {"attention_bias", false}});
  {
    const models::ModelSpec s = read_hf_config(dir).spec;
    EXPECT_FALSE(s.parallel_block());
    EXPECT_FALSE(s.qkv_bias() || s.out_bias());
    EXPECT_EQ(models::parameter_count(s),
              12 * (block(768, 3072, 2) - 4 * 768) + 2 * 50304 * 768 + 2 * 768);
  }
  for (const auto& [file, fields, needle] :
       std::vector<std::tuple<const char*, nlohmann::json, std::string>>{
           {"phi_2.json", {{"tie_word_embeddings", true}}, "tie_word_embeddings = true"},
           {"phi_2.json", {{"hidden_act", "relu"}}, "hidden_act 'relu'"},
           {"pythia_160m.json", {{"rotary_pct", 0.3}}, "rotary_pct = 0.3"},
           {"pythia_160m.json", {{"rotary_pct", 1.5}}, "rotary_pct must be a number in (0, 1]"},
           {"olmo_1b.json", {{"clip_qkv", -8.0}}, "clip_qkv = -8.0 must be a positive bound"}}) {
    SCOPED_TRACE(needle);
    with(file, fields);
    try {
      read_hf_config(dir);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(dir + "/config.json"), std::string::npos) << e.what();
    }
  }
}

// Falcon (FalconForCausalLM) as its published configs give it: Falcon-7B's multi_query (one
// key/value head for 71 query heads, one norm a block) and Falcon-40B's new_decoder_architecture
// (8 key/value groups of 16 queries, ln_attn and ln_mlp), both without biases, the exact gelu, an
// MLP 4 x hidden_size wide (no ffn_hidden_size in their files) and the head tied (FalconConfig
// keeps PretrainedConfig's tie_word_embeddings); written back as FalconConfig reads them.
TEST(HfModel, FalconReadsItsPublishedConfigs) {
  for (const char* file : {"falcon_7b.json", "falcon_40b.json"}) {
    SCOPED_TRACE(file);
    const std::string dir = test::temp_dir("hf-falcon");
    fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/" + file,
                  dir + "/config.json", fs::copy_options::overwrite_existing);
    const models::ModelSpec s = read_hf_config(dir).spec;
    const bool seven = std::string(file) == "falcon_7b.json";
    EXPECT_EQ(s.architecture(), "falcon");
    EXPECT_TRUE(s.parallel_block() && s.grouped_qkv() && s.biased_norms() && s.tie_embeddings);
    EXPECT_FALSE(s.qkv_bias() || s.out_bias() || s.mlp_bias() || s.head_bias());
    EXPECT_EQ(s.shared_block_norm(), seven);
    EXPECT_EQ(s.kv_heads(), seven ? 1 : 8);
    EXPECT_EQ(s.head_dim(), 64);
    EXPECT_EQ(s.rotary_dim(), 64);
    EXPECT_EQ(s.mlp_gelu, ops::GeluApprox::None);
    EXPECT_EQ(s.max_seq_len, 2048);  // (FalconConfig's default)
    const int64_t C = seven ? 4544 : 8192, H = seven ? 71 : 128, V = 65024;
    const int64_t block =
        (seven ? 2 : 4) * C + (H + 2 * s.kv_heads()) * 64 * C + C * C + 2 * C * 4 * C;
    EXPECT_EQ(models::parameter_count(s), (seven ? 32 : 60) * block + V * C + 2 * C);
    EXPECT_EQ(models::parameter_count(s), seven ? 6921720704 : 41303293952);
    const nlohmann::json back = io::hf_config_json(s, DType::BF16);
    EXPECT_EQ(back.at("architectures")[0], "FalconForCausalLM");
    EXPECT_EQ(back.at("new_decoder_architecture"), !seven);
    EXPECT_EQ(back.at("multi_query"), seven);
    EXPECT_EQ(back.at("num_kv_heads"), s.kv_heads());
    EXPECT_EQ(back.at("ffn_hidden_size"), 4 * C);
    EXPECT_EQ(back.at("num_ln_in_parallel_attn"), seven ? nlohmann::json() : nlohmann::json(2));
    EXPECT_EQ(back.at("activation"), "gelu");
    for (const char* llama_key :
         {"head_dim", "num_key_value_heads", "intermediate_size", "hidden_act", "layer_norm_eps"})
      EXPECT_FALSE(back.contains(llama_key)) << llama_key;
    // Read back from what it wrote: the same model.
    std::ofstream(dir + "/config.json") << back.dump(2);
    const models::ModelSpec again = read_hf_config(dir).spec;
    EXPECT_EQ(models::parameter_count(again), models::parameter_count(s));
    EXPECT_EQ(again.kv_heads(), s.kv_heads());
    EXPECT_EQ(again.norm_per_branch, s.norm_per_branch);
  }
}

// GPT-J-6B (GPTJForCausalLM) as its published config gives it: GPT-2's names (n_embd, n_inner
// null: 4 x n_embd), RoPE on adjacent pairs of the first rotary_dim 64 of each head's 256
// channels, an untied head with a bias; written back as GPTJConfig reads it. An absent, odd or
// too wide rotary_dim is refused naming the field.
TEST(HfModel, GptjReadsItsPublishedConfig) {
  const std::string dir = test::temp_dir("hf-gptj");
  fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/gptj_6b.json",
                dir + "/config.json", fs::copy_options::overwrite_existing);
  const nlohmann::json file = nlohmann::json::parse(test::slurp(dir + "/config.json"));
  const models::ModelSpec s = read_hf_config(dir).spec;
  EXPECT_EQ(s.architecture(), "gptj");
  EXPECT_TRUE(s.parallel_block() && s.shared_block_norm() && s.interleaved_rope());
  EXPECT_TRUE(s.head_bias() && s.mlp_bias() && !s.qkv_bias() && !s.out_bias());
  EXPECT_FALSE(s.tie_embeddings);
  EXPECT_EQ(s.head_dim(), 256);
  EXPECT_EQ(s.rotary_dim(), 64);
  EXPECT_EQ(s.ffn_dim(), 16384);
  EXPECT_EQ(s.max_seq_len, 2048);
  EXPECT_EQ(s.rope_theta, 10000.0);
  EXPECT_EQ(s.mlp_gelu, ops::GeluApprox::Tanh);
  // Per block: ln_1's weight and bias, q/k/v/out_proj 4096 x 4096, fc_in and fc_out with biases;
  // the embedding, ln_f, and lm_head with its bias.
  const int64_t C = 4096, F = 16384, V = 50400;
  const int64_t block = 2 * C + 4 * C * C + (C * F + F) + (F * C + C);
  EXPECT_EQ(models::parameter_count(s), 28 * block + V * C + 2 * C + V * C + V);
  EXPECT_EQ(models::parameter_count(s), 6050882784);
  const nlohmann::json back = io::hf_config_json(s, DType::F16);
  EXPECT_EQ(back.at("architectures")[0], "GPTJForCausalLM");
  for (const char* key :
       {"n_embd", "n_layer", "n_head", "n_positions", "rotary_dim", "activation_function",
        "layer_norm_epsilon", "resid_pdrop", "embd_pdrop", "attn_pdrop", "tie_word_embeddings"})
    EXPECT_EQ(back.at(key), file.at(key)) << key;
  EXPECT_EQ(back.at("n_inner"), 16384);
  for (const char* llama_key :
       {"hidden_size", "num_attention_heads", "intermediate_size", "rope_theta", "head_dim"})
    EXPECT_FALSE(back.contains(llama_key)) << llama_key;
  for (const auto& [value, message] : std::vector<std::pair<nlohmann::json, std::string>>{
           {nullptr, "rotary_dim = null is not supported by keel's gptj model"},
           {63, "rotary_dim = 63 must be an even number of channels from 2 to a head's 256"},
           {512, "rotary_dim = 512 must be an even number of channels from 2 to a head's 256"}}) {
    nlohmann::json bad = file;
    bad["rotary_dim"] = value;
    std::ofstream(dir + "/config.json") << bad.dump(2);
    EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }), message);
  }
}

// CodeGen-350M-mono (CodeGenForCausalLM) as its published config gives it: GPT-J's block, q, v and
// k one qkv_proj (its 4 blocks of heads), RoPE on the first 32 of each head's 64 channels; written
// back as CodeGenConfig reads it. Heads that 4 blocks cannot share are refused naming the sizes.
TEST(HfModel, CodegenReadsItsPublishedConfig) {
  const std::string dir = test::temp_dir("hf-codegen");
  fs::copy_file(
      std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/codegen_350m_mono.json",
      dir + "/config.json", fs::copy_options::overwrite_existing);
  const nlohmann::json file = nlohmann::json::parse(test::slurp(dir + "/config.json"));
  const models::ModelSpec s = read_hf_config(dir).spec;
  EXPECT_EQ(s.architecture(), "codegen");
  EXPECT_TRUE(s.gptj() && s.codegen() && s.parallel_block() && s.head_bias());
  EXPECT_EQ(s.rotary_dim(), 32);
  const int64_t C = 1024, F = 4096, V = 51200;
  const int64_t block = 2 * C + 4 * C * C + (C * F + F) + (F * C + C);
  EXPECT_EQ(models::parameter_count(s), 20 * block + V * C + 2 * C + V * C + V);
  EXPECT_EQ(models::parameter_count(s), 356712448);
  bool fused = false;
  for (const models::ParamShape& p : models::parameter_shapes(s))
    fused =
        fused || (p.name == "transformer.h.0.attn.qkv_proj.weight" && p.shape == Shape{3 * C, C});
  EXPECT_TRUE(fused);
  const nlohmann::json back = io::hf_config_json(s, DType::F16);
  EXPECT_EQ(back.at("architectures")[0], "CodeGenForCausalLM");
  for (const char* key : {"n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "rotary_dim",
                          "activation_function", "tie_word_embeddings"})
    EXPECT_EQ(back.at(key), file.at(key)) << key;
  nlohmann::json bad = file;
  bad["n_head"] = 2;
  bad["n_embd"] = 128;
  bad["rotary_dim"] = 32;
  std::ofstream(dir + "/config.json") << bad.dump(2);
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  "codegen's qkv_proj holds its heads in 4 blocks: n_head must be a multiple of 4, "
                  "not 2");
}

// StarCoder2-3B (Starcoder2ForCausalLM) as its published config gives it: Llama's layers with
// biased LayerNorms (norm_epsilon) and projections (use_bias), the tanh-gelu MLP (c_fc, c_proj),
// 24 query heads over 2 key/value heads, every layer sliding over 4096 positions, the head tied;
// 3,030,371,328 parameters; its dropouts (0.1 each) read as the file's; written back as
// Starcoder2Config reads it.
TEST(HfModel, Starcoder2ReadsItsPublishedConfig) {
  const std::string dir = test::temp_dir("hf-starcoder2");
  fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/starcoder2_3b.json",
                dir + "/config.json", fs::copy_options::overwrite_existing);
  const models::ModelSpec s = read_hf_config(dir).spec;
  EXPECT_EQ(s.architecture(), "starcoder2");
  EXPECT_TRUE(s.biased_norms() && s.qkv_bias() && s.out_bias() && s.mlp_bias() && s.gelu_mlp());
  EXPECT_FALSE(s.parallel_block());
  EXPECT_TRUE(s.tie_embeddings);
  EXPECT_EQ(s.layer_window(0), 4096);
  EXPECT_EQ(s.layer_window(29), 4096);
  EXPECT_EQ(s.mlp_gelu, ops::GeluApprox::Tanh);
  EXPECT_EQ(s.dropout, 0.1);
  const int64_t C = 3072, F = 12288, V = 49152, kv = 2 * 128;
  const int64_t layer = 4 * C + 2 * (C * C + C) + 2 * (C * kv + kv) + (C * F + F) + (F * C + C);
  EXPECT_EQ(models::parameter_count(s), 30 * layer + V * C + 2 * C);
  EXPECT_EQ(models::parameter_count(s), 3030371328);
  const nlohmann::json back = io::hf_config_json(s, DType::BF16);
  EXPECT_EQ(back.at("architectures")[0], "Starcoder2ForCausalLM");
  EXPECT_EQ(back.at("norm_epsilon"), 1e-5);
  EXPECT_EQ(back.at("use_bias"), true);
  EXPECT_EQ(back.at("sliding_window"), 4096);
  EXPECT_EQ(back.at("hidden_act"), "gelu_pytorch_tanh");
  EXPECT_EQ(back.at("residual_dropout"), 0.1);
  EXPECT_EQ(back.at("embedding_dropout"), 0.1);
  EXPECT_FALSE(back.contains("layer_norm_eps"));
  EXPECT_FALSE(back.contains("attention_bias"));
}

// StarCoder (GPTBigCodeForCausalLM) as its published config gives it: GPT-2's blocks with nn.Linear
// weights and multi_query (c_attn [6144 + 2 x 128, 6144]), 8192 learned positions; 15.5B
// parameters; written back as GPTBigCodeConfig reads it.
TEST(HfModel, GptBigCodeReadsItsPublishedConfig) {
  const std::string dir = test::temp_dir("hf-bigcode");
  fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/starcoder.json",
                dir + "/config.json", fs::copy_options::overwrite_existing);
  const models::ModelSpec s = read_hf_config(dir).spec;
  EXPECT_EQ(s.family, "gpt2");
  EXPECT_EQ(s.architecture(), "gpt_bigcode");
  EXPECT_EQ(s.kv_heads(), 1);
  EXPECT_EQ(s.max_seq_len, 8192);
  const int64_t C = 6144, F = 24576, V = 49152, qkv = C + 2 * 128;
  const int64_t block = 4 * C + (C * qkv + qkv) + (C * C + C) + (C * F + F) + (F * C + C);
  EXPECT_EQ(models::parameter_count(s), 40 * block + V * C + 8192 * C + 2 * C);
  EXPECT_NEAR(double(models::parameter_count(s)) / 1e9, 15.5, 0.05);
  const nlohmann::json back = io::hf_config_json(s, DType::F32);
  EXPECT_EQ(back.at("architectures")[0], "GPTBigCodeForCausalLM");
  EXPECT_EQ(back.at("model_type"), "gpt_bigcode");
  EXPECT_EQ(back.at("multi_query"), true);
  EXPECT_EQ(back.at("activation_function"), "gelu_pytorch_tanh");
  EXPECT_EQ(back.at("n_inner"), F);
}

TEST(HfModel, MixturesOfExpertsReadTheirPublishedConfigs) {
  struct Case {
    const char* file;
    const char* type;
    int64_t layers, experts, per_token, ffn, params;
    bool normalize;
  };
  // The counts, per layer: attention, norms, the router and the experts; then the embedding and
  // the untied head.
  const int64_t qwen_layer =
      2048 * 4096 * 2 + 2048 * 512 * 2 + 2 * 128 + 2 * 2048 + 128 * 2048 + 128 * 3 * 2048 * 768;
  const int64_t olmoe_layer =
      4 * 2048 * 2048 + 2 * 2048 + 2 * 2048 + 64 * 2048 + 64 * 3 * 2048 * 1024;
  const int64_t mixtral_layer =
      2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 8 * 4096 + 8 * 3 * 4096 * int64_t{14336};
  for (const Case& c : {Case{"qwen3_moe_30b_a3b.json", "qwen3_moe", 48, 128, 8, 768,
                             48 * qwen_layer + 2 * 151936 * int64_t{2048} + 2048, true},
                        Case{"olmoe_1b_7b.json", "olmoe", 16, 64, 8, 1024,
                             16 * olmoe_layer + 2 * 50304 * int64_t{2048} + 2048, false},
                        Case{"mixtral_8x7b.json", "mixtral", 32, 8, 2, 14336,
                             32 * mixtral_layer + 2 * 32000 * int64_t{4096} + 4096, true}}) {
    SCOPED_TRACE(c.file);
    const std::string dir = test::temp_dir("hf-moe");
    fs::copy_file(std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/" + c.file,
                  dir + "/config.json", fs::copy_options::overwrite_existing);
    const models::ModelSpec s = read_hf_config(dir).spec;
    EXPECT_EQ(s.architecture(), c.type);
    EXPECT_EQ(s.n_layer, c.layers);
    EXPECT_EQ(s.moe.experts, c.experts);
    EXPECT_EQ(s.moe.per_token, c.per_token);
    EXPECT_EQ(s.moe.ffn, c.ffn);
    EXPECT_EQ(s.moe.normalize, c.normalize);
    for (int64_t layer = 0; layer < s.n_layer; ++layer) EXPECT_TRUE(s.moe_layer(layer)) << layer;
    EXPECT_EQ(models::parameter_count(s), c.params);
    EXPECT_EQ(s.qk_norm_over_projection(), std::string(c.type) == "olmoe");
    // output_router_logits false (as published): no load-balancing loss; true: the file's
    // router_aux_loss_coef, or the type's default where it is absent (OlmoeConfig's 0.01,
    // Qwen3MoeConfig's and MixtralConfig's 0.001).
    EXPECT_EQ(s.moe.aux_coef, 0.0);
    nlohmann::json j = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
    j["output_router_logits"] = true;
    const double published = j.at("router_aux_loss_coef");
    std::ofstream(dir + "/config.json") << j.dump();
    EXPECT_EQ(read_hf_config(dir).spec.moe.aux_coef, published);
    j.erase("router_aux_loss_coef");
    std::ofstream(dir + "/config.json") << j.dump();
    EXPECT_EQ(read_hf_config(dir).spec.moe.aux_coef, std::string(c.type) == "olmoe" ? 0.01 : 0.001);
  }
  EXPECT_NEAR(double(48 * qwen_layer + 2 * 151936 * int64_t{2048} + 2048) / 1e9, 30.53, 0.01);
  // Qwen1.5-MoE-A2.7B (Qwen2MoeForCausalLM): Qwen2's q/k/v biases, 60 experts 1408 wide, 4 a token
  // unrenormalized, and a shared expert 5632 wide with its gate [1, 2048]: 14.32B.
  {
    const std::string dir = test::temp_dir("hf-qwen2-moe");
    fs::copy_file(
        std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/qwen1_5_moe_a2_7b.json",
        dir + "/config.json", fs::copy_options::overwrite_existing);
    const models::ModelSpec s = read_hf_config(dir).spec;
    EXPECT_EQ(s.architecture(), "qwen2_moe");
    EXPECT_TRUE(s.qkv_bias());
    EXPECT_EQ(s.moe.experts, 60);
    EXPECT_EQ(s.moe.per_token, 4);
    EXPECT_EQ(s.moe.ffn, 1408);
    EXPECT_EQ(s.moe.shared_ffn, 5632);
    EXPECT_FALSE(s.moe.normalize);
    const int64_t layer = 4 * 2048 * 2048 + 3 * 2048 + 2 * 2048 + 60 * 2048 + 60 * 3 * 2048 * 1408 +
                          3 * 2048 * 5632 + 2048;
    EXPECT_EQ(models::parameter_count(s), 24 * layer + 2 * 151936 * int64_t{2048} + 2048);
    EXPECT_NEAR(double(models::parameter_count(s)) / 1e9, 14.32, 0.01);
    const nlohmann::json back = io::hf_config_json(s, DType::BF16);
    EXPECT_EQ(back.at("architectures")[0], "Qwen2MoeForCausalLM");
    EXPECT_EQ(back.at("shared_expert_intermediate_size"), 5632);
    EXPECT_EQ(back.at("moe_intermediate_size"), 1408);
    EXPECT_EQ(back.at("intermediate_size"), 5632);
    EXPECT_FALSE(back.contains("attention_bias"));
  }
  // Qwen3-MoE's decoder_sparse_step and mlp_only_layers: its dense layers' MLP is
  // intermediate_size wide, and their count is the file's.
  const std::string dir = test::temp_dir("hf-moe-dense");
  nlohmann::json j = nlohmann::json::parse(std::ifstream(
      std::string(KEEL_SOURCE_DIR) + "/tests/fuzz/corpus/hf_config/qwen3_moe_30b_a3b.json"));
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {5};
  std::ofstream(dir + "/config.json") << j.dump();
  const models::ModelSpec s = read_hf_config(dir).spec;
  EXPECT_FALSE(s.moe_layer(0));
  EXPECT_TRUE(s.moe_layer(1));
  EXPECT_FALSE(s.moe_layer(5));
  EXPECT_TRUE(s.moe_layer(7));
  EXPECT_EQ(s.ffn_dim(), 6144);
  j["mlp_only_layers"] = {48};
  std::ofstream(dir + "/config.json") << j.dump();
  EXPECT_CONTAINS(error_of([&] { read_hf_config(dir); }),
                  "mlp_only_layers [48] must list layers from 0 to num_hidden_layers - 1 (47)");
}

}  // namespace
}  // namespace keel::io
