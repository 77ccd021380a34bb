// Activation checkpointing: a segment of a model (one or more consecutive blocks) runs its forward
// without recording a graph, keeping only its input; its backward recomputes the forward with the
// graph and backpropagates through it. Gradients and losses are bit-identical to the run without
// it: the recompute sees the forward's dropout step seed (masks are a function of it and each
// module's path), the forward's autocast state (weight casts are cached per step and rounded the
// same way), and its nodes run in the order one pass over the whole graph runs them.
//
// Memory: between forward and backward a segment holds its input alone (one [B, T, C] tensor, which
// is the previous segment's output); inside backward one segment at a time holds its activations
// and graph, freed when its backward returns.
#pragma once
#include <functional>

#include "keel/tensor/tensor.h"

namespace keel::nn {

// A segment's forward, input to output. It is called twice (forward, then inside backward), so it
// must own what it captures (tensors by value).
using Segment = std::function<Tensor(const Tensor&)>;

// segment(x), checkpointed when grad mode is on and a gradient can flow (x requires grad, or
// `trainable`: some parameter the segment uses requires grad); otherwise a plain call.
Tensor checkpoint(Segment segment, const Tensor& x, bool trainable);

}  // namespace keel::nn
