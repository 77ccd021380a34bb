#include "keel/amp/grad_pass.h"

#include "keel/backend/monitor.h"
#include "keel/numerics/format_info.h"

namespace keel::amp {

GradPass grad_pass(const std::vector<Tensor>& grads, float inv_scale, DType format) {
  GradPass p;
  std::vector<void*> bufs;  // gradients on a GPU: one fused pass over all of them
  std::vector<DType> dts;
  std::vector<int64_t> ns;
  std::vector<size_t> where;  // bufs[k] is grads[where[k]]
  Device dev;
  p.sum_squares_of.assign(grads.size(), 0.0);
  p.zero_of.assign(grads.size(), 0);
  p.below_normal_of.assign(grads.size(), 0);
  // A value v was |v| / inv_scale while the compute dtype carried it: judge it there.
  const auto normal_min =
      static_cast<float>(format_info(format).min_normal * static_cast<double>(inv_scale));
  auto keep = [&](size_t i, const GradBufStats& b) {
    p.sum_squares_of[i] = b.sum_squares;
    p.zero_of[i] = b.zero;
    p.below_normal_of[i] = b.below_normal;
  };
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined() || g.numel() == 0) continue;
    KEEL_CHECK(dtype_is_floating(g.dtype()), "grad_pass: floating gradient required");
    void* data = g.data();
    if (g.device().is_cuda() && (bufs.empty() || g.device() == dev)) {
      dev = g.device();
      bufs.push_back(data), dts.push_back(g.dtype()), ns.push_back(g.numel()), where.push_back(i);
      continue;
    }
    const DType dt = g.dtype();
    const int64_t n = g.numel();
    GradBufStats b;
    const GradSetStats s =
        monitor_kernels(g.device()).unscale_norm(&data, &dt, &n, 1, inv_scale, normal_min, &b);
    p.nonfinite += s.nonfinite;
    keep(i, b);
    p.sum_squares += s.sum_squares;
  }
  if (!bufs.empty()) {
    std::vector<GradBufStats> per(bufs.size());
    const GradSetStats s = monitor_kernels(dev).unscale_norm(bufs.data(), dts.data(), ns.data(),
                                                             static_cast<int>(bufs.size()),
                                                             inv_scale, normal_min, per.data());
    p.nonfinite += s.nonfinite;
    p.sum_squares += s.sum_squares;
    for (size_t k = 0; k < per.size(); ++k) keep(where[k], per[k]);
  }
  return p;
}

}  // namespace keel::amp
