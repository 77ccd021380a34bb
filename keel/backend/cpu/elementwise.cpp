#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const ElementwiseKernels& elementwise_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::elementwise_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no element-wise kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::elementwise, cpu::avx2::elementwise, cpu::avx512::elementwise);
}

}  // namespace keel
