// CUDA element-wise kernels: arithmetic, row broadcasts, column sums, conversion and sums.
// Semantics as backend/cpu (see the family header): f32 opmath, one RNE rounding on store,
// NaN/inf propagate.
// Reductions run in fixed launch shapes without atomics, so they are deterministic; their order
// differs from the CPU's (within f32 rounding).
#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {
namespace {

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
// s * b rounded into T (a store and load of T) before the sum, as the two ops round it; the
// _rn intrinsics are never contracted into a fused multiply-add (f32 would otherwise round once).
template <class T>
__global__ void add_scaled_kernel(T* out, const T* a, float s, const T* b, int64_t n) {
  KEEL_CUDA_FOR(i, n) {
    T scaled;
    st(&scaled, __fmul_rn(s, ld(b + i)));
    st(out + i, __fadd_rn(ld(a + i), ld(&scaled)));
  }
}
void ew_add_scaled(void* out, const void* a, float s, const void* b, DType dt, int64_t n) {
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        KEEL_LAUNCH(grid_for(n), kThreads, 0, add_scaled_kernel<T>)(
                            (T*)out, (const T*)a, s, (const T*)b, n));
  KEEL_CUDA_LAUNCHED();
}
void ew_add_row(void* out, const void* a, const void* row, DType dt, int64_t rows, int64_t cols) {
  map_rows(out, a, row, dt, rows, cols, AddOp{});
}
void ew_mul_row(void* out, const void* a, const void* row, DType dt, int64_t rows, int64_t cols) {
  map_rows(out, a, row, dt, rows, cols, MulOp{});
}

// Column sums out[c] = sum_r a[r, c] (* b[r, c]) in two stages: partial sums over chunks of
// kColChunk rows (f32, row order), then the chunks in order (f32). Coalesced over columns.
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
void col_sums(void* out, const void* a, const void* b, DType dt, int64_t rows, int64_t cols) {
  if (cols <= 0) return;
  const int64_t chunks = std::max<int64_t>(1, (rows + kColChunk - 1) / kColChunk);
  Scratch partial(static_cast<size_t>(chunks * cols) * 4);
  if (rows <= 0)
    KEEL_CUDA_CHECK(cudaMemsetAsync(partial.as<float>(), 0, chunks * cols * 4, stream()));
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (rows > 0) KEEL_LAUNCH(grid_for(chunks * cols), kThreads, 0, col_partial_kernel<T>)
    (partial.as<float>(), (const T*)a, (const T*)b, rows, cols);
    KEEL_LAUNCH(grid_for(cols), kThreads, 0, col_finish_kernel<T>)
    ((T*)out, partial.as<float>(), chunks, cols);
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
template <bool kSquare>
double block_sum(const void* a, DType dt, int64_t n) {
  if (n <= 0) return 0.0;
  const int64_t blocks = (n + kReduceBlock - 1) / kReduceBlock;
  Scratch partial(static_cast<size_t>(blocks + 1) * 8);
  double* p = partial.as<double>();
  KEEL_CUDA_FLOAT_TYPES(
      dt, T, KEEL_LAUNCH(blocks, kThreads, 0, block_sum_kernel<T, kSquare>)(p + 1, (const T*)a, n));
  KEEL_LAUNCH(1, 1024, 0, sum_doubles_kernel<>)(p, p + 1, blocks);
  KEEL_CUDA_LAUNCHED();
  double out = 0;
  read_back(&out, p, 8);
  return out;
}
double ew_sum(const void* a, DType dt, int64_t n) { return block_sum<false>(a, dt, n); }
double ew_sum_squares(const void* a, DType dt, int64_t n) { return block_sum<true>(a, dt, n); }

const ElementwiseKernels kElementwise = {
    ew_add,      ew_mul,          ew_axpby,   ew_add_scaled, ew_add_row,     ew_mul_row,
    ew_sum_rows, ew_sum_rows_mul, ew_convert, ew_sum,        ew_sum_squares,
};

}  // namespace

const ElementwiseKernels& elementwise_table() { return kElementwise; }

}  // namespace keel::cuda
