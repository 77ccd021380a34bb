#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const ActivationKernels& activation_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::activation_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no activation kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::activation, cpu::avx2::activation, cpu::avx512::activation);
}

}  // namespace keel
