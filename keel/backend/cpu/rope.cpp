#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"

namespace keel {

const RopeKernels& rope_kernels(Device dev) {
  KEEL_CHECK(dev.is_cpu(), "no rope kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::rope, cpu::avx2::rope, cpu::avx512::rope);
}

}  // namespace keel
