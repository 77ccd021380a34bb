// Module: a tree of named parameters, buffers and children with forward pre/post hooks — the only
// instrumentation points of a model (the tracer, NaN capture and fault injection attach here).
//
// Parameters are Tensor handles shared between the module's members and the registry; they are
// never reassigned: loading copies into them, dtype changes rewrite the shared TensorImpl, so
// every holder sees the same parameter.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "keel/autograd/node.h"
#include "keel/tensor/tensor.h"

namespace keel::nn {

class Module {
 public:
  explicit Module(std::string type) : type_(std::move(type)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& type() const { return type_; }
  // Dotted path from the root ("transformer.h.0.attn"); "" for the root. Set by assign_paths().
  const std::string& path() const { return path_; }
  // Names every module and parameter from this root down; call once the tree is built.
  void assign_paths(const std::string& prefix = "");

  // Full names ("transformer.h.0.attn.c_attn.weight"), in registration order, depth first.
  std::vector<std::pair<std::string, Tensor>> named_parameters(bool trainable_only = false) const;
  std::vector<std::pair<std::string, Tensor>> named_buffers() const;
  std::vector<Module*> modules();  // pre-order, this first
  Module* find_module(const std::string& path);
  Tensor find_parameter(const std::string& full_name) const;  // undefined if absent
  int64_t num_parameters(bool trainable_only = false) const;

  void train(bool on = true);
  bool is_training() const { return training_; }

  // Hooks. A post hook may replace the output (fault injection does); inputs are what the module
  // received. Handles are unique per module.
  using PreHook = std::function<void(Module&, const std::vector<Tensor>& inputs)>;
  using PostHook = std::function<void(Module&, const std::vector<Tensor>& inputs, Tensor& output)>;
  int add_forward_pre_hook(PreHook h);
  int add_forward_post_hook(PostHook h);
  void remove_hook(int handle);
  bool has_hooks() const { return !pre_hooks_.empty() || !post_hooks_.empty(); }
  // True while a checkpointed segment's forward is recomputed inside backward (nn/checkpoint.h).
  // Hooks run for that second call of every module in the segment: a hook that records must
  // ignore it (the forward already ran, and was recorded, once); a hook that changes the output
  // must change it again, the same way, so that the recomputed graph is the forward's.
  static bool recomputing();

  // Parameters of this module only (not children).
  const std::vector<std::pair<std::string, Tensor>>& local_parameters() const { return params_; }
  const std::vector<std::pair<std::string, std::unique_ptr<Module>>>& children() const {
    return children_;
  }

 protected:
  Tensor register_parameter(const std::string& name, Tensor t, bool trainable = true);
  Tensor register_buffer(const std::string& name, Tensor t);
  template <class M>
  M* register_module(const std::string& name, std::unique_ptr<M> m) {
    M* raw = m.get();
    children_.emplace_back(name, std::move(m));
    return raw;
  }

  // Runs `body` as this module's forward: nodes it creates are attributed to this module, and
  // the hooks run around it. One branch when no hook is attached.
  template <class F>
  Tensor call(std::initializer_list<Tensor> inputs, F&& body) {
    ScopeGuard scope(&path_);
    if (!has_hooks()) return body();
    return call_hooked(std::vector<Tensor>(inputs), std::function<Tensor()>(body));
  }

 private:
  Tensor call_hooked(const std::vector<Tensor>& inputs, const std::function<Tensor()>& body);
  void collect(const std::string& prefix, bool params, bool trainable_only,
               std::vector<std::pair<std::string, Tensor>>& out) const;

  std::string type_, path_;
  bool training_ = true;
  std::vector<std::pair<std::string, Tensor>> params_, buffers_;
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> children_;
  std::vector<std::pair<int, PreHook>> pre_hooks_;
  std::vector<std::pair<int, PostHook>> post_hooks_;
  int next_hook_ = 1;
};

// Moves every parameter and buffer of `m` to `dev` in place: each tensor keeps its TensorImpl
// (handles held elsewhere, e.g. by an optimizer, see the move) and tensors that shared a storage
// (tied weights, views) still share one afterwards.
void move_to_device(Module& m, Device dev);

}  // namespace keel::nn
