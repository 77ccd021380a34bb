// CPU memory for tensor storage, with a cache of released blocks.
//
// A training step allocates the same sizes in the same order every step. Handing a released
// block back to the next request of its size, instead of returning it to the OS and faulting in
// fresh zeroed pages, removes the first-touch page faults that dominated a GPT-2 124M step on
// these VMs (23% of a 32-true step was the kernel clearing pages). This is the CPU counterpart of
// PyTorch's CUDA caching allocator (llm.c and ggml get the same effect from one allocation made
// up front).
//
// The cache keeps the process near its peak: before mapping a new block it unmaps cached blocks
// so that mapped bytes (live + cached) stay under the largest live total so far plus 1/16 of it.
// Without that slack, phases that alternate between sizes (forward activations, backward
// gradients) keep evicting each other's blocks: GPT-2 124M missed 49 times a step with none, 0
// with 1/16, at the same peak RSS (2559 vs 2565 MB).
// A step whose sizes still evict each other under 1/16 teaches the cache a larger slack: a miss for
// a size the cache dropped earlier adds that size to the slack, up to 1/8 of the peak in all. GPT-2
// 124M B8 T256 bf16-mixed re-faulted its 198 MB logits block and six 10-12 MB blocks every step
// under 1/16 (8% of the step clearing pages); the learned slack stops that after the first steps.
// Blocks under 64 KiB go straight to malloc. KEEL_HOST_CACHE=0 turns the cache off; it is off in
// AddressSanitizer builds so that a use after free is still caught. KEEL_POISON_ALLOC=1 fills every
// block handed out with 0xFF bytes (NaN in f32, bf16 and f16), so a kernel that reads memory it
// never wrote produces NaN instead of silently reading zeros.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "keel/numerics/error.h"

namespace keel::host_memory {

// allocate's Error when a block cannot be had. Its message names the config keys that size a
// training run; commands whose sizes are flags (keel eval) catch it to name their own.
struct OutOfMemory : Error {
  OutOfMemory(const std::string& message, size_t nbytes) : Error(message), bytes(nbytes) {}
  size_t bytes;  // the block asked for
};

constexpr size_t kSlackDivisor = 16;    // mapped <= peak live * (1 + 1/16) ...
constexpr size_t kMaxSlackDivisor = 8;  // ... + what thrashing taught, up to peak live / 8 in all

void* allocate(size_t nbytes);  // 64-byte aligned; 2 MiB aligned from 8 MiB up
// The bytes allocate(nbytes) takes: below 64 KiB a 64-byte multiple (malloc's); from there to
// 8 MiB a multiple of 1/16 of the size's power of two (at least 4 KiB); from 8 MiB up a multiple of
// 2 MiB. Nearby sizes share blocks, and the rounding is real memory: the memory estimate
// (monitor/memory_estimate) counts every tensor in it.
size_t block_size(size_t nbytes);
void release(void* p, size_t nbytes);

struct Stats {
  size_t live_bytes = 0;       // handed out and not yet released (blocks >= 64 KiB, rounded)
  size_t cached_bytes = 0;     // released and kept for reuse
  size_t peak_live_bytes = 0;  // the most ever handed out at once
  size_t learned_slack = 0;    // slack added by misses for sizes the cache had dropped
  int64_t hits = 0, misses = 0, evictions = 0;
};
Stats stats();
void empty_cache();  // unmaps every cached block and forgets the learned slack
bool cache_enabled();

// This process's resident set now and its peak so far (/proc/self/status VmRSS, VmHWM), in bytes:
// heap and file-mapped pages alike (a mapped model's touched pages count). 0 where unreadable.
struct ProcessMemory {
  size_t rss = 0, peak_rss = 0;
};
ProcessMemory process_memory();

}  // namespace keel::host_memory
