// numerics/hash.h: splitmix64 and FNV-1a against their published reference values, and the
// identities the kernels rely on (dropout's key, the stream computed at any index).
#include "keel/numerics/hash.h"

#include <gtest/gtest.h>

#include <string>

namespace keel {
namespace {

// Vigna's splitmix64.c for seed 0: x += G; return mix64(x).
TEST(Hash, Splitmix64MatchesReferenceOutputs) {
  EXPECT_EQ(splitmix64_at(0, 0), 0xe220a8397b1dcdafull);
  EXPECT_EQ(splitmix64_at(0, 1), 0x6e789e6aa1b965f4ull);
  EXPECT_EQ(splitmix64_at(0, 2), 0x06c45d188009454full);
  EXPECT_EQ(mix64(0), 0u);  // the mixer's fixed point
  EXPECT_EQ(mix64(1), 0x5692161d100b05e5ull);
}

TEST(Hash, Splitmix64AtIsTheSequentialStream) {
  const uint64_t seed = 0x1234'5678'9abc'def0ull;
  uint64_t state = seed;
  for (uint64_t i = 0; i < 100; ++i) {
    state += kSplitmixGamma;
    EXPECT_EQ(splitmix64_at(seed, i), mix64(state)) << i;
  }
  // The counter wraps modulo 2^64 like the sequential generator.
  EXPECT_EQ(splitmix64_at(~0ull, 0), mix64(~0ull + kSplitmixGamma));
}

// Usable in constant expressions (and so in CUDA device code, where it is __host__ __device__).
static_assert(mix64(0) == 0);
static_assert(splitmix64_at(0, 0) == 0xe220a8397b1dcdafull);
static_assert(fnv1a_step(kFnvOffsetBasis, 'a') == 0xaf63dc4c8601ec8cull);

// The FNV-1a test vectors of the FNV reference (Fowler, Noll, Vo).
TEST(Hash, Fnv1aMatchesReferenceVectors) {
  EXPECT_EQ(fnv1a("", 0, kFnvOffsetBasis), kFnvOffsetBasis);
  EXPECT_EQ(fnv1a("a", 1, kFnvOffsetBasis), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a("foobar", 6, kFnvOffsetBasis), 0x85944171f73967e8ull);
  EXPECT_EQ(kFnvPrime, 1099511628211ull);
  EXPECT_EQ(kFnvOffsetBasis, 14695981039346656037ull);
}

// keel's name hashes start one digit short of the offset basis; their values are pinned.
TEST(Hash, NameHashStartIsPinned) {
  EXPECT_EQ(kNameHashStart, 1469598103934665603ull);
  EXPECT_EQ(fnv1a("a", 1, kNameHashStart), 4953267810257967366ull);
  EXPECT_EQ(fnv1a("model.layers.0", 14, kNameHashStart), 0xed9a156f97901b72ull);
}

TEST(Hash, Fnv1aContinuesAcrossCalls) {
  const std::string s = "transformer.h.0.attn.c_attn.weight";
  const uint64_t whole = fnv1a(s.data(), s.size(), kNameHashStart);
  const uint64_t split = fnv1a(s.data() + 7, s.size() - 7, fnv1a(s.data(), 7, kNameHashStart));
  EXPECT_EQ(whole, split);
  EXPECT_NE(fnv1a("ab", 2, kNameHashStart), fnv1a("ba", 2, kNameHashStart));
}

}  // namespace
}  // namespace keel
