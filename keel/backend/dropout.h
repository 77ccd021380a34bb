// Kernel interface: inverted dropout with a counter-based mask.
//
// Element i survives when the top 32 bits of hash(seed, i) are >= threshold, where hash is the
// i-th output of a splitmix64 stream keyed by seed (numerics/hash.h):
//   key = splitmix64_at(seed, 0),  hash(seed, i) = splitmix64_at(key, i)
// (splitmix64_at(s, i) = mix64(s + (i + 1) * G), G = 0x9E3779B97F4A7C15, mix64 splitmix64's
// finalizer). The drop probability is threshold / 2^32 (p < 1 keeps
// threshold below 2^32). The mask is a pure function of (seed, i): the same on every ISA, for
// every thread count, in forward and backward.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct DropoutKernels {
  // out[i] = x[i] * (keep(seed, i) ? scale : 0)   (f32 product, rounded once into dt; a NaN or
  // inf in a dropped element gives NaN, as PyTorch's x * mask does). out may alias x.
  void (*apply)(void* out, const void* x, DType dt, int64_t n, uint64_t seed, uint32_t threshold,
                float scale);
  // The same with x and out in their own dtypes (f32 opmath, one rounding into out_dt): LoRA's
  // input path in one pass (ops::dropout_cast) instead of a widening cast, a dropout in f32
  // and a narrowing cast. Not aliased. `keep`, when not null, receives the mask: bit i % 8 of
  // keep[i / 8] is set where element i survives (dropout_keep_bytes(n) bytes).
  void (*apply_cast)(void* out, DType out_dt, const void* x, DType x_dt, int64_t n, uint64_t seed,
                     uint32_t threshold, float scale, uint8_t* keep);
  // apply_cast's product with the mask apply_cast kept instead of the hash (the backward: a
  // read of n / 8 bytes where the hash is most of the kernel's time), bit for bit.
  void (*apply_kept)(void* out, DType out_dt, const void* x, DType x_dt, int64_t n,
                     const uint8_t* keep, float scale);
};

inline int64_t dropout_keep_bytes(int64_t n) { return (n + 7) / 8; }

const DropoutKernels& dropout_kernels(Device dev);

}  // namespace keel
