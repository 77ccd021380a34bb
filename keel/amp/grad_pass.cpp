#include "keel/amp/grad_pass.h"

#include "keel/backend/monitor.h"
#include "keel/numerics/format_info.h"

namespace keel::amp {

GradPass grad_pass(const std::vector<Tensor>& grads, float inv_scale, DType format) {
  GradPass p;
  p.sum_squares_of.assign(grads.size(), 0.0);
  p.zero_of.assign(grads.size(), 0);
  p.below_normal_of.assign(grads.size(), 0);
  // A value v was |v| / inv_scale while the compute dtype carried it: judge it there.
  const auto normal_min =
      static_cast<float>(format_info(format).min_normal * static_cast<double>(inv_scale));
  // The gradients of one device go to its kernel in one call (one parallel loop on the CPU, one
  // kernel and one readback on a GPU); a model lives on one device, so there is one call.
  std::vector<bool> done(grads.size(), false);
  for (size_t first = 0; first < grads.size(); ++first) {
    if (done[first] || !grads[first].defined() || grads[first].numel() == 0) continue;
    const Device dev = grads[first].device();
    std::vector<void*> bufs;
    std::vector<DType> dts;
    std::vector<int64_t> ns;
    std::vector<size_t> where;  // bufs[k] is grads[where[k]]
    for (size_t i = first; i < grads.size(); ++i) {
      const Tensor& g = grads[i];
      if (done[i] || !g.defined() || g.numel() == 0 || g.device() != dev) continue;
      KEEL_CHECK(dtype_is_floating(g.dtype()), "grad_pass: floating gradient required");
      bufs.push_back(g.data()), dts.push_back(g.dtype()), ns.push_back(g.numel());
      where.push_back(i), done[i] = true;
    }
    std::vector<GradBufStats> per(bufs.size());
    const GradSetStats s = monitor_kernels(dev).unscale_norm(bufs.data(), dts.data(), ns.data(),
                                                             static_cast<int>(bufs.size()),
                                                             inv_scale, normal_min, per.data());
    p.nonfinite += s.nonfinite;
    p.sum_squares += s.sum_squares;
    for (size_t k = 0; k < per.size(); ++k) {
      p.sum_squares_of[where[k]] = per[k].sum_squares;
      p.zero_of[where[k]] = per[k].zero;
      p.below_normal_of[where[k]] = per[k].below_normal;
    }
  }
  return p;
}

}  // namespace keel::amp
