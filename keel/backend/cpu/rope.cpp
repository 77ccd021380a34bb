#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const RopeKernels& rope_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::rope_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no rope kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::rope, cpu::avx2::rope, cpu::avx512::rope);
}

}  // namespace keel
