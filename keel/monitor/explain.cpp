#include "keel/monitor/explain.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "keel/numerics/convert.h"
#include "keel/numerics/format_info.h"
#include "keel/numerics/text.h"

namespace keel::monitor {

namespace {
// `v` rounded once, to nearest even, into `to`: the IEEE answer for a decimal value. Going through
// f32 first rounds twice: 65519.99999 became f32's 65520 and then f16's inf (its answer is 65504),
// and 1 + 2^-11 + 2^-40 became the f32 tie 1 + 2^-11 and then 1 (its answer is 1 + 2^-10).
double round_once(double v, DType to) {
  if (to == DType::F32) return static_cast<float>(v);  // the hardware rounds f64 -> f32 once
  if (!std::isfinite(v) || v == 0) return v;
  const FormatInfo& fi = format_info(to);
  // The spacing of `to` around v (that of its subnormals below the smallest normal): both
  // divisions by it and the product back are exact in f64, and nearbyint ties to even.
  const int e = std::max(std::ilogb(v), std::ilogb(fi.min_normal));
  const double ulp = std::ldexp(1.0, e - fi.mantissa_bits);
  const double r = std::nearbyint(v / ulp) * ulp;
  return std::fabs(r) > fi.max ? std::copysign(std::numeric_limits<double>::infinity(), v) : r;
}
}  // namespace

std::string format_table() {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "%-6s %14s %14s %14s %14s %6s %6s\n", "format", "max",
                "min normal", "min subnormal", "epsilon", "bits", "exp");
  out += line;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const FormatInfo& f = format_info(dt);
    std::snprintf(line, sizeof line, "%-6s %14.6g %14.6g %14.6g %14.6g %6d %6d\n", dtype_name(dt),
                  f.max, f.min_normal, f.min_subnormal, f.epsilon, f.mantissa_bits + 1,
                  f.exponent_bits);
    out += line;
  }
  out += "bits = significant bits (stored fraction + 1); exp = exponent bits.\n";
  return out;
}

CastReport cast_value(double v, DType to) {
  CastReport r;
  r.input = v;
  const FormatInfo& fi = format_info(to);
  r.stored = round_once(v, to);
  // Every bf16/f16 value (and inf, NaN) is an f32 value: its bits come from f32 exactly.
  const float f = static_cast<float>(r.stored);
  switch (to) {
    case DType::BF16:
      r.bits = f32_to_bf16_bits(f);
      break;
    case DType::F16:
      r.bits = f32_to_f16_bits(f);
      break;
    default:
      r.bits = f32_bits(f);
      break;
  }
  char buf[256];
  const char* name = dtype_name(to);
  if (std::isnan(v)) {
    r.outcome = "nan";
    r.explanation = "NaN stays NaN in every format.";
  } else if (std::isinf(r.stored) && !std::isinf(v)) {
    r.outcome = "overflow";
    // Round-to-nearest-even goes to inf from the largest finite value plus half its ulp (65520
    // for f16), as the largest value's last bit is odd.
    const double to_inf = fi.max + std::ldexp(1.0, std::ilogb(fi.max) - fi.mantissa_bits - 1);
    const double f32_max = format_info(DType::F32).max;
    char f32_holds[96];
    std::snprintf(f32_holds, sizeof f32_holds,
                  "f32 holds it (up to %.6g): keep this tensor in f32, or scale it down", f32_max);
    const char* fix =
        to == DType::F16
            ? "scale it down (a smaller loss scale) or use bf16, whose range matches f32"
        : to == DType::BF16 && std::fabs(v) <= f32_max
            ? f32_holds
            : "no training format holds it (f32's range is the widest): scale it down, or find "
              "what grows without bound (keel train's NaN capture names the op)";
    std::snprintf(buf, sizeof buf,
                  "%.6g is beyond %s's largest finite value %.6g (values from %.6g up round to "
                  "inf); %s.",
                  v, name, fi.max, to_inf, fix);
    r.explanation = buf;
  } else if (r.stored == 0 && v != 0) {
    r.outcome = "underflow";
    // bf16 has f32's exponent but 16 fewer fraction bits: its subnormals stop 2^16 above f32's.
    const double f32_min = format_info(DType::F32).min_subnormal;
    char f32_keeps[112];
    std::snprintf(f32_keeps, sizeof f32_keeps,
                  "f32 keeps it (its smallest subnormal is %.2g): hold this tensor in f32, or "
                  "scale it up",
                  f32_min);
    // Which wider format keeps it: f16's fix named bf16 for values bf16 flushes too (1e-41).
    const bool bf16_keeps = std::fabs(v) > format_info(DType::BF16).min_subnormal / 2;
    const bool f32_keeps_it = std::fabs(v) > f32_min / 2;
    const char* fix = to == DType::F16 && bf16_keeps
                          ? "gradients this small need a loss scale (16-mixed) or bf16"
                      : to == DType::F16 && f32_keeps_it
                          ? "gradients this small need a loss scale (16-mixed) or f32 (bf16 "
                            "flushes it too)"
                      : to == DType::BF16 && f32_keeps_it
                          ? f32_keeps
                          : "no training format keeps it (f32's range is the widest): it is 0 "
                            "unless scaled up first";
    std::snprintf(buf, sizeof buf,
                  "%.6g is at most half of %s's smallest subnormal %.6g and flushes to 0; %s.", v,
                  name, fi.min_subnormal, fix);
    r.explanation = buf;
  } else if (static_cast<double>(r.stored) == v) {
    r.outcome = std::fabs(v) < fi.min_normal && v != 0 ? "subnormal" : "exact";
    r.explanation = r.outcome == "exact" ? std::string(name) + " holds this value exactly."
                                         : std::string(name) +
                                               " holds it exactly, as a subnormal "
                                               "(fewer significant bits).";
  } else {
    r.rel_error = std::fabs(r.stored - v) / std::fabs(v);
    const bool sub = std::fabs(r.stored) < fi.min_normal;
    r.outcome = sub ? "subnormal" : "rounded";
    std::snprintf(buf, sizeof buf,
                  "rounded to the nearest %s value (relative error %.3g; %s keeps %d significant "
                  "bits%s).",
                  name, r.rel_error, name, fi.mantissa_bits + 1,
                  sub ? ", fewer here: the value is subnormal" : "");
    r.explanation = buf;
  }
  return r;
}

std::vector<ScalerTrial> scaler_trace(double grad, const GradScalerOptions& opt, int max_tries) {
  GradScaler scaler(opt);
  std::vector<ScalerTrial> out;
  for (int i = 0; i < max_tries; ++i) {
    ScalerTrial t;
    t.step = i + 1;
    t.scale = scaler.get_scale();
    t.scaled_grad = round_once(grad * t.scale, DType::F16);
    t.finite = std::isfinite(t.scaled_grad);
    t.outcome = cast_value(grad * t.scale, DType::F16).outcome;
    out.push_back(t);
    const ScalerUpdate u = scaler.update(!t.finite);
    if (t.finite || u.at_min_scale || !std::isfinite(grad)) break;
  }
  return out;
}

namespace {
// The smallest power of two s >= `from` with grad * s at least `least` in magnitude (0 when none
// below f32's largest scale).
double scale_reaching(double grad, double from, double least) {
  for (double s = from; s < 1e38; s *= 2)
    if (std::fabs(grad * s) >= least) return s;
  return 0;
}
// The smallest power of two s >= `from` whose grad * s does not round to 0 in f16: round to
// nearest lifts anything above half the smallest subnormal (2^-25) to it, so this is half the
// scale that reaches the subnormal itself (0 when none below f32's largest scale).
double scale_nonzero_f16(double grad, double from) {
  for (double s = from; s < 1e38; s *= 2)
    if (round_once(grad * s, DType::F16) != 0) return s;
  return 0;
}
}  // namespace

std::string scaler_verdict(double grad, const std::vector<ScalerTrial>& trials) {
  char buf[512];
  if (!std::isfinite(grad)) {
    std::snprintf(buf, sizeof buf,
                  "a%s gradient is %s at every scale: the scaler skips the step and backs off "
                  "forever, and no scale or format fixes it; the value comes from the computation "
                  "itself (keel train's NaN capture and keel replay name the op that made it).",
                  std::isnan(grad) ? " NaN" : "n infinite", std::isnan(grad) ? "NaN" : "inf");
    return buf;
  }
  if (grad == 0) return "a zero gradient is 0 at every scale: there is nothing to lose or keep.";
  if (trials.empty()) return "";
  const ScalerTrial& last = trials.back();
  const FormatInfo& f16 = format_info(DType::F16);
  // Whether f16 holds the gradient itself (at a scale of 1): a scale small enough then carries it.
  const bool fits_f16 = std::isfinite(round_once(grad, DType::F16));
  const double first_scale = trials.front().scale;
  if (!last.finite && fits_f16) {
    // The trace gave up while backing off from a scale far too large: a scale does fit, and the
    // fix is where the scale starts, not the format (--grad 100 --init-scale 1e30 was told
    // "never finite ...; use bf16-mixed").
    std::snprintf(buf, sizeof buf,
                  "not finite within %zu steps: the scale started at %.8g and is still %.6g after "
                  "%s, while |grad| = %.6g fits f16 at any scale up to %.6g (its max "
                  "%.6g / |grad|); start the scale there or lower: a smaller --init-scale "
                  "(scaler.init_scale; PyTorch's default 65536 suits gradients below 1).",
                  trials.size(), first_scale, last.scale,
                  count_of(static_cast<long long>(trials.size() - 1), "back-off").c_str(),
                  std::fabs(grad), f16.max / std::fabs(grad), f16.max);
    return buf;
  }
  if (!last.finite) {
    std::snprintf(buf, sizeof buf,
                  "never finite: |grad| x scale overflows f16 (max %.6g) even at scale %.6g; use "
                  "bf16-mixed, whose range matches f32.",
                  f16.max, last.scale);
    return buf;
  }
  // "applied after N skipped step(s)" leads whatever else is said of the applied step.
  std::string lead;
  if (const size_t skipped = trials.size() - 1; skipped > 0)
    lead = "applied after " + count_of(static_cast<long long>(skipped), "skipped step") +
           "; the LR schedule does not advance on skips.";
  const char* sep = lead.empty() ? "" : " ";
  if (last.outcome == "underflow") {
    const double keep = scale_nonzero_f16(grad, last.scale);
    if (keep == 0)  // below what any f32 scale lifts into f16 (|grad| under ~1e-45)
      std::snprintf(buf, sizeof buf,
                    "%sapplied, but grad x scale underflows f16 to 0 and no loss scale within "
                    "f32's range keeps it: a gradient of %.6g is 0 in every format keel trains in.",
                    sep, grad);
    else
      // The first nonzero scale keeps one bit (the smallest subnormal); all of f16's bits need
      // grad x scale at its smallest normal: said both, since "keeping" it at one bit is barely.
      std::snprintf(buf, sizeof buf,
                    "%sapplied, but grad x scale = %.6g underflows f16 to 0: the update is zero, "
                    "the symptom of a 16-mixed run stuck at grad_norm 0.0. A scale of %.6g "
                    "makes it nonzero (rounded to f16's smallest subnormal %.6g, about 1 "
                    "significant bit); %.6g keeps all %d bits; or bf16-mixed.",
                    sep, grad * last.scale, keep, f16.min_subnormal,
                    scale_reaching(grad, last.scale, f16.min_normal), f16.mantissa_bits + 1);
    return lead + buf;
  }
  if (last.outcome == "subnormal") {
    // A subnormal is at most 2^11 below a normal: this scale exists.
    const double full = scale_reaching(grad, last.scale, f16.min_normal);
    std::snprintf(buf, sizeof buf,
                  "%sapplied with fewer significant bits: grad x scale = %.6g is an f16 subnormal "
                  "(below its smallest normal %.6g); a scale of at least %.6g keeps all %d bits.",
                  sep, grad * last.scale, f16.min_normal, full, f16.mantissa_bits + 1);
    return lead + buf;
  }
  if (last.scale < 1 && trials.size() == 1) {
    // A scale set below 1 from the start shrinks the gradient towards f16's underflow instead of
    // lifting it away: no overflow pushed it there, and f16 is not at fault (--grad 1e-3
    // --init-scale 0.5 was told "|grad| = 0.001 is itself beyond f16's max 65504").
    std::snprintf(buf, sizeof buf,
                  "applied, but the scale starts below 1 (--init-scale %.8g): it shrinks the "
                  "gradient towards f16's underflow instead of lifting it away, and no overflow "
                  "called for it (|grad| x scale = %.6g); start at a scale of 1 or more "
                  "(scaler.init_scale; PyTorch's default 65536).",
                  first_scale, grad * last.scale);
    return buf;
  }
  if (last.scale < 1 && fits_f16) {
    // The back-off went past the scales that fit: the factor was too small for a gradient f16
    // holds (--grad 10 --init-scale 1e4 --backoff 1e-6 lands at 0.01).
    std::snprintf(buf, sizeof buf,
                  " The scale fell below 1 (PyTorch warns there; keel train's advisor calls it "
                  "loss-scale collapsing), while |grad| = %.6g fits f16 at any scale up to %.6g: "
                  "the back-off jumped past it; a --backoff closer to 1 (scaler.backoff_factor; "
                  "PyTorch's 0.5) stops nearer.",
                  std::fabs(grad), f16.max / std::fabs(grad));
    return lead + buf;
  }
  if (last.scale < 1) {
    // Applied only once the scale shrank the gradient: PyTorch warns below 1, and keel's trend
    // advisor calls a run there "loss-scale collapsing". The trace alone read as a success.
    std::snprintf(buf, sizeof buf,
                  " The scale fell below 1 (PyTorch warns there; keel train's advisor calls it "
                  "loss-scale collapsing): |grad| = %.6g is itself beyond f16's max %.6g, so "
                  "16-mixed carries it only by shrinking it; "
                  "use bf16-mixed, whose range matches f32.",
                  std::fabs(grad), f16.max);
    return lead + buf;
  }
  return lead.empty() ? "applied at the first try: grad x scale is a normal f16 value." : lead;
}

}  // namespace keel::monitor
