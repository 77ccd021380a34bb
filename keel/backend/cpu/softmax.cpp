#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const SoftmaxKernels& softmax_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::softmax_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no softmax kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::softmax, cpu::avx2::softmax, cpu::avx512::softmax);
}

}  // namespace keel
