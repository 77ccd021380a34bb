// One full optimizer step of a tiny GPT-2, Llama, Qwen2 and Qwen3 (and a Qwen3 with wide heads)
// against PyTorch (tests/fixtures/gen_models.py): forward, backward and torch.optim.AdamW (lr
// 1e-2, weight decay 0.1 on matrices only) — the parameters after the step, in 32-true and
// bf16-mixed.
#include <gtest/gtest.h>

#include <cmath>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/models/causal_lm.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/shape.h"
#include "keel/optim/adamw.h"
#include "tests/support/check.h"
#include "tests/support/tiny_models.h"

namespace keel {
namespace {

class ModelStep : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(ModelStep, ParametersAfterOneAdamWStepMatchPyTorch) {
  const auto& [family, precision] = GetParam();
  const io::Safetensors& fx = test::fixture("models");
  const std::string pre = family + "." + precision + ".";
  const bool mixed = precision == "bf16-mixed";
  auto model = models::make_causal_lm(test::tiny_model_spec(family), 1);
  for (auto& [name, p] : model->named_parameters()) {
    Tensor dst = p;
    dst.copy_from(fx.at(pre + "param." + name));
  }
  {
    amp::AutocastGuard autocast(mixed, DType::BF16);
    Tensor logits = model->forward(fx.at(pre + "input_ids"), fx.at(pre + "attention_mask"));
    Tensor flat = amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, 37}));
    backward(ops::cross_entropy(flat, ops::reshape(fx.at(pre + "labels"), {-1})));
  }
  optim::AdamW opt(optim::make_param_groups(model->named_parameters(), 0.1));
  opt.step(1e-2);
  for (auto& [name, p] : model->named_parameters()) {
    // Adam's first step moves each weight by ~lr * sign(g). Where the true gradient is 0 (e.g. the
    // key bias: softmax ignores a constant added to every score) g is rounding noise whose sign is
    // arbitrary, in torch as in keel: there only the size of the step can be checked.
    const auto got = p.to_floats(), want = fx.at(pre + "adamw." + name).to_floats();
    const auto g = fx.at(pre + "grad." + name).to_floats();
    double gmax = 0;
    for (float v : g) gmax = std::max(gmax, double(std::fabs(v)));
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      // bf16-mixed gradients carry ~eps_bf16 * max|g| of rounding noise: signs below that are
      // not determined. Everywhere else the first step is exactly lr * sign(g) (+ decay).
      const bool noise = std::fabs(g[i]) <= (mixed ? 2e-2 : 1e-5) * gmax;
      const double tol = noise ? 2.1e-2 : 2e-6;
      if (std::fabs(got[i] - want[i]) > tol && ++bad <= 3)
        ADD_FAILURE() << pre << name << "[" << i << "] after AdamW: " << got[i] << " vs torch "
                      << want[i] << " (grad " << g[i] << ")";
    }
    EXPECT_EQ(bad, 0) << pre << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ModelStep,
                         ::testing::Combine(::testing::ValuesIn(test::kFixtureFamilies),
                                            ::testing::Values("32-true", "bf16-mixed")),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param) + "_" + std::get<1>(info.param);
                           for (auto& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace keel
