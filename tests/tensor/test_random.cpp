// The seeds every random choice derives from: they must not change between runs, builds or
// machines, or a replay would draw other dropout masks and adapters other initial weights.
#include <gtest/gtest.h>

#include <set>

#include "keel/tensor/random.h"

namespace keel {
namespace {

TEST(Random, NameSeedKeepsItsValues) {
  // Pinned: FNV-1a's loop and prime from 1469598103934665603 (random.h says why not FNV's basis).
  EXPECT_EQ(name_seed(""), 1469598103934665603ull);
  EXPECT_EQ(name_seed("a"), 4953267810257967366ull);
  EXPECT_EQ(name_seed("foobar"), 9870438755804841970ull);
  EXPECT_NE(name_seed("h.0.mlp.dropout"), name_seed("h.1.mlp.dropout"));
}

TEST(Random, MixSeedIsSplitmix64AndSeparatesStreams) {
  EXPECT_EQ(mix_seed(0, 0), mix_seed(0));
  std::set<uint64_t> seen;
  for (uint64_t a = 0; a < 16; ++a)
    for (uint64_t b = 0; b < 16; ++b) seen.insert(mix_seed(a, b));
  EXPECT_EQ(seen.size(), 256u);
}

TEST(Random, RngIsDeterministicPerSeed) {
  Rng a(42), b(42), c(43);
  bool differs = false;
  for (int i = 0; i < 1000; ++i) {
    const double u = a.uniform();
    EXPECT_EQ(u, b.uniform());
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
    differs |= u != c.uniform();
  }
  EXPECT_TRUE(differs);
}

}  // namespace
}  // namespace keel
