#include "keel/backend/attention.h"

#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

const AttentionKernels& attention_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::attention_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no attention kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::attention, cpu::avx2::attention, cpu::avx512::attention);
}

}  // namespace keel
