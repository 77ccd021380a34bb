// Fault injection: the right module, the right step, each kind, gradients still flowing, and a
// helpful error for a module that does not exist.
#include <gtest/gtest.h>

#include <cmath>

#include "keel/autograd/node.h"
#include "keel/models/causal_lm.h"
#include "keel/monitor/inject.h"
#include "keel/monitor/tracer.h"
#include "keel/nn/layers.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using monitor::FaultInjector;
using monitor::InjectOptions;

// a -> b -> c, Linear(4, 4) with weights 0.5 * I and biases 0: outputs are exact.
class Three : public nn::Module {
 public:
  Three() : nn::Module("Three") {
    for (auto* name : {"a", "b", "c"}) {
      auto* l = register_module(name, std::make_unique<nn::Linear>(4, 4, true));
      std::vector<float> w(16, 0.f);
      for (int i = 0; i < 4; ++i) w[i * 4 + i] = 0.5f;
      l->weight.copy_from(Tensor::from_floats(w, {4, 4}));
      layers.push_back(l);
    }
    assign_paths();
  }
  Tensor forward(const Tensor& x) {
    return call({x}, [&] {
      Tensor h = x;
      for (auto* l : layers) h = l->forward(h);
      return h;
    });
  }
  std::vector<nn::Linear*> layers;
};

// Outputs of a, b, c recorded by post hooks attached after the injector (they see its result).
struct Recorder {
  explicit Recorder(Three& net) {
    for (auto* l : net.layers)
      l->add_forward_post_hook([this](nn::Module& m, const std::vector<Tensor>&, Tensor& out) {
        seen.emplace_back(m.path(), out.to_floats());
      });
  }
  std::vector<std::pair<std::string, std::vector<float>>> seen;
};

TEST(Inject, EachKindAtTheRightStepAndModule) {
  for (const char* kind : {"nan", "inf", "scale"}) {
    Three net;
    InjectOptions o;
    o.module = "b";
    o.step = 3;
    o.kind = kind;
    o.factor = 1000;
    FaultInjector inj(net, o);
    Recorder rec(net);
    Tensor x = Tensor::full({2, 4}, 8.f);
    for (int64_t step = 1; step <= 4; ++step) {
      inj.begin_step(step);
      rec.seen.clear();
      Tensor y = net.forward(x);
      const auto out = y.to_floats();
      ASSERT_EQ(rec.seen.size(), 3u);
      // a always 4; b 2 (corrupted at step 3); c half of b.
      for (float v : rec.seen[0].second) EXPECT_EQ(v, 4.f);
      const auto& b = rec.seen[1].second;
      if (step != 3) {
        for (float v : b) EXPECT_EQ(v, 2.f) << kind << " step " << step;
        for (float v : out) EXPECT_EQ(v, 1.f);
        continue;
      }
      const std::string k = kind;
      if (k == "scale") {
        for (float v : b) EXPECT_EQ(v, 2000.f);
        for (float v : out) EXPECT_EQ(v, 1000.f);
      } else {
        // Exactly one element of b's output is corrupted: element 0.
        EXPECT_TRUE(k == "nan" ? std::isnan(b[0]) : std::isinf(b[0]) && b[0] > 0) << kind;
        for (size_t i = 1; i < b.size(); ++i) EXPECT_EQ(b[i], 2.f) << i;
        // Downstream, c mixes row 0 only: row 1 stays finite.
        EXPECT_FALSE(std::isfinite(out[0]));
        for (size_t i = 4; i < out.size(); ++i) EXPECT_EQ(out[i], 1.f);
      }
    }
    EXPECT_EQ(inj.injections(), 1);
  }
}

TEST(Inject, EveryMicroBatchOfTheStepAndNeverInEval) {
  Three net;
  InjectOptions o;
  o.module = "a";
  o.step = 2;
  o.kind = "nan";
  FaultInjector inj(net, o);
  inj.begin_step(2);
  Tensor x = Tensor::full({1, 4}, 1.f);
  EXPECT_TRUE(std::isnan(net.forward(x).to_floats()[0]));
  EXPECT_TRUE(std::isnan(net.forward(x).to_floats()[0]));  // second micro-batch
  EXPECT_EQ(inj.injections(), 2);
  net.train(false);
  EXPECT_TRUE(std::isfinite(net.forward(x).to_floats()[0]));  // evaluation is never corrupted
  EXPECT_EQ(inj.injections(), 2);
}

TEST(Inject, GradientsFlowThroughTheCorruptedOutput) {
  // scale: d(out)/d(a.weight) picks up the factor, so the graph was kept.
  Three net;
  InjectOptions o;
  o.module = "b";
  o.step = 1;
  o.kind = "scale";
  o.factor = 10;
  FaultInjector inj(net, o);
  inj.begin_step(1);
  Tensor y = net.forward(Tensor::full({1, 4}, 1.f));
  backward(y, Tensor::full({1, 4}, 1.f));
  ASSERT_TRUE(net.layers[0]->weight.grad().defined());
  // y = 10 * 0.5 * 0.5 * (0.5 x): dy_i/dWa_ii = 10 * 0.25 * x_i = 2.5.
  EXPECT_EQ(net.layers[0]->weight.grad().to_floats()[0], 2.5f);

  // nan: the NaN reaches a's gradients through b's backward.
  Three net2;
  o.kind = "nan";
  FaultInjector inj2(net2, o);
  inj2.begin_step(1);
  Tensor y2 = net2.forward(Tensor::full({1, 4}, 1.f));
  backward(y2, Tensor::full({1, 4}, 1.f));
  EXPECT_TRUE(std::isnan(net2.layers[2]->weight.grad().to_floats()[0]));
}

TEST(Inject, TheTracerNamesTheInjectedModule) {
  auto spec = models::ModelSpec();
  spec.vocab_size = 16;
  spec.n_layer = 2;
  spec.n_embd = 8;
  spec.n_head = 2;
  spec.max_seq_len = 8;
  auto model = models::make_causal_lm(spec, 1);
  InjectOptions o;
  o.module = "transformer.h.1.attn";
  o.step = 5;
  FaultInjector inj(*model, o);  // before the tracer: it must see the corrupted output
  monitor::UnderflowOverflowTracer tracer(*model, {}, test::temp_dir("inject-tracer") + "/t.log");
  tracer.set_stop_on_finding(false);
  Tensor ids = Tensor::from_ints({1, 2, 3, 4, 5, 6}, {1, 6});
  for (int64_t step = 1; step <= 5; ++step) {
    inj.begin_step(step);
    tracer.begin_batch(step);
    model->forward(ids, Tensor());
  }
  ASSERT_TRUE(tracer.finding().found);
  EXPECT_EQ(tracer.finding().module, "transformer.h.1.attn");
  EXPECT_EQ(tracer.finding().module_type, "GPT2Attention");
  EXPECT_EQ(tracer.finding().tensor, "output");
  EXPECT_EQ(tracer.finding().batch, 5);
}

TEST(Inject, UnknownModuleNamesThePathAndSimilarOnes) {
  auto spec = models::ModelSpec();
  spec.vocab_size = 16;
  spec.n_layer = 2;
  spec.n_embd = 8;
  spec.n_head = 2;
  auto model = models::make_causal_lm(spec, 1);
  InjectOptions o;
  o.module = "transformer.h.1.atn";
  o.step = 1;
  try {
    FaultInjector inj(*model, o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.kind, Error::kUsage);
    EXPECT_NE(msg.find("\"transformer.h.1.atn\""), std::string::npos) << msg;
    // The closest path comes first.
    EXPECT_NE(msg.find("similar paths: transformer.h.1.attn "), std::string::npos) << msg;
  }
  o.module = "transformer.h.0.mlp";
  o.kind = "zero";
  EXPECT_THROW(FaultInjector(*model, o), Error);
  o.kind = "scale";
  o.factor = std::numeric_limits<double>::infinity();
  EXPECT_THROW(FaultInjector(*model, o), Error);
}

TEST(Inject, DetachesOnDestruction) {
  Three net;
  {
    InjectOptions o;
    o.module = "c";
    o.step = 1;
    FaultInjector inj(net, o);
    EXPECT_TRUE(net.layers[2]->has_hooks());
  }
  EXPECT_FALSE(net.layers[2]->has_hooks());
}

}  // namespace
}  // namespace keel
