// Flat gradients (Optimizer::use_flat_grads, DESIGN §8): every gradient lands in a view of one
// buffer per dtype and device, and the bits are those of gradients that adopt backward's own
// tensors: two micro-batches accumulated, a tied embedding (GPT-2's wte is used twice), two
// AdamW steps with zero_grad between them, in 32-true and bf16-mixed.
#include <gtest/gtest.h>

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

class FlatGrads : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(FlatGrads, SameBitsAsAdoptedGradientsAndEveryGradientIsAViewOfTheBuffer) {
  const auto& [family, precision] = GetParam();
  const io::Safetensors& fx = test::fixture("models");
  const std::string pre = family + "." + precision + ".";
  const bool mixed = precision == "bf16-mixed";
  auto plain = models::make_causal_lm(test::tiny_model_spec(family), 1);
  auto flat = models::make_causal_lm(test::tiny_model_spec(family), 1);
  optim::AdamW opt_plain(optim::make_param_groups(plain->named_parameters(), 0.1));
  optim::AdamW opt_flat(optim::make_param_groups(flat->named_parameters(), 0.1));
  opt_flat.use_flat_grads();
  ASSERT_FALSE(opt_flat.flat_grad_buffers().empty());
  EXPECT_TRUE(opt_plain.flat_grad_buffers().empty());
  auto micro_batches = [&](models::CausalLM& m) {
    amp::AutocastGuard autocast(mixed, DType::BF16);
    for (int k = 0; k < 2; ++k) {
      Tensor logits = m.forward(fx.at(pre + "input_ids"), fx.at(pre + "attention_mask"));
      Tensor f = amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, 37}));
      backward(ops::cross_entropy(f, ops::reshape(fx.at(pre + "labels"), {-1})));
    }
  };
  for (int step = 0; step < 2; ++step) {
    opt_plain.zero_grad();
    opt_flat.zero_grad();
    micro_batches(*plain);
    micro_batches(*flat);
    const auto pp = plain->named_parameters(), fp = flat->named_parameters();
    ASSERT_EQ(pp.size(), fp.size());
    for (size_t i = 0; i < pp.size(); ++i) {
      const Tensor &a = pp[i].second.grad(), &b = fp[i].second.grad();
      ASSERT_TRUE(a.defined() && b.defined()) << pp[i].first;
      test::expect_bitwise_equal(a, b, pp[i].first + " grad");
      bool in_buffer = false;
      for (const Tensor& buf : opt_flat.flat_grad_buffers()) in_buffer |= b.shares_storage(buf);
      EXPECT_TRUE(in_buffer) << fp[i].first << " step " << step;
    }
    opt_plain.step(1e-2);
    opt_flat.step(1e-2);
    for (size_t i = 0; i < pp.size(); ++i)
      test::expect_bitwise_equal(pp[i].second, fp[i].second, pp[i].first);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FlatGrads,
                         ::testing::Combine(::testing::Values("gpt2", "llama"),
                                            ::testing::Values("32-true", "bf16-mixed")));

}  // namespace
}  // namespace keel
