// Kernel interface: (batched) matrix multiplication with f32 accumulation.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct MatmulArgs {
  void* c = nullptr;        // [batch, M, N], dtype out_dt
  const void* a = nullptr;  // [batch, M, K], or [batch, K, M] when trans_a; dtype in_dt
  const void* b = nullptr;  // [batch, K, N], or [batch, N, K] when trans_b; dtype in_dt
  DType in_dt = DType::F32;
  DType out_dt = DType::F32;  // F32 or in_dt
  int64_t batch = 1, m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  bool accumulate = false;  // C += A·B instead of C = A·B
  // C = A·B + bias, the row `bias` [N] (dtype bias_dt) added to the f32 accumulator before the
  // one rounding to out_dt, where the table's fuses_bias says so. Not with accumulate.
  const void* bias = nullptr;
  DType bias_dt = DType::F32;
  // CPU only: C = alpha·(A·B), the f32 accumulator scaled in f32 before the one rounding to out_dt
  // (the bits of an f32 product scaled, then rounded). Not with accumulate.
  float alpha = 1.f;
};

struct MatmulKernels {
  // bf16 inputs multiply exactly and accumulate in f32; f16 inputs are converted to f32 (exact)
  // where the CPU has no f16 matmul; the result is rounded once to out_dt.
  void (*matmul)(const MatmulArgs& args);
  const char* (*describe)();  // which implementation runs (for logs and the bench)
  // Whether matmul adds this bias itself (one batch, no accumulate); otherwise the caller adds it
  // (ops::linear: an f32 product, a row add, a conversion).
  bool (*fuses_bias)(const void* bias, DType bias_dt, DType out_dt);
};

const MatmulKernels& matmul_kernels(Device dev);

// Whether this CPU's oneDNN has a matmul kernel for `in_dt` inputs (f32 always; bf16 needs
// AVX-512, f16 AVX512-FP16 or AMX-FP16). Without one every product converts its operands and
// result to f32 vectors outside host_memory (the memory estimate's matmul scratch).
bool cpu_matmul_native(DType in_dt);

}  // namespace keel
