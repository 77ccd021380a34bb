#include <algorithm>
#include <exception>
#include <unordered_map>
#include <unordered_set>

#include "keel/autograd/node.h"
#include "keel/backend/elementwise.h"

namespace keel {

namespace {
thread_local bool t_grad_enabled = true;
thread_local uint64_t t_sequence = 0;
thread_local const std::string* t_scope = nullptr;
struct HookEntry {
  int handle;
  NodePostHook fn;
};
thread_local std::vector<HookEntry> t_hooks;
thread_local int t_next_hook = 1;
thread_local uint64_t t_produced = 0;  // gradients handed to leaves so far (grad_production_order)

// `n` (an edge's target) received a gradient contribution: when it is a leaf's accumulator, that
// leaf's gradient was produced now.
void note_produced(Node* n) {
  if (n->sequence_nr != 0) return;  // accumulators carry sequence 0, every other node more
  if (auto* acc = dynamic_cast<AccumulateGrad*>(n)) acc->produced_at = ++t_produced;
}

// a += b, both of a's dtype and shape (the sum of two gradient contributions).
void accumulate_into(Tensor& a, const Tensor& b) {
  KEEL_CHECK(a.numel() == b.numel(),
             "gradient shape mismatch " + shape_str(a.shape()) + " vs " + shape_str(b.shape()));
  Tensor bb = b.dtype() == a.dtype() ? b : b.to_dtype(a.dtype());
  elementwise_kernels(a.device()).add(a.data(), a.data(), bb.data(), a.dtype(), a.numel());
  // A write in place: whoever measured `a` before (the tracer caches statistics per tensor and
  // version) must not take the old values for the sum.
  a.bump_version();
}
}  // namespace

bool grad_mode_enabled() { return t_grad_enabled; }
NoGradGuard::NoGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = prev_; }

uint64_t reserve_sequence(uint64_t count) {
  const uint64_t first = t_sequence + 1;
  t_sequence += count;
  return first;
}
SequenceGuard::SequenceGuard(uint64_t first, uint64_t count)
    : prev_(t_sequence), end_(first + count) {
  t_sequence = first - 1;
}
SequenceGuard::~SequenceGuard() noexcept(false) {
  const bool overflowed = t_sequence >= end_;
  t_sequence = prev_;
  if (std::uncaught_exceptions() == 0)
    KEEL_CHECK(!overflowed, "a scope created more graph nodes than its reserved sequence numbers");
}

EnableGradGuard::EnableGradGuard() : prev_(t_grad_enabled) { t_grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { t_grad_enabled = prev_; }

const std::string* current_scope() { return t_scope; }
ScopeGuard::ScopeGuard(const std::string* s) : prev_(t_scope) { t_scope = s; }
ScopeGuard::~ScopeGuard() { t_scope = prev_; }

bool any_requires_grad(std::span<const Tensor* const> inputs) {
  if (!t_grad_enabled) return false;
  for (const Tensor* t : inputs)
    if (t && t->defined() && t->requires_grad()) return true;
  return false;
}
bool any_requires_grad(std::initializer_list<const Tensor*> inputs) {
  return any_requires_grad(std::span<const Tensor* const>(inputs.begin(), inputs.size()));
}

static std::shared_ptr<Node> edge_for(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return nullptr;
  if (t.grad_fn()) return t.grad_fn();
  TensorImpl* impl = t.impl();
  if (!impl->grad_accumulator) {
    auto acc = std::make_shared<AccumulateGrad>();
    acc->leaf = t.impl_ptr();
    acc->output_dtype = t.dtype();
    acc->output_shape = t.shape();
    impl->grad_accumulator = acc;
  }
  return impl->grad_accumulator;
}

void record_node(Tensor& out, std::shared_ptr<Node> node,
                 std::initializer_list<const Tensor*> inputs) {
  record_node(out, std::move(node), std::span<const Tensor* const>(inputs.begin(), inputs.size()));
}
void record_node(Tensor& out, std::shared_ptr<Node> node, std::span<const Tensor* const> inputs) {
  node->next.clear();
  for (const Tensor* t : inputs) node->next.push_back(t ? edge_for(*t) : nullptr);
  node->sequence_nr = ++t_sequence;
  node->scope = t_scope;
  node->output_dtype = out.dtype();
  node->output_shape = out.shape();
  out.impl()->grad_fn = std::move(node);
  out.impl()->requires_grad = true;
}

int add_node_post_hook(NodePostHook hook) {
  t_hooks.push_back({t_next_hook, std::move(hook)});
  return t_next_hook++;
}
void remove_node_post_hook(int handle) {
  t_hooks.erase(std::remove_if(t_hooks.begin(), t_hooks.end(),
                               [&](const HookEntry& e) { return e.handle == handle; }),
                t_hooks.end());
}

bool sole_owner(const Tensor& t) {
  return t.impl_ptr().use_count() == 1 && t.impl()->storage.use_count() == 1;
}

std::vector<Tensor> AccumulateGrad::backward(const Tensor& g) {
  auto impl = leaf.lock();
  if (!impl || !g.defined()) return {};
  Tensor& grad = impl->grad;
  const Tensor& home = impl->grad_home;
  if (home_live && g.data() == home.data()) {
    // The gradient was written in the home (Node::grad_buffer): it becomes .grad as it is.
    home_live = false;
    if (grad.defined()) {  // another pass's contribution came first: the same sum, then moved
      accumulate_into(grad, g);
      Tensor sum = grad;
      grad = home.view(impl->shape);
      grad.copy_from(sum);
    } else {
      grad = home.view(impl->shape);
    }
    grad.bump_version();
  } else if (!grad.defined() && home.defined() && !home_live) {
    // A flat gradient buffer (optim's use_flat_grads): the first contribution is copied into the
    // leaf's view of it (a copy, not 0 + g, keeps the sign of zeros), and later ones add there.
    grad = home.view(impl->shape);
    grad.copy_from(g);
    grad.bump_version();
  } else if (!grad.defined()) {
    // The first contribution becomes .grad without a copy when nothing else can see it (the
    // caller's one reference to a tensor with its own storage): a later accumulation into .grad
    // then writes memory no other gradient shares. Otherwise (add hands one tensor to both
    // inputs, a view shares its input's storage) it is copied, as before. (With a flat buffer,
    // only while the home holds another pass's pending sum; its arrival moves .grad there.)
    if (g.dtype() != impl->dtype)
      grad = g.to_dtype(impl->dtype);
    else
      grad = sole_owner(g) ? g : g.clone();
    grad = grad.view(impl->shape);
  } else {
    accumulate_into(grad, g);
  }
  return {};
}

uint64_t grad_production_order(const Tensor& leaf) {
  if (!leaf.defined() || !leaf.impl()->grad_accumulator) return 0;
  const auto* acc = dynamic_cast<const AccumulateGrad*>(leaf.impl()->grad_accumulator.get());
  return acc ? acc->produced_at : 0;
}

namespace {
struct Pending {
  Tensor grad;
  bool owned;  // false while `grad` may alias a tensor a backward formula returned elsewhere
};
// `g` is the home of accumulator `n`'s leaf, written by Node::grad_buffer and not yet in .grad.
AccumulateGrad* live_home_of(Node* n, const Tensor& g) {
  if (n->sequence_nr != 0) return nullptr;
  auto* acc = dynamic_cast<AccumulateGrad*>(n);
  if (!acc || !acc->home_live) return nullptr;
  auto impl = acc->leaf.lock();
  return impl && impl->grad_home.data() == g.data() ? acc : nullptr;
}

// One backward pass. Leaves' accumulators (sequence 0) run after every other node, in the order
// their first gradient arrived; a nested pass (a checkpointed segment's, inside its node's
// backward) hands them to the pass around it when post-hooks are attached.
struct Pass {
  std::unordered_map<Node*, Pending> pending;
  std::vector<Node*> leaves;  // accumulators with a pending gradient, in arrival order
  // Nodes a nested pass handed over (a max-heap on sequence number), run at their place in order.
  std::vector<Node*> adopted;
  std::unordered_map<Node*, int> fan_in;       // edges into each node
  std::unordered_map<Node*, size_t> captured;  // accumulators of backward_to's inputs
  uint64_t own_from = 0;
  const Node* running = nullptr;              // the node whose backward() runs now
  std::vector<AccumulateGrad*> handed_homes;  // homes grad_buffer gave `running`

  bool foreign(const Node* n) const { return n->sequence_nr != 0 && n->sequence_nr < own_from; }
  static bool later(const Node* a, const Node* b) { return a->sequence_nr < b->sequence_nr; }
  void adopt(Node* n, Tensor g) {
    add(n, std::move(g));
    adopted.push_back(n);
    std::push_heap(adopted.begin(), adopted.end(), later);
  }

  void add(Node* n, Tensor g) {
    auto p = pending.find(n);
    AccumulateGrad* home = live_home_of(n, g);
    if (p == pending.end()) {
      if (n->sequence_nr == 0) leaves.push_back(n);
      // A leaf's home holds nothing anyone else sees: later contributions add into it.
      pending.emplace(n, Pending{std::move(g), home != nullptr});
      return;
    }
    // A backward may hand the same tensor to several inputs (add does): copy before adding,
    // unless nothing else holds it by now (a tied weight's first gradient: 154 MB for GPT-2's
    // wte).
    if (!p->second.owned && !sole_owner(p->second.grad)) p->second = {p->second.grad.clone(), true};
    accumulate_into(p->second.grad, g);
    if (home) home->home_live = false;  // its values are in the sum now
  }

  // Node::grad_buffer's home for `n`'s input `i`: the leaf reached through pass-through nodes
  // alone, with no gradient yet (in .grad, in this pass, or waiting in its home from another
  // pass), whose gradient this pass hands over as it is (no post-hooks, not a backward_to input).
  Tensor home_for(const Node* n, size_t i, DType dt, int64_t numel) {
    if (n != running || !t_hooks.empty() || i >= n->next.size()) return Tensor();
    Node* nx = n->next[i].get();
    while (nx && nx->sequence_nr != 0) {  // pass-through nodes with no other gradient
      if (foreign(nx) || fan_in[nx] != 1 || !nx->passes_through(dt) || nx->next.size() != 1)
        return Tensor();
      nx = nx->next[0].get();
    }
    auto* acc = nx ? dynamic_cast<AccumulateGrad*>(nx) : nullptr;
    if (!acc || acc->home_live || captured.count(acc) || pending.count(acc)) return Tensor();
    auto impl = acc->leaf.lock();
    if (!impl || impl->grad.defined() || !impl->grad_home.defined() || impl->dtype != dt ||
        impl->grad_home.numel() != numel)
      return Tensor();
    acc->home_live = true;
    handed_homes.push_back(acc);
    return impl->grad_home;
  }
  // After `running`'s backward(): a home it did not return as a gradient holds nothing.
  void settle_homes(const Node* n, const std::vector<Tensor>& grads) {
    for (AccumulateGrad* acc : handed_homes) {
      auto impl = acc->leaf.lock();
      bool returned = false;
      for (const Tensor& g : grads)
        returned |= impl && g.defined() && g.data() == impl->grad_home.data();
      if (!returned) acc->home_live = false;
    }
    handed_homes.clear();
    if (running == n) running = nullptr;
  }
};
thread_local Pass* t_pass = nullptr;

void run_hooks(const Node& n, const Tensor& g, const std::vector<Tensor>& grads) {
  if (!t_hooks.empty() && !n.transparent())
    for (auto& h : t_hooks) h.fn(n, g, grads);
}
}  // namespace

Tensor Node::grad_buffer(size_t input, const Shape& shape, DType dtype, Device device) const {
  if (t_pass) {
    Tensor home = t_pass->home_for(this, input, dtype, shape_numel(shape));
    if (home.defined() && home.device() == device) return home.view(shape);
    KEEL_CHECK(!home.defined(), "grad_buffer: a gradient's home on another device");
  }
  return Tensor::empty(shape, dtype, device);
}

void backward(const Tensor& root, const Tensor& grad_root) { backward_to(root, grad_root, {}); }

std::vector<Tensor> backward_to(const Tensor& root, const Tensor& grad_root,
                                const std::vector<Tensor>& inputs, uint64_t own_from) {
  KEEL_CHECK(root.defined(), "backward of an undefined tensor");
  KEEL_CHECK(root.requires_grad(),
             "backward: the tensor does not require grad (was it computed under NoGradGuard, or "
             "from parameters with requires_grad = false?)");
  Tensor seed = grad_root;
  if (!seed.defined()) {
    KEEL_CHECK(root.numel() == 1, "backward: grad_root is required for a non-scalar output " +
                                      shape_str(root.shape()));
    seed = Tensor::full(root.shape(), 1.0f, root.dtype());
    if (!root.device().is_cpu()) seed = seed.to(root.device());
  }
  NoGradGuard no_grad;  // backward formulas never build graphs
  std::shared_ptr<Node> start = root.grad_fn() ? root.grad_fn() : edge_for(root);
  // The accumulators of `inputs`: their sums are returned instead of run.
  Pass pass;
  pass.own_from = own_from;
  auto& captured = pass.captured;
  for (size_t i = 0; i < inputs.size(); ++i) {
    KEEL_CHECK(!inputs[i].defined() || inputs[i].is_leaf(), "backward_to: inputs must be leaves");
    if (inputs[i].defined() && inputs[i].impl()->grad_accumulator)
      captured.emplace(inputs[i].impl()->grad_accumulator.get(), i);
  }

  // Collect reachable nodes. Creation order is a topological order of a define-by-run graph, so
  // running them in decreasing sequence number sees every consumer before its producer.
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  auto& fan_in = pass.fan_in;
  Pass* const outer = t_pass;
  KEEL_CHECK(own_from == 0 || outer, "backward_to: own_from needs an enclosing backward pass");
  auto foreign = [&](const Node* n) { return pass.foreign(n); };
  std::vector<Node*> stack{start.get()};
  seen.insert(start.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    // Accumulators run from `pass.leaves`, foreign nodes in the outer pass: neither is walked.
    if (n->sequence_nr == 0 || foreign(n)) continue;
    order.push_back(n);
    for (auto& nx : n->next) {
      if (nx) ++fan_in[nx.get()];
      if (nx && seen.insert(nx.get()).second) stack.push_back(nx.get());
    }
  }
  std::sort(order.begin(), order.end(),
            [](Node* a, Node* b) { return a->sequence_nr > b->sequence_nr; });

  struct PassScope {
    Pass* prev;
    ~PassScope() { t_pass = prev; }
  } pass_scope{outer};
  t_pass = &pass;
  pass.add(start.get(), seed);
  size_t next = 0;
  auto next_node = [&]() -> Node* {  // `order` and the adopted nodes, in decreasing sequence
    if (!pass.adopted.empty() &&
        (next == order.size() || pass.adopted.front()->sequence_nr > order[next]->sequence_nr)) {
      std::pop_heap(pass.adopted.begin(), pass.adopted.end(), Pass::later);
      Node* n = pass.adopted.back();
      pass.adopted.pop_back();
      return n;
    }
    return next < order.size() ? order[next++] : nullptr;
  };
  while (Node* n = next_node()) {
    auto it = pass.pending.find(n);
    if (it == pass.pending.end()) continue;  // no gradient flows here
    Tensor g = std::move(it->second.grad);
    pass.pending.erase(it);
    // A node may add its gradients straight into the sums pending for its inputs (a tied
    // embedding's rows into the head's dense gradient: GPT-2 124M skips a zero-filled 154 MB
    // tensor and an add over it). Not with hooks attached, which expect every gradient.
    if (t_hooks.empty() && n->backward_into(g, [&](size_t i) -> Tensor* {
          if (i >= n->next.size() || !n->next[i]) return nullptr;
          auto p = pass.pending.find(n->next[i].get());
          if (p == pass.pending.end() || (!p->second.owned && !sole_owner(p->second.grad)))
            return nullptr;
          return &p->second.grad;
        })) {
      for (auto& nx : n->next)
        if (nx) note_produced(nx.get());
      continue;
    }
    pass.running = n;
    std::vector<Tensor> grads = n->backward(g);
    pass.settle_homes(n, grads);
    run_hooks(*n, g, grads);
    // Drop this node's own handle before passing gradients on: a node that hands its incoming
    // gradient straight through (cast back to an f32 master that already is f32) then leaves the
    // receiver the sole owner, and the weight's .grad takes it without a copy (500 MB a step for
    // GPT-2 124M under bf16-mixed).
    g = Tensor();
    for (size_t i = 0; i < n->next.size() && i < grads.size(); ++i) {
      Node* nx = n->next[i].get();
      if (!nx || !grads[i].defined()) continue;
      note_produced(nx);
      // A leaf reached by a single edge gets its gradient into .grad at once instead of waiting
      // in `pending` until the end: otherwise every weight gradient of the model is alive at the
      // same time (one extra copy of all parameters at the peak). The arithmetic is the same
      // (one add into .grad); leaves with several edges (tied embeddings) still sum their
      // contributions first, and with post-hooks attached accumulators run last as before.
      if (t_hooks.empty() && nx->sequence_nr == 0 && fan_in[nx] == 1 && !captured.count(nx))
        if (auto* acc = dynamic_cast<AccumulateGrad*>(nx)) {
          acc->backward(grads[i]);
          continue;
        }
      pass.add(nx, std::move(grads[i]));
    }
  }

  // Foreign nodes, in decreasing sequence (distinct nodes: the order only fixes the heap's).
  std::vector<Node*> handed;
  for (auto& [n, p] : pass.pending)
    if (foreign(n)) handed.push_back(n);
  std::sort(handed.begin(), handed.end(), [](Node* a, Node* b) { return Pass::later(b, a); });
  for (Node* n : handed) outer->adopt(n, std::move(pass.pending.at(n).grad));
  std::vector<Tensor> result(inputs.size());
  for (Node* n : pass.leaves) {
    Pending& p = pass.pending.at(n);
    if (auto c = captured.find(n); c != captured.end()) {
      result[c->second] = std::move(p.grad);
    } else if (outer && !t_hooks.empty()) {
      outer->add(n, std::move(p.grad));
    } else {
      std::vector<Tensor> none = n->backward(p.grad);
      run_hooks(*n, p.grad, none);
    }
  }
  return result;
}

}  // namespace keel
