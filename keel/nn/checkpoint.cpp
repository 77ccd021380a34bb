#include "keel/nn/checkpoint.h"

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/nn/layers.h"
#include "keel/nn/module.h"

namespace keel::nn {

namespace {
thread_local bool t_recomputing = false;

// Sequence numbers reserved per segment for its recomputed nodes (a block makes about a hundred;
// 2^24 leave 2^40 segments before the 64-bit counter wraps).
constexpr uint64_t kSequenceSpan = uint64_t{1} << 24;

// What the forward ran under, restored around the recompute: everything a segment's forward reads
// besides its input and parameters.
struct ForwardState {
  bool autocast = false;
  DType compute_dtype = DType::BF16;
  uint64_t dropout_seed = 0;
  const std::string* scope = nullptr;

  static ForwardState current() {
    return {amp::autocast_enabled(), amp::autocast_dtype(), Dropout::step_seed(), current_scope()};
  }
};

// Marks the recompute (Module::recomputing()) and restores the forward's dropout step seed.
struct Recomputing {
  explicit Recomputing(uint64_t seed) : prev_seed(Dropout::step_seed()), prev(t_recomputing) {
    Dropout::set_step_seed(seed);
    t_recomputing = true;
  }
  ~Recomputing() {
    Dropout::set_step_seed(prev_seed);
    t_recomputing = prev;
  }
  Recomputing(const Recomputing&) = delete;
  Recomputing& operator=(const Recomputing&) = delete;
  uint64_t prev_seed;
  bool prev;
};

// A second handle to x's values with no history: the recompute's leaf.
Tensor detached(const Tensor& x) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = x.impl()->storage;
  impl->offset = x.impl()->offset;
  impl->shape = x.shape();
  impl->dtype = x.dtype();
  impl->version = x.version();
  impl->name = x.impl()->name;
  Tensor d(impl);
  d.set_requires_grad(x.requires_grad());
  return d;
}

struct CheckpointNode final : Node {
  Segment segment;
  Tensor input;  // what the segment keeps between its forward and its backward
  ForwardState state;
  uint64_t first_sequence = 0;  // the numbers the forward's nodes would have had

  std::vector<Tensor> backward(const Tensor& grad_output) override {
    Tensor x = detached(input);
    Tensor out;
    {
      EnableGradGuard grad;  // backward runs with grad mode off
      amp::AutocastGuard autocast(state.autocast, state.compute_dtype);
      ScopeGuard scope(state.scope);
      Recomputing recomputing(state.dropout_seed);
      SequenceGuard sequence(first_sequence, kSequenceSpan);
      out = segment(x);
    }
    if (!out.requires_grad()) return {Tensor()};
    // Nested in the pass that called us: parameters' gradients accumulate as one pass would, x's
    // sum comes back, and the recomputed graph is freed when `out` goes.
    return backward_to(out, grad_output, {x}, first_sequence);
  }
  const char* name() const override { return "checkpoint"; }
  bool transparent() const override { return true; }
};
}  // namespace

bool Module::recomputing() { return t_recomputing; }

Tensor checkpoint(Segment segment, const Tensor& x, bool trainable) {
  if (!grad_mode_enabled() || !(trainable || x.requires_grad())) return segment(x);
  auto node = std::make_shared<CheckpointNode>();
  node->state = ForwardState::current();
  node->first_sequence = reserve_sequence(kSequenceSpan);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = segment(x);
  }
  node->segment = std::move(segment);
  node->input = x;
  record_node(out, node, {&x});
  return out;
}

}  // namespace keel::nn
