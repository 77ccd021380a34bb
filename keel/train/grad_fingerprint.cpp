#include "keel/train/grad_fingerprint.h"

#include "keel/numerics/hash.h"

namespace keel {

std::string gradient_fingerprint(const std::vector<std::pair<std::string, Tensor>>& params) {
  uint64_t h = kNameHashStart;
  for (const auto& [name, p] : params) {
    if (!p.grad().defined()) continue;
    const Tensor g = p.grad().device().is_cpu() ? p.grad() : p.grad().to(Device::cpu());
    h = fnv1a(name.data(), name.size(), h);
    h = fnv1a(g.data(), g.numel() * dtype_size(g.dtype()), h);
  }
  return hash_hex(h);
}

}  // namespace keel
