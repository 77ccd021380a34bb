// Flat gradients (Optimizer::use_flat_grads, DESIGN §8): every gradient lands in a view of one
// buffer per dtype and device, and the bits are those of gradients that adopt backward's own
// tensors: micro-batches accumulated, a tied embedding (GPT-2's wte is used twice), two AdamW steps
// with zero_grad between them, in 32-true and bf16-mixed, with LoRA, DoRA and LoKr adapters and
// with activation checkpointing. Then the mechanism itself (Node::grad_buffer): which gradients
// are written straight into their home and which are not.
#include <gtest/gtest.h>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/models/causal_lm.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"
#include "keel/ops/shape.h"
#include "keel/optim/adamw.h"
#include "tests/support/check.h"
#include "tests/support/tiny_models.h"

namespace keel {
namespace {

// family, precision, variant (full | lora | dora | lokr | checkpoint), micro-batches per step
using FlatCase = std::tuple<std::string, std::string, std::string, int>;
class FlatGrads : public ::testing::TestWithParam<FlatCase> {};

std::unique_ptr<models::CausalLM> make_flat_case_model(const std::string& family,
                                                       const std::string& variant) {
  auto m = models::make_causal_lm(test::tiny_model_spec(family), 1);
  if (variant == "checkpoint") m->set_activation_checkpointing(1);
  if (variant == "lora" || variant == "dora" || variant == "lokr") {
    nn::AdapterOptions o;
    o.kind = variant;
    o.r = 4;
    o.target_modules = family == "gpt2" ? std::vector<std::string>{"c_attn", "c_fc"}
                                        : std::vector<std::string>{"q_proj", "v_proj", "down_proj"};
    nn::apply_adapters(*m, o);
  }
  return m;
}

TEST_P(FlatGrads, SameBitsAsAdoptedGradientsAndEveryGradientIsAViewOfTheBuffer) {
  const auto& [family, precision, variant, micro] = GetParam();
  const io::Safetensors& fx = test::fixture("models");
  const std::string pre = family + "." + precision + ".";
  const bool mixed = precision == "bf16-mixed";
  auto plain = make_flat_case_model(family, variant);
  auto flat = make_flat_case_model(family, variant);
  optim::AdamW opt_plain(optim::make_param_groups(plain->named_parameters(), 0.1));
  optim::AdamW opt_flat(optim::make_param_groups(flat->named_parameters(), 0.1));
  opt_flat.use_flat_grads();
  ASSERT_FALSE(opt_flat.flat_grad_buffers().empty());
  EXPECT_TRUE(opt_plain.flat_grad_buffers().empty());
  const int n_micro = micro;  // clang 14 lets no lambda capture a structured binding
  auto micro_batches = [&](models::CausalLM& m) {
    amp::AutocastGuard autocast(mixed, DType::BF16);
    for (int k = 0; k < n_micro; ++k) {
      Tensor logits = m.forward(fx.at(pre + "input_ids"), fx.at(pre + "attention_mask"));
      Tensor f = amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, 37}));
      // A different weight per micro-batch, as the trainer's token shares give.
      backward(ops::scale(ops::cross_entropy(f, ops::reshape(fx.at(pre + "labels"), {-1})),
                          1.f / static_cast<float>(k + 2)));
    }
  };
  int64_t trainable = 0;
  for (int step = 0; step < 3; ++step) {
    opt_plain.zero_grad();
    opt_flat.zero_grad();
    micro_batches(*plain);
    micro_batches(*flat);
    const auto pp = plain->named_parameters(), fp = flat->named_parameters();
    ASSERT_EQ(pp.size(), fp.size());
    trainable = 0;
    for (size_t i = 0; i < pp.size(); ++i) {
      if (!pp[i].second.requires_grad()) continue;
      ++trainable;
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
  EXPECT_GT(trainable, 0);
}

INSTANTIATE_TEST_SUITE_P(Families, FlatGrads,
                         ::testing::Combine(::testing::Values("gpt2", "llama"),
                                            ::testing::Values("32-true", "bf16-mixed"),
                                            ::testing::Values("full", "lora", "dora", "lokr",
                                                              "checkpoint"),
                                            ::testing::Values(1, 3)));

// A node whose backward asks grad_buffer for every input's gradient (of the input's shape and
// dtype, or `as` when given), fills it with `value` and records whether it got the input's home.
struct HomeProbe final : Node {
  float value = 1;
  DType as = DType::U8;  // U8: each input's own dtype
  std::vector<Shape> shapes;
  std::vector<DType> dtypes;
  std::vector<bool> got_home;
  std::vector<Tensor> homes;
  std::vector<Tensor> backward(const Tensor& g) override {
    std::vector<Tensor> out;
    got_home.clear();
    for (size_t i = 0; i < shapes.size(); ++i) {
      const DType dt = as == DType::U8 ? dtypes[i] : as;
      Tensor t = grad_buffer(i, shapes[i], dt, g.device());
      t.fill(value * static_cast<float>(i + 1));
      got_home.push_back(homes[i].defined() && t.shares_storage(homes[i]));
      out.push_back(t);
    }
    return out;
  }
  const char* name() const override { return "home_probe"; }
};

// probe_home(inputs) -> a scalar-shaped output recorded with a HomeProbe.
Tensor probe_home(std::shared_ptr<HomeProbe>& node, std::initializer_list<const Tensor*> inputs,
                  float value = 1) {
  node = std::make_shared<HomeProbe>();
  node->value = value;
  for (const Tensor* t : inputs) {
    node->shapes.push_back(t->shape());
    node->dtypes.push_back(t->dtype());
    node->homes.push_back(t->impl()->grad_home);
  }
  Tensor out = Tensor::zeros({1});
  record_node(out, node, inputs);
  return out;
}

struct FlatPair {
  Tensor w = Tensor::zeros({4, 3}), v = Tensor::zeros({5});
  std::unique_ptr<optim::AdamW> opt;
  FlatPair() {
    w.set_requires_grad(true);
    v.set_requires_grad(true);
    opt = std::make_unique<optim::AdamW>(
        optim::make_param_groups({{"w.weight", w}, {"v.weight", v}}, 0.0));
    opt->use_flat_grads();
  }
};

TEST(FlatGradsHome, AFirstGradientIsWrittenInItsHomeAndALaterOneIsNot) {
  FlatPair p;
  std::shared_ptr<HomeProbe> n;
  backward(probe_home(n, {&p.w, &p.v}, 1));
  EXPECT_EQ(n->got_home, (std::vector<bool>{true, true}));
  EXPECT_EQ(p.w.grad().to_floats(), std::vector<float>(12, 1.f));
  EXPECT_EQ(p.v.grad().to_floats(), std::vector<float>(5, 2.f));
  EXPECT_TRUE(p.w.grad().shares_storage(p.opt->flat_grad_buffers()[0]));
  backward(probe_home(n, {&p.w, &p.v}, 10));  // accumulates: 1 + 10, 2 + 20
  EXPECT_EQ(n->got_home, (std::vector<bool>{false, false}));
  EXPECT_EQ(p.w.grad().to_floats(), std::vector<float>(12, 11.f));
  EXPECT_EQ(p.v.grad().to_floats(), std::vector<float>(5, 22.f));
  p.opt->zero_grad();
  backward(probe_home(n, {&p.w}, 3));
  EXPECT_EQ(n->got_home, (std::vector<bool>{true}));
  EXPECT_EQ(p.w.grad().to_floats(), std::vector<float>(12, 3.f));
}

TEST(FlatGradsHome, AGradientOfAnotherDtypeOrALeafWithoutHomeGetsAFreshTensor) {
  FlatPair p;
  Tensor u = Tensor::zeros({4, 3});
  u.set_requires_grad(true);  // no optimizer: no home
  std::shared_ptr<HomeProbe> n;
  backward(probe_home(n, {&u}));
  EXPECT_EQ(n->got_home, (std::vector<bool>{false}));
  std::shared_ptr<HomeProbe> b;
  Tensor out = probe_home(b, {&p.w});
  b->as = DType::BF16;  // converted to the leaf's f32 by AccumulateGrad
  backward(out);
  EXPECT_EQ(b->got_home, (std::vector<bool>{false}));
  EXPECT_EQ(p.w.grad().to_floats(), std::vector<float>(12, 1.f));
  EXPECT_TRUE(p.w.grad().shares_storage(p.opt->flat_grad_buffers()[0]));
}

TEST(FlatGradsHome, AGradientReachesItsHomeThroughACastBackToItsDtype) {
  FlatPair p;
  Tensor w16 = ops::cast(p.w, DType::BF16);  // autocast's copy of an f32 master
  std::shared_ptr<HomeProbe> n;
  Tensor out = probe_home(n, {&w16});
  n->as = DType::F32;  // what linear does (ops::grad_dtype_for): the master's dtype
  n->homes = {p.w.impl()->grad_home};
  backward(out);
  EXPECT_EQ(n->got_home, (std::vector<bool>{true}));
  EXPECT_EQ(p.w.grad().to_floats(), std::vector<float>(12, 1.f));
  // A bf16 gradient is converted by the cast: never the home.
  p.opt->zero_grad();
  Tensor w16b = ops::cast(p.w, DType::BF16);
  out = probe_home(n, {&w16b});
  n->homes = {p.w.impl()->grad_home};
  backward(out);
  EXPECT_EQ(n->got_home, (std::vector<bool>{false}));
  EXPECT_EQ(p.w.grad().to_floats(), std::vector<float>(12, 1.f));
  EXPECT_TRUE(p.w.grad().shares_storage(p.opt->flat_grad_buffers()[0]));
}

TEST(FlatGradsHome, ATiedLeafSumsItsContributionsInItsHome) {
  FlatPair p;
  std::shared_ptr<HomeProbe> first, second;
  Tensor a = probe_home(first, {&p.w}, 1);
  Tensor b = probe_home(second, {&p.w}, 4);
  backward(ops::add(a, b));
  // One of the two (the later node, which runs first) gets the home; the other adds into it.
  EXPECT_NE(first->got_home[0], second->got_home[0]);
  EXPECT_TRUE(second->got_home[0]);
  EXPECT_EQ(p.w.grad().to_floats(), std::vector<float>(12, 5.f));
  EXPECT_TRUE(p.w.grad().shares_storage(p.opt->flat_grad_buffers()[0]));
}

TEST(FlatGradsHome, WithPostHooksOrForABackwardToInputTheHomeIsNotHandedOut) {
  FlatPair p;
  std::shared_ptr<HomeProbe> n;
  int calls = 0;
  const int h =
      add_node_post_hook([&](const Node&, const Tensor&, const std::vector<Tensor>&) { ++calls; });
  backward(probe_home(n, {&p.w}));
  remove_node_post_hook(h);
  EXPECT_GT(calls, 0);
  EXPECT_EQ(n->got_home, (std::vector<bool>{false}));
  EXPECT_EQ(p.w.grad().to_floats(), std::vector<float>(12, 1.f));
  p.opt->zero_grad();
  Tensor out = probe_home(n, {&p.w, &p.v});
  std::vector<Tensor> got = backward_to(out, Tensor(), {p.w});
  EXPECT_EQ(n->got_home, (std::vector<bool>{false, true}));
  EXPECT_FALSE(p.w.grad().defined());
  EXPECT_EQ(got[0].to_floats(), std::vector<float>(12, 1.f));
  EXPECT_EQ(p.v.grad().to_floats(), std::vector<float>(5, 2.f));
}

}  // namespace
}  // namespace keel
