// The data layer's fixed 64-bit RNG: SplitMix64 (Steele, Lea, Flood 2014), the generator Java's
// SplittableRandom and xoshiro's seeding use. It is pinned (tests check its first outputs) because
// a checkpoint resumes the data order from (seed, epoch, index) alone: a different generator would
// silently change which examples a resumed run sees.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "keel/numerics/hash.h"

namespace keel::data {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() { return mix64(state_ += kSplitmixGamma); }
  // Uniform in [0, n), n >= 1, without modulo bias: draws below 2^64 mod n are rejected so that
  // the accepted range is a multiple of n.
  uint64_t below(uint64_t n) {
    const uint64_t reject_under = (0 - n) % n;  // = 2^64 mod n
    uint64_t r;
    do r = next();
    while (r < reject_under);
    return r % n;
  }

 private:
  uint64_t state_;
};

// Fisher-Yates (Durstenfeld): i from the end, swap with a uniform j in [0, i].
template <class T>
void shuffle_in_place(std::vector<T>& v, SplitMix64& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.below(i)]);
}

}  // namespace keel::data
