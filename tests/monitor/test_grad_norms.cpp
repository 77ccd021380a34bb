// Per-layer grad norms: block names for GPT-2 and Llama, and the squares of the block norms add up
// to the global norm squared on real gradients from a Trainer's forward/backward.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "keel/monitor/grad_norms.h"
#include "keel/optim/clip.h"
#include "keel/train/trainer.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using monitor::grad_norm_block;
using monitor::per_layer_grad_norms;

TEST(GradNorms, BlockNames) {
  EXPECT_EQ(grad_norm_block("transformer.h.3.attn.c_attn.weight"), "transformer.h.3");
  EXPECT_EQ(grad_norm_block("transformer.h.12.ln_1.bias"), "transformer.h.12");
  EXPECT_EQ(grad_norm_block("transformer.wte.weight"), "transformer.wte");
  EXPECT_EQ(grad_norm_block("transformer.ln_f.weight"), "transformer.ln_f");
  EXPECT_EQ(grad_norm_block("model.layers.0.mlp.up_proj.weight"), "model.layers.0");
  EXPECT_EQ(grad_norm_block("model.layers.1.self_attn.q_proj.lora_A.weight"), "model.layers.1");
  EXPECT_EQ(grad_norm_block("model.embed_tokens.weight"), "model.embed_tokens");
  EXPECT_EQ(grad_norm_block("model.norm.weight"), "model.norm");
  EXPECT_EQ(grad_norm_block("lm_head.weight"), "lm_head");
  EXPECT_EQ(grad_norm_block("weight"), "weight");
}

// f64 reference: sqrt of the sum of squares of the gradients of the named block.
double reference_norm(const std::vector<std::pair<std::string, Tensor>>& params,
                      const std::string& block) {
  double s = 0;
  for (auto& [name, p] : params)
    if (p.grad().defined() && grad_norm_block(name) == block)
      for (float v : p.grad().to_floats()) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

void check_trainer(const std::string& family, const std::string& precision,
                   const std::vector<std::string>& expected_blocks) {
  Config cfg =
      load_config("", {"model.family=\"" + family + "\"", "model.n_layer=2", "model.n_embd=32",
                       "model.n_head=4", "data.num_examples=64", "data.eval_examples=8",
                       "train.batch_size=8", "train.precision=\"" + precision + "\"",
                       "run.out_dir=\"" + test::temp_dir("gradnorms") + "\""});
  Trainer trainer(cfg);
  std::vector<data::Batch> window{trainer.loader().batch(0, 0), trainer.loader().batch(0, 1)};
  trainer.forward_backward(window, trainer.step_seed(1), 1.0);
  const auto& params = trainer.trainable();
  auto norms = per_layer_grad_norms(params);
  std::vector<std::string> blocks;
  for (auto& b : norms) blocks.push_back(b.block);
  EXPECT_EQ(blocks, expected_blocks) << family;

  std::vector<Tensor> grads;
  for (auto& [n, p] : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  const double global = optim::global_grad_norm(grads);
  ASSERT_GT(global, 0);
  double sq = 0;
  for (auto& b : norms) {
    EXPECT_GT(b.norm, 0) << b.block;
    sq += b.norm * b.norm;
    // Each block against the f64 reference (f32 accumulation inside 4096-element blocks).
    const double ref = reference_norm(params, b.block);
    EXPECT_NEAR(b.norm, ref, 1e-5 * ref) << b.block;
  }
  EXPECT_NEAR(sq, global * global, 1e-12 * global * global) << family << " " << precision;
  // Deterministic: same bits on a second call.
  auto again = per_layer_grad_norms(params);
  for (size_t i = 0; i < norms.size(); ++i) EXPECT_EQ(again[i].norm, norms[i].norm);
}

TEST(GradNorms, BlocksSumToTheGlobalNormGpt2) {
  check_trainer("gpt2", "32-true",
                {"transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                 "transformer.ln_f"});
}

TEST(GradNorms, BlocksSumToTheGlobalNormLlamaBf16Mixed) {
  check_trainer("llama", "bf16-mixed",
                {"model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"});
}

TEST(GradNorms, NonFiniteGradientMakesItsBlockNonFinite) {
  Tensor a = Tensor::full({3}, 1.f).set_requires_grad(true);
  Tensor b = Tensor::full({2}, 2.f).set_requires_grad(true);
  Tensor c = Tensor::full({2}, 2.f).set_requires_grad(true);
  a.set_grad(Tensor::from_floats({3.f, 4.f, 0.f}, {3}));
  b.set_grad(Tensor::from_floats({1.f, std::numeric_limits<float>::infinity()}, {2}));
  // c has no grad: skipped.
  auto norms = per_layer_grad_norms({{"x.0.w", a}, {"y.w", b}, {"z.w", c}});
  ASSERT_EQ(norms.size(), 2u);
  EXPECT_EQ(norms[0].block, "x.0");
  EXPECT_EQ(norms[0].norm, 5.0);
  EXPECT_EQ(norms[1].block, "y");
  EXPECT_TRUE(std::isinf(norms[1].norm));
}

}  // namespace
}  // namespace keel
