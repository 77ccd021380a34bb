#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const CrossEntropyKernels& cross_entropy_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::cross_entropy_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no cross-entropy kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::cross_entropy, cpu::avx2::cross_entropy,
                   cpu::avx512::cross_entropy);
}

}  // namespace keel
