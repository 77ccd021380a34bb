// Embedding lookup. ids: I64 or I32 of any shape; weight [V, D] -> [..., D] in weight's dtype.
// Backward scatter-adds into dW in a fixed order (deterministic). An id outside [0, V) is an
// Error naming the id, its position and V.
#pragma once
#include "keel/tensor/tensor.h"

namespace keel::ops {

Tensor embedding(const Tensor& ids, const Tensor& weight);

}  // namespace keel::ops
