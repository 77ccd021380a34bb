// Runtime CPU-feature dispatch. Kernels are compiled once per ISA level (isa_*.cpp include the
// same *.inc sources under different -m flags); the level is detected once at startup.
#pragma once

namespace keel {

enum class CpuIsa { Generic, Avx2, Avx512 };

// The level kernels run at: the best the CPU supports, capped by KEEL_CPU_ISA=generic|avx2|avx512.
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);
// Tests switch levels to check that every variant computes the same bits.
void set_cpu_isa(CpuIsa isa);
// True when the CPU has native bf16 dot products (AVX512_BF16).
bool cpu_has_avx512_bf16();

}  // namespace keel
