// CUDA activations: GELU (erf, tanh), SiLU, SwiGLU, exp, tanh, erf, forward and backward.
// Semantics as backend/cpu (see the family header): f32 opmath, one RNE rounding on store,
// NaN/inf propagate.
#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

constexpr float kSqrt1_2 = 0.707106781186547524f;
constexpr float kInvSqrt2Pi = 0.398942280401432678f;
constexpr float kSqrt2OverPi = 0.797884560802865355f;
constexpr float kKappa = 0.044715f;

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigmoid(x);
  return s * (1.f + x * (1.f - s));
}

struct GeluErf {
  __device__ float operator()(float x) const { return x * 0.5f * (1.f + erff(x * kSqrt1_2)); }
};
// x sigmoid(2u), u = sqrt(2/pi) (x + kappa x^3): equal to 0.5 x (1 + tanh u) without its
// cancellation where tanh u -> -1 (the CPU kernel's form; backend/cpu/activation.inc).
struct GeluTanh {
  __device__ float operator()(float x) const {
    const float u = kSqrt2OverPi * (x + kKappa * (x * x * x));
    return x / (1.f + expf(-2.f * u));
  }
};
struct GeluErfGrad {
  __device__ float operator()(float g, float x) const {
    const float cdf = 0.5f * (1.f + erff(x * kSqrt1_2));
    const float pdf = kInvSqrt2Pi * expf(x * x * -0.5f);
    return g * (cdf + x * pdf);
  }
};
struct GeluTanhGrad {
  __device__ float operator()(float g, float x) const {
    const float x2 = x * x;
    const float u = kSqrt2OverPi * (x + kKappa * (x2 * x));
    const float e = expf(-2.f * u);
    const float s = 1.f / (1.f + e);
    const float one_minus_s = e <= 3.402823466e38f ? e * s : 1.f;  // e s, or 1 where e overflows
    const float du2 = 2.f * kSqrt2OverPi * (1.f + 3.f * kKappa * x2);
    return g * (s + x * s * one_minus_s * du2);
  }
};
struct Silu {
  __device__ float operator()(float x) const { return silu(x); }
};
struct SiluGrad {
  __device__ float operator()(float g, float x) const { return g * silu_grad(x); }
};
struct Swiglu {
  __device__ float operator()(float g, float u) const { return silu(g) * u; }
};
struct SoftCap {
  float cap, inv;
  __device__ float operator()(float x) const { return cap * tanhf(x * inv); }
};
struct SoftCapGrad {
  float inv;
  __device__ float operator()(float g, float x) const {  // sech², not 1 - tanh² (cancellation)
    const float e = expf(-2.f * fabsf(x * inv)), d = 1.f + e;
    return g * (4.f * e / (d * d));
  }
};
struct Clamp {  // (comparisons: a NaN passes through, as torch.clamp keeps it)
  float lo, hi;
  __device__ float operator()(float x) const { return x < lo ? lo : (x > hi ? hi : x); }
};
struct ClampGrad {
  float lo, hi;
  __device__ float operator()(float g, float x) const { return x >= lo && x <= hi ? g : 0.f; }
};
struct Exp {
  __device__ float operator()(float x) const { return expf(x); }
};
struct Tanh {
  __device__ float operator()(float x) const { return tanhf(x); }
};
struct Erf {
  __device__ float operator()(float x) const { return erff(x); }
};

void act_gelu(void* out, const void* x, DType dt, int64_t n, bool tanh_approx) {
  if (tanh_approx)
    map1(out, x, dt, n, GeluTanh{});
  else
    map1(out, x, dt, n, GeluErf{});
}
void act_gelu_backward(void* dx, const void* dout, const void* x, DType dt, int64_t n,
                       bool tanh_approx) {
  if (tanh_approx)
    map2(dx, dout, x, dt, n, GeluTanhGrad{});
  else
    map2(dx, dout, x, dt, n, GeluErfGrad{});
}
void act_silu(void* out, const void* x, DType dt, int64_t n) { map1(out, x, dt, n, Silu{}); }
void act_silu_backward(void* dx, const void* dout, const void* x, DType dt, int64_t n) {
  map2(dx, dout, x, dt, n, SiluGrad{});
}
void act_swiglu(void* out, const void* gate, const void* up, DType dt, int64_t n) {
  map2(out, gate, up, dt, n, Swiglu{});
}
template <class T>
__global__ void swiglu_bwd_kernel(T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                                  int64_t n) {
  KEEL_CUDA_FOR(i, n) {
    const float d = ld(dout + i), g = ld(gate + i);
    if (dgate) st(dgate + i, (d * ld(up + i)) * silu_grad(g));
    if (dup) st(dup + i, d * silu(g));
  }
}
void act_swiglu_backward(void* dgate, void* dup, const void* dout, const void* gate, const void* up,
                         DType dt, int64_t n) {
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        KEEL_LAUNCH(grid_for(n), kThreads, 0, swiglu_bwd_kernel<T>)(
                            (T*)dgate, (T*)dup, (const T*)dout, (const T*)gate, (const T*)up, n));
  KEEL_CUDA_LAUNCHED();
}
void act_softcap(void* out, const void* x, DType dt, int64_t n, float cap) {
  map1(out, x, dt, n, SoftCap{cap, 1.f / cap});
}
void act_softcap_backward(void* dx, const void* dout, const void* x, DType dt, int64_t n,
                          float cap) {
  map2(dx, dout, x, dt, n, SoftCapGrad{1.f / cap});
}
void act_clamp(void* out, const void* x, DType dt, int64_t n, float lo, float hi) {
  map1(out, x, dt, n, Clamp{lo, hi});
}
void act_clamp_backward(void* dx, const void* dout, const void* x, DType dt, int64_t n, float lo,
                        float hi) {
  map2(dx, dout, x, dt, n, ClampGrad{lo, hi});
}
void act_exp(void* out, const void* x, DType dt, int64_t n) { map1(out, x, dt, n, Exp{}); }
void act_tanh(void* out, const void* x, DType dt, int64_t n) { map1(out, x, dt, n, Tanh{}); }
void act_erf(void* out, const void* x, DType dt, int64_t n) { map1(out, x, dt, n, Erf{}); }

const ActivationKernels kActivation = {
    act_gelu,   act_gelu_backward,   act_silu,    act_silu_backward,
    act_swiglu, act_swiglu_backward, act_softcap, act_softcap_backward,
    act_clamp,  act_clamp_backward,  act_exp,     act_tanh,
    act_erf,
};

}  // namespace

const ActivationKernels& activation_table() { return kActivation; }

}  // namespace keel::cuda
