#include "keel/nn/module.h"

#include <algorithm>
#include <map>

namespace keel::nn {

void Module::assign_paths(const std::string& prefix) {
  path_ = prefix;
  for (auto& [name, t] : params_) t.set_name(prefix.empty() ? name : prefix + "." + name);
  for (auto& [name, t] : buffers_) t.set_name(prefix.empty() ? name : prefix + "." + name);
  for (auto& [name, child] : children_)
    child->assign_paths(prefix.empty() ? name : prefix + "." + name);
}

void Module::collect(const std::string& prefix, bool params, bool trainable_only,
                     std::vector<std::pair<std::string, Tensor>>& out) const {
  for (auto& [name, t] : params ? params_ : buffers_)
    if (!trainable_only || t.requires_grad()) out.emplace_back(prefix + name, t);
  for (auto& [name, child] : children_)
    child->collect(prefix + name + ".", params, trainable_only, out);
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters(bool trainable_only) const {
  std::vector<std::pair<std::string, Tensor>> out;
  collect("", true, trainable_only, out);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers() const {
  std::vector<std::pair<std::string, Tensor>> out;
  collect("", false, false, out);
  return out;
}

std::vector<Module*> Module::modules() {
  std::vector<Module*> out{this};
  for (auto& [name, child] : children_) {
    auto sub = child->modules();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

Module* Module::find_module(const std::string& path) {
  for (Module* m : modules())
    if (m->path_ == path) return m;
  return nullptr;
}

Tensor Module::find_parameter(const std::string& full_name) const {
  for (auto& [name, t] : named_parameters())
    if (name == full_name) return t;
  return Tensor();
}

int64_t Module::num_parameters(bool trainable_only) const {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters(trainable_only)) n += t.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

Tensor Module::register_parameter(const std::string& name, Tensor t, bool trainable) {
  t.set_requires_grad(trainable);
  t.set_name(name);
  params_.emplace_back(name, t);
  return t;
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  t.set_name(name);
  buffers_.emplace_back(name, t);
  return t;
}

int Module::add_forward_pre_hook(PreHook h) {
  pre_hooks_.emplace_back(next_hook_, std::move(h));
  return next_hook_++;
}

int Module::add_forward_post_hook(PostHook h) {
  post_hooks_.emplace_back(next_hook_, std::move(h));
  return next_hook_++;
}

void Module::remove_hook(int handle) {
  auto pre = std::remove_if(pre_hooks_.begin(), pre_hooks_.end(),
                            [&](auto& e) { return e.first == handle; });
  pre_hooks_.erase(pre, pre_hooks_.end());
  auto post = std::remove_if(post_hooks_.begin(), post_hooks_.end(),
                             [&](auto& e) { return e.first == handle; });
  post_hooks_.erase(post, post_hooks_.end());
}

Tensor Module::call_hooked(const std::vector<Tensor>& inputs, const std::function<Tensor()>& body) {
  // Copies: a hook may remove itself (or others) while running.
  auto pre = pre_hooks_;
  for (auto& [id, h] : pre) h(*this, inputs);
  Tensor out = body();
  auto post = post_hooks_;
  for (auto& [id, h] : post) h(*this, inputs, out);
  return out;
}

void move_to_device(Module& m, Device dev) {
  std::map<const Storage*, std::shared_ptr<Storage>> moved;
  std::vector<std::shared_ptr<Storage>> keep;  // old storages stay alive: their keys stay unique
  auto move = [&](const Tensor& t) {
    if (!t.defined() || t.device() == dev) return;
    std::shared_ptr<Storage>& st = t.impl()->storage;
    auto it = moved.find(st.get());
    if (it == moved.end()) {
      // The whole storage as bytes, so that every view into it keeps its offset.
      auto whole = std::make_shared<TensorImpl>();
      whole->storage = st;
      whole->shape = {static_cast<int64_t>(st->nbytes)};
      whole->dtype = DType::U8;
      it = moved.emplace(st.get(), Tensor(whole).to(dev).impl()->storage).first;
    }
    keep.push_back(st);
    st = it->second;
  };
  for (auto& [name, p] : m.named_parameters()) move(p);
  for (auto& [name, b] : m.named_buffers()) move(b);
}

}  // namespace keel::nn
