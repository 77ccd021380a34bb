// The toolkit passes: the kernels of monitor.inc for the running ISA, or CUDA's.
#include "keel/backend/monitor.h"

#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const MonitorKernels& monitor_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::monitor_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no monitor kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::monitor, cpu::avx2::monitor, cpu::avx512::monitor);
}

}  // namespace keel
