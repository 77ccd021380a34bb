// The toolkit passes on the CPU, composed from the element-wise and optimizer kernels (which
// already run in fixed blocks across threads) and numerics' tensor_stats.
#include "keel/backend/monitor.h"

#include "keel/backend/elementwise.h"
#include "keel/backend/optim.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

namespace {

GradSetStats unscale_norm(void* const* bufs, const DType* dts, const int64_t* ns, int count,
                          float inv_scale) {
  GradSetStats s;
  const auto& opt = optim_kernels(Device::cpu());
  const auto& ew = elementwise_kernels(Device::cpu());
  for (int i = 0; i < count; ++i) {
    // Without a scale to apply the values are only read once, by the sum: a non-finite one shows
    // there (MonitorKernels::unscale_norm).
    if (inv_scale != 1.f) s.nonfinite += opt.unscale(bufs[i], dts[i], ns[i], inv_scale);
    s.sum_squares += ew.sum_squares(bufs[i], dts[i], ns[i]);
  }
  return s;
}

TensorStats stats(const void* data, DType dt, int64_t n, DType fmt) {
  return tensor_stats(data, dt, n, fmt);
}

const MonitorKernels kCpuMonitor = {unscale_norm, stats};

}  // namespace

const MonitorKernels& monitor_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::monitor_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no monitor kernels for " + dev.str() + " in this build");
  return kCpuMonitor;
}

}  // namespace keel
