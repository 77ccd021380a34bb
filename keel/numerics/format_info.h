// FormatInfo: the facts about a floating format that instability diagnosis needs.
#pragma once
#include "keel/numerics/dtype.h"

namespace keel {

struct FormatInfo {
  DType dtype;
  int mantissa_bits;     // stored fraction bits (23, 7, 10); significant bits = mantissa_bits + 1
  int exponent_bits;     // 8, 8, 5
  double max;            // largest finite value
  double min_normal;     // smallest positive normal
  double min_subnormal;  // smallest positive subnormal
  double epsilon;        // 2^-mantissa_bits: gap between 1 and the next value
};

// Defined for F32, BF16, F16; throws keel::Error for the integer formats.
const FormatInfo& format_info(DType dt);

}  // namespace keel
