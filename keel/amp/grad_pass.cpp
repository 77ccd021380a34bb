#include "keel/amp/grad_pass.h"

#include "keel/backend/monitor.h"

namespace keel::amp {

GradPass grad_pass(const std::vector<Tensor>& grads, float inv_scale) {
  GradPass p;
  std::vector<void*> bufs;  // gradients on a GPU: one fused pass over all of them
  std::vector<DType> dts;
  std::vector<int64_t> ns;
  Device dev;
  p.sum_squares_of.assign(grads.size(), 0.0);
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined() || g.numel() == 0) continue;
    KEEL_CHECK(dtype_is_floating(g.dtype()), "grad_pass: floating gradient required");
    void* data = g.data();
    if (g.device().is_cuda() && (bufs.empty() || g.device() == dev)) {
      dev = g.device();
      bufs.push_back(data), dts.push_back(g.dtype()), ns.push_back(g.numel());
      continue;
    }
    const DType dt = g.dtype();
    const int64_t n = g.numel();
    const GradSetStats s = monitor_kernels(g.device()).unscale_norm(&data, &dt, &n, 1, inv_scale);
    p.nonfinite += s.nonfinite;
    p.sum_squares_of[i] = s.sum_squares;
    p.sum_squares += s.sum_squares;
  }
  if (!bufs.empty()) {
    const GradSetStats s = monitor_kernels(dev).unscale_norm(
        bufs.data(), dts.data(), ns.data(), static_cast<int>(bufs.size()), inv_scale);
    p.nonfinite += s.nonfinite;
    p.sum_squares += s.sum_squares;
    p.sum_squares_of.clear();
  }
  return p;
}

double grad_sum_squares(const GradPass& pass, const std::vector<Tensor>& grads, size_t i) {
  if (i < pass.sum_squares_of.size()) return pass.sum_squares_of[i];
  return grad_pass({grads[i]}).sum_squares;
}

}  // namespace keel::amp
