#include "keel/tensor/random.h"

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

double Rng::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

double Rng::normal() {
  const double u1 = 1.0 - uniform(), u2 = uniform();  // u1 in (0, 1]
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

void fill_normal(Tensor& t, Rng& rng, double mean, double stddev) {
  std::vector<float> v(t.numel());
  for (auto& x : v) x = static_cast<float>(mean + stddev * rng.normal());
  t.copy_from(Tensor::from_floats(v, t.shape()));
}

void fill_uniform(Tensor& t, Rng& rng, double lo, double hi) {
  std::vector<float> v(t.numel());
  for (auto& x : v) x = static_cast<float>(lo + (hi - lo) * rng.uniform());
  t.copy_from(Tensor::from_floats(v, t.shape()));
}

}  // namespace keel
