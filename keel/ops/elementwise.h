// Differentiable element-wise arithmetic and dtype casts.
//
// Inputs share one floating dtype (no implicit promotion: autocast decides dtypes); `b` may have
// the full shape of `a` or a suffix of it (broadcast over the leading dims, as a bias row).
#pragma once
#include "keel/tensor/tensor.h"

namespace keel::ops {

Tensor add(const Tensor& a, const Tensor& b);  // a + b
Tensor mul(const Tensor& a, const Tensor& b);  // a * b
Tensor scale(const Tensor& a, float s);        // s * a
// add(a, scale(b, s)) in one pass, with its values and gradients bit for bit (same shapes).
Tensor add_scaled(const Tensor& a, const Tensor& b, float s);
Tensor cast(const Tensor& a, DType dt);  // rounds to dt; backward casts back
// The same cast when `rounded` already holds a's values rounded to dt (autocast's kept weight
// copy, refreshed by the optimizer): its storage becomes the output, with the same graph node.
Tensor cast_precomputed(const Tensor& a, const Tensor& rounded);
double sum_squares(const Tensor& a);  // not differentiable: for norms

}  // namespace keel::ops
