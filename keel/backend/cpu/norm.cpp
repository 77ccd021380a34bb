#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"

namespace keel {

const NormKernels& norm_kernels(Device dev) {
  KEEL_CHECK(dev.is_cpu(), "no norm kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::norm, cpu::avx2::norm, cpu::avx512::norm);
}

}  // namespace keel
