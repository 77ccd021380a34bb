#include "keel/amp/precision.h"

#include "keel/backend/cpu/isa.h"
#include "keel/numerics/error.h"

namespace keel {

std::string PrecisionPolicy::name() const {
  switch (kind) {
    case Precision::k32True:
      return "32-true";
    case Precision::kBf16Mixed:
      return "bf16-mixed";
    case Precision::k16Mixed:
      return "16-mixed";
    case Precision::kBf16True:
      return "bf16-true";
    case Precision::k16True:
      return "16-true";
  }
  return "?";
}

static PrecisionPolicy make(Precision p) {
  PrecisionPolicy r;
  r.kind = p;
  switch (p) {
    case Precision::k32True:
      break;
    case Precision::kBf16Mixed:
      r.compute_dtype = DType::BF16;
      r.autocast = true;
      break;
    case Precision::k16Mixed:
      r.compute_dtype = DType::F16;
      r.autocast = true;
      r.scaler = true;
      break;
    case Precision::kBf16True:
      r.param_dtype = r.compute_dtype = DType::BF16;
      break;
    case Precision::k16True:
      r.param_dtype = r.compute_dtype = DType::F16;
      break;
  }
  return r;
}

PrecisionPolicy resolve_precision(std::string_view s, Device device, bool allow_cpu_bf16) {
  if (s == "32-true" || s == "32") return make(Precision::k32True);
  if (s == "bf16-mixed" || s == "bf16") return make(Precision::kBf16Mixed);
  if (s == "16-mixed" || s == "16") return make(Precision::k16Mixed);
  if (s == "bf16-true") return make(Precision::kBf16True);
  if (s == "16-true") return make(Precision::k16True);
  if (s == "auto") {
    if (device.is_cuda()) return make(Precision::kBf16Mixed);  // sm_80+ only are built
    if (allow_cpu_bf16 && cpu_has_avx512_bf16()) return make(Precision::kBf16Mixed);
    return make(Precision::k32True);
  }
  throw Error("unknown precision '" + std::string(s) +
                  "': use 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, auto (aliases 32, "
                  "bf16, 16)",
              Error::kUsage);
}

std::string wider_precisions(std::string_view policy_name) {
  if (policy_name == "16-mixed" || policy_name == "16-true" || policy_name == "bf16-true")
    return "bf16-mixed or 32-true";
  if (policy_name == "bf16-mixed") return "32-true";
  return "";
}

}  // namespace keel
