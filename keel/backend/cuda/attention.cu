// Attention on CUDA: the masked softmax pair of the eager/math backends, and the flash backend as
// tiled kernels with an f32 online softmax (running max and sum), the P tile rounded to the
// compute dtype before P·V, and a FlashAttention-2 backward (P recomputed from lse; P and dS
// rounded to the compute dtype before their products; dK/dV per key tile and dQ per query tile,
// each accumulated in a fixed order without atomics). Semantics: backend/attention.h and
// backend/cpu/attention.inc: query i sees key j when j <= i and the key is real; a row that sees
// no key gives 0 (never NaN) and lse = -inf.
//
// Tiles are 32 queries x 32 keys held in shared memory as f32 (rows padded to D + 1 floats so
// that a lane per row reads without bank conflicts); 4 warps per block, each owning 8 query rows
// (forward, dQ) or 8 keys (dK/dV). Head dims up to 128.
#include <algorithm>
#include <type_traits>

#include "keel/backend/cuda/attention.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

constexpr int kTile = 32;  // queries and keys per tile
constexpr int kWarps = 4;  // per block
constexpr int kPerWarp = kTile / kWarps;
constexpr int kMaxHeadDim = 128;

// rows [r0, r0 + 32) of a [t, d] matrix into a [32, d + 1] f32 tile (zeros past t).
template <class T>
__device__ void load_tile(float* tile, const T* src, int64_t r0, int64_t t, int64_t d) {
  const int64_t p = d + 1;
  for (int64_t e = threadIdx.x; e < kTile * d; e += blockDim.x) {
    const int64_t r = e / d, c = e % d;
    tile[r * p + c] = r0 + r < t ? ld(src + (r0 + r) * d + c) : 0.f;
  }
}

__device__ __forceinline__ float dot_rows(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma unroll 4
  for (int64_t x = 0; x < d; ++x) s += a[x] * b[x];
  return s;
}

// ---- eager/math softmax ---------------------------------------------------------------------

// The row of this block (one per query row): its length, its causal visible prefix (keys
// j < i + 1) and its batch's padding mask.
struct Row {
  int64_t r, t, n;
  const uint8_t* mk;
};
__device__ __forceinline__ Row row_of(const AttnDims& a) {
  const int64_t r = blockIdx.x, i = r % a.t, b = r / (a.hq * a.t);
  return {r, a.t, i + 1, a.mask ? a.mask + b * a.t : nullptr};
}

template <class EP, class ES>
__global__ void softmax_fwd_kernel(float* p32, EP* p_lp, const float* s, AttnDims a) {
  __shared__ float sh[32];
  const auto [r, t, n, mk] = row_of(a);
  float* pr = p32 + r * t;
  const float* sr = s + r * t;
  float cnt = 0.f, mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    if (key_real(mk, j)) cnt += 1.f, mx = nan_max(mx, round_to<ES>(a.scale * sr[j]));
  cnt = block_reduce(cnt, sh, SumOp{}, 0.f);
  mx = block_reduce(mx, sh, MaxOp{}, -INFINITY);
  float sum = 0.f;
  if (cnt > 0)
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      if (key_real(mk, j)) sum += expf(round_to<ES>(a.scale * sr[j]) - mx);
  sum = block_reduce(sum, sh, SumOp{}, 0.f);
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    float p = 0.f;
    if (cnt > 0 && j < n && key_real(mk, j)) p = expf(round_to<ES>(a.scale * sr[j]) - mx) / sum;
    pr[j] = p;  // p32 may alias s: this thread read s[j] above, before this write
    if (p_lp) st(p_lp + r * t + j, p);
  }
}

template <class ED, class EG>
__global__ void softmax_bwd_kernel(ED* ds, const float* p32, const EG* dp, AttnDims a) {
  __shared__ float sh[32];
  const auto [r, t, n, mk] = row_of(a);
  const float* pr = p32 + r * t;
  float dot = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    if (key_real(mk, j)) dot += ld(dp + r * t + j) * pr[j];
  dot = block_reduce(dot, sh, SumOp{}, 0.f);
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x) {
    const float g = j < n && key_real(mk, j) ? pr[j] * (ld(dp + r * t + j) - dot) : 0.f;
    st(ds + r * t + j, g);  // ds may alias dp: read above by this thread
  }
}

// Rows of up to PER x blockDim keys (T <= 2048) are read once into registers: thread x holds keys
// x, x + blockDim, ... (the keys the loops above give it, so the same sums and bits), so each
// score is read and exponentiated once, and masked keys are never read. Without a padding mask
// every row sees i + 1 >= 1 keys and needs no count. Longer rows take the kernels above.
template <class EP, class ES, int PER>
__global__ void softmax_fwd_reg_kernel(float* p32, EP* p_lp, const float* s, AttnDims a) {
  __shared__ float sh[32];
  const auto [r, t, n, mk] = row_of(a);
  float* pr = p32 + r * t;
  const float* sr = s + r * t;
  float x[PER];
  uint32_t visible = 0;
  float cnt = 0.f, mx = -INFINITY;
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    const int64_t j = threadIdx.x + int64_t(q) * blockDim.x;
    x[q] = 0.f;
    if (j < n && key_real(mk, j)) {
      visible |= 1u << q;
      x[q] = round_to<ES>(a.scale * sr[j]);
      cnt += 1.f, mx = nan_max(mx, x[q]);
    }
  }
  cnt = mk ? block_reduce(cnt, sh, SumOp{}, 0.f) : 1.f;
  mx = block_reduce(mx, sh, MaxOp{}, -INFINITY);
  float sum = 0.f;
#pragma unroll
  for (int q = 0; q < PER; ++q)
    if (cnt > 0 && (visible >> q & 1)) x[q] = expf(x[q] - mx), sum += x[q];
  sum = block_reduce(sum, sh, SumOp{}, 0.f);
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    const int64_t j = threadIdx.x + int64_t(q) * blockDim.x;
    if (j < t) {
      const float p = cnt > 0 && (visible >> q & 1) ? x[q] / sum : 0.f;
      pr[j] = p;  // p32 may alias s: this thread read its s[j] above
      if (p_lp) st(p_lp + r * t + j, p);
    }
  }
}

template <class ED, class EG, int PER>
__global__ void softmax_bwd_reg_kernel(ED* ds, const float* p32, const EG* dp, AttnDims a) {
  __shared__ float sh[32];
  const auto [r, t, n, mk] = row_of(a);
  const float* pr = p32 + r * t;
  float pv[PER], g[PER];
  uint32_t visible = 0;
  float dot = 0.f;
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    const int64_t j = threadIdx.x + int64_t(q) * blockDim.x;
    pv[q] = g[q] = 0.f;
    if (j < n && key_real(mk, j)) {
      visible |= 1u << q;
      pv[q] = pr[j], g[q] = ld(dp + r * t + j);
      dot += g[q] * pv[q];
    }
  }
  dot = block_reduce(dot, sh, SumOp{}, 0.f);
#pragma unroll
  for (int q = 0; q < PER; ++q) {
    const int64_t j = threadIdx.x + int64_t(q) * blockDim.x;
    if (j < t)
      st(ds + r * t + j, visible >> q & 1 ? pv[q] * (g[q] - dot) : 0.f);  // ds may alias dp
  }
}

// The block size of a row (as the loops above), and PER as a compile-time constant for f; false
// for rows too long for registers.
int row_threads_for(int64_t t) { return t >= 512 ? 256 : 128; }
template <class F>
bool with_keys_per_thread(int64_t t, F&& f) {
  const int64_t per = (t + row_threads_for(t) - 1) / row_threads_for(t);
  if (per <= 4)
    f(std::integral_constant<int, 4>{});
  else if (per <= 8)
    f(std::integral_constant<int, 8>{});
  else
    return false;
  return true;
}

void attn_softmax_forward(float* p32, void* p_lp, DType p_dt, const void* s_raw, DType s_dt,
                          DType score_dt, const AttentionDims& ad) {
  KEEL_CHECK(s_dt == DType::F32, "attention softmax: CUDA takes raw f32 scores");
  const float* s = static_cast<const float*>(s_raw);
  const AttnDims a = attn_dims_of(ad);
  const int64_t rows = a.batch * a.hq * a.t;
  if (rows <= 0) return;
  const int threads = row_threads_for(a.t);
  const bool in_registers = with_keys_per_thread(a.t, [&](auto per) {
    KEEL_CUDA_FLOAT_TYPES(score_dt, ES, {
      if (p_lp) {
        KEEL_CUDA_FLOAT_TYPES(p_dt, EP,
                              KEEL_LAUNCH(rows, threads, 0, softmax_fwd_reg_kernel<EP, ES, per()>)(
                                  p32, (EP*)p_lp, s, a));
      } else {
        KEEL_LAUNCH(rows, threads, 0, softmax_fwd_reg_kernel<float, ES, per()>)(p32, nullptr, s, a);
      }
    });
  });
  if (!in_registers) {
    KEEL_CUDA_FLOAT_TYPES(score_dt, ES, {
      if (p_lp) {
        KEEL_CUDA_FLOAT_TYPES(
            p_dt, EP,
            KEEL_LAUNCH(rows, threads, 0, softmax_fwd_kernel<EP, ES>)(p32, (EP*)p_lp, s, a));
      } else {
        KEEL_LAUNCH(rows, threads, 0, softmax_fwd_kernel<float, ES>)(p32, nullptr, s, a);
      }
    });
  }
  KEEL_CUDA_LAUNCHED();
}

void attn_softmax_backward(void* ds, DType ds_dt, const float* p32, const void* dp, DType dp_dt,
                           void* p_lp, const AttentionDims& ad) {
  const AttnDims a = attn_dims_of(ad);
  const int64_t rows = a.batch * a.hq * a.t;
  if (rows <= 0) return;
  if (p_lp) convert_async(p_lp, ds_dt, p32, DType::F32, rows * a.t);  // a pass of its own here
  const int threads = row_threads_for(a.t);
  const bool in_registers = with_keys_per_thread(a.t, [&](auto per) {
    KEEL_CUDA_FLOAT_TYPES(ds_dt, ED, KEEL_CUDA_FLOAT_TYPES(dp_dt, EG, {
                            KEEL_LAUNCH(rows, threads, 0, softmax_bwd_reg_kernel<ED, EG, per()>)
                            ((ED*)ds, p32, (const EG*)dp, a);
                          }));
  });
  if (!in_registers) {
    KEEL_CUDA_FLOAT_TYPES(ds_dt, ED, KEEL_CUDA_FLOAT_TYPES(dp_dt, EG, {
                            KEEL_LAUNCH(rows, threads, 0, softmax_bwd_kernel<ED, EG>)
                            ((ED*)ds, p32, (const EG*)dp, a);
                          }));
  }
  KEEL_CUDA_LAUNCHED();
}

// acc[dd] += coef(c) * tile[c][dd] over the tile's 32 keys c in order, where lane c holds coef(c)
// (P or dS of its key) and each lane accumulates the head dims lane, lane + 32, ... (the P·V of
// the forward, the dS·K of dQ).
template <int NDV>
__device__ __forceinline__ void accumulate_keys(float (&acc)[NDV], float coef, const float* tile,
                                                int64_t p, int64_t d, int lane) {
#pragma unroll 4
  for (int c = 0; c < kTile; ++c) {
    const float cc = __shfl_sync(0xffffffffu, coef, c);
#pragma unroll
    for (int x = 0; x < NDV; ++x) {
      const int64_t dd = lane + 32 * x;
      if (dd < d) acc[x] += cc * tile[c * p + dd];
    }
  }
}

// ---- flash forward --------------------------------------------------------------------------

template <class T, int NDV>
__global__ void __launch_bounds__(kWarps * 32)
    flash_fwd_kernel(T* o, float* lse, const T* q, const T* k, const T* v, AttnDims a) {
  KEEL_DYNAMIC_SMEM(smem_bytes);
  float* smem = reinterpret_cast<float*>(smem_bytes);
  const int64_t t = a.t, d = a.d, p = d + 1, group = a.hq / a.hkv;
  float* qs = smem;
  float* ks = qs + kTile * p;
  float* vs = ks + kTile * p;
  const int64_t ntiles = (t + kTile - 1) / kTile;
  const int64_t qt = blockIdx.x % ntiles, h = (blockIdx.x / ntiles) % a.hq,
                b = blockIdx.x / (ntiles * a.hq);
  const int64_t i0 = qt * kTile, i1 = min(t, i0 + kTile);
  const uint8_t* mk = a.mask ? a.mask + b * t : nullptr;
  const int64_t first = first_real_key(mk, t);
  const T* qb = q + (b * a.hq + h) * t * d;
  const T* kb = k + (b * a.hkv + h / group) * t * d;
  const T* vb = v + (b * a.hkv + h / group) * t * d;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  load_tile(qs, qb, i0, t, d);
  float m[kPerWarp], l[kPerWarp], acc[kPerWarp][NDV];
#pragma unroll
  for (int rr = 0; rr < kPerWarp; ++rr) {
    m[rr] = -INFINITY, l[rr] = 0.f;
#pragma unroll
    for (int x = 0; x < NDV; ++x) acc[rr][x] = 0.f;
  }
  for (int64_t j0 = 0; j0 < i1; j0 += kTile) {
    if (min(i1, j0 + kTile) <= first) continue;  // only padding keys (block-uniform)
    __syncthreads();
    load_tile(ks, kb, j0, t, d);
    load_tile(vs, vb, j0, t, d);
    __syncthreads();
    const int64_t j = j0 + lane;
#pragma unroll
    for (int rr = 0; rr < kPerWarp; ++rr) {
      const int r = warp * kPerWarp + rr;
      const int64_t i = i0 + r;
      if (i >= t || i < first || j0 > i) continue;  // warp-uniform
      const bool vis = j <= i && key_real(mk, j);
      const float s = dot_rows(qs + r * p, ks + lane * p, d) * a.scale;
      if (!__any_sync(0xffffffffu, vis)) continue;
      const float mt = warp_max(vis ? s : -INFINITY);
      const float mnew = nan_max(m[rr], mt), alpha = expf(m[rr] - mnew);
      float pj = vis ? expf(s - mnew) : 0.f;
      l[rr] = l[rr] * alpha + warp_sum(pj);  // the sum of the f32 probabilities
      m[rr] = mnew;
      pj = round_to<T>(pj);  // the P tile in the compute dtype before P·V
#pragma unroll
      for (int x = 0; x < NDV; ++x) acc[rr][x] *= alpha;
      accumulate_keys<NDV>(acc[rr], pj, vs, p, d, lane);
    }
  }
#pragma unroll
  for (int rr = 0; rr < kPerWarp; ++rr) {
    const int64_t i = i0 + warp * kPerWarp + rr;
    if (i >= t) continue;
    const int64_t row = (b * a.hq + h) * t + i;
    const bool masked = i < first;  // fully masked row: 0 out, lse -inf
#pragma unroll
    for (int x = 0; x < NDV; ++x) {
      const int64_t dd = lane + 32 * x;
      if (dd < d) st(o + row * d + dd, masked ? 0.f : acc[rr][x] / l[rr]);
    }
    if (lane == 0) lse[row] = masked ? -INFINITY : m[rr] + logf(l[rr]);
  }
}

size_t tiles_smem(int tiles, int64_t d) { return static_cast<size_t>(tiles) * kTile * (d + 1) * 4; }

void check_head_dim(const AttnDims& a) {
  if (a.d > kMaxHeadDim)
    throw Error("attention = \"flash\" on CUDA supports head dims up to " +
                    std::to_string(kMaxHeadDim) + ", this model has " + std::to_string(a.d) +
                    "; use model.attention = \"eager\"",
                Error::kUsage);
}

template <class T, int NDV>
void flash_fwd_launch(void* o, float* lse, const void* q, const void* k, const void* v,
                      const AttnDims& a) {
  const size_t smem = tiles_smem(3, a.d);
  auto kernel = flash_fwd_kernel<T, NDV>;
  allow_smem(kernel, smem);
  const int64_t blocks = a.batch * a.hq * ((a.t + kTile - 1) / kTile);
  KEEL_LAUNCH(blocks, kWarps * 32, smem, kernel)
  ((T*)o, lse, (const T*)q, (const T*)k, (const T*)v, a);
  KEEL_CUDA_LAUNCHED();
}

void attn_flash_forward(void* o, float* lse, const void* q, const void* k, const void* v, DType dt,
                        const AttentionDims& ad) {
  const AttnDims a = attn_dims_of(ad);
  check_head_dim(a);
  if (a.batch * a.hq * a.t <= 0) return;
  if (flash_mma_forward(o, lse, q, k, v, dt, a)) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (a.d <= 64)
      flash_fwd_launch<T, 2>(o, lse, q, k, v, a);
    else
      flash_fwd_launch<T, 4>(o, lse, q, k, v, a);
  });
}

// ---- flash backward -------------------------------------------------------------------------

// drow[r] = sum_d dO[r, d] * O[r, d] (one warp per row).
template <class T>
__global__ void flash_drow_kernel(float* drow, const T* o, const T* dout, int64_t rows, int64_t d) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r >= rows) return;
  float s = 0.f;
  for (int64_t x = threadIdx.x & 31; x < d; x += 32) s += ld(dout + r * d + x) * ld(o + r * d + x);
  s = warp_sum(s);
  if ((threadIdx.x & 31) == 0) drow[r] = s;
}

// dK, dV for one key tile of one kv head: each warp owns 8 keys; lanes hold head dims.
template <class T, int NDV>
__global__ void __launch_bounds__(kWarps * 32)
    flash_dkdv_kernel(T* dk, T* dv, const T* q, const T* k, const T* v, const T* dout,
                      const float* lse, const float* drow, AttnDims a) {
  KEEL_DYNAMIC_SMEM(smem_bytes);
  float* smem = reinterpret_cast<float*>(smem_bytes);
  const int64_t t = a.t, d = a.d, p = d + 1, group = a.hq / a.hkv;
  float* ks = smem;
  float* vs = ks + kTile * p;
  float* qs = vs + kTile * p;
  float* dos = qs + kTile * p;
  const int64_t nkt = (t + kTile - 1) / kTile;
  const int64_t kt = blockIdx.x % nkt, kvh = (blockIdx.x / nkt) % a.hkv,
                b = blockIdx.x / (nkt * a.hkv);
  const int64_t j0 = kt * kTile, j1 = min(t, j0 + kTile);
  const uint8_t* mk = a.mask ? a.mask + b * t : nullptr;
  const int64_t first = first_real_key(mk, t);
  const int64_t kvoff = (b * a.hkv + kvh) * t * d;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float gk[kPerWarp][NDV], gv[kPerWarp][NDV];
#pragma unroll
  for (int cc = 0; cc < kPerWarp; ++cc)
#pragma unroll
    for (int x = 0; x < NDV; ++x) gk[cc][x] = gv[cc][x] = 0.f;
  if (j1 > first) {  // else only padding keys: zero gradients
    load_tile(ks, k + kvoff, j0, t, d);
    load_tile(vs, v + kvoff, j0, t, d);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g, hoff = (b * a.hq + h) * t;
      for (int64_t ic = max(j0, first); ic < t; ic += kTile) {
        __syncthreads();
        load_tile(qs, q + hoff * d, ic, t, d);
        load_tile(dos, dout + hoff * d, ic, t, d);
        __syncthreads();
        const int64_t i = ic + lane;  // this lane's query row
        const float lse_i = i < t ? lse[hoff + i] : 0.f, d_i = i < t ? drow[hoff + i] : 0.f;
#pragma unroll
        for (int cc = 0; cc < kPerWarp; ++cc) {
          const int c = warp * kPerWarp + cc;
          const int64_t j = j0 + c;
          const bool vis = i < t && j < t && j <= i && key_real(mk, j);
          float pj = 0.f, dsj = 0.f;
          if (vis) {
            pj = expf(dot_rows(qs + lane * p, ks + c * p, d) * a.scale - lse_i);
            dsj = pj * (dot_rows(dos + lane * p, vs + c * p, d) - d_i);
          }
          pj = round_to<T>(pj);  // P and dS in the compute dtype before their products
          dsj = round_to<T>(dsj);
#pragma unroll 4
          for (int r = 0; r < kTile; ++r) {
            const float pr = __shfl_sync(0xffffffffu, pj, r);
            const float dr = __shfl_sync(0xffffffffu, dsj, r);
#pragma unroll
            for (int x = 0; x < NDV; ++x) {
              const int64_t dd = lane + 32 * x;
              if (dd < d) {
                gv[cc][x] += pr * dos[r * p + dd];
                gk[cc][x] += dr * qs[r * p + dd];
              }
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int cc = 0; cc < kPerWarp; ++cc) {
    const int64_t j = j0 + warp * kPerWarp + cc;
    if (j >= t) continue;
#pragma unroll
    for (int x = 0; x < NDV; ++x) {
      const int64_t dd = lane + 32 * x;
      if (dd >= d) continue;
      if (dk) st(dk + kvoff + j * d + dd, gk[cc][x] * a.scale);
      if (dv) st(dv + kvoff + j * d + dd, gv[cc][x]);
    }
  }
}

// dQ for one query tile: each warp owns 8 query rows; lanes are keys for the scores and head
// dims for the accumulation.
template <class T, int NDV>
__global__ void __launch_bounds__(kWarps * 32)
    flash_dq_kernel(T* dq, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                    const float* drow, AttnDims a) {
  KEEL_DYNAMIC_SMEM(smem_bytes);
  float* smem = reinterpret_cast<float*>(smem_bytes);
  const int64_t t = a.t, d = a.d, p = d + 1, group = a.hq / a.hkv;
  float* qs = smem;
  float* dos = qs + kTile * p;
  float* ks = dos + kTile * p;
  float* vs = ks + kTile * p;
  const int64_t ntiles = (t + kTile - 1) / kTile;
  const int64_t qt = blockIdx.x % ntiles, h = (blockIdx.x / ntiles) % a.hq,
                b = blockIdx.x / (ntiles * a.hq);
  const int64_t i0 = qt * kTile, i1 = min(t, i0 + kTile);
  const uint8_t* mk = a.mask ? a.mask + b * t : nullptr;
  const int64_t first = first_real_key(mk, t);
  const int64_t hoff = (b * a.hq + h) * t;
  const int64_t kvoff = (b * a.hkv + h / group) * t * d;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  load_tile(qs, q + hoff * d, i0, t, d);
  load_tile(dos, dout + hoff * d, i0, t, d);
  float acc[kPerWarp][NDV];
#pragma unroll
  for (int rr = 0; rr < kPerWarp; ++rr)
#pragma unroll
    for (int x = 0; x < NDV; ++x) acc[rr][x] = 0.f;
  for (int64_t j0 = 0; j0 < i1; j0 += kTile) {
    if (min(i1, j0 + kTile) <= first) continue;  // block-uniform
    __syncthreads();
    load_tile(ks, k + kvoff, j0, t, d);
    load_tile(vs, v + kvoff, j0, t, d);
    __syncthreads();
    const int64_t j = j0 + lane;
#pragma unroll
    for (int rr = 0; rr < kPerWarp; ++rr) {
      const int r = warp * kPerWarp + rr;
      const int64_t i = i0 + r;
      if (i >= t || i < first || j0 > i) continue;  // warp-uniform
      const bool vis = j <= i && key_real(mk, j);
      float dsj = 0.f;
      if (vis) {
        const float pj = expf(dot_rows(qs + r * p, ks + lane * p, d) * a.scale - lse[hoff + i]);
        dsj = pj * (dot_rows(dos + r * p, vs + lane * p, d) - drow[hoff + i]);
      }
      dsj = round_to<T>(dsj);
      accumulate_keys<NDV>(acc[rr], dsj, ks, p, d, lane);
    }
  }
#pragma unroll
  for (int rr = 0; rr < kPerWarp; ++rr) {
    const int64_t i = i0 + warp * kPerWarp + rr;
    if (i >= t) continue;
#pragma unroll
    for (int x = 0; x < NDV; ++x) {
      const int64_t dd = lane + 32 * x;
      if (dd < d) st(dq + (hoff + i) * d + dd, acc[rr][x] * a.scale);
    }
  }
}

template <class T, int NDV>
void flash_bwd_launch(void* dq, void* dk, void* dv, const void* q, const void* k, const void* v,
                      const void* dout, const float* lse, const float* drow, const AttnDims& a) {
  const size_t smem = tiles_smem(4, a.d);
  if (dk || dv) {
    auto kernel = flash_dkdv_kernel<T, NDV>;
    allow_smem(kernel, smem);
    const int64_t blocks = a.batch * a.hkv * ((a.t + kTile - 1) / kTile);
    KEEL_LAUNCH(blocks, kWarps * 32, smem, kernel)
    ((T*)dk, (T*)dv, (const T*)q, (const T*)k, (const T*)v, (const T*)dout, lse, drow, a);
    KEEL_CUDA_LAUNCHED();
  }
  if (dq) {
    auto kernel = flash_dq_kernel<T, NDV>;
    allow_smem(kernel, smem);
    const int64_t blocks = a.batch * a.hq * ((a.t + kTile - 1) / kTile);
    KEEL_LAUNCH(blocks, kWarps * 32, smem, kernel)
    ((T*)dq, (const T*)q, (const T*)k, (const T*)v, (const T*)dout, lse, drow, a);
    KEEL_CUDA_LAUNCHED();
  }
}

void attn_flash_backward(void* dq, void* dk, void* dv, const void* q, const void* k, const void* v,
                         const void* o, const void* dout, const float* lse, DType dt,
                         const AttentionDims& ad) {
  const AttnDims a = attn_dims_of(ad);
  check_head_dim(a);
  const int64_t rows = a.batch * a.hq * a.t;
  if (rows <= 0 || (!dq && !dk && !dv)) return;
  Scratch drow(static_cast<size_t>(rows) * 4);
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    KEEL_LAUNCH((rows + 7) / 8, 256, 0, flash_drow_kernel<T>)
    (drow.as<float>(), (const T*)o, (const T*)dout, rows, a.d);
    KEEL_CUDA_LAUNCHED();
    if (flash_mma_backward(dq, dk, dv, q, k, v, dout, lse, drow.as<float>(), dt, a)) return;
    if (a.d <= 64)
      flash_bwd_launch<T, 2>(dq, dk, dv, q, k, v, dout, lse, drow.as<float>(), a);
    else
      flash_bwd_launch<T, 4>(dq, dk, dv, q, k, v, dout, lse, drow.as<float>(), a);
  });
}

const AttentionKernels kAttention = {attn_softmax_forward, attn_softmax_backward,
                                     attn_flash_forward, attn_flash_backward};

}  // namespace

const AttentionKernels& attention_table() { return kAttention; }

}  // namespace keel::cuda
