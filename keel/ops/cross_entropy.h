// Cross-entropy from logits. logits [N, V] (any floating dtype; log-sum-exp in f32), targets [N]
// (I64 or I32). Targets equal to ignore_index count neither in the loss nor in the mean. The loss
// is an f32 scalar. kMean divides by the number of counted targets; with none counted it returns
// 0 with zero gradients (PyTorch returns NaN there; keel's trainer never divides by zero).
// A target outside [0, V) other than ignore_index is an Error naming the row and the value.
#pragma once
#include <cstdint>

#include "keel/tensor/tensor.h"

namespace keel::ops {

enum class Reduction { kMean, kSum };

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::kMean);
// Number of targets that are not ignore_index.
int64_t count_targets(const Tensor& targets, int64_t ignore_index = -100);

}  // namespace keel::ops
