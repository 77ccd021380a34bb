// The numerics explainer behind `keel numerics`: format tables, what a value becomes in a format,
// and how a GradScaler backs off for a given gradient. Pure functions returning text and facts.
#pragma once
#include <string>
#include <vector>

#include "keel/amp/grad_scaler.h"
#include "keel/numerics/dtype.h"

namespace keel::monitor {

// A table of max, min normal, min subnormal, epsilon and significant bits for f32, bf16, f16.
std::string format_table();

struct CastReport {
  double input = 0;
  double stored = 0;  // the value the format holds
  uint32_t bits = 0;  // its bit pattern
  // "exact", "rounded", "underflow" (nonzero became 0), "subnormal" (kept with reduced
  // precision), "overflow" (finite became inf), "nan"
  std::string outcome;
  double rel_error = 0;     // |stored - input| / |input| for finite nonzero results
  std::string explanation;  // one sentence a user can act on
};
CastReport cast_value(double value, DType to);

struct ScalerTrial {
  int64_t step = 0;
  double scale = 0;
  double scaled_grad = 0;  // grad * scale as f16 stores it (inf on overflow)
  bool finite = false;     // the step is applied
  std::string outcome;     // cast_value's outcome for grad * scale in f16 ("underflow", ...)
};
// Simulates a 16-mixed step whose true gradient is `grad`: each try multiplies by the scale,
// stores in f16 and, on overflow, backs off as the scaler does, until a step applies (or
// max_tries). The last trial is the applied one. A NaN or infinite gradient gets one trial: it is
// non-finite at every scale.
std::vector<ScalerTrial> scaler_trace(double grad, const GradScalerOptions& opt,
                                      int max_tries = 64);
// What the trace means, in one or two sentences a user can act on: applied after N skips; applied
// but lost to underflow (a zero update: a run stuck at grad_norm 0.0) or kept with fewer bits as
// an f16 subnormal, with the scale that would keep it; never finite (a gradient beyond f16's
// max), or not finite within the tries from a start scale far too large (a gradient f16 holds);
// a scale set below 1 from the start; or a NaN/inf gradient that no scale can help.
std::string scaler_verdict(double grad, const std::vector<ScalerTrial>& trials);

}  // namespace keel::monitor
