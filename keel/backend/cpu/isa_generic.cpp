// The kernels compiled for any x86-64 CPU (SSE2). See isa_avx512.cpp.
#include "keel/backend/cpu/isa_common.h"

namespace keel::cpu::generic {
#include "keel/backend/cpu/kernels.inc"
}  // namespace keel::cpu::generic
