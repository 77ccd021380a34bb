// The one pass over a step's gradients (DESIGN §3 steps 4-5): unscale in place, count non-finite
// values, and sum the squares of the results, per gradient and in total, in a fixed order (f32
// within fixed blocks, f64 across blocks and gradients). The step, GradScaler, clipping's global
// norm, the per-layer norms and each rank's own check all read it. It is one backend call over
// every gradient (backend/monitor.h's unscale_norm): on the CPU one parallel loop that reads each
// value once, on a GPU one kernel and one readback.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::amp {

struct GradPass {
  double sum_squares = 0;  // of the values after scaling: inf or nan when any is non-finite
  // Values that were nan or inf, counted while unscaling (inv_scale != 1) and by the GPU's fused
  // pass; without unscaling the CPU reads each value once, and a non-finite one shows in the sum.
  int64_t nonfinite = 0;
  // Per gradient, in the order given (0 for an undefined one).
  std::vector<double> sum_squares_of;
  // Per gradient, counted in the same read as its sum (after scaling): values exactly 0, and
  // non-zero values below the smallest normal of `format` (subnormal there, or flushed to 0 when
  // the compute dtype carried them). The per-layer underflow statistics read these.
  std::vector<int64_t> zero_of, below_normal_of;

  double norm() const { return std::sqrt(sum_squares); }
  // False when a value is non-finite, or the sum of squares overflowed f32/f64 (every element
  // finite but some beyond ~1.8e19): either way the step must not be applied.
  bool finite() const { return nonfinite == 0 && std::isfinite(sum_squares); }
};

// inv_scale == 1: no value is written. `format`: the compute dtype whose range the counts judge
// (16-mixed: f16; a scaled gradient is judged as the f16 backward carried it, before unscaling).
GradPass grad_pass(const std::vector<Tensor>& grads, float inv_scale = 1.f,
                   DType format = DType::F32);

}  // namespace keel::amp
