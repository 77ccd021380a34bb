#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const DropoutKernels& dropout_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::dropout_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no dropout kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::dropout, cpu::avx2::dropout, cpu::avx512::dropout);
}

}  // namespace keel
