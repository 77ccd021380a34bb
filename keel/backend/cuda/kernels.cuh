// Helpers shared by several CUDA kernel families (on top of common.cuh's element access,
// reductions and launch shapes): the element-wise launchers (element-wise and activations), the
// column-chunk finish of weight/bias gradients (element-wise column sums and norms), row launch
// shapes (softmax and norms), and id checks (cross-entropy and embedding).
#pragma once
#include <initializer_list>

#include "keel/backend/cuda/common.cuh"

namespace keel::cuda {

inline constexpr int kThreads = 256;

// Threads per row for one-block-per-row kernels.
inline int row_threads(int64_t cols) { return cols >= 4096 ? 1024 : (cols >= 512 ? 256 : 128); }

// ---- element-wise launchers ------------------------------------------------------------------

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
      KEEL_LAUNCH(grid_for(n / 4 + 1), kThreads, 0, map1_kernel<T, 4, Op>)
      ((T*)out, (const T*)a, n, op);
    else
      KEEL_LAUNCH(grid_for(n), kThreads, 0, map1_kernel<T, 1, Op>)((T*)out, (const T*)a, n, op);
  });
  KEEL_CUDA_LAUNCHED();
}
template <class Op>
void map2(void* out, const void* a, const void* b, DType dt, int64_t n, Op op) {
  if (n <= 0) return;
  KEEL_CUDA_FLOAT_TYPES(dt, T, {
    if (vectorizable<T>({out, a, b}))
      KEEL_LAUNCH(grid_for(n / 4 + 1), kThreads, 0, map2_kernel<T, 4, Op>)
    ((T*)out, (const T*)a, (const T*)b, n, op);
    else KEEL_LAUNCH(grid_for(n), kThreads, 0, map2_kernel<T, 1, Op>)((T*)out, (const T*)a,
                                                                      (const T*)b, n, op);
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
      KEEL_LAUNCH(grid_for(n / 4), kThreads, 0, map_rows_kernel<T, 4, Op>)
    ((T*)out, (const T*)a, (const T*)row, n, cols, op);
    else KEEL_LAUNCH(grid_for(n), kThreads, 0, map_rows_kernel<T, 1, Op>)(
        (T*)out, (const T*)a, (const T*)row, n, cols, op);
  });
  KEEL_CUDA_LAUNCHED();
}

// ---- column sums in chunks of rows ---------------------------------------------------------

// Column sums (element-wise sum_rows, norms' weight and bias gradients) in two stages: partial
// sums over chunks of kColChunk rows (f32, row order), then the chunks in order (f32).
inline constexpr int64_t kColChunk = 64;

// The second stage: out[c] = the chunks' partial sums in chunk order (f32).
template <class T>
__global__ void col_finish_kernel(T* out, const float* partial, int64_t chunks, int64_t cols) {
  KEEL_CUDA_FOR(c, cols) {
    float acc = 0.f;
    for (int64_t k = 0; k < chunks; ++k) acc += partial[k * cols + c];
    st(out + c, acc);
  }
}

// ---- a fixed-order f64 sum ---------------------------------------------------------------

// *out = the sum of partial[0, n) in a fixed tree (one block of up to 1024 threads: launch
// <<<1, 1024>>>): the second stage of element-wise sums and of cross-entropy's loss over rows.
// (A template only so that every file may launch its own copy: kernels do not cross files
// without relocatable device code.)
template <class V = double>
__global__ void sum_doubles_kernel(V* out, const V* partial, int64_t n) {
  __shared__ V sh[32];
  V acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  acc = block_reduce(acc, sh, SumOp{}, V(0));
  if (threadIdx.x == 0) *out = acc;
}

// ---- ids -------------------------------------------------------------------------------------

__device__ __forceinline__ int64_t id_at(const void* ids, bool i32, int64_t i) {
  return i32 ? static_cast<const int32_t*>(ids)[i] : static_cast<const int64_t*>(ids)[i];
}
// The first index i whose id is outside [0, v) (and, with use_ignore, not `ignore`), or -1
// (embedding.cu).
int64_t find_invalid_ids(const void* ids, DType dt, int64_t n, int64_t v, int64_t ignore,
                         bool use_ignore);

}  // namespace keel::cuda
