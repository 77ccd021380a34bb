// The backward engine's scheduling of leaf accumulators: a leaf reached by a single edge receives
// its gradient as soon as that edge's node has run (so the weight gradients of a model are not all
// alive at once), a leaf with several edges sums them first, and with post-hooks attached every
// accumulator runs last, once. Built from hand-written nodes so that only autograd/ is involved.
#include <gtest/gtest.h>

#include "keel/autograd/node.h"

namespace keel {
namespace {

// out = s * x, elementwise, with a callback when its backward runs.
struct ScaleNode final : Node {
  float s = 1;
  std::function<void()> on_backward;
  std::vector<Tensor> backward(const Tensor& g) override {
    if (on_backward) on_backward();
    std::vector<float> v = g.to_floats();
    for (float& e : v) e *= s;
    return {Tensor::from_floats(v, g.shape())};
  }
  const char* name() const override { return "scale"; }
};

Tensor scale(const Tensor& x, float s, std::function<void()> on_backward = {}) {
  std::vector<float> v = x.to_floats();
  for (float& e : v) e *= s;
  Tensor out = Tensor::from_floats(v, x.shape());
  if (any_requires_grad({&x})) {
    auto n = std::make_shared<ScaleNode>();
    n->s = s;
    n->on_backward = std::move(on_backward);
    record_node(out, n, {&x});
  }
  return out;
}

// out = sum of a and b, returning the same gradient tensor for both inputs (as add does).
struct AddNode final : Node {
  std::vector<Tensor> backward(const Tensor& g) override { return {g, g}; }
  const char* name() const override { return "add"; }
};

Tensor add(const Tensor& a, const Tensor& b) {
  std::vector<float> va = a.to_floats(), vb = b.to_floats();
  for (size_t i = 0; i < va.size(); ++i) va[i] += vb[i];
  Tensor out = Tensor::from_floats(va, a.shape());
  if (any_requires_grad({&a, &b})) record_node(out, std::make_shared<AddNode>(), {&a, &b});
  return out;
}

Tensor leaf(std::vector<float> v) {
  Tensor t = Tensor::from_floats(v, {static_cast<int64_t>(v.size())});
  t.set_requires_grad(true);
  return t;
}

// u's node is created first, so backward runs it after w's node. Returns whether w.grad was
// already filled in when u's node ran.
bool w_grad_ready_when_u_runs(Tensor& w, Tensor& u) {
  bool ready = false;
  Tensor a = scale(u, 2.f, [&] { ready = w.grad().defined(); });
  Tensor b = scale(w, 3.f);
  backward(add(a, b), Tensor::from_floats({1.f, 1.f}, {2}));
  return ready;
}

TEST(Engine, SingleEdgeLeafGetsItsGradientBeforeEarlierNodesRun) {
  Tensor w = leaf({1.f, -2.f}), u = leaf({0.5f, 4.f});
  EXPECT_TRUE(w_grad_ready_when_u_runs(w, u));
  EXPECT_EQ(w.grad().to_floats(), (std::vector<float>{3.f, 3.f}));
  EXPECT_EQ(u.grad().to_floats(), (std::vector<float>{2.f, 2.f}));
  // A second backward adds into the existing .grad (gradient accumulation).
  EXPECT_TRUE(w_grad_ready_when_u_runs(w, u));
  EXPECT_EQ(w.grad().to_floats(), (std::vector<float>{6.f, 6.f}));
  EXPECT_EQ(u.grad().to_floats(), (std::vector<float>{4.f, 4.f}));
}

TEST(Engine, WithPostHooksAccumulatorsRunLastAndOnce) {
  Tensor w = leaf({1.f, -2.f}), u = leaf({0.5f, 4.f});
  int accumulator_calls = 0;
  const int h = add_node_post_hook([&](const Node& n, const Tensor&, const std::vector<Tensor>&) {
    if (std::string(n.name()) == "AccumulateGrad") ++accumulator_calls;
  });
  const bool ready = w_grad_ready_when_u_runs(w, u);
  remove_node_post_hook(h);
  EXPECT_FALSE(ready);
  EXPECT_EQ(accumulator_calls, 2);  // one per leaf
  EXPECT_EQ(w.grad().to_floats(), (std::vector<float>{3.f, 3.f}));
}

TEST(Engine, LeafWithSeveralEdgesSumsThemFirstAndKeepsTheInputsIntact) {
  // y = 2w + 3w + w (tied use): the add node hands one tensor to both of its inputs, and w's
  // accumulator must not alias or modify it.
  Tensor w = leaf({1.f, 0.25f});
  Tensor y = add(add(scale(w, 2.f), scale(w, 3.f)), w);
  Tensor g = Tensor::from_floats({1.f, -1.f}, {2});
  backward(y, g);
  EXPECT_EQ(w.grad().to_floats(), (std::vector<float>{6.f, -6.f}));
  EXPECT_EQ(g.to_floats(), (std::vector<float>{1.f, -1.f}));
  // Under accumulation the sum is formed first, then added once: .grad + (2g + 3g + g).
  backward(y, g);
  EXPECT_EQ(w.grad().to_floats(), (std::vector<float>{12.f, -12.f}));
}

// out = x, whose backward hands back a fresh tensor and remembers where its data lives (without
// holding a reference, which would make the engine copy it).
struct FreshGradNode final : Node {
  const void** data_out = nullptr;
  Tensor keep;  // when defined, the node also holds the tensor it returns
  bool hold = false;
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor out = Tensor::from_floats(g.to_floats(), g.shape());
    *data_out = out.data();
    if (hold) keep = out;
    return {out};
  }
  const char* name() const override { return "fresh"; }
};

Tensor fresh(const Tensor& x, const void** data_out, std::shared_ptr<FreshGradNode>* node) {
  Tensor out = Tensor::from_floats(x.to_floats(), x.shape());
  auto n = std::make_shared<FreshGradNode>();
  n->data_out = data_out;
  *node = n;
  record_node(out, n, {&x});
  return out;
}

TEST(Engine, FirstGradientIsTakenOverWithoutACopyWhenNothingElseHoldsIt) {
  Tensor w = leaf({1.f, 2.f});
  const void* returned = nullptr;
  std::shared_ptr<FreshGradNode> node;
  backward(fresh(w, &returned, &node), Tensor::from_floats({5.f, 7.f}, {2}));
  EXPECT_EQ(w.grad().data(), returned) << "the node's sole tensor becomes .grad";
  EXPECT_EQ(w.grad().to_floats(), (std::vector<float>{5.f, 7.f}));
}

// out = x; backward hands the incoming gradient straight through (as a cast back to a dtype the
// gradient already has does).
struct PassThroughNode final : Node {
  std::vector<Tensor> backward(const Tensor& g) override { return {g}; }
  const char* name() const override { return "pass"; }
};

TEST(Engine, GradientPassedStraightThroughIsTakenOverWithoutACopy) {
  Tensor w = leaf({1.f, 2.f});
  Tensor mid = Tensor::from_floats(w.to_floats(), w.shape());
  record_node(mid, std::make_shared<PassThroughNode>(), {&w});
  const void* returned = nullptr;
  std::shared_ptr<FreshGradNode> node;
  backward(fresh(mid, &returned, &node), Tensor::from_floats({5.f, 7.f}, {2}));
  EXPECT_EQ(w.grad().data(), returned) << "the pass-through node's handle is dropped first";
  EXPECT_EQ(w.grad().to_floats(), (std::vector<float>{5.f, 7.f}));
}

TEST(Engine, FirstGradientIsCopiedWhenTheNodeStillHoldsIt) {
  // The node keeps the tensor it returned: .grad must not alias it, or the second backward's
  // accumulation into .grad would change the node's tensor.
  Tensor w = leaf({1.f, 2.f});
  const void* returned = nullptr;
  std::shared_ptr<FreshGradNode> node;
  Tensor y = fresh(w, &returned, &node);
  node->hold = true;
  backward(y, Tensor::from_floats({5.f, 7.f}, {2}));
  EXPECT_NE(w.grad().data(), returned);
  const Tensor kept = node->keep;
  backward(y, Tensor::from_floats({1.f, 1.f}, {2}));
  EXPECT_EQ(w.grad().to_floats(), (std::vector<float>{6.f, 8.f}));
  EXPECT_EQ(kept.to_floats(), (std::vector<float>{5.f, 7.f})) << "the held tensor is intact";
}

// ---- nested passes (activation checkpointing, nn/checkpoint.h) -------------------------------

// out = 3x + c: the forward records no graph and keeps x; backward recomputes it with the graph
// (its nodes numbered where the forward would have put them) and backpropagates in a nested pass.
struct RecomputeNode final : Node {
  Tensor input, c;
  uint64_t first = 0;
  static constexpr uint64_t kSpan = 16;
  static Tensor body(const Tensor& x, const Tensor& c) { return add(scale(x, 3.f), c); }
  std::vector<Tensor> backward(const Tensor& g) override {
    Tensor x = Tensor::from_floats(input.to_floats(), input.shape());
    x.set_requires_grad(input.requires_grad());
    Tensor out;
    {
      EnableGradGuard grad;
      SequenceGuard sequence(first, kSpan);
      out = body(x, c);
    }
    return backward_to(out, g, {x}, first);
  }
  const char* name() const override { return "recompute"; }
  bool transparent() const override { return true; }
};

Tensor recomputed(const Tensor& x, const Tensor& c) {
  auto node = std::make_shared<RecomputeNode>();
  node->first = reserve_sequence(RecomputeNode::kSpan);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = RecomputeNode::body(x, c);
  }
  node->input = x;
  node->c = c;
  record_node(out, node, {&x});
  return out;
}

// 5 * (3 * (2u) + c) with c = 1 * w made first (a weight's cast shared with an earlier micro-batch
// is such a node): the hooks' sequence of (node, gradient) and the leaves' gradients.
struct NestedRun {
  std::vector<std::pair<std::string, std::vector<float>>> seen;
  std::vector<float> u_grad, w_grad;
};

NestedRun run_nested(bool checkpoint) {
  Tensor u = leaf({1.f, -2.f}), w = leaf({0.5f, 4.f});
  Tensor c = scale(w, 1.f);
  Tensor h = scale(u, 2.f);
  Tensor y = scale(checkpoint ? recomputed(h, c) : RecomputeNode::body(h, c), 5.f);
  NestedRun r;
  const int hook =
      add_node_post_hook([&](const Node& n, const Tensor& g, const std::vector<Tensor>&) {
        r.seen.emplace_back(n.name(), g.to_floats());
      });
  backward(y, Tensor::from_floats({1.f, 2.f}, {2}));
  remove_node_post_hook(hook);
  r.u_grad = u.grad().to_floats();
  r.w_grad = w.grad().to_floats();
  return r;
}

TEST(Engine, ANestedPassIsSeenByHooksAsOnePassOverTheWholeGraph) {
  const NestedRun flat = run_nested(false), nested = run_nested(true);
  EXPECT_EQ(nested.u_grad, (std::vector<float>{30.f, 60.f}));
  EXPECT_EQ(nested.w_grad, (std::vector<float>{5.f, 10.f}));
  EXPECT_EQ(nested.u_grad, flat.u_grad);
  EXPECT_EQ(nested.w_grad, flat.w_grad);
  // scale 5, add, scale 3, scale 2, then c's node (created first: the nested pass hands it to the
  // outer one), then the accumulators; never the transparent recompute node.
  std::vector<std::string> names;
  for (auto& [name, g] : nested.seen) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"scale", "add", "scale", "scale", "scale",
                                             "AccumulateGrad", "AccumulateGrad"}));
  EXPECT_EQ(nested.seen, flat.seen);
}

TEST(Engine, BackwardToReturnsAnInputsSumAndLeavesItsGradAlone) {
  // y = x + 2x: x's two contributions come back summed; w (another leaf) accumulates as usual.
  Tensor x = leaf({1.f, 2.f}), w = leaf({3.f, 4.f});
  Tensor y = add(add(x, scale(x, 2.f)), scale(w, 4.f));
  const std::vector<Tensor> g = backward_to(y, Tensor::from_floats({1.f, -1.f}, {2}), {x});
  ASSERT_EQ(g.size(), 1u);
  EXPECT_EQ(g[0].to_floats(), (std::vector<float>{3.f, -3.f}));
  EXPECT_FALSE(x.grad().defined());
  EXPECT_EQ(w.grad().to_floats(), (std::vector<float>{4.f, -4.f}));
  // An input no gradient reaches comes back undefined.
  Tensor z = leaf({1.f});
  EXPECT_FALSE(backward_to(scale(z, 2.f), Tensor(), {leaf({1.f})})[0].defined());
}

TEST(Engine, AScopeThatOutgrowsItsReservedSequenceNumbersIsAnError) {
  Tensor x = leaf({1.f});
  const uint64_t first = reserve_sequence(2);
  EXPECT_THROW(
      {
        SequenceGuard sequence(first, 2);
        Tensor y = scale(scale(scale(x, 2.f), 2.f), 2.f);  // three nodes
      },
      Error);
  // Own_from without an enclosing pass is a misuse, named.
  EXPECT_THROW(backward_to(scale(x, 2.f), Tensor(), {}, first), Error);
}

}  // namespace
}  // namespace keel
