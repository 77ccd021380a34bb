// A CUDA emulator for the host, just large enough to run keel's attention kernels on the CPU in a
// test (tests/cuda_emulated): a block is blockDim.x std::threads that meet at std::barriers
// (__syncthreads for the block, __syncwarp for each warp of 32), shuffles exchange through the
// warp's slots between two barriers, and blocks run one after another. WMMA fragments (shim/mma.h)
// hold a whole 16 x 16 tile in every lane. What it checks is the kernels' own logic (tiles,
// indices, masks, synchronization, rounding points); not what only hardware shows (bank
// conflicts, register pressure, the fragments' lane layout, timing).
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n)
#define __shared__ static  // (blocks run one at a time: a static is the block's)
#define KEEL_CUDA_EMULATED 1

struct EmuDim {
  unsigned x = 0, y = 0, z = 0;
};

namespace emu {

struct Warp {
  std::barrier<> bar{32};
  uint64_t slot[32] = {};
};
struct Block {
  explicit Block(unsigned threads, size_t smem_bytes)
      : bar(static_cast<std::ptrdiff_t>(threads)), warps(threads / 32), smem(smem_bytes + 128) {}
  std::barrier<> bar;
  std::vector<Warp> warps;
  std::vector<unsigned char> smem;
  std::mutex atomics;
  unsigned char* dynamic_smem() {
    auto p = reinterpret_cast<uintptr_t>(smem.data());
    return smem.data() + ((128 - p % 128) % 128);  // 128-byte aligned, as CUDA's
  }
};

inline thread_local EmuDim thread_idx, block_idx;
inline thread_local Block* current = nullptr;
inline EmuDim block_dim, grid_dim;

inline Warp& warp() { return current->warps[thread_idx.x / 32]; }

// Runs kernel(args...) over `grid` blocks of `threads` threads with `smem` bytes of dynamic
// shared memory, one block at a time: the same `threads` host threads run every block, meeting at
// a barrier between blocks (shared memory is not cleared in between, as on a GPU).
template <class Kernel, class... Args>
void launch(Kernel kernel, unsigned grid, unsigned threads, size_t smem, Args... args) {
  block_dim = {threads, 1, 1};
  grid_dim = {grid, 1, 1};
  Block block(threads, smem);
  std::barrier<> next_block(static_cast<std::ptrdiff_t>(threads));
  std::vector<std::thread> ts;
  ts.reserve(threads);
  for (unsigned t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      thread_idx = {t, 0, 0};
      current = &block;
      for (unsigned b = 0; b < grid; ++b) {
        block_idx = {b, 0, 0};
        kernel(args...);
        next_block.arrive_and_wait();
      }
    });
  for (auto& th : ts) th.join();
}

// KEEL_LAUNCH(grid, block, smem, kernel)(args...) (backend/cuda/common.cuh) runs it here.
template <class Kernel>
auto launcher(Kernel kernel, int64_t grid, int64_t threads, size_t smem) {
  return [=](auto... args) {
    launch(kernel, static_cast<unsigned>(grid), static_cast<unsigned>(threads), smem, args...);
  };
}

}  // namespace emu

#define KEEL_LAUNCH(grid, block, smem, ...) ::emu::launcher(__VA_ARGS__, (grid), (block), (smem))
#define threadIdx (::emu::thread_idx)
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)
#define KEEL_DYNAMIC_SMEM(name) unsigned char* name = ::emu::current->dynamic_smem()

inline void __syncthreads() { emu::current->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp().bar.arrive_and_wait(); }

template <class V>
V emu_exchange(V v, int from_lane) {
  static_assert(sizeof(V) <= 8 && std::is_trivially_copyable_v<V>);
  emu::Warp& w = emu::warp();
  const unsigned lane = threadIdx.x % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof v);
  w.slot[lane] = bits;
  w.bar.arrive_and_wait();
  bits = w.slot[from_lane & 31];
  w.bar.arrive_and_wait();
  V out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
template <class V>
V __shfl_xor_sync(unsigned, V v, int lane_mask) {
  return emu_exchange(v, static_cast<int>(threadIdx.x % 32) ^ lane_mask);
}
template <class V>
V __shfl_sync(unsigned, V v, int src_lane) {
  return emu_exchange(v, src_lane);
}
inline bool __any_sync(unsigned, bool p) {
  emu::Warp& w = emu::warp();
  w.slot[threadIdx.x % 32] = p;
  w.bar.arrive_and_wait();
  bool any = false;
  for (uint64_t v : w.slot) any |= v != 0;
  w.bar.arrive_and_wait();
  return any;
}

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  std::lock_guard<std::mutex> lock(emu::current->atomics);
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}
template <class I>  // long long, unsigned long long
inline I atomicMin(I* p, I v) {
  std::lock_guard<std::mutex> lock(emu::current->atomics);
  const I old = *p;
  if (v < old) *p = v;
  return old;
}

// CUDA's rounded arithmetic intrinsics (never fused: a volatile keeps the host from contracting).
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float __fdiv_rn(float a, float b) {
  volatile float r = a / b;
  return r;
}
inline float __fsqrt_rn(float a) { return std::sqrt(a); }  // IEEE: correctly rounded on both
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

using std::isfinite;  // CUDA's device math in the global namespace
using std::isinf;
using std::isnan;

template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
  return b < a ? b : a;
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}
