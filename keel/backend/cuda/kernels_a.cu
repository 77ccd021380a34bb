// CUDA kernels: element-wise arithmetic and reductions, activations, softmax, LayerNorm/RMSNorm,
// RoPE and dropout. Same semantics as backend/cpu/*.inc (see the family headers): f32 opmath,
// one RNE rounding on store, NaN/inf propagate. Reductions run in fixed launch shapes without
// atomics, so they are deterministic; their order differs from the CPU's (within f32 rounding).
#include "keel/backend/cuda/common.cuh"
#include "keel/backend/cuda/tables.h"

#include <initializer_list>

namespace keel::cuda {
namespace {

constexpr int kThreads = 256;

// ---- element-wise ---------------------------------------------------------------------------

struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct MulOp {
  __device__ float operator()(float a, float b) const { return a * b; }
};
struct AxpbyOp {
  float alpha, beta;
  __device__ float operator()(float a, float b) const { return alpha * a + beta * b; }
};
struct ScaleOp {
  float alpha;
  __device__ float operator()(float a) const { return alpha * a; }
};

// V elements per load and store when the addresses (and, for a row operand, the row length)
// allow: these kernels are bandwidth-bound, and 2-byte scalar loads leave much of it unused.
template <class T, int V, class Op>
__global__ void map1_kernel(T* out, const T* a, int64_t n, Op op) {
  using W = Vec<T, V>;
  KEEL_CUDA_FOR(i, n / V) {
    const W x = reinterpret_cast<const W*>(a)[i];
    W y;
#pragma unroll
    for (int k = 0; k < V; ++k) st(&y.v[k], op(ld(&x.v[k])));
    reinterpret_cast<W*>(out)[i] = y;
  }
  const int64_t tail = n / V * V + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (tail < n) st(out + tail, op(ld(a + tail)));
}
template <class T, int V, class Op>
__global__ void map2_kernel(T* out, const T* a, const T* b, int64_t n, Op op) {
  using W = Vec<T, V>;
  KEEL_CUDA_FOR(i, n / V) {
    const W x = reinterpret_cast<const W*>(a)[i], z = reinterpret_cast<const W*>(b)[i];
    W y;
#pragma unroll
    for (int k = 0; k < V; ++k) st(&y.v[k], op(ld(&x.v[k]), ld(&z.v[k])));
    reinterpret_cast<W*>(out)[i] = y;
  }
  const int64_t tail = n / V * V + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (tail < n) st(out + tail, op(ld(a + tail), ld(b + tail)));
}
// V divides cols here, so a vector never straddles two rows.
template <class T, int V, class Op>
__global__ void map_rows_kernel(T* out, const T* a, const T* row, int64_t n, int64_t cols, Op op) {
  using W = Vec<T, V>;
  const int64_t row_vecs = cols / V;
  KEEL_CUDA_FOR(i, n / V) {
    const W x = reinterpret_cast<const W*>(a)[i], z = reinterpret_cast<const W*>(row)[i % row_vecs];
    W y;
#pragma unroll
    for (int k = 0; k < V; ++k) st(&y.v[k], op(ld(&x.v[k]), ld(&z.v[k])));
    reinterpret_cast<W*>(out)[i] = y;
  }
}

template <class T>
bool vectorizable(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (!aligned_to(p, 4 * sizeof(T))) return false;
  return true;
}

template <class Op>
void map1(void* out, const void* a, DType dt, int64_t n, Op op) {
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (vectorizable<T>({out, a}))
      map1_kernel<T, 4>
          <<<grid_for(n / 4 + 1), kThreads, 0, stream()>>>((T*)out, (const T*)a, n, op);
    else
      map1_kernel<T, 1><<<grid_for(n), kThreads, 0, stream()>>>((T*)out, (const T*)a, n, op);
  });
  KEEL_CUDA_LAUNCHED();
}
template <class Op>
void map2(void* out, const void* a, const void* b, DType dt, int64_t n, Op op) {
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (vectorizable<T>({out, a, b}))
      map2_kernel<T, 4><<<grid_for(n / 4 + 1), kThreads, 0, stream()>>>((T*)out, (const T*)a,
                                                                        (const T*)b, n, op);
    else
      map2_kernel<T, 1>
          <<<grid_for(n), kThreads, 0, stream()>>>((T*)out, (const T*)a, (const T*)b, n, op);
  });
  KEEL_CUDA_LAUNCHED();
}
template <class Op>
void map_rows(void* out, const void* a, const void* row, DType dt, int64_t rows, int64_t cols,
              Op op) {
  const int64_t n = rows * cols;
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (cols % 4 == 0 && vectorizable<T>({out, a, row}))
      map_rows_kernel<T, 4><<<grid_for(n / 4), kThreads, 0, stream()>>>((T*)out, (const T*)a,
                                                                        (const T*)row, n, cols, op);
    else
      map_rows_kernel<T, 1><<<grid_for(n), kThreads, 0, stream()>>>((T*)out, (const T*)a,
                                                                    (const T*)row, n, cols, op);
  });
  KEEL_CUDA_LAUNCHED();
}

void ew_add(void* out, const void* a, const void* b, DType dt, int64_t n) {
  map2(out, a, b, dt, n, AddOp{});
}
void ew_mul(void* out, const void* a, const void* b, DType dt, int64_t n) {
  map2(out, a, b, dt, n, MulOp{});
}
void ew_axpby(void* out, float alpha, const void* a, float beta, const void* b, DType dt,
              int64_t n) {
  if (!b || beta == 0.f) return map1(out, a, dt, n, ScaleOp{alpha});
  map2(out, a, b, dt, n, AxpbyOp{alpha, beta});
}
void ew_add_row(void* out, const void* a, const void* row, DType dt, int64_t rows, int64_t cols) {
  map_rows(out, a, row, dt, rows, cols, AddOp{});
}
void ew_mul_row(void* out, const void* a, const void* row, DType dt, int64_t rows, int64_t cols) {
  map_rows(out, a, row, dt, rows, cols, MulOp{});
}

// Column sums out[c] = sum_r a[r, c] (* b[r, c]) in two stages: partial sums over chunks of
// kColChunk rows (f32, row order), then the chunks in order (f32). Coalesced over columns.
constexpr int64_t kColChunk = 64;

template <class T>
__global__ void col_partial_kernel(float* partial, const T* a, const T* b, int64_t rows,
                                   int64_t cols) {
  const int64_t chunks = (rows + kColChunk - 1) / kColChunk;
  KEEL_CUDA_FOR(i, chunks * cols) {
    const int64_t c = i % cols, k = i / cols;
    const int64_t r0 = k * kColChunk, r1 = min(rows, r0 + kColChunk);
    float acc = 0.f;
    for (int64_t r = r0; r < r1; ++r)
      acc += b ? ld(a + r * cols + c) * ld(b + r * cols + c) : ld(a + r * cols + c);
    partial[k * cols + c] = acc;
  }
}
template <class T>
__global__ void col_finish_kernel(T* out, const float* partial, int64_t chunks, int64_t cols) {
  KEEL_CUDA_FOR(c, cols) {
    float acc = 0.f;
    for (int64_t k = 0; k < chunks; ++k) acc += partial[k * cols + c];
    st(out + c, acc);
  }
}
void col_sums(void* out, const void* a, const void* b, DType dt, int64_t rows, int64_t cols) {
  if (cols <= 0) return;
  const int64_t chunks = std::max<int64_t>(1, (rows + kColChunk - 1) / kColChunk);
  Scratch partial(static_cast<size_t>(chunks * cols) * 4);
  if (rows <= 0)
    KEEL_CUDA_CHECK(cudaMemsetAsync(partial.as<float>(), 0, chunks * cols * 4, stream()));
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (rows > 0)
      col_partial_kernel<<<grid_for(chunks * cols), kThreads, 0, stream()>>>(
          partial.as<float>(), (const T*)a, (const T*)b, rows, cols);
    col_finish_kernel<<<grid_for(cols), kThreads, 0, stream()>>>((T*)out, partial.as<float>(),
                                                                 chunks, cols);
  });
  KEEL_CUDA_LAUNCHED();
}
void ew_sum_rows(void* out, const void* a, DType dt, int64_t rows, int64_t cols) {
  col_sums(out, a, nullptr, dt, rows, cols);
}
void ew_sum_rows_mul(void* out, const void* a, const void* b, DType dt, int64_t rows,
                     int64_t cols) {
  col_sums(out, a, b, dt, rows, cols);
}

void ew_convert(void* out, DType out_dt, const void* in, DType in_dt, int64_t n) {
  convert_async(out, out_dt, in, in_dt, n);
}

// Sum over fixed 4096-element blocks: f32 within a block (one thread block), f64 across blocks in
// block order (one thread block, fixed tree).
constexpr int64_t kReduceBlock = 4096;

template <class T, bool kSquare>
__global__ void block_sum_kernel(double* partial, const T* a, int64_t n) {
  __shared__ float sh[32];
  const int64_t lo = blockIdx.x * kReduceBlock, hi = min(n, lo + kReduceBlock);
  float acc = 0.f;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float v = ld(a + i);
    acc += kSquare ? v * v : v;
  }
  acc = block_reduce(acc, sh, SumOp{}, 0.f);
  if (threadIdx.x == 0) partial[blockIdx.x] = static_cast<double>(acc);
}
__global__ void sum_doubles_kernel(double* out, const double* partial, int64_t n) {
  __shared__ double sh[32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  acc = block_reduce(acc, sh, SumOp{}, 0.0);
  if (threadIdx.x == 0) *out = acc;
}
template <bool kSquare>
double block_sum(const void* a, DType dt, int64_t n) {
  if (n <= 0) return 0.0;
  const int64_t blocks = (n + kReduceBlock - 1) / kReduceBlock;
  Scratch partial(static_cast<size_t>(blocks + 1) * 8);
  double* p = partial.as<double>();
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        block_sum_kernel<T, kSquare>
                        <<<blocks, kThreads, 0, stream()>>>(p + 1, (const T*)a, n));
  sum_doubles_kernel<<<1, 1024, 0, stream()>>>(p, p + 1, blocks);
  KEEL_CUDA_LAUNCHED();
  double out = 0;
  read_back(&out, p, 8);
  return out;
}
double ew_sum(const void* a, DType dt, int64_t n) { return block_sum<false>(a, dt, n); }
double ew_sum_squares(const void* a, DType dt, int64_t n) { return block_sum<true>(a, dt, n); }

const ElementwiseKernels kElementwise = {
    ew_add,      ew_mul,          ew_axpby,   ew_add_row, ew_mul_row,
    ew_sum_rows, ew_sum_rows_mul, ew_convert, ew_sum,     ew_sum_squares,
};

// ---- activations ----------------------------------------------------------------------------

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
                        swiglu_bwd_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
                            (T*)dgate, (T*)dup, (const T*)dout, (const T*)gate, (const T*)up, n));
  KEEL_CUDA_LAUNCHED();
}
void act_exp(void* out, const void* x, DType dt, int64_t n) { map1(out, x, dt, n, Exp{}); }
void act_tanh(void* out, const void* x, DType dt, int64_t n) { map1(out, x, dt, n, Tanh{}); }
void act_erf(void* out, const void* x, DType dt, int64_t n) { map1(out, x, dt, n, Erf{}); }

const ActivationKernels kActivation = {
    act_gelu, act_gelu_backward, act_silu, act_silu_backward, act_swiglu, act_swiglu_backward,
    act_exp,  act_tanh,          act_erf,
};

// ---- softmax over rows (one thread block per row) -------------------------------------------

inline int row_threads(int64_t cols) { return cols >= 4096 ? 1024 : (cols >= 512 ? 256 : 128); }

template <class T>
__global__ void softmax_kernel(T* y, const T* x, int64_t cols, bool log) {
  __shared__ float sh[32];
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  float mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) mx = nan_max(mx, ld(xr + c));
  mx = block_reduce(mx, sh, MaxOp{}, -INFINITY);
  if (mx == -INFINITY) {  // every entry -inf: zeros (softmax) or -inf (log_softmax), not NaN
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) st(yr + c, log ? mx : 0.f);
    return;
  }
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += expf(ld(xr + c) - mx);
  sum = block_reduce(sum, sh, SumOp{}, 0.f);
  const float lsum = logf(sum), inv = 1.f / sum;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = ld(xr + c);
    st(yr + c, log ? (v - mx) - lsum : expf(v - mx) * inv);
  }
}
template <class T>
__global__ void softmax_bwd_kernel(T* dx, const T* dy, const T* y, int64_t cols, bool log) {
  __shared__ float sh[32];
  const int64_t off = blockIdx.x * cols;
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    s += log ? ld(dy + off + c) : ld(dy + off + c) * ld(y + off + c);
  s = block_reduce(s, sh, SumOp{}, 0.f);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = ld(dy + off + c), yv = ld(y + off + c);
    st(dx + off + c, log ? d - expf(yv) * s : yv * (d - s));
  }
}
void softmax_fwd(void* y, const void* x, DType dt, int64_t rows, int64_t cols, bool log) {
  if (rows <= 0 || cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(
      dt, T,
      softmax_kernel<<<rows, row_threads(cols), 0, stream()>>>((T*)y, (const T*)x, cols, log));
  KEEL_CUDA_LAUNCHED();
}
void softmax_bwd(void* dx, const void* dy, const void* y, DType dt, int64_t rows, int64_t cols,
                 bool log) {
  if (rows <= 0 || cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        softmax_bwd_kernel<<<rows, row_threads(cols), 0, stream()>>>(
                            (T*)dx, (const T*)dy, (const T*)y, cols, log));
  KEEL_CUDA_LAUNCHED();
}
void sm_softmax(void* y, const void* x, DType dt, int64_t rows, int64_t cols) {
  softmax_fwd(y, x, dt, rows, cols, false);
}
void sm_log_softmax(void* y, const void* x, DType dt, int64_t rows, int64_t cols) {
  softmax_fwd(y, x, dt, rows, cols, true);
}
void sm_softmax_backward(void* dx, const void* dy, const void* y, DType dt, int64_t rows,
                         int64_t cols) {
  softmax_bwd(dx, dy, y, dt, rows, cols, false);
}
void sm_log_softmax_backward(void* dx, const void* dy, const void* y, DType dt, int64_t rows,
                             int64_t cols) {
  softmax_bwd(dx, dy, y, dt, rows, cols, true);
}
const SoftmaxKernels kSoftmax = {sm_softmax, sm_log_softmax, sm_softmax_backward,
                                 sm_log_softmax_backward};

// ---- LayerNorm / RMSNorm (one thread block per row; weight grads by column chunks) ----------

template <class T>
__global__ void norm_fwd_kernel(T* y, float* mean, float* rstd, const T* x, const T* w, const T* b,
                                int64_t cols, float eps, bool center) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  float mu = 0.f;
  if (center) {
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += ld(xr + c);
    mu = block_reduce(s, sh, SumOp{}, 0.f) / static_cast<float>(cols);
  }
  float v = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = ld(xr + c) - mu;
    v += d * d;
  }
  const float var = block_reduce(v, sh, SumOp{}, 0.f) / static_cast<float>(cols);
  const float rs = 1.f / sqrtf(var + eps);
  if (threadIdx.x == 0) {
    if (mean) mean[r] = mu;
    rstd[r] = rs;
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float wv = w ? ld(w + c) : 1.f, bv = b ? ld(b + c) : 0.f;
    st(y + r * cols + c, (ld(xr + c) - mu) * rs * wv + bv);
  }
}

template <class T>
__global__ void norm_dx_kernel(T* dx, const T* dy, const T* x, const T* w, const float* mean,
                               const float* rstd, int64_t cols, bool center) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x, off = r * cols;
  const float mu = center ? mean[r] : 0.f, rs = rstd[r];
  float sg = 0.f, sgx = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = w ? ld(dy + off + c) * ld(w + c) : ld(dy + off + c);
    const float xh = (ld(x + off + c) - mu) * rs;
    sg += g;
    sgx += g * xh;
  }
  const float mean_g = center ? block_reduce(sg, sh, SumOp{}, 0.f) / static_cast<float>(cols) : 0.f;
  const float mean_gx = block_reduce(sgx, sh, SumOp{}, 0.f) / static_cast<float>(cols);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = w ? ld(dy + off + c) * ld(w + c) : ld(dy + off + c);
    const float xh = (ld(x + off + c) - mu) * rs;
    st(dx + off + c, (g - mean_g - xh * mean_gx) * rs);
  }
}

// Partial column sums of dy * xhat and dy over chunks of kColChunk rows.
template <class T>
__global__ void norm_dw_partial_kernel(float* pw, float* pb, const T* dy, const T* x,
                                       const float* mean, const float* rstd, int64_t rows,
                                       int64_t cols) {
  const int64_t chunks = (rows + kColChunk - 1) / kColChunk;
  KEEL_CUDA_FOR(i, chunks * cols) {
    const int64_t c = i % cols, k = i / cols;
    const int64_t r0 = k * kColChunk, r1 = min(rows, r0 + kColChunk);
    float aw = 0.f, ab = 0.f;
    for (int64_t r = r0; r < r1; ++r) {
      const float d = ld(dy + r * cols + c);
      if (pw) aw += d * ((ld(x + r * cols + c) - (mean ? mean[r] : 0.f)) * rstd[r]);
      ab += d;
    }
    if (pw) pw[i] = aw;
    if (pb) pb[i] = ab;
  }
}

template <class T>
void norm_dw(T* dw, T* db, const T* dy, const T* x, const float* mean, const float* rstd,
             int64_t rows, int64_t cols) {
  const int64_t chunks = std::max<int64_t>(1, (rows + kColChunk - 1) / kColChunk);
  Scratch part(static_cast<size_t>(2 * chunks * cols) * 4);
  float* pw = dw ? part.as<float>() : nullptr;
  float* pb = db ? part.as<float>() + chunks * cols : nullptr;
  if (rows <= 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(part.as<float>(), 0, 2 * chunks * cols * 4, stream()));
  } else {
    norm_dw_partial_kernel<<<grid_for(chunks * cols), kThreads, 0, stream()>>>(pw, pb, dy, x, mean,
                                                                               rstd, rows, cols);
  }
  if (dw) col_finish_kernel<<<grid_for(cols), kThreads, 0, stream()>>>(dw, pw, chunks, cols);
  if (db) col_finish_kernel<<<grid_for(cols), kThreads, 0, stream()>>>(db, pb, chunks, cols);
  KEEL_CUDA_LAUNCHED();
}

void norm_layer_norm(void* y, float* mean, float* rstd, const void* x, const void* w, const void* b,
                     DType dt, int64_t rows, int64_t cols, float eps) {
  if (rows <= 0 || cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(
      dt, T,
      norm_fwd_kernel<<<rows, row_threads(cols), 0, stream()>>>(
          (T*)y, mean, rstd, (const T*)x, (const T*)w, (const T*)b, cols, eps, true));
  KEEL_CUDA_LAUNCHED();
}
void norm_layer_norm_backward(void* dx, void* dw, void* db, const void* dy, const void* x,
                              const void* w, const float* mean, const float* rstd, DType dt,
                              int64_t rows, int64_t cols) {
  if (cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (dx && rows > 0)
      norm_dx_kernel<<<rows, row_threads(cols), 0, stream()>>>((T*)dx, (const T*)dy, (const T*)x,
                                                               (const T*)w, mean, rstd, cols, true);
    if (dw || db) norm_dw((T*)dw, (T*)db, (const T*)dy, (const T*)x, mean, rstd, rows, cols);
  });
  KEEL_CUDA_LAUNCHED();
}
void norm_rms_norm(void* y, float* rstd, const void* x, const void* w, DType dt, int64_t rows,
                   int64_t cols, float eps) {
  if (rows <= 0 || cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(
      dt, T,
      norm_fwd_kernel<<<rows, row_threads(cols), 0, stream()>>>(
          (T*)y, nullptr, rstd, (const T*)x, (const T*)w, (const T*)nullptr, cols, eps, false));
  KEEL_CUDA_LAUNCHED();
}
void norm_rms_norm_backward(void* dx, void* dw, const void* dy, const void* x, const void* w,
                            const float* rstd, DType dt, int64_t rows, int64_t cols) {
  if (cols <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (dx && rows > 0)
      norm_dx_kernel<<<rows, row_threads(cols), 0, stream()>>>(
          (T*)dx, (const T*)dy, (const T*)x, (const T*)w, nullptr, rstd, cols, false);
    if (dw) norm_dw((T*)dw, (T*)nullptr, (const T*)dy, (const T*)x, nullptr, rstd, rows, cols);
  });
  KEEL_CUDA_LAUNCHED();
}
const NormKernels kNorm = {norm_layer_norm, norm_layer_norm_backward, norm_rms_norm,
                           norm_rms_norm_backward};

// ---- RoPE -----------------------------------------------------------------------------------

template <class T>
__global__ void rope_kernel(T* out, const T* x, const float* cos, const float* sin, int64_t rows,
                            int64_t t, int64_t d, float sgn) {
  const int64_t h = d / 2;
  KEEL_CUDA_FOR(e, rows * t * h) {
    const int64_t i = e % h, rp = e / h, p = rp % t;
    const float x1 = ld(x + rp * d + i), x2 = ld(x + rp * d + h + i);
    const float c = cos[p * h + i], s = sgn * sin[p * h + i];
    st(out + rp * d + i, x1 * c - x2 * s);
    st(out + rp * d + h + i, x2 * c + x1 * s);
  }
}
void rope_rotate(void* out, const void* x, const float* cos, const float* sin, DType dt,
                 int64_t rows, int64_t t, int64_t d, bool inverse) {
  const int64_t n = rows * t * (d / 2);
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        rope_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
                            (T*)out, (const T*)x, cos, sin, rows, t, d, inverse ? -1.f : 1.f));
  KEEL_CUDA_LAUNCHED();
}
const RopeKernels kRope = {rope_rotate};

// ---- dropout (the counter-based mask of backend/dropout.h) ----------------------------------

template <class T>
__global__ void dropout_kernel(T* out, const T* x, int64_t n, uint64_t key, uint32_t threshold,
                               float scale) {
  KEEL_CUDA_FOR(i, n) {
    const uint32_t bits =
        static_cast<uint32_t>(splitmix64_at(key, static_cast<uint64_t>(i)) >> 32);
    st(out + i, ld(x + i) * (bits >= threshold ? 1.f : 0.f) * scale);
  }
}
void dropout_apply(void* out, const void* x, DType dt, int64_t n, uint64_t seed, uint32_t threshold,
                   float scale) {
  if (n <= 0) return;
  const uint64_t key = splitmix64_at(seed, 0);
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        dropout_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
                            (T*)out, (const T*)x, n, key, threshold, scale));
  KEEL_CUDA_LAUNCHED();
}
const DropoutKernels kDropout = {dropout_apply};

}  // namespace

const ElementwiseKernels& elementwise_table() { return kElementwise; }
const ActivationKernels& activation_table() { return kActivation; }
const SoftmaxKernels& softmax_table() { return kSoftmax; }
const NormKernels& norm_table() { return kNorm; }
const RopeKernels& rope_table() { return kRope; }
const DropoutKernels& dropout_table() { return kDropout; }

}  // namespace keel::cuda
