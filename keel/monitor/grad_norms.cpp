#include "keel/monitor/grad_norms.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "keel/backend/elementwise.h"

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
    const std::vector<std::pair<std::string, Tensor>>& params) {
  std::vector<BlockGradNorm> out;
  std::vector<double> sums;
  for (const auto& [name, p] : params) {
    const Tensor& g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    KEEL_CHECK(dtype_is_floating(g.dtype()), "per_layer_grad_norms: floating gradient required");
    const double ss = elementwise_kernels(g.device()).sum_squares(g.data(), g.dtype(), g.numel());
    const std::string block = grad_norm_block(name);
    size_t i = 0;
    while (i < out.size() && out[i].block != block) ++i;  // a few dozen blocks: linear is fine
    if (i == out.size()) {
      out.push_back({block, 0});
      sums.push_back(0);
    }
    sums[i] += ss;
  }
  for (size_t i = 0; i < out.size(); ++i) out[i].norm = std::sqrt(sums[i]);
  return out;
}

}  // namespace keel::monitor
