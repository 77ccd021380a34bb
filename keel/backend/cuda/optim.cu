// CUDA optimizer updates: AdamW and SGD (stochastic rounding for bf16 parameters), and
// GradScaler's unscale (the fused pass of monitor.cu). Semantics as backend/cpu/optim.inc.
#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

struct AdamWConsts {
  float decay, b1, c1, b2, c2, bc2_sqrt, eps, neg_step;
  float grad_scale;  // clipping: g * grad_scale
};

template <class T>
__device__ __forceinline__ void store_param(T* p, float v, bool, uint64_t, int64_t) {
  st(p, v);
}
template <>
__device__ __forceinline__ void store_param(__nv_bfloat16* p, float v, bool sr, uint64_t seed,
                                            int64_t i) {
  const uint32_t u = __float_as_uint(v);
  if (!sr || (u & 0x7fffffffu) >= 0x7f800000u) {
    st(p, v);
  } else {
    const uint32_t r = static_cast<uint32_t>(splitmix64_at(seed, i) >> 48);
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>((u + r) >> 16);
  }
}

// Whether two stored values have the same bits (a rounded-away update leaves them so).
template <class T>
__device__ __forceinline__ bool same_bits(const T& a, const T& b) {
  if constexpr (sizeof(T) == 4)
    return *reinterpret_cast<const uint32_t*>(&a) == *reinterpret_cast<const uint32_t*>(&b);
  else
    return *reinterpret_cast<const uint16_t*>(&a) == *reinterpret_cast<const uint16_t*>(&b);
}
// An update asked for (`asked`: a non-zero increment or decay) that left p's bits unchanged
// counts as rounded away; each block adds its count to *away once (integers: deterministic).
__device__ __forceinline__ void add_rounded_away(unsigned long long* away, long long count) {
  __shared__ long long sh[32];
  count = block_reduce(count, sh, SumOp{}, 0ll);
  if (away && threadIdx.x == 0 && count) atomicAdd(away, static_cast<unsigned long long>(count));
}

// The CPU's order of operations, one rounding per stored value; no FMA contraction (__fmul_rn /
// __fadd_rn) so the update matches the CPU kernel's f32 arithmetic.
template <class T>
__global__ void adamw_kernel(T* p, const T* g, T* m, T* v, int64_t n, AdamWConsts c, bool sr,
                             uint64_t seed, unsigned long long* away) {
  long long rounded = 0;
  KEEL_CUDA_FOR(i, n) {
    float gj = ld(g + i);
    if (c.grad_scale != 1.f) {  // clipping, rounded to T as clip_grad_norm_ would store it
      T scaled;
      st(&scaled, __fmul_rn(gj, c.grad_scale));
      gj = ld(&scaled);
    }
    const T old = p[i];
    const float pold = ld(&old);
    const float pj = __fmul_rn(pold, c.decay);
    const float mj = __fadd_rn(__fmul_rn(ld(m + i), c.b1), __fmul_rn(c.c1, gj));
    const float vj = __fadd_rn(__fmul_rn(ld(v + i), c.b2), __fmul_rn(__fmul_rn(c.c2, gj), gj));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vj), c.bc2_sqrt), c.eps);
    const float inc = __fdiv_rn(__fmul_rn(c.neg_step, mj), denom);
    store_param(p + i, __fadd_rn(pj, inc), sr, seed, i);
    rounded += (inc != 0.f || pj != pold) && same_bits(p[i], old);
    st(m + i, mj);
    st(v + i, vj);
  }
  add_rounded_away(away, rounded);
}
void opt_adamw(void* p, const void* g, void* m, void* v, DType dt, int64_t n, const AdamWStep& s) {
  KEEL_CHECK(s.step >= 1, "adamw: step must be >= 1, got " + std::to_string(s.step));
  KEEL_CHECK(!s.stochastic_rounding || dt != DType::F16,
             "optimizer: stochastic rounding is implemented for bf16 parameters only");
  KEEL_CHECK(!s.p_copy, "adamw: the weight-copy write is CPU only (AdamW::writes_weight_copy)");
  if (n <= 0) return;
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  const AdamWConsts c{static_cast<float>(1.0 - s.lr * s.weight_decay),
                      static_cast<float>(s.beta1),
                      static_cast<float>(1.0 - s.beta1),
                      static_cast<float>(s.beta2),
                      static_cast<float>(1.0 - s.beta2),
                      static_cast<float>(std::sqrt(bc2)),
                      static_cast<float>(s.eps),
                      static_cast<float>(-(s.lr / bc1)),
                      s.grad_scale};
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        KEEL_LAUNCH(grid_for(n), kThreads, 0, adamw_kernel<T>)(
                            (T*)p, (const T*)g, (T*)m, (T*)v, n, c, s.stochastic_rounding, s.seed,
                            reinterpret_cast<unsigned long long*>(s.rounded_away)));
  KEEL_CUDA_LAUNCHED();
}

struct SgdConsts {
  float wd, momentum, one_minus_damp, neg_lr;
  bool use_wd, use_momentum, nesterov, first;
};
template <class T>
__global__ void sgd_kernel(T* p, const T* g, T* buf, int64_t n, SgdConsts c, bool sr, uint64_t seed,
                           unsigned long long* away) {
  long long rounded = 0;
  KEEL_CUDA_FOR(i, n) {
    const T old = p[i];
    const float pj = ld(&old);
    float d = ld(g + i);
    if (c.use_wd) d = __fadd_rn(d, __fmul_rn(c.wd, pj));
    if (c.use_momentum) {
      const float b =
          c.first ? d
                  : __fadd_rn(__fmul_rn(ld(buf + i), c.momentum), __fmul_rn(c.one_minus_damp, d));
      st(buf + i, b);
      d = c.nesterov ? __fadd_rn(d, __fmul_rn(c.momentum, b)) : b;
    }
    const float inc = __fmul_rn(c.neg_lr, d);
    store_param(p + i, __fadd_rn(pj, inc), sr, seed, i);
    rounded += inc != 0.f && same_bits(p[i], old);
  }
  add_rounded_away(away, rounded);
}
void opt_sgd(void* p, const void* g, void* buf, DType dt, int64_t n, const SgdStep& s) {
  const SgdConsts c{static_cast<float>(s.weight_decay),
                    static_cast<float>(s.momentum),
                    static_cast<float>(1.0 - s.dampening),
                    static_cast<float>(-s.lr),
                    s.weight_decay != 0.0,
                    s.momentum != 0.0,
                    s.nesterov,
                    s.first};
  KEEL_CHECK(!c.use_momentum || buf, "sgd: momentum != 0 needs a momentum buffer");
  KEEL_CHECK(!s.stochastic_rounding || dt != DType::F16,
             "optimizer: stochastic rounding is implemented for bf16 parameters only");
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(
      dt, T,
      KEEL_LAUNCH(grid_for(n), kThreads, 0, sgd_kernel<T>)(
          (T*)p, (const T*)g, c.use_momentum ? (T*)buf : (T*)nullptr, n, c, s.stochastic_rounding,
          s.seed, reinterpret_cast<unsigned long long*>(s.rounded_away)));
  KEEL_CUDA_LAUNCHED();
}

int64_t opt_unscale(void* g, DType dt, int64_t n, float inv_scale) {
  void* const bufs[1] = {g};
  return monitor_table()
      .unscale_norm(bufs, &dt, &n, 1, inv_scale, 0.f, nullptr)
      .nonfinite;  // monitor.cu
}
const OptimKernels kOptim = {opt_adamw, opt_sgd, opt_unscale};

}  // namespace

const OptimKernels& optim_table() { return kOptim; }

}  // namespace keel::cuda
