#include "keel/train/grad_fingerprint.h"

#include <cstdio>

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
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace keel
