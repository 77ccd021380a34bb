#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const NormKernels& norm_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::norm_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no norm kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::norm, cpu::avx2::norm, cpu::avx512::norm);
}

}  // namespace keel
