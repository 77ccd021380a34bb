// A fingerprint of a step's gradients: replay compares it with the one a NaN capture recorded, so
// that bit-exactness covers the whole backward, not only a loss that may be NaN. The trainer takes
// it of a rank's own gradients before the all-reduce (what one rank's replay reproduces), the
// capture of the gradients it stopped on.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel {

// FNV-1a (64 bits, hex) over the names and raw bytes of every defined gradient, in order.
std::string gradient_fingerprint(const std::vector<std::pair<std::string, Tensor>>& params);

}  // namespace keel
