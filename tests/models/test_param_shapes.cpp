// models/param_shapes.h: every name, shape and order against the models gpt2.cpp and llama.cpp
// build, the matmul flag against the modules that own the parameters, and the counts of published
// models computed without building them.
#include "keel/models/param_shapes.h"

#include <gtest/gtest.h>

#include <set>

#include "keel/models/causal_lm.h"
#include "keel/numerics/error.h"
#include "tests/support/tiny_models.h"

namespace keel::models {
namespace {

ModelSpec spec(const char* family, int64_t layers, int64_t embd, int64_t heads, int64_t kv_heads,
               int64_t vocab, bool tie, int64_t ffn = 0) {
  ModelSpec s;
  s.family = family;
  s.n_layer = layers;
  s.n_embd = embd;
  s.n_head = heads;
  s.n_kv_head = kv_heads;
  s.vocab_size = vocab;
  s.max_seq_len = 40;
  s.tie_embeddings = tie;
  s.intermediate_size = ffn;
  return s;
}

TEST(ParamShapes, MatchTheBuiltModelsNameForName) {
  const ModelSpec specs[] = {
      spec("gpt2", 2, 32, 4, 0, 259, true),      spec("gpt2", 3, 48, 6, 0, 300, true, 100),
      spec("gpt2", 1, 16, 2, 0, 50, false),  // GPT-2 ties whatever the flag says
      spec("llama", 2, 32, 4, 2, 259, true),     spec("llama", 2, 32, 4, 0, 259, false),
      spec("llama", 3, 64, 8, 1, 77, false, 96),  // multi-query, explicit MLP width
  };
  for (const ModelSpec& s : specs) {
    const std::string what = s.family + " L" + std::to_string(s.n_layer) + " C" +
                             std::to_string(s.n_embd) + (s.tie_embeddings ? " tied" : " untied");
    auto model = make_causal_lm(s, 1);
    // The parameters autocast casts: those of Linear modules, and the embedding a tied head
    // multiplies by (GPT-2's wte, a tied Llama's embed_tokens).
    std::set<std::string> matmul;
    for (nn::Module* m : model->modules())
      if (m->type() == "Linear")
        for (const auto& [name, p] : m->local_parameters()) matmul.insert(m->path() + "." + name);
    if (s.family == "gpt2") matmul.insert("transformer.wte.weight");
    if (s.family == "llama" && s.tie_embeddings) matmul.insert("model.embed_tokens.weight");

    const std::vector<ParamShape> shapes = parameter_shapes(s);
    const auto& params = model->named_parameters();
    ASSERT_EQ(shapes.size(), params.size()) << what;
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_EQ(shapes[i].name, params[i].first) << what << " #" << i;
      EXPECT_EQ(shapes[i].shape, params[i].second.shape()) << what << " " << shapes[i].name;
      EXPECT_EQ(shapes[i].numel(), params[i].second.numel()) << what << " " << shapes[i].name;
      EXPECT_EQ(shapes[i].matmul, matmul.count(params[i].first) == 1)
          << what << " " << shapes[i].name;
    }
    EXPECT_EQ(parameter_count(s), model->num_parameters()) << what;
  }
}

// The mixtures of experts (a Qwen3-MoE with a dense layer, an OLMoE, a Mixtral with its w1/w3/w2
// and block_sparse_moe names), and every other fixture family: the shapes listed without building
// are the built model's, name for name.
TEST(ParamShapes, EveryFixtureFamilyMatchesItsBuiltModel) {
  for (const std::string& family : test::kFixtureFamilies) {
    const ModelSpec s = test::tiny_model_spec(family);
    auto model = make_causal_lm(s, 1);
    const std::vector<ParamShape> shapes = parameter_shapes(s);
    const auto& params = model->named_parameters();
    ASSERT_EQ(shapes.size(), params.size()) << family;
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_EQ(shapes[i].name, params[i].first) << family << " #" << i;
      EXPECT_EQ(shapes[i].shape, params[i].second.shape()) << family << " " << shapes[i].name;
    }
  }
}

// Published sizes, counted without building: Llama-3.1-8B (grouped-query attention with 8 kv heads,
// untied head) is 8.03B, not the 8.31B that full-width k/v projections would give; GPT-2 124M.
TEST(ParamShapes, CountPublishedModelsWithoutBuildingThem) {
  const ModelSpec llama31_8b = spec("llama", 32, 4096, 32, 8, 128256, false, 14336);
  EXPECT_EQ(parameter_count(llama31_8b), 8'030'261'248);
  ModelSpec mha = llama31_8b;
  mha.n_kv_head = 0;
  EXPECT_EQ(parameter_count(mha), 8'835'567'616);  // what ignoring n_kv_head would count
  ModelSpec gpt2_124m = spec("gpt2", 12, 768, 12, 0, 50257, true);
  gpt2_124m.max_seq_len = 1024;
  EXPECT_EQ(parameter_count(gpt2_124m), 124'439'808);
}

// adapter_parameter_shapes against apply_adapters on the built models: every adapter parameter's
// name and shape, in tree order, for each kind (LoKr with a full and a low-rank w2), and the
// linear flag against the model's Linear modules.
TEST(ParamShapes, AdapterShapesMatchTheBuiltAdapters) {
  struct Case {
    ModelSpec spec;
    nn::AdapterOptions opt;
  };
  auto opt = [](const char* kind, int64_t r, std::vector<std::string> targets) {
    nn::AdapterOptions o;
    o.kind = kind;
    o.r = r;
    o.target_modules = std::move(targets);
    return o;
  };
  const Case cases[] = {
      {spec("llama", 2, 32, 4, 2, 259, true), opt("lora", 4, {"q_proj", "v_proj", "down_proj"})},
      {spec("llama", 2, 32, 4, 2, 259, false), opt("dora", 3, {"k_proj", "lm_head"})},
      {spec("llama", 2, 48, 4, 1, 77, true, 96), opt("lokr", 2, {"q_proj", "up_proj"})},
      {spec("llama", 1, 48, 4, 1, 77, true, 96), opt("lokr", 16, {"o_proj", "down_proj"})},
      {spec("gpt2", 2, 32, 4, 0, 259, true), opt("lora", 8, {"c_attn", "mlp.c_proj"})},
  };
  for (const Case& c : cases) {
    const std::string what = c.spec.family + " " + c.opt.kind + " r" + std::to_string(c.opt.r);
    auto model = make_causal_lm(c.spec, 1);
    const std::vector<ParamShape> base = parameter_shapes(c.spec);
    std::set<std::string> linear;
    for (nn::Module* m : model->modules())
      if (m->type() == "Linear") linear.insert(m->path() + ".weight");
    for (const ParamShape& p : base) EXPECT_EQ(p.linear, linear.count(p.name) == 1) << p.name;
    nn::apply_adapters(*model, c.opt);
    const std::vector<ParamShape> shapes = adapter_parameter_shapes(c.spec, c.opt);
    std::vector<std::pair<std::string, Shape>> built;
    for (const auto& [name, p] : model->named_parameters(/*trainable_only=*/true))
      built.emplace_back(name, p.shape());
    ASSERT_EQ(shapes.size(), built.size()) << what;
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_EQ(shapes[i].name, built[i].first) << what << " #" << i;
      EXPECT_EQ(shapes[i].shape, built[i].second) << what << " " << shapes[i].name;
    }
  }
  // A target that names no Linear: apply_adapters' message, with the model's Linear names.
  try {
    adapter_parameter_shapes(spec("llama", 1, 32, 4, 2, 259, true), opt("lora", 4, {"qkv"}));
    ADD_FAILURE() << "no error for a target that names nothing";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind, Error::kUsage);
    EXPECT_NE(std::string(e.what()).find("'qkv' matches no linear layer"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("q_proj, k_proj, v_proj, o_proj"), std::string::npos)
        << e.what();
  }
}

// Llama-3.1-8B with the seed's LoRA (r = 32 on q, k, v, up, down): r·(in + out) per adapted
// projection, 32 layers.
TEST(ParamShapes, SeedLoraOnLlama31_8bCountsItsAdapters) {
  const ModelSpec s = spec("llama", 32, 4096, 32, 8, 128256, false, 14336);
  nn::AdapterOptions o;
  o.kind = "lora";
  o.r = 32;
  o.target_modules = {"q_proj", "k_proj", "v_proj", "up_proj", "down_proj"};
  int64_t n = 0;
  for (const ParamShape& p : adapter_parameter_shapes(s, o)) n += p.numel();
  const int64_t per_layer = (4096 + 4096) + 2 * (4096 + 1024) + 2 * (4096 + 14336);
  EXPECT_EQ(n, 32 * 32 * per_layer);
}

}  // namespace
}  // namespace keel::models
