// The kernels compiled for any x86-64 CPU (SSE2). See isa_avx512.cpp.
#include "keel/backend/cpu/isa_common.h"

// GCC 12 reports the scratch blocks of the kernels as maybe-uninitialized under sanitizers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace keel::cpu::generic {
#include "keel/backend/cpu/kernels.inc"
}  // namespace keel::cpu::generic
