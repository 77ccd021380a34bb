// Differentiable shape ops. reshape is a view (shares storage); the others copy into a new
// contiguous tensor.
#pragma once
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::ops {

Tensor reshape(const Tensor& x, const Shape& shape);            // one dim may be -1
Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1);  // negative dims count from the end
Tensor split_heads(const Tensor& x, int64_t n_heads);           // [B, T, H*D] -> [B, H, T, D]
Tensor merge_heads(const Tensor& x);                            // [B, H, T, D] -> [B, T, H*D]
// Pieces of the last dimension, e.g. a fused qkv projection into q, k, v.
std::vector<Tensor> split_last(const Tensor& x, const std::vector<int64_t>& sizes);
// The parts side by side along the last dimension (the same leading dims and dtype): split_last's
// inverse, e.g. a partial RoPE's turned channels back beside those it passed.
Tensor concat_last(const std::vector<Tensor>& parts);
Tensor concat_last(const Tensor& a, const Tensor& b);

}  // namespace keel::ops
