// Kernel interface: fused optimizer updates and the loss-scaler's unscale pass.
//
// One call updates one whole tensor in a single pass over memory: read the parameter, its gradient
// and its state, compute in f32, write the parameter and the state back rounded to `dt`. The
// parameter, gradient and state buffers all have the floating dtype `dt` (PyTorch keeps optimizer
// state in the parameter's dtype). Every scalar below is computed once on the host in double, as
// PyTorch's Python floats are, and applied as f32 (the "opmath" of f32, bf16 and f16).
//
// The arithmetic follows PyTorch's single-tensor loops op by op and is never contracted into FMAs,
// so every ISA variant produces the same bits.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

// torch.optim.AdamW (amsgrad = false, maximize = false), for one parameter at step `step`:
//   p = p * (1 - lr*wd);  m = m*beta1 + (1-beta1)*g;  v = v*beta2 + ((1-beta2)*g)*g
//   denom = sqrt(v) / sqrt(1 - beta2^step) + eps;  p = p + (-lr / (1 - beta1^step)) * m / denom
struct AdamWStep {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;  // this update's count for the parameter (>= 1): bias corrections
  // bf16 parameters only: round the new parameter stochastically (unbiased) instead of to nearest.
  // The random bits are a hash of (seed, element index), so results do not depend on threads.
  bool stochastic_rounding = false;
  uint64_t seed = 0;
  // Gradient clipping fused into the update: g is first multiplied by this and rounded to dt,
  // exactly what clip_grad_norm_'s in-place multiply would have stored (1: no clipping). .grad
  // itself is not changed.
  float grad_scale = 1.f;
  // When set (f32 parameters, CPU): also store the new parameter rounded to copy_dt (bf16/f16)
  // here, in the same pass: autocast's kept weight copy (amp::weight_copy).
  void* p_copy = nullptr;
  DType copy_dt = DType::BF16;
  // When set: adds the number of elements whose update was non-zero (the increment or the weight
  // decay) but left the stored value's bits unchanged: rounded away by the parameter's dtype.
  // Counted in the update's own pass; an int64 on the parameter's device (host memory on the CPU).
  int64_t* rounded_away = nullptr;
};

// torch.optim.SGD (maximize = false), for one parameter:
//   d = g + wd*p;  buf = first ? d : buf*momentum + (1-dampening)*d   (when momentum != 0)
//   d = nesterov ? d + momentum*buf : buf;  p = p + (-lr)*d
struct SgdStep {
  double lr = 1e-3;
  double momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false;
  bool first = false;  // the buffer is uninitialized: buf = d (PyTorch's clone on the first step)
  bool stochastic_rounding = false;  // as AdamWStep
  uint64_t seed = 0;
  int64_t* rounded_away = nullptr;  // as AdamWStep (the increment lr * d non-zero)
};

struct OptimKernels {
  // p, g, m, v: [n] each, dtype dt.
  void (*adamw)(void* p, const void* g, void* m, void* v, DType dt, int64_t n, const AdamWStep& s);
  // p, g, buf: [n]; buf is null when momentum == 0.
  void (*sgd)(void* p, const void* g, void* buf, DType dt, int64_t n, const SgdStep& s);
  // GradScaler's unscale: g = g * inv_scale in place (skipped when inv_scale == 1, as PyTorch),
  // counting the values that were non-finite before scaling (fixed blocks: thread-independent).
  // Non-finite values are scaled too: PyTorch unscales in place even when the step is skipped.
  int64_t (*unscale)(void* g, DType dt, int64_t n, float inv_scale);
};

const OptimKernels& optim_kernels(Device dev);

}  // namespace keel
