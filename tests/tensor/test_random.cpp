// The seeds every random choice derives from: they must not change between runs, builds or
// machines, or a replay would draw other dropout masks and adapters other initial weights.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "keel/tensor/random.h"
#include "tests/support/check.h"

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

// fill_normal draws its words in order and spreads the Box-Muller arithmetic over threads: the
// values are rng.normal()'s, called once per element, at any thread count and over several chunks
// (a partial last one); the generator ends where those calls leave it; and the first values of
// seed 0 keep their bits (every from-scratch run's initial weights).
TEST(Random, FillNormalIsNormalCalledInOrderAtAnyThreadCount) {
  const int64_t n = (int64_t{1} << 17) + 4099;
  for (int threads : {1, 3}) {
    test::ThreadsGuard guard(threads);
    Rng seq(7), filled(7);
    Tensor t = Tensor::empty({n}, DType::F32);
    fill_normal(t, filled, 0.5, 0.02);
    const std::vector<float> v = t.to_floats();
    for (int64_t i = 0; i < n; ++i) {
      const float want = static_cast<float>(0.5 + 0.02 * seq.normal());
      if (v[i] != want) {
        ADD_FAILURE() << threads << " threads: element " << i << " is " << v[i] << ", not " << want;
        break;
      }
    }
    EXPECT_EQ(filled.state(), seq.state()) << threads << " threads";
  }
  Rng r(0);
  EXPECT_EQ(r.normal(), -0x1.36b8ef9b1343ep-6);
  EXPECT_EQ(r.normal(), -0x1.9d69103227bc6p-2);
}

}  // namespace
}  // namespace keel
