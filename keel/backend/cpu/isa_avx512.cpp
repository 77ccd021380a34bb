// The kernels compiled for AVX-512 (F, BW, VL, DQ) + FMA + F16C.
//
// Every header is included first, with the default target; only the kernel sources after the
// pragma are compiled for the ISA, inside their own namespace, so that no inline function or
// template instantiation built for AVX-512 can be picked by the linker for code running elsewhere.
#include "keel/backend/cpu/isa_common.h"

// GCC 12 reports its own intrinsics (_mm512_cvtph_ps) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define KEEL_ISA_AVX512 1
namespace keel::cpu::avx512 {
#include "keel/backend/cpu/kernels.inc"
}  // namespace keel::cpu::avx512
