// Global gradient norm and clipping (DESIGN §3 steps 5 and 7).
#pragma once
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::optim {

// sqrt of the sum of squares of every defined gradient: f32 accumulation within fixed 4096-element
// blocks (elementwise sum_squares), f64 across blocks and across tensors in list order, so the
// bits depend on neither the thread count nor timing. Any inf gives inf, any NaN gives NaN: a
// non-finite norm is the step's found_inf.
double global_grad_norm(const std::vector<Tensor>& grads);

// torch.nn.utils.clip_grad_norm_'s rule: coef = max_norm / (total_norm + 1e-6), applied when
// coef < 1. Returns the factor to multiply the gradients by (1 when no clipping is needed), as the
// f32 the multiply uses. A non-finite total_norm is an Error: clip after the finite check.
float clip_coefficient(double max_norm, double total_norm);
// Multiplies every defined gradient by `coef` in place (in its own dtype, f32 math).
void scale_grads(std::vector<Tensor>& grads, float coef);
// clip_coefficient, then scale_grads when it is < 1. Returns whether the gradients were changed.
// (The Trainer instead hands the coefficient to Optimizer::step, which AdamW fuses into its pass.)
bool clip_grads(std::vector<Tensor>& grads, double max_norm, double total_norm);

}  // namespace keel::optim
