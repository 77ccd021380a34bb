#include "keel/tensor/random.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "keel/numerics/hash.h"

namespace keel {

uint64_t mix_seed(uint64_t a, uint64_t b) { return splitmix64_at(a, b); }

uint64_t name_seed(const std::string& name) {
  return fnv1a(name.data(), name.size(), kNameHashStart);
}

Rng::Rng(uint64_t seed) {
  for (int i = 0; i < 4; ++i) s_[i] = mix_seed(seed, static_cast<uint64_t>(i));
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t Rng::next_u64() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return uniform_of(next_u64()); }
double Rng::uniform_of(uint64_t w) { return static_cast<double>(w >> 11) * 0x1.0p-53; }

double Rng::normal() {
  const uint64_t a = next_u64();
  return normal_of(a, next_u64());
}

double Rng::normal_of(uint64_t a, uint64_t b) {
  const double u1 = 1.0 - uniform_of(a), u2 = uniform_of(b);  // u1 in (0, 1]
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// The generator's words are drawn in order (a few ns each); the log, root and cosine of each value
// (~25 ns) are a pure function of its two words, so they go to threads a chunk at a time: the
// values, and every run initialized from them, are those of rng.normal() called n times.
void fill_normal(Tensor& t, Rng& rng, double mean, double stddev) {
  const int64_t n = t.numel();
  constexpr int64_t kChunk = int64_t{1} << 16;
  std::vector<float> v(static_cast<size_t>(n));
  std::vector<uint64_t> words(static_cast<size_t>(2 * std::min(n, kChunk)));
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = std::min(kChunk, n - c0);
    for (int64_t i = 0; i < 2 * m; ++i) words[i] = rng.next_u64();
#pragma omp parallel for schedule(static) if (m >= 4096 && !omp_in_parallel())
    for (int64_t i = 0; i < m; ++i)
      v[c0 + i] =
          static_cast<float>(mean + stddev * Rng::normal_of(words[2 * i], words[2 * i + 1]));
  }
  t.copy_from(Tensor::from_floats(v, t.shape()));
}

void fill_uniform(Tensor& t, Rng& rng, double lo, double hi) {
  std::vector<float> v(t.numel());
  for (auto& x : v) x = static_cast<float>(lo + (hi - lo) * rng.uniform());
  t.copy_from(Tensor::from_floats(v, t.shape()));
}

}  // namespace keel
