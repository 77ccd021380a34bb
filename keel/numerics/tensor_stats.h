// TensorStats: what a tracer needs to know about a buffer of values in a given format, gathered
// in one pass. Used by the underflow/overflow tracer, the doctor and the numerics explainer.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"

namespace keel {

struct TensorStats {
  int64_t count = 0;
  int64_t nan = 0;
  int64_t inf = 0;
  int64_t zero = 0;
  int64_t subnormal = 0;  // nonzero values below the format's min normal (f32 view of the value)
  int64_t near_max = 0;   // finite values whose magnitude is within 2x of the format's max
  double abs_min = 0;     // over finite values (0 if none); zeros count, as in HF's tracer
  double abs_max = 0;     // over finite values
  // log2(format max / abs_max): how many doublings are left before overflow (inf if abs_max == 0).
  double headroom_bits = 0;

  bool all_finite() const { return nan == 0 && inf == 0; }
};

// `data` holds `n` elements stored as `dt`; the subnormal/near-max thresholds are those of `fmt`
// (normally the same as dt; a tracer may ask "how would these f32 values fare in f16?").
TensorStats tensor_stats(const void* data, DType dt, int64_t n, DType fmt);
inline TensorStats tensor_stats(const void* data, DType dt, int64_t n) {
  return tensor_stats(data, dt, n, dt);
}

}  // namespace keel
