// The two integer hashes keel is built on, in one place for host and CUDA device code.
//
// splitmix64 (Steele, Lea, Flood 2014): its output function mix64 is a bijective 64-bit mixer,
// and mix64(seed + (i + 1) * kSplitmixGamma) is the counter-based stream behind dropout masks,
// stochastic rounding, the data order and tensor/random's seeds. FNV-1a: an order-sensitive
// byte hash for names and fingerprints. Both are pinned: dropout masks, initial adapter weights,
// the data order of a resumed run and the captures replayed from them depend on these values.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#if defined(__CUDACC__)
#define KEEL_HOST_DEVICE __host__ __device__
#else
#define KEEL_HOST_DEVICE
#endif

namespace keel {

// The golden-ratio increment of splitmix64's counter (2^64 / phi, odd).
inline constexpr uint64_t kSplitmixGamma = 0x9E3779B97F4A7C15ull;

// splitmix64's output function (variant 13 of Stafford's mixers).
KEEL_HOST_DEVICE constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element i of the counter-based stream keyed by `seed`: the (i + 1)-th output of a splitmix64
// generator started at `seed`, computed without the i outputs before it.
KEEL_HOST_DEVICE constexpr uint64_t splitmix64_at(uint64_t seed, uint64_t i) {
  return mix64(seed + (i + 1) * kSplitmixGamma);
}

// FNV-1a, 64-bit.
inline constexpr uint64_t kFnvPrime = 0x100000001b3ull;             // 1099511628211
inline constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ull;  // 14695981039346656037
// The start value of keel's name seeds and gradient fingerprints: FNV's offset basis short of its
// last digit (1469598103934665603 instead of 14695981039346656037). Kept as it is, see
// tensor/random.h's name_seed.
inline constexpr uint64_t kNameHashStart = 1469598103934665603ull;

// One FNV-1a step: xor a value (a byte, or a whole 64-bit word) in, multiply by the prime.
KEEL_HOST_DEVICE constexpr uint64_t fnv1a_step(uint64_t h, uint64_t v) {
  return (h ^ v) * kFnvPrime;
}

// FNV-1a over `n` bytes, continuing from `h`.
inline uint64_t fnv1a(const void* data, size_t n, uint64_t h) {
  const auto* b = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = fnv1a_step(h, b[i]);
  return h;
}

// A 64-bit hash as 16 lower-case hex digits (how fingerprints are written into JSON files).
inline std::string hash_hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace keel
