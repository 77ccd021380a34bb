#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"

namespace keel {

const CrossEntropyKernels& cross_entropy_kernels(Device dev) {
  KEEL_CHECK(dev.is_cpu(), "no cross-entropy kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::cross_entropy, cpu::avx2::cross_entropy,
                   cpu::avx512::cross_entropy);
}

}  // namespace keel
