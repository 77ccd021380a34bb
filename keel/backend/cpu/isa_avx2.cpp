// The kernels compiled for AVX2 + FMA + F16C. See isa_avx512.cpp.
#include "keel/backend/cpu/isa_common.h"

// GCC 12 reports its own intrinsics (_mm512_cvtph_ps) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx2,fma,f16c")
#define KEEL_ISA_AVX2 1
namespace keel::cpu::avx2 {
#include "keel/backend/cpu/kernels.inc"
}  // namespace keel::cpu::avx2
