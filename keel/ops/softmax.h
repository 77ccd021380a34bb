// Softmax and log-softmax over the last dimension. Computed in f32 (max-subtracted), stored in the
// input's dtype. A row of all -inf gives zeros from softmax (not NaN) and -inf from log_softmax.
#pragma once
#include "keel/tensor/tensor.h"

namespace keel::ops {

Tensor softmax(const Tensor& x);
Tensor log_softmax(const Tensor& x);

}  // namespace keel::ops
