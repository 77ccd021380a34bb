// What the attention kernels of attention.cu (the softmax pair, flash on CUDA cores) and
// attention_mma.cu (flash on tensor cores) share: the problem's dimensions, the key padding rule,
// the first real key of a row, and the opt-in for more than 48 KB of shared memory.
#pragma once
#include "keel/backend/attention.h"
#include "keel/backend/cuda/common.cuh"

namespace keel::cuda {

struct AttnDims {
  int64_t batch, hq, hkv, t, d;
  float scale;
  const uint8_t* mask;  // [batch, t], 1 = a real key; null: every key is real
};
inline AttnDims attn_dims_of(const AttentionDims& a) {
  return {a.batch, a.heads_q, a.heads_kv, a.seq, a.head_dim, a.scale, a.key_padding_mask};
}

__device__ __forceinline__ bool key_real(const uint8_t* mk, int64_t j) { return !mk || mk[j]; }

// First real key of a mask row (t when none), computed by the whole block. Query i sees key j
// when j <= i and the key is real, so rows before it see nothing (output 0, lse -inf).
__device__ inline int64_t first_real_key(const uint8_t* mk, int64_t t) {
  __shared__ long long first;
  if (!mk) return 0;
  if (threadIdx.x == 0) first = t;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < t; j += blockDim.x)
    if (mk[j]) {
      atomicMin(&first, static_cast<long long>(j));  // a minimum: order-independent
      break;
    }
  __syncthreads();
  const int64_t f = first;
  __syncthreads();
  return f;
}

template <class K>
void allow_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    KEEL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes)));
}

// Flash attention on tensor cores (attention_mma.cu). Each returns false, having queued nothing,
// for a case it does not take: f32, head dims other than 64 and 128, a GPU before sm_80,
// tensors not 16-byte aligned, or KEEL_CUDA_FLASH_MMA not set to 1 (the kernels are new and off
// by default until a GPU run has checked them: docs/cuda.md). The caller then runs the CUDA-core
// kernels, whose semantics these share. `drow` is sum_d dO * O per row (the backward's D).
bool flash_mma_forward(void* o, float* lse, const void* q, const void* k, const void* v, DType dt,
                       const AttnDims& a);
bool flash_mma_backward(void* dq, void* dk, void* dv, const void* q, const void* k, const void* v,
                        const void* dout, const float* lse, const float* drow, DType dt,
                        const AttnDims& a);

}  // namespace keel::cuda
