#include "keel/backend/cpu/isa.h"

#include <cpuid.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace keel {

// F16C (CPUID leaf 1, ECX bit 29): asked through cpuid, as clang 14's __builtin_cpu_supports does
// not know "f16c" (the fuzz build, scripts/fuzz.sh, uses clang).
static bool has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  return (ecx & (1u << 29)) != 0;
}

static CpuIsa detect() {
  __builtin_cpu_init();
  CpuIsa best = CpuIsa::Generic;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c())
    best = CpuIsa::Avx2;
  if (best == CpuIsa::Avx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    best = CpuIsa::Avx512;
  if (const char* cap = std::getenv("KEEL_CPU_ISA")) {
    CpuIsa want = best;
    if (!std::strcmp(cap, "generic")) want = CpuIsa::Generic;
    if (!std::strcmp(cap, "avx2")) want = CpuIsa::Avx2;
    if (!std::strcmp(cap, "avx512")) want = CpuIsa::Avx512;
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

static std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{static_cast<int>(detect())};
  return slot;
}

CpuIsa cpu_isa() { return static_cast<CpuIsa>(isa_slot().load(std::memory_order_relaxed)); }
void set_cpu_isa(CpuIsa isa) { isa_slot().store(static_cast<int>(isa)); }

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Generic: return "generic";
    case CpuIsa::Avx2: return "avx2";
    case CpuIsa::Avx512: return "avx512";
  }
  return "?";
}

bool cpu_has_avx512_bf16() {
  unsigned a, b, c, d;
  // CPUID leaf 7 subleaf 1, EAX bit 5: AVX512_BF16.
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
  return (a >> 5) & 1u;
}

}  // namespace keel
