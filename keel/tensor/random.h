// Rng: a small, fast, serializable generator (xoshiro256**, seeded through splitmix64). Its whole
// state is four words, so a checkpoint or a NaN capture stores it and a replay restores it exactly.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "keel/tensor/tensor.h"

namespace keel {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0);
  uint64_t next_u64();
  double uniform();  // [0, 1)
  double normal();   // standard normal (Box-Muller, one value per call, deterministic)
  // The value normal() gives when its two draws are a and b (fill_normal spreads these over
  // threads after drawing the words in order).
  static double normal_of(uint64_t a, uint64_t b);
  static double uniform_of(uint64_t w);  // the value uniform() gives when its draw is w
  std::array<uint64_t, 4> state() const { return s_; }
  void set_state(const std::array<uint64_t, 4>& s) { s_ = s; }

 private:
  std::array<uint64_t, 4> s_;
};

// splitmix64: the mixing function used to derive independent seeds (e.g. per step, per module).
uint64_t mix_seed(uint64_t a, uint64_t b = 0);
// A seed that depends on a name (a module's path) and nothing else, for dropout masks and adapter
// initialization: FNV-1a's loop and prime, with 1469598103934665603 as its start, FNV's published
// offset basis short of its last digit. Kept as it is: every run's dropout masks and initial
// adapter weights, and the captures replayed from them, depend on these values.
uint64_t name_seed(const std::string& name);

// In-place fills of a floating tensor (values generated in f32, rounded into its dtype).
void fill_normal(Tensor& t, Rng& rng, double mean, double stddev);
void fill_uniform(Tensor& t, Rng& rng, double lo, double hi);

}  // namespace keel
