// Precision policies (DESIGN §2): what dtype parameters are stored in, what forward computes in,
// and whether a GradScaler runs. Strings as Lightning spells them, with its aliases, plus auto.
#pragma once
#include <string>
#include <string_view>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

enum class Precision { k32True, kBf16Mixed, k16Mixed, kBf16True, k16True };

struct PrecisionPolicy {
  Precision kind = Precision::k32True;
  DType param_dtype = DType::F32;    // trainable parameters (masters in the mixed policies)
  DType compute_dtype = DType::F32;  // low-precision dtype of autocast / of a hard cast
  bool autocast = false;             // run forward under autocast (the -mixed policies)
  bool scaler = false;               // a GradScaler is on by default (16-mixed)
  std::string name() const;          // canonical: "32-true", "bf16-mixed", ...
};

// "32-true" | "32" | "bf16-mixed" | "bf16" | "16-mixed" | "16" | "bf16-true" | "16-true" | "auto".
// auto: CUDA with bf16 -> bf16-mixed; CUDA without -> 16-mixed; CPU -> 32-true, or bf16-mixed
// when the CPU has native bf16 dot products and allow_cpu_bf16 is set. Unknown strings are a
// usage Error listing the valid ones.
PrecisionPolicy resolve_precision(std::string_view s, Device device, bool allow_cpu_bf16 = false);

// The policies with more range or bits to suggest when `policy_name`'s low precision is a suspect:
// "bf16-mixed or 32-true" from the f16 policies and bf16-true, "32-true" from bf16-mixed, and ""
// from 32-true (precision is not the cause there: naming a switch would mislead) or an unknown
// name. Canonical names (PrecisionPolicy::name()).
std::string wider_precisions(std::string_view policy_name);

}  // namespace keel
