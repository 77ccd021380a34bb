// Kernel interface: activations (GELU, SiLU, SwiGLU, soft cap, clamp) and the element-wise
// transcendental maps they are built from.
//
// Buffers hold n elements of one floating dtype `dt` (f32, bf16 or f16); values are computed in
// f32 and rounded once on store (opmath). Backward kernels write (not accumulate) their gradients,
// which have dtype dt. Outputs may alias inputs of the same call.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct ActivationKernels {
  // out = gelu(x): exact 0.5 x (1 + erf(x / sqrt 2)), or with `tanh_approx`
  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (PyTorch's approximate='tanh').
  void (*gelu)(void* out, const void* x, DType dt, int64_t n, bool tanh_approx);
  // dx = dout * gelu'(x)
  void (*gelu_backward)(void* dx, const void* dout, const void* x, DType dt, int64_t n,
                        bool tanh_approx);
  // out = x / (1 + exp(-x))
  void (*silu)(void* out, const void* x, DType dt, int64_t n);
  // dx = dout * s (1 + x (1 - s)), s = sigmoid(x)
  void (*silu_backward)(void* dx, const void* dout, const void* x, DType dt, int64_t n);
  // out = silu(gate) * up
  void (*swiglu)(void* out, const void* gate, const void* up, DType dt, int64_t n);
  // dgate = dout * up * silu'(gate), dup = dout * silu(gate); either output may be null.
  void (*swiglu_backward)(void* dgate, void* dup, const void* dout, const void* gate,
                          const void* up, DType dt, int64_t n);
  // out = cap * tanh(x / cap), cap > 0 (Gemma-2's soft caps on attention scores and logits)
  void (*softcap)(void* out, const void* x, DType dt, int64_t n, float cap);
  // dx = dout * (1 - tanh(x / cap)^2)
  void (*softcap_backward)(void* dx, const void* dout, const void* x, DType dt, int64_t n,
                           float cap);
  // out = min(max(x, lo), hi), a NaN kept (torch.clamp's; OLMo's clip_qkv)
  void (*clamp)(void* out, const void* x, DType dt, int64_t n, float lo, float hi);
  // dx = dout where lo <= x <= hi, else 0 (torch's: the bounds pass, a NaN does not)
  void (*clamp_backward)(void* dx, const void* dout, const void* x, DType dt, int64_t n, float lo,
                         float hi);
  // out = exp(x), tanh(x), erf(x) with the vectorized f32 functions of backend/cpu/vec_math.inc
  // (<= 2 ulp in f32), for ops that need them and for the accuracy tests.
  void (*exp)(void* out, const void* x, DType dt, int64_t n);
  void (*tanh)(void* out, const void* x, DType dt, int64_t n);
  void (*erf)(void* out, const void* x, DType dt, int64_t n);
};

const ActivationKernels& activation_kernels(Device dev);

}  // namespace keel
