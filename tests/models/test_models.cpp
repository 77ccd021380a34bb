// One full training step of a tiny GPT-2, Llama, Qwen2, Qwen3 (and a Qwen3 with heads wider than
// n_embd / n_head), Mistral, Qwen2 and Phi-3 with sliding windows against PyTorch
// (tests/fixtures/gen_models.py): the loss, every parameter's gradient, and the parameters after
// one AdamW step, in 32-true and bf16-mixed.
#include <gtest/gtest.h>

#include <cmath>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/models/causal_lm.h"
#include "keel/models/llama.h"
#include "keel/nn/layers.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/shape.h"
#include "tests/support/check.h"
#include "tests/support/tiny_models.h"

namespace keel {
namespace {

struct StepOutput {
  double loss;
  std::unique_ptr<models::CausalLM> model;
};

// `aux_coef`: the fixture `family` (a mixture's spec with "_aux" after it) adds HF's
// load-balancing loss times it (output_router_logits), as training does (ops::MoeBalance).
StepOutput run_step(const std::string& family, const std::string& precision, double aux_coef = 0) {
  const io::Safetensors& fx = test::fixture("models");
  const std::string pre = family + "." + precision + ".";
  StepOutput out;
  const std::string spec_family =
      aux_coef > 0 ? family.substr(0, family.size() - std::string("_aux").size()) : family;
  out.model = models::make_causal_lm(test::tiny_model_spec(spec_family), 1);
  for (auto& [name, p] : out.model->named_parameters()) {
    Tensor dst = p;
    dst.copy_from(fx.at(pre + "param." + name));
  }
  const bool mixed = precision == "bf16-mixed";
  amp::AutocastGuard autocast(mixed, DType::BF16);
  Tensor logits = out.model->forward(fx.at(pre + "input_ids"), fx.at(pre + "attention_mask"));
  EXPECT_EQ(logits.dtype(), mixed ? DType::BF16 : DType::F32);
  const int64_t V = logits.size(-1);
  Tensor flat = amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, V}));
  Tensor loss = ops::cross_entropy(flat, ops::reshape(fx.at(pre + "labels"), {-1}));
  out.loss = loss.item();
  if (aux_coef > 0) {
    ops::MoeBalance* balance = models::router_balance(*out.model);
    EXPECT_NEAR(balance->forward.loss(), fx.at(pre + "aux_loss").item(), 1e-5) << pre;
    out.loss += aux_coef * balance->forward.loss();
    balance->grad = aux_coef;
  }
  backward(loss);
  return out;
}

// The loss and every gradient of a step against the fixture's.
void expect_step_matches(const StepOutput& s, const std::string& pre, bool mixed) {
  const io::Safetensors& fx = test::fixture("models");
  const double ref_loss = fx.at(pre + "loss").item();
  EXPECT_NEAR(s.loss, ref_loss, mixed ? 2e-2 * std::fabs(ref_loss) : 1e-5 * std::fabs(ref_loss))
      << pre << "loss";
  int checked = 0;
  for (auto& [name, p] : s.model->named_parameters()) {
    const Tensor& ref = fx.at(pre + "grad." + name);
    ASSERT_TRUE(p.grad().defined()) << name << " got no gradient";
    EXPECT_EQ(p.grad().dtype(), DType::F32) << name << ": master gradients are f32";
    // Scale-aware tolerance: bf16-mixed rounds every product to 8 bits; a 1-ulp difference in an
    // intermediate moves a gradient by about eps_bf16 times the tensor's largest entry.
    double amax = 0;
    for (float v : ref.to_floats()) amax = std::max(amax, double(std::fabs(v)));
    const double atol = mixed ? 0.06 * amax + 1e-4 : 1e-5 * amax + 1e-7;
    const double rtol = mixed ? 0.06 : 1e-4;
    test::expect_close(p.grad(), ref, atol, rtol, pre + "grad." + name);
    ++checked;
  }
  EXPECT_GT(checked, 10);
}

class ModelParity : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(ModelParity, LossAndEveryGradientMatchPyTorch) {
  const auto& [family, precision] = GetParam();
  expect_step_matches(run_step(family, precision), family + "." + precision + ".",
                      precision == "bf16-mixed");
}

// A mixture's load-balancing loss added as HF adds it (output_router_logits, router_aux_loss_coef
// 0.5), over a padded batch: the loss, the aux loss alone, and every gradient (the routers' move
// by it most). The Qwen3-MoE has one sparse layer, the OLMoE two (their routings counted together).
TEST(ModelParity, TheLoadBalancingLossAndItsGradientsMatchPyTorch) {
  for (const std::string family : {"qwen3_moe_aux", "olmoe_aux"})
    for (const std::string precision : {"32-true", "bf16-mixed"}) {
      SCOPED_TRACE(family + " " + precision);
      expect_step_matches(run_step(family, precision, 0.5), family + "." + precision + ".",
                          precision == "bf16-mixed");
    }
  // The term moves the routers' gradients well beyond the tolerance above: without it they differ.
  const io::Safetensors& fx = test::fixture("models");
  const std::string router = "model.layers.0.mlp.gate.weight";
  const auto with = fx.at("olmoe_aux.32-true.grad." + router).to_floats();
  const auto without = fx.at("olmoe.32-true.grad." + router).to_floats();
  double diff = 0, amax = 0;
  for (size_t i = 0; i < with.size(); ++i) {
    diff = std::max(diff, double(std::fabs(with[i] - without[i])));
    amax = std::max(amax, double(std::fabs(with[i])));
  }
  EXPECT_GT(diff, 0.1 * amax);
}

INSTANTIATE_TEST_SUITE_P(Models, ModelParity,
                         ::testing::Combine(::testing::ValuesIn(test::kFixtureFamilies),
                                            ::testing::Values("32-true", "bf16-mixed")),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param) + "_" + std::get<1>(info.param);
                           for (auto& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

TEST(Models, HfParameterNames) {
  auto gpt2 = models::make_causal_lm(test::tiny_model_spec("gpt2"), 1);
  EXPECT_TRUE(gpt2->find_parameter("transformer.h.1.attn.c_attn.weight").defined());
  EXPECT_EQ(gpt2->find_parameter("transformer.h.0.mlp.c_fc.weight").shape(), (Shape{64, 16}));
  EXPECT_FALSE(gpt2->find_parameter("lm_head.weight").defined()) << "gpt2 ties lm_head to wte";
  auto llama = models::make_causal_lm(test::tiny_model_spec("llama"), 1);
  EXPECT_EQ(llama->find_parameter("model.layers.1.self_attn.k_proj.weight").shape(),
            (Shape{8, 16}));  // 2 kv heads x head dim 4
  EXPECT_TRUE(llama->find_parameter("lm_head.weight").defined());
  EXPECT_TRUE(llama->find_module("model.layers.0.mlp") != nullptr);
}

TEST(Models, InitializationIsDeterministicAndFollowsHf) {
  auto a = models::make_causal_lm(test::tiny_model_spec("gpt2"), 7),
       b = models::make_causal_lm(test::tiny_model_spec("gpt2"), 7);
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    test::expect_bitwise_equal(pa[i].second, pb[i].second, pa[i].first);
  EXPECT_EQ(a->find_parameter("transformer.h.0.ln_1.weight").to_floats()[0], 1.0f);
  EXPECT_EQ(a->find_parameter("transformer.h.0.attn.c_attn.bias").to_floats()[0], 0.0f);
  // Every family's norms start at 1 (Gemma's, which scale by 1 + weight, at 0) and its biases at
  // 0, whatever HF names them (Falcon's ln_attn, GPT-J's ln_1); every other parameter is drawn.
  for (const std::string& family : test::kFixtureFamilies) {
    const models::ModelSpec s = test::tiny_model_spec(family);
    auto m = models::make_causal_lm(s, 7);
    for (auto& [name, p] : m->named_parameters()) {
      const std::vector<float> v = p.to_floats();
      const bool norm =
          name.find("norm") != std::string::npos || name.find(".ln_") != std::string::npos;
      const bool bias = name.ends_with(".bias");
      const float built = bias ? 0.0f : s.gemma() ? 0.0f : 1.0f;
      if (norm || bias) {
        EXPECT_EQ(std::count(v.begin(), v.end(), built), std::ssize(v)) << family << " " << name;
      } else {
        EXPECT_LT(std::count(v.begin(), v.end(), v[0]), std::ssize(v)) << family << " " << name;
      }
    }
  }
}

TEST(Models, SpecErrorsNameTheProblem) {
  models::ModelSpec s = test::tiny_model_spec("llama");
  s.n_kv_head = 3;
  try {
    models::make_causal_lm(s, 1);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_head"), std::string::npos) << e.what();
  }
  s = test::tiny_model_spec("gpt3");
  s.family = "gpt3";
  EXPECT_THROW(models::make_causal_lm(s, 1), Error);
}

// A Phi-3's qkv_proj is q_proj's, k_proj's and v_proj's rows one after another, its gate_up_proj
// gate_proj's then up_proj's (HF's Phi3Attention and Phi3MLP split them so): drawn from one seed
// (the fused tensors take the split ones' draws in order), it computes the Mistral's logits, and
// its fused gradients are the split ones' side by side.
TEST(Models, FusedProjectionsComputeTheSplitOnes) {
  const io::Safetensors& fx = test::fixture("models");
  for (const bool mixed : {false, true}) {
    auto fused = models::make_causal_lm(test::tiny_model_spec("phi3_w3"), 7);
    auto split = models::make_causal_lm(test::tiny_model_spec("mistral_w3"), 7);
    amp::AutocastGuard autocast(mixed, DType::BF16);
    auto loss_of = [&](models::CausalLM& m, Tensor& logits) {
      logits = m.forward(fx.at("llama.32-true.input_ids"), fx.at("llama.32-true.attention_mask"));
      Tensor flat =
          amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, logits.size(-1)}));
      Tensor loss = ops::cross_entropy(flat, ops::reshape(fx.at("llama.32-true.labels"), {-1}));
      backward(loss);
      return loss.item();
    };
    Tensor lf, ls;
    const double tol = mixed ? 2e-2 : 1e-6;
    EXPECT_NEAR(loss_of(*fused, lf), loss_of(*split, ls), tol);
    test::expect_close(lf, ls, tol, tol, mixed ? "bf16-mixed logits" : "f32 logits");
    for (const std::string layer : {"model.layers.0.", "model.layers.1."}) {
      auto grads_of = [&](const std::vector<std::string>& names) {
        std::vector<float> all;
        for (const std::string& n : names) {
          const std::vector<float> g =
              split->find_parameter(layer + n + ".weight").grad().to_floats();
          all.insert(all.end(), g.begin(), g.end());
        }
        return Tensor::from_floats(all, {static_cast<int64_t>(all.size())});
      };
      const Tensor qkv = fused->find_parameter(layer + "self_attn.qkv_proj.weight").grad();
      const Tensor gate_up = fused->find_parameter(layer + "mlp.gate_up_proj.weight").grad();
      EXPECT_EQ(qkv.shape(), (Shape{32, 16}));      // (4 + 2 x 2 heads) x 4 channels, 16 wide
      EXPECT_EQ(gate_up.shape(), (Shape{96, 16}));  // 2 x 48
      test::expect_close(ops::reshape(qkv, {-1}),
                         grads_of({"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}),
                         tol, tol, layer + "qkv_proj");
      test::expect_close(ops::reshape(gate_up, {-1}), grads_of({"mlp.gate_proj", "mlp.up_proj"}),
                         tol, tol, layer + "gate_up_proj");
    }
  }
}

// The order of a parallel block's sum, pinned bit for bit under bf16-mixed (the parity fixtures'
// tolerance does not tell the orders apart): Phi's, GPT-NeoX's, Falcon's and GPT-J's (attention +
// mlp)
// + x, the branches added in bf16 first as HF's autocast adds its bf16 Linear outputs; Cohere's and
// StableLM's x + attention, then + mlp, in f32. A block's output against its own sublayers'.
TEST(Models, ParallelBlocksSumAsTheirHfModelsDo) {
  const io::Safetensors& fx = test::fixture("models");
  for (const std::string family : {"phi", "gpt_neox", "cohere", "stablelm_par", "falcon", "gptj"}) {
    auto m = models::make_causal_lm(test::tiny_model_spec(family), 7);
    auto* layer = dynamic_cast<models::LlamaForCausalLM&>(*m).model->layers[0];
    NoGradGuard no_grad;
    amp::AutocastGuard autocast(true, DType::BF16);
    const Tensor x = dynamic_cast<models::LlamaForCausalLM&>(*m).model->embed_tokens->forward(
        fx.at("llama.32-true.input_ids"));
    const ops::AttentionMask mask(fx.at("llama.32-true.attention_mask"), Tensor());
    const Tensor got = layer->forward(x, mask, ops::AttentionBackend::kEager);
    const Tensor h = layer->input_layernorm->forward(x);
    const Tensor a = layer->self_attn->forward(h, mask, ops::AttentionBackend::kEager);
    const Tensor f = layer->feed_forward(
        layer->post_attention_layernorm ? layer->post_attention_layernorm->forward(x) : h);
    ASSERT_EQ(a.dtype(), DType::BF16) << family;
    const bool residual_first = family == "cohere" || family == "stablelm_par";
    const Tensor want = residual_first ? nn::residual_add(nn::residual_add(x, a), f)
                                       : nn::residual_add(ops::add(a, f), x);
    test::expect_bitwise_equal(got, want, family);
    // (and the other order differs: the pin has something to hold)
    const Tensor other = residual_first ? nn::residual_add(ops::add(a, f), x)
                                        : nn::residual_add(nn::residual_add(x, a), f);
    EXPECT_NE(got.to_floats(), other.to_floats()) << family;
  }
}

TEST(Models, BitIdenticalAcrossRuns) {
  for (const char* fam : {"gpt2", "llama"}) {
    StepOutput a = run_step(fam, "bf16-mixed"), b = run_step(fam, "bf16-mixed");
    EXPECT_EQ(a.loss, b.loss);
    auto pa = a.model->named_parameters(), pb = b.model->named_parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      test::expect_bitwise_equal(pa[i].second.grad(), pb[i].second.grad(), pa[i].first);
  }
}

}  // namespace
}  // namespace keel
