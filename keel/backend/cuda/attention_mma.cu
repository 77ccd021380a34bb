// Flash attention on tensor cores (bf16 and f16, head dims 64 and 128, sm_80 and later): the
// semantics of the CUDA-core flash kernels of attention.cu with the products on WMMA 16x16x16
// fragments (16-bit inputs, f32 accumulation). Forward: an f32 online softmax (running max and
// sum per row), the P tile rounded to the compute dtype before P·V. Backward (FlashAttention-2):
// P recomputed from lse, P and dS rounded to the compute dtype before their products, dK/dV per
// key tile and dQ per query tile, each accumulated in a fixed order without atomics, so a step is
// bit-reproducible. Query i sees key j when j <= i and the key is real; a row that sees no key
// gives 0 and lse = -inf.
//
// A block is 4 warps over 64 rows (queries in the forward and dQ, keys in dK/dV), 16 per warp,
// and walks the other side in tiles of 64. The 64-row tiles sit in shared memory in their 16-bit
// dtype (rows padded by 8 elements against bank conflicts); each warp has its own f32 score tile
// and 16-bit P / dS tiles. The softmax reads scores from shared memory (a fragment's register
// layout is unspecified), two lanes per row, 32 keys each. The forward keeps its output
// accumulator in shared memory too, where each row's rescaling by exp(m_old - m_new) can reach it;
// the backward's accumulators never need rescaling and stay in fragments.
//
// Off unless KEEL_CUDA_FLASH_MMA=1: written without a GPU (session 45) and not yet run on one.
// tests/cuda_emulated runs these kernels on the CPU through a host emulator of blocks, warps and
// WMMA tiles (their logic: tiles, masks, synchronization, rounding points) on every machine;
// `CudaOps.FlashOnTensorCoresMatchesTheCpu` (tests/cuda) checks them on a GPU.
#include <mma.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "keel/backend/cuda/attention.cuh"

namespace keel::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kRows = 64;  // rows of a block: 16 per warp
constexpr int kCols = 64;  // keys (forward, dQ) or queries (dK/dV) of one inner tile
constexpr int kWarps = kRows / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kSLd = kCols + 4;  // f32 score rows (a multiple of 4 floats, as WMMA requires)
constexpr int kPLd = kCols + 8;  // 16-bit P / dS rows (a multiple of 8 elements)

template <int D>
constexpr int kLd = D + 8;  // 16-bit Q / K / V / dO tile rows
template <int D>
constexpr size_t kTileBytes = size_t(kRows) * kLd<D> * 2;
constexpr size_t kScoreBytes = size_t(16) * kSLd * 4;
constexpr size_t kPBytes = size_t(16) * kPLd * 2;

template <class T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <class T, class Layout>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, Layout>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Rows [r0, r0 + 64) of a [t, D] matrix into a [64, D + 8] tile of the same dtype, zeros past t
// (a zero row times a zero probability: never garbage times zero, which could be NaN). 16-byte
// moves: the host checks that the tensors are 16-byte aligned, and D is a multiple of 8.
template <class T, int D>
__device__ void load_rows(T* tile, const T* src, int64_t r0, int64_t t) {
  constexpr int kChunks = D / 8;  // 8 elements of 16 bits each
  for (int e = threadIdx.x; e < kRows * kChunks; e += kThreads) {
    const int r = e / kChunks, c = e % kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < t) v = *reinterpret_cast<const uint4*>(src + (r0 + r) * D + c * 8);
    *reinterpret_cast<uint4*>(tile + r * kLd<D> + c * 8) = v;
  }
}

// acc[n] (16 x 16 each) += A (16 x 16·KK, row-major at a, leading dimension lda) times B, where
// B is 16·KK x 16·N: b_at(kk, n) is the address of its (kk, n) 16 x 16 block.
template <class T, class Layout, int KK, int N, class BAt>
__device__ __forceinline__ void mma_rows(FragC (&acc)[N], const T* a, int lda, BAt b_at, int ldb) {
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) {
    FragA<T> fa;
    wmma::load_matrix_sync(fa, a + kk * 16, lda);
#pragma unroll
    for (int n = 0; n < N; ++n) {
      FragB<T, Layout> fb;
      wmma::load_matrix_sync(fb, b_at(kk, n), ldb);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// S (16 x 64, f32, row-major at s) = A (16 x D, row-major at a) times the transpose of the 64
// rows at b (each D long): Q·Kᵀ, K·Qᵀ, dO·Vᵀ, V·dOᵀ.
template <class T, int D>
__device__ __forceinline__ void scores(float* s, const T* a, const T* b) {
  FragC acc[kCols / 16];
#pragma unroll
  for (int n = 0; n < kCols / 16; ++n) wmma::fill_fragment(acc[n], 0.f);
  // Bᵀ as a D x 64 matrix is column-major in b's rows: block (kk, n) starts at row 16n, col 16kk.
  mma_rows<T, wmma::col_major, D / 16, kCols / 16>(
      acc, a, kLd<D>, [&](int kk, int n) { return b + n * 16 * kLd<D> + kk * 16; }, kLd<D>);
#pragma unroll
  for (int n = 0; n < kCols / 16; ++n)
    wmma::store_matrix_sync(s + n * 16, acc[n], kSLd, wmma::mem_row_major);
}

// acc (16 x D) += P (16 x 64, row-major at p) times the 64 rows at b (each D long): P·V, dS·K,
// Pᵀ·dO, dSᵀ·Q.
template <class T, int D>
__device__ __forceinline__ void accumulate(FragC (&acc)[D / 16], const T* p, const T* b) {
  mma_rows<T, wmma::row_major, kCols / 16, D / 16>(
      acc, p, kPLd, [&](int kk, int n) { return b + kk * 16 * kLd<D> + n * 16; }, kLd<D>);
}

// A block's shared memory: `Tiles` 64-row tiles in the 16-bit dtype, then each warp's scratch: an
// f32 16 x 64 score tile, two 16-bit 16 x 64 tiles (P and dS, or Pᵀ and dSᵀ) and, for the
// forward (Out), its f32 16 x D output rows. Every piece starts on a 32-byte boundary (WMMA).
template <class T, int D, int Tiles, bool Out>
struct Smem {
  static constexpr size_t kWarpBytes =
      kScoreBytes + 2 * kPBytes + (Out ? size_t(16) * (D + 4) * 4 : 0);
  static constexpr size_t kBytes = Tiles * kTileBytes<D> + kWarps * kWarpBytes;
  T* tile[Tiles];
  float* scores;
  T* p;
  T* ds;
  float* out;
  __device__ explicit Smem(unsigned char* base) {
#pragma unroll
    for (int i = 0; i < Tiles; ++i) tile[i] = reinterpret_cast<T*>(base + i * kTileBytes<D>);
    unsigned char* mine = base + Tiles * kTileBytes<D> + (threadIdx.x >> 5) * kWarpBytes;
    scores = reinterpret_cast<float*>(mine);
    p = reinterpret_cast<T*>(mine + kScoreBytes);
    ds = reinterpret_cast<T*>(mine + kScoreBytes + kPBytes);
    out = Out ? reinterpret_cast<float*>(mine + kScoreBytes + 2 * kPBytes) : nullptr;
  }
};
template <class T, int D>
using FwdSmem = Smem<T, D, 3, true>;  // Q, K, V
template <class T, int D>
using BwdSmem = Smem<T, D, 4, false>;  // K, V, Q, dO (dK/dV); Q, dO, K, V (dQ)

// The block's place: blocks walk 64-row tiles, then `heads` heads, then the batch; its rows
// [r0, r1), its batch row's padding mask and first real key (computed by the whole block).
struct Place {
  int64_t r0, r1, head, b;
  const uint8_t* mk;
  int64_t first;
};
__device__ Place place_of(const AttnDims& a, int64_t heads) {
  const int64_t tiles = (a.t + kRows - 1) / kRows;
  Place p;
  p.r0 = blockIdx.x % tiles * kRows;
  p.r1 = min(a.t, p.r0 + kRows);
  p.head = blockIdx.x / tiles % heads;
  p.b = blockIdx.x / (tiles * heads);
  p.mk = a.mask ? a.mask + p.b * a.t : nullptr;
  p.first = first_real_key(p.mk, a.t);
  return p;
}

// ---- forward --------------------------------------------------------------------------------

template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_mma_fwd_kernel(T* o, float* lse, const T* q, const T* k, const T* v, AttnDims a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  KEEL_DYNAMIC_SMEM(smem);
  constexpr int kOLd = D + 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const FwdSmem<T, D> sm(smem);
  T *qs = sm.tile[0], *ks = sm.tile[1], *vs = sm.tile[2], *pt = sm.p;
  float *sc = sm.scores, *oacc = sm.out;

  const int64_t t = a.t, group = a.hq / a.hkv;
  const auto [i0, i1, h, b, mk, first] = place_of(a, a.hq);
  const T* qb = q + (b * a.hq + h) * t * D;
  const T* kb = k + (b * a.hkv + h / group) * t * D;
  const T* vb = v + (b * a.hkv + h / group) * t * D;
  // This warp's rows [w0, w0 + 16); lane pair (2r, 2r + 1) owns row r, each lane half its keys
  // and half its head dims.
  const int64_t w0 = i0 + warp * 16, wlast = min(t, w0 + 16) - 1;
  const int lr = lane >> 1, half = lane & 1;
  const int64_t i = w0 + lr;
  float m = -INFINITY, l = 0.f;  // the row's running max (of scaled scores) and sum

  for (int x = lane; x < 16 * kOLd; x += 32) oacc[x] = 0.f;
  load_rows<T, D>(qs, qb, i0, t);
  for (int64_t j0 = 0; j0 < i1; j0 += kCols) {
    if (min(i1, j0 + kCols) <= first) continue;  // only padding keys (block-uniform)
    __syncthreads();
    load_rows<T, D>(ks, kb, j0, t);
    load_rows<T, D>(vs, vb, j0, t);
    __syncthreads();
    if (w0 >= t || wlast < j0 || wlast < first) continue;  // no row of this warp sees them
    scores<T, D>(sc, qs + warp * 16 * kLd<D>, ks);
    __syncwarp();
    // The online softmax of row lr over keys j0 + 32·half + c.
    const float* srow = sc + lr * kSLd + half * 32;
    T* prow = pt + lr * kPLd + half * 32;
    float mt = -INFINITY;
    bool any = false;
    for (int c = 0; c < 32; ++c) {
      const int64_t j = j0 + half * 32 + c;
      if (i < t && j <= i && key_real(mk, j)) mt = nan_max(mt, srow[c] * a.scale), any = true;
    }
    mt = nan_max(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    any = __shfl_xor_sync(0xffffffffu, int(any), 1) || any;
    float alpha = 1.f, sum = 0.f;
    if (any) {
      const float mnew = nan_max(m, mt);
      alpha = expf(m - mnew);  // 0 for the row's first visible keys (m = -inf)
      for (int c = 0; c < 32; ++c) {
        const int64_t j = j0 + half * 32 + c;
        float p = 0.f;
        if (i < t && j <= i && key_real(mk, j)) p = expf(srow[c] * a.scale - mnew);
        sum += p;         // the sum of the f32 probabilities
        st(prow + c, p);  // the P tile in the compute dtype before P·V
      }
      m = mnew;
    } else {
      for (int c = 0; c < 32; ++c) st(prow + c, 0.f);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    if (alpha != 1.f)
      for (int x = half * (D / 2); x < (half + 1) * (D / 2); ++x) oacc[lr * kOLd + x] *= alpha;
    __syncwarp();
    FragC acc[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
      wmma::load_matrix_sync(acc[n], oacc + n * 16, kOLd, wmma::mem_row_major);
    accumulate<T, D>(acc, pt, vs);
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
      wmma::store_matrix_sync(oacc + n * 16, acc[n], kOLd, wmma::mem_row_major);
    __syncwarp();
  }
  __syncwarp();
  if (i < t) {
    const int64_t row = (b * a.hq + h) * t + i;
    const bool masked = i < first;  // sees no key: 0 out, lse -inf
    for (int x = half * (D / 2); x < (half + 1) * (D / 2); ++x)
      st(o + row * D + x, masked ? 0.f : oacc[lr * kOLd + x] / l);
    if (half == 0) lse[row] = masked ? -INFINITY : m + logf(l);
  }
#endif
}

// ---- backward -------------------------------------------------------------------------------

// Writes a warp's 16 x D accumulator, times `scale`, to rows [r0, r0 + 16) of out (rows past t
// dropped), through its 16 x 16 f32 scratch tile.
template <class T, int D>
__device__ void store_rows(T* out, FragC (&acc)[D / 16], float* scratch, int64_t r0, int64_t t,
                           float scale) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::store_matrix_sync(scratch, acc[n], kSLd, wmma::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {
      const int r = e / 16, c = e % 16;
      if (r0 + r < t) st(out + (r0 + r) * D + n * 16 + c, scratch[r * kSLd + c] * scale);
    }
    __syncwarp();
  }
}

// dK, dV for 64 keys of one kv head, over the query tiles of each of its query heads; warp w owns
// keys [j0 + 16w, j0 + 16w + 16) and computes Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (keys as rows).
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_mma_dkdv_kernel(T* dk, T* dv, const T* q, const T* k, const T* v, const T* dout,
                          const float* lse, const float* drow, AttnDims a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  KEEL_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const BwdSmem<T, D> sm(smem);
  T *ks = sm.tile[0], *vs = sm.tile[1], *qs = sm.tile[2], *dos = sm.tile[3];
  T *pt = sm.p, *dst = sm.ds;  // Pᵀ and dSᵀ, 16 keys x 64 queries
  float* sc = sm.scores;

  const int64_t t = a.t, group = a.hq / a.hkv;
  const auto [j0, j1, kvh, b, mk, first] = place_of(a, a.hkv);  // keys [j0, j1) of kv head kvh
  const int64_t kvoff = (b * a.hkv + kvh) * t * D;
  const int64_t w0 = j0 + warp * 16;  // this warp's first key

  FragC gk[D / 16], gv[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(gk[n], 0.f), wmma::fill_fragment(gv[n], 0.f);
  if (j1 > first) {  // else only padding keys: zero gradients
    load_rows<T, D>(ks, k + kvoff, j0, t);
    load_rows<T, D>(vs, v + kvoff, j0, t);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t hoff = (b * a.hq + kvh * group + g) * t;
      for (int64_t ic = max(j0, first); ic < t; ic += kCols) {
        __syncthreads();
        load_rows<T, D>(qs, q + hoff * D, ic, t);
        load_rows<T, D>(dos, dout + hoff * D, ic, t);
        __syncthreads();
        if (w0 >= t || ic + kCols - 1 < w0) continue;  // no query of the tile sees these keys
        // Lane owns queries ic + lane and ic + lane + 32 (columns of Sᵀ), over the 16 keys.
        scores<T, D>(sc, ks + warp * 16 * kLd<D>, qs);
        __syncwarp();
        float p[2][16];
        uint32_t seen = 0;  // bit 16u + c: query col u sees key c (else dS is 0, whatever dP)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int col = lane + 32 * u;
          const int64_t i = ic + col;
          const float lse_i = i < t ? lse[hoff + i] : 0.f;
#pragma unroll
          for (int c = 0; c < 16; ++c) {
            const int64_t j = w0 + c;
            p[u][c] = 0.f;
            if (i < t && j < t && j <= i && key_real(mk, j)) {
              seen |= 1u << (16 * u + c);
              p[u][c] = expf(sc[c * kSLd + col] * a.scale - lse_i);
            }
            st(pt + c * kPLd + col, p[u][c]);  // P in the compute dtype before Pᵀ·dO
          }
        }
        __syncwarp();
        scores<T, D>(sc, vs + warp * 16 * kLd<D>, dos);  // dPᵀ
        __syncwarp();
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int col = lane + 32 * u;
          const int64_t i = ic + col;
          const float d_i = i < t ? drow[hoff + i] : 0.f;
#pragma unroll
          for (int c = 0; c < 16; ++c) {  // dS in the compute dtype before dSᵀ·Q
            const bool vis = seen >> (16 * u + c) & 1;
            st(dst + c * kPLd + col, vis ? p[u][c] * (sc[c * kSLd + col] - d_i) : 0.f);
          }
        }
        __syncwarp();
        accumulate<T, D>(gv, pt, dos);
        accumulate<T, D>(gk, dst, qs);
        __syncwarp();
      }
    }
  }
  store_rows<T, D>(dk + kvoff, gk, sc, w0, t, a.scale);
  store_rows<T, D>(dv + kvoff, gv, sc, w0, t, 1.f);
#endif
}

// dQ for 64 queries of one head, over its key tiles; warp w owns rows [i0 + 16w, i0 + 16w + 16).
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_mma_dq_kernel(T* dq, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                        const float* drow, AttnDims a) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  KEEL_DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const BwdSmem<T, D> sm(smem);
  T *qs = sm.tile[0], *dos = sm.tile[1], *ks = sm.tile[2], *vs = sm.tile[3], *dst = sm.ds;
  float* sc = sm.scores;

  const int64_t t = a.t, group = a.hq / a.hkv;
  const auto [i0, i1, h, b, mk, first] = place_of(a, a.hq);
  const int64_t hoff = (b * a.hq + h) * t;
  const int64_t kvoff = (b * a.hkv + h / group) * t * D;
  const int64_t w0 = i0 + warp * 16, wlast = min(t, w0 + 16) - 1;
  const int lr = lane >> 1, half = lane & 1;
  const int64_t i = w0 + lr;
  const float lse_i = i < t ? lse[hoff + i] : 0.f, d_i = i < t ? drow[hoff + i] : 0.f;

  FragC acc[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(acc[n], 0.f);
  load_rows<T, D>(qs, q + hoff * D, i0, t);
  load_rows<T, D>(dos, dout + hoff * D, i0, t);
  for (int64_t j0 = 0; j0 < i1; j0 += kCols) {
    if (min(i1, j0 + kCols) <= first) continue;  // block-uniform
    __syncthreads();
    load_rows<T, D>(ks, k + kvoff, j0, t);
    load_rows<T, D>(vs, v + kvoff, j0, t);
    __syncthreads();
    if (w0 >= t || wlast < j0 || wlast < first) continue;  // warp-uniform
    scores<T, D>(sc, qs + warp * 16 * kLd<D>, ks);
    __syncwarp();
    float p[32];
    uint32_t seen = 0;  // bit c: this row sees key c (else dS is 0, whatever dP)
    const float* srow = sc + lr * kSLd + half * 32;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int64_t j = j0 + half * 32 + c;
      p[c] = 0.f;
      if (i < t && j <= i && key_real(mk, j)) {
        seen |= 1u << c;
        p[c] = expf(srow[c] * a.scale - lse_i);
      }
    }
    __syncwarp();
    scores<T, D>(sc, dos + warp * 16 * kLd<D>, vs);  // dP
    __syncwarp();
    T* drow_tile = dst + lr * kPLd + half * 32;
#pragma unroll
    for (int c = 0; c < 32; ++c)  // dS in the compute dtype before dS·K
      st(drow_tile + c, seen >> c & 1 ? p[c] * (srow[c] - d_i) : 0.f);
    __syncwarp();
    accumulate<T, D>(acc, dst, ks);
    __syncwarp();
  }
  store_rows<T, D>(dq + hoff * D, acc, sc, w0, t, a.scale);
#endif
}

}  // namespace

// ---- dispatch -------------------------------------------------------------------------------
namespace {

bool enabled() {
  const char* e = std::getenv("KEEL_CUDA_FLASH_MMA");  // read at each call: tests switch it
  return e && std::strcmp(e, "1") == 0;
}

bool takes(DType dt, int64_t d, std::initializer_list<const void*> ptrs) {
  if (!enabled() || (dt != DType::BF16 && dt != DType::F16) || (d != 64 && d != 128)) return false;
  for (const void* p : ptrs)
    if (p && !aligned_to(p, 16)) return false;
  return compute_capability() >= 80;
}

template <class F>
void with_head_dim(int64_t d, F&& f) {
  if (d == 64)
    f(std::integral_constant<int, 64>{});
  else
    f(std::integral_constant<int, 128>{});
}

// The 16-bit CUDA type of dt (the caller has checked that it is bf16 or f16).
template <class F>
void with_half_type(DType dt, F&& f) {
  if (dt == DType::BF16)
    f(__nv_bfloat16{});
  else
    f(__half{});
}

}  // namespace

bool flash_mma_forward(void* o, float* lse, const void* q, const void* k, const void* v, DType dt,
                       const AttnDims& a) {
  if (!takes(dt, a.d, {o, q, k, v})) return false;
  with_half_type(dt, [&](auto type) {
    using T = decltype(type);
    with_head_dim(a.d, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      auto kernel = flash_mma_fwd_kernel<T, D>;
      constexpr size_t smem = FwdSmem<T, D>::kBytes;
      allow_smem(kernel, smem);
      const int64_t blocks = a.batch * a.hq * ((a.t + kRows - 1) / kRows);
      KEEL_LAUNCH(blocks, kThreads, smem, kernel)
      (static_cast<T*>(o), lse, static_cast<const T*>(q), static_cast<const T*>(k),
       static_cast<const T*>(v), a);
      KEEL_CUDA_LAUNCHED();
    });
  });
  return true;
}

bool flash_mma_backward(void* dq, void* dk, void* dv, const void* q, const void* k, const void* v,
                        const void* dout, const float* lse, const float* drow, DType dt,
                        const AttnDims& a) {
  if (!takes(dt, a.d, {dq, dk, dv, q, k, v, dout})) return false;
  with_half_type(dt, [&](auto type) {
    using T = decltype(type);
    with_head_dim(a.d, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      if (dk || dv) {
        // The kernel writes both: a missing one gets scratch (none when both are wanted).
        Scratch spare(dk && dv ? 0 : static_cast<size_t>(a.batch * a.hkv * a.t * D) * sizeof(T));
        auto kernel = flash_mma_dkdv_kernel<T, D>;
        constexpr size_t smem = BwdSmem<T, D>::kBytes;
        allow_smem(kernel, smem);
        const int64_t blocks = a.batch * a.hkv * ((a.t + kRows - 1) / kRows);
        KEEL_LAUNCH(blocks, kThreads, smem, kernel)
        (static_cast<T*>(dk ? dk : spare.as<void>()), static_cast<T*>(dv ? dv : spare.as<void>()),
         static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
         static_cast<const T*>(dout), lse, drow, a);
        KEEL_CUDA_LAUNCHED();
      }
      if (dq) {
        auto kernel = flash_mma_dq_kernel<T, D>;
        constexpr size_t smem = BwdSmem<T, D>::kBytes;
        allow_smem(kernel, smem);
        const int64_t blocks = a.batch * a.hq * ((a.t + kRows - 1) / kRows);
        KEEL_LAUNCH(blocks, kThreads, smem, kernel)
        (static_cast<T*>(dq), static_cast<const T*>(q), static_cast<const T*>(k),
         static_cast<const T*>(v), static_cast<const T*>(dout), lse, drow, a);
        KEEL_CUDA_LAUNCHED();
      }
    });
  });
  return true;
}

}  // namespace keel::cuda
