#include "keel/monitor/grad_norms.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "keel/backend/monitor.h"
#include "keel/numerics/error.h"

namespace keel::monitor {

std::string grad_norm_block(const std::string& name) {
  // Split into components; drop the parameter's own name (the last one).
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t i = 0; i <= name.size(); ++i)
    if (i == name.size() || name[i] == '.') {
      parts.push_back(name.substr(start, i - start));
      start = i + 1;
    }
  if (parts.size() > 1) parts.pop_back();
  std::string block;
  for (const std::string& p : parts) {
    block += block.empty() ? p : "." + p;
    const bool numeric = !p.empty() && std::all_of(p.begin(), p.end(),
                                                   [](unsigned char c) { return std::isdigit(c); });
    if (numeric) break;
  }
  return block;
}

std::vector<BlockGradNorm> per_layer_grad_norms(
    const std::vector<std::pair<std::string, Tensor>>& params, const amp::GradPass* pass,
    const std::vector<int64_t>* unselected) {
  std::vector<Tensor> grads;
  for (const auto& [name, p] : params) grads.push_back(p.grad());
  const amp::GradPass own = pass ? amp::GradPass{} : amp::grad_pass(grads);
  if (!pass) pass = &own;
  KEEL_CHECK(pass->sum_squares_of.size() == grads.size(),
             "per_layer_grad_norms: the pass is not over these parameters' gradients");
  std::vector<BlockGradNorm> out;
  std::vector<double> sums;
  for (size_t k = 0; k < params.size(); ++k) {
    const Tensor& g = grads[k];
    if (!g.defined() || g.numel() == 0) continue;
    const std::string block = grad_norm_block(params[k].first);
    size_t i = 0;
    while (i < out.size() && out[i].block != block) ++i;  // a few dozen blocks: linear is fine
    if (i == out.size()) {
      out.push_back({block});
      sums.push_back(0);
    }
    sums[i] += pass->sum_squares_of[k];
    // Unselected rows are among the zeros the pass counted (a gradient never touched them).
    const int64_t skip =
        unselected && k < unselected->size() ? std::min((*unselected)[k], pass->zero_of[k]) : 0;
    out[i].count += g.numel() - skip;
    out[i].zero += pass->zero_of[k] - skip;
    out[i].below_normal += pass->below_normal_of[k];
  }
  for (size_t i = 0; i < out.size(); ++i) out[i].norm = std::sqrt(sums[i]);
  return out;
}

LargestWeight largest_weight(const std::vector<std::pair<std::string, Tensor>>& params) {
  LargestWeight out;
  for (const auto& [name, p] : params)
    if (const double m =
            monitor_kernels(p.device()).stats(p.data(), p.dtype(), p.numel(), p.dtype()).abs_max;
        m > out.value) {
      out.value = m;
      out.param = name;
    }
  return out;
}

}  // namespace keel::monitor
