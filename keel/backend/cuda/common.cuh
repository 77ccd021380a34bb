// Shared helpers of the CUDA kernels: error checks, the per-device stream, f32 loads and RNE
// stores for the three floating dtypes, launch shapes and NaN-propagating warp/block reductions.
//
// Conventions (the same as the CPU kernels): values are computed in f32 and rounded once on
// store (__float2bfloat16_rn / __float2half_rn: round to nearest even, NaN kept, overflow to inf);
// no atomics in reductions, so results are deterministic for a given launch shape.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "keel/numerics/dtype.h"
#include "keel/numerics/error.h"
#include "keel/numerics/hash.h"

namespace keel::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line);

#define KEEL_CUDA_CHECK(expr)                                               \
  do {                                                                      \
    const cudaError_t keel_err_ = (expr);                                   \
    if (keel_err_ != cudaSuccess)                                           \
      ::keel::cuda::throw_cuda_error(keel_err_, #expr, __FILE__, __LINE__); \
  } while (0)
// After a kernel launch: reports a bad launch configuration at once (asynchronous faults surface
// at the next synchronizing call), and marks the launch for cuda::profile_begin/end.
#define KEEL_CUDA_LAUNCHED()                                                                 \
  do {                                                                                       \
    KEEL_CUDA_CHECK(cudaGetLastError());                                                     \
    if (::keel::cuda::g_profiling) ::keel::cuda::profile_mark(__func__, __FILE__, __LINE__); \
  } while (0)
// Set between profile_begin() and profile_end() (cuda_api.h).
extern bool g_profiling;
// A kernel launch on the current device's stream: KEEL_LAUNCH(grid, block, smem, kernel)(args...)
// (the kernel last: its template arguments may hold commas). tests/cuda_emulated's host emulator
// defines it to run the kernel on std::threads.
#ifndef KEEL_LAUNCH
#define KEEL_LAUNCH(grid, block, smem, ...) \
  __VA_ARGS__<<<(grid), (block), (smem), ::keel::cuda::stream()>>>
#endif
// A kernel's dynamic shared memory, 128-byte aligned (the host emulator defines its own).
#ifndef KEEL_DYNAMIC_SMEM
#define KEEL_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif
// Records an event after the work queued so far, labelled by its launch site or `site`.
void profile_mark(const char* func, const char* file, int line);
void profile_mark(std::string site);

// The stream every keel kernel, copy and matmul of the current device runs on (in order).
cudaStream_t stream();
int current_device();
int sm_count();
int compute_capability();  // of the current device: 80 for an A100, 90 for an H100/H200

// ---- element access -------------------------------------------------------------------------
__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(__half* p, float v) { *p = __float2half_rn(v); }
template <class T>
__device__ __forceinline__ float round_to(float v) {
  T t;
  st(&t, v);
  return ld(&t);
}

// NaN-propagating max (as the CPU kernels' (b > a || b != b) ? b : a).
__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ long long warp_sum(long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide reductions (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
// `sh` is shared scratch of 32 entries; the call synchronizes the block twice.
template <class V, class Op>
__device__ __forceinline__ V block_reduce(V v, V* sh, Op op, V identity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // sh may still be read by a previous reduction
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : identity;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
struct SumOp {
  template <class V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return a + b;
  }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return nan_max(a, b); }
};

// Device scratch from the caching allocator, released at scope exit (safe at once: later work on
// the stream runs after the kernels that use it).
class Scratch {
 public:
  explicit Scratch(size_t nbytes);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
  int dev_ = 0;
};

// Reads back `nbytes` from the device after the queued work (one synchronization).
void read_back(void* host, const void* dev, size_t nbytes);
// out = in converted (RNE) on the current stream.
void convert_async(void* out, DType out_dt, const void* in, DType in_dt, int64_t n);

// N elements moved as one aligned load/store (element-wise kernels read 4 at a time).
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};
inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Grid-stride loop over [0, n).
#define KEEL_CUDA_FOR(i, n)                                                 \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

// Grid for a grid-stride loop over n elements.
inline unsigned grid_for(int64_t n, int threads = 256) {
  const int64_t want = (n + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * 32;
  return static_cast<unsigned>(want < 1 ? 1 : (want < cap ? want : cap));
}

}  // namespace keel::cuda

// Dispatch on a floating dtype with T the CUDA element type.
#define KEEL_CUDA_FLOAT_TYPES(dt, T, ...)                                                     \
  switch (dt) {                                                                               \
    case ::keel::DType::F32: {                                                                \
      using T = float;                                                                        \
      __VA_ARGS__;                                                                            \
    } break;                                                                                  \
    case ::keel::DType::BF16: {                                                               \
      using T = __nv_bfloat16;                                                                \
      __VA_ARGS__;                                                                            \
    } break;                                                                                  \
    case ::keel::DType::F16: {                                                                \
      using T = __half;                                                                       \
      __VA_ARGS__;                                                                            \
    } break;                                                                                  \
    default:                                                                                  \
      KEEL_CHECK(false, std::string("cuda: floating dtype required, got ") + dtype_name(dt)); \
  }
