#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"

namespace keel {

const ActivationKernels& activation_kernels(Device dev) {
  KEEL_CHECK(dev.is_cpu(), "no activation kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::activation, cpu::avx2::activation, cpu::avx512::activation);
}

}  // namespace keel
