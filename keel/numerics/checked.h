// Checked size arithmetic: every size that comes from input (a file header, a config key, a
// tokenizer table) is multiplied with these, so that an absurd size is an error naming what it
// was computing instead of a wrapped product that allocates too little or segfaults.
#pragma once
#include <cstdint>
#include <string>

#include "keel/numerics/error.h"

namespace keel {

// a * b for non-negative sizes; an Error "WHAT: A x B overflows int64" when it does not fit.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r))
    throw Error(std::string(what) + ": " + std::to_string(a) + " x " + std::to_string(b) +
                " is negative or does not fit in 64 bits");
  return r;
}

}  // namespace keel
