// Reverse-mode autograd: nodes, the thread-local grad mode, and the hooks the tracer attaches to.
//
// Eager and define-by-run: an op computes its output at once and, when grad mode is on and an
// input requires grad, records a Node holding what its backward needs. Every node has exactly one
// output (ops with several outputs are built from single-output ones).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel {

struct Node {
  virtual ~Node() = default;
  // Gradients with respect to each input given the gradient of the output. An entry may be left
  // undefined when the input does not need one (check needs_grad(i) to skip the work).
  virtual std::vector<Tensor> backward(const Tensor& grad_output) = 0;
  virtual const char* name() const = 0;
  // Optional, for a gradient that touches few elements of a large input (an embedding's B·T rows
  // of a 50k-row table): add every input gradient straight into the sum already pending for that
  // input (`pending_sum(i)`: the total of its other contributions so far, a tensor nothing else
  // holds, or null when there is none) and return true; the engine then skips backward(), its
  // dense tensors and the passes that add them. Return false to have backward() run instead.
  using PendingSum = std::function<Tensor*(size_t input)>;
  virtual bool backward_into(const Tensor& /*grad_output*/, const PendingSum& /*pending_sum*/) {
    return false;
  }

  // A node that only runs other nodes (a checkpointed segment, which recomputes its forward and
  // backpropagates through it inside backward()): post-hooks see those nodes, never this one.
  virtual bool transparent() const { return false; }

  // Whether backward() returns its incoming gradient itself, unchanged, as its one input's
  // gradient when that gradient has dtype `dt` (a cast back to an f32 master that already is
  // f32): a buffer handed out for this node's gradient is then the input's gradient too.
  virtual bool passes_through(DType /*dt*/) const { return false; }

  // The dtype in which a consumer should produce the gradient of this node's output, whose dtype
  // is `output` (ops::grad_dtype_for): the output's own, unless the node converts the gradient
  // straight into a wider one (a narrowing cast of an f32 tensor: a matmul writes its f32
  // accumulator there, skipping a rounding to 16 bits and a conversion pass).
  virtual DType wanted_grad_dtype(DType output) const { return output; }

  // For backward(): the tensor to write input `input`'s gradient into (every element of it,
  // never accumulating) and return. When that gradient is the first one of a leaf with a
  // flat-buffer home (optim's use_flat_grads) and reaches it as it is, that is the home itself:
  // the gradient is never allocated and then copied there (GPT-2's tied 154 MB wte gradient).
  // Otherwise, and outside a backward pass, a fresh Tensor::empty(shape, dtype, device).
  Tensor grad_buffer(size_t input, const Shape& shape, DType dtype, Device device) const;

  bool needs_grad(size_t input) const { return input < next.size() && next[input] != nullptr; }

  std::vector<std::shared_ptr<Node>> next;  // per input: its grad_fn, its accumulator, or null
  uint64_t sequence_nr = 0;                 // creation order; backward runs in decreasing order
  const std::string* scope = nullptr;       // module active at creation (outlives the graph)
  DType output_dtype = DType::F32;
  Shape output_shape;
};

// The node that accumulates into a leaf's .grad.
struct AccumulateGrad final : Node {
  std::weak_ptr<TensorImpl> leaf;
  uint64_t produced_at = 0;  // see grad_production_order()
  // The leaf's grad_home holds a gradient (Node::grad_buffer) that has not reached .grad yet
  // (it waits as a pending sum, or at a pass-through node): nothing else may write there.
  bool home_live = false;
  std::vector<Tensor> backward(const Tensor& grad_output) override;
  const char* name() const override { return "AccumulateGrad"; }
};

// Grad mode: on by default, per thread.
bool grad_mode_enabled();
struct NoGradGuard {
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Turns grad mode on for a scope (a checkpointed segment's recompute runs inside backward, which
// turns it off).
struct EnableGradGuard {
  EnableGradGuard();
  ~EnableGradGuard();
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

// The module scope recorded into nodes created on this thread (set by nn::Module's call).
const std::string* current_scope();
struct ScopeGuard {
  explicit ScopeGuard(const std::string* scope);
  ~ScopeGuard();
  ScopeGuard(const ScopeGuard&) = delete;
  ScopeGuard& operator=(const ScopeGuard&) = delete;

 private:
  const std::string* prev_;
};

// True when grad mode is on and any input requires grad: the op must record a node.
bool any_requires_grad(std::initializer_list<const Tensor*> inputs);
bool any_requires_grad(std::span<const Tensor* const> inputs);  // (a count known at run time)

// True when `t` is the only handle to its data (one reference to a tensor with its own storage):
// writing into it in place changes nothing anyone else can see.
bool sole_owner(const Tensor& t);

// Wires `node` to `inputs` and makes it `out`'s grad_fn. Call only when any_requires_grad().
void record_node(Tensor& out, std::shared_ptr<Node> node,
                 std::initializer_list<const Tensor*> inputs);
void record_node(Tensor& out, std::shared_ptr<Node> node, std::span<const Tensor* const> inputs);

// Post-hooks run after a node's backward with its output gradient and the input gradients it
// produced. Hooks are per thread; the engine pays one branch when none is attached.
using NodePostHook = std::function<void(const Node& node, const Tensor& grad_output,
                                        const std::vector<Tensor>& grad_inputs)>;
int add_node_post_hook(NodePostHook hook);  // returns a handle
void remove_node_post_hook(int handle);

// Runs backward from `root` (a scalar unless `grad_root` is given), accumulating into the .grad of
// every leaf that requires grad. Grads of a leaf keep the leaf's dtype.
void backward(const Tensor& root, const Tensor& grad_root = Tensor());

// backward() that returns the gradients with respect to `inputs` (leaves that require grad: each
// gets the sum of its contributions, exactly as a non-leaf's node would receive it, and its .grad
// is left alone; undefined where no gradient reaches it) and accumulates into every other leaf.
// Called inside a node's backward (a checkpointed segment), it runs nested in the outer pass: with
// post-hooks attached, the leaves' accumulations are handed to the outer pass, which runs them
// last as one pass over the whole graph would, so that the hooks see the same sequence.
//
// `own_from` (nested passes): nodes created before this sequence number belong to the graph around
// the nested one (a weight's cast cached by an earlier micro-batch): their gradients are handed to
// the outer pass, which runs them at their place in its order, as one pass over the whole graph
// would.
std::vector<Tensor> backward_to(const Tensor& root, const Tensor& grad_root,
                                const std::vector<Tensor>& inputs, uint64_t own_from = 0);

// Sequence numbers for a graph built later: reserve_sequence(n) skips n numbers and returns the
// first; a SequenceGuard(first, n) makes the nodes created in its scope take numbers from there
// (a checkpointed segment's recompute, whose nodes then sort where the forward would have put
// them). More than n nodes in the scope is an internal error.
uint64_t reserve_sequence(uint64_t count);
struct SequenceGuard {
  SequenceGuard(uint64_t first, uint64_t count);
  ~SequenceGuard() noexcept(false);
  SequenceGuard(const SequenceGuard&) = delete;
  SequenceGuard& operator=(const SequenceGuard&) = delete;

 private:
  uint64_t prev_, end_;
};
// When backward produced `leaf`'s gradient: a per-thread count of the gradients handed to leaves,
// taken at the last contribution (a leaf reached by several edges, a tied embedding, counts when
// its last one arrives). Among the leaves of one backward, smaller = produced earlier = nearer the
// loss; a non-finite gradient produced in backward first reaches the leaves nearest its producer,
// so the non-finite gradient with the smallest order names where it came from (the model order
// would name the embedding: every gradient before it is non-finite by then). 0 when no backward
// has produced one.
uint64_t grad_production_order(const Tensor& leaf);

}  // namespace keel
