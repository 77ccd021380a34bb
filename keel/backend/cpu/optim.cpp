#include "keel/backend/optim.h"

#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const OptimKernels& optim_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::optim_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no optimizer kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::optim, cpu::avx2::optim, cpu::avx512::optim);
}

}  // namespace keel
