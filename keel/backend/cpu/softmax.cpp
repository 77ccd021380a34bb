#include "keel/backend/cpu/kernel_tables.h"
#include "keel/numerics/error.h"

namespace keel {

const SoftmaxKernels& softmax_kernels(Device dev) {
  KEEL_CHECK(dev.is_cpu(), "no softmax kernels for " + dev.str() + " in this build");
  return cpu::pick(cpu::generic::softmax, cpu::avx2::softmax, cpu::avx512::softmax);
}

}  // namespace keel
