#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"

namespace keel {

const DropoutKernels& dropout_kernels(Device dev) {
  KEEL_CHECK(dev.is_cpu(), "no dropout kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::dropout, cpu::avx2::dropout, cpu::avx512::dropout);
}

}  // namespace keel
