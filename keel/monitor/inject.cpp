#include "keel/monitor/inject.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "keel/numerics/text.h"
#include "keel/ops/elementwise.h"

namespace keel::monitor {

std::vector<std::string> similar_module_paths(nn::Module& root, const std::string& path,
                                              size_t max) {
  std::vector<std::pair<size_t, std::string>> scored;
  for (nn::Module* m : root.modules())
    if (!m->path().empty()) scored.emplace_back(edit_distance(path, m->path()), m->path());
  std::stable_sort(scored.begin(), scored.end(),
                   [](auto& a, auto& b) { return a.first < b.first; });
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < max; ++i) out.push_back(scored[i].second);
  return out;
}

FaultInjector::FaultInjector(nn::Module& root, InjectOptions opt) : opt_(std::move(opt)) {
  if (opt_.kind != "nan" && opt_.kind != "inf" && opt_.kind != "scale")
    throw Error("debug.inject.kind = \"" + opt_.kind + "\": use nan, inf or scale", Error::kUsage);
  if (opt_.kind == "scale" && !std::isfinite(opt_.factor))
    throw Error(
        "debug.inject.factor must be finite for kind = \"scale\" (use kind = \"inf\" or "
        "\"nan\" for a non-finite value)",
        Error::kUsage);
  target_ = opt_.module.empty() ? nullptr : root.find_module(opt_.module);
  if (!target_) {
    std::string msg = "debug.inject.module = \"" + opt_.module +
                      "\": no module with this path in " + root.type() + "; similar paths:";
    for (auto& p : similar_module_paths(root, opt_.module)) msg += " " + p;
    msg +=
        " (paths are the parameter names without the last component, e.g. "
        "\"transformer.h.0.attn\")";
    throw Error(msg, Error::kUsage);
  }
  hook_ = target_->add_forward_post_hook(
      [this](nn::Module& m, const std::vector<Tensor>&, Tensor& out) { corrupt(m, out); });
}

FaultInjector::~FaultInjector() {
  if (target_ && hook_) target_->remove_hook(hook_);
}

void FaultInjector::begin_step(int64_t step) { step_ = step; }

void FaultInjector::corrupt(nn::Module& m, Tensor& out) {
  if (step_ != opt_.step || opt_.step < 0 || !m.is_training()) return;
  if (!out.defined() || !dtype_is_floating(out.dtype()) || out.numel() == 0) return;
  if (opt_.kind == "scale") {
    out = ops::scale(out, static_cast<float>(opt_.factor));
  } else {
    // output + d with d = [v, 0, 0, ...]: one element becomes v, the graph stays intact.
    const float v = opt_.kind == "nan" ? std::numeric_limits<float>::quiet_NaN()
                                       : std::numeric_limits<float>::infinity();
    Tensor d = Tensor::zeros(out.shape(), out.dtype(), out.device());
    std::vector<float> first{v};
    Tensor one = Tensor::from_floats(first, {1}, out.dtype());
    d.view({-1}).slice_rows(0, 1).copy_from(one);
    out = ops::add(out, d);
  }
  // A checkpointed segment's recompute corrupts its output again (its graph must be the
  // forward's), but it is the same injection.
  if (!nn::Module::recomputing()) ++injections_;
}

}  // namespace keel::monitor
