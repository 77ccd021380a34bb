#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"

namespace keel {

const ElementwiseKernels& elementwise_kernels(Device dev) {
  KEEL_CHECK(dev.is_cpu(), "no element-wise kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::elementwise, cpu::avx2::elementwise, cpu::avx512::elementwise);
}

}  // namespace keel
