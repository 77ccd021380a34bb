#include "keel/tensor/host_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "keel/numerics/error.h"

namespace keel::host_memory {

namespace {

constexpr size_t kMinCached = size_t{64} << 10;  // below this, malloc's own bins do well
constexpr size_t kHuge = size_t{2} << 20;
constexpr size_t kMapped = 4 * kHuge;  // from here up: our own 2 MiB aligned mmap
bool env_flag(const char* name, bool def) {
  const char* v = std::getenv(name);
  if (!v || !*v) return def;
  return std::string(v) != "0";
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

struct Cache {
  std::mutex mu;
  std::multimap<size_t, void*> free;  // rounded size -> block
  // rounded size -> blocks make_room unmapped whose size has not been asked for since
  std::map<size_t, int64_t> dropped;
  Stats st;
  const bool enabled = !kSanitized && env_flag("KEEL_HOST_CACHE", true);
  const bool poison = env_flag("KEEL_POISON_ALLOC", false);
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: tensors may be freed during static destruction
  return *c;
}

// Requests are rounded so that nearby sizes share blocks: to 2 MiB from 8 MiB up (huge pages),
// below that to 1/16 of the size's power of two (at most 6.25% more).
size_t round_size(size_t n) {
  const size_t gran = n >= kMapped ? kHuge : std::max<size_t>(4096, std::bit_floor(n) / 16);
  return (n + gran - 1) / gran * gran;
}

// Blocks from 64 KiB up are mapped, each on its own, so that a block the cache drops leaves the
// process at once. They used to come from malloc below 8 MiB: a dropped one stayed in glibc's
// heap, resident and unaccounted (Llama LoRA, 4 x 256, B8 T256 with checkpointing every block:
// 148 MB peak RSS for 78 MB of live blocks; 115 MB mapped). Without the cache (KEEL_HOST_CACHE=0,
// and AddressSanitizer builds, which must see every block to catch a use after free) they still
// come from malloc.
void* map_block(size_t rounded, bool own_mapping) {
  if (rounded < kMapped) {
    if (!own_mapping) return std::aligned_alloc(64, rounded);
    void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  // Over-map by 2 MiB and trim, so the block starts on a huge-page boundary.
  void* raw =
      mmap(nullptr, rounded + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (base + kHuge - 1) / kHuge * kHuge;
  if (aligned > base) munmap(raw, aligned - base);
  const uintptr_t end = base + rounded + kHuge, used_end = aligned + rounded;
  if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
  void* p = reinterpret_cast<void*>(aligned);
  // Transparent huge pages: first-touch faults on 4 KiB pages are slow in VMs
  // (reference/cpu-dependencies.md: a fresh 100 MB memset took 290 ms, 13 ms with the advice).
  madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure changes nothing
  return p;
}

void unmap_block(void* p, size_t rounded, bool own_mapping) {
  if (rounded < kMapped && !own_mapping)
    std::free(p);
  else
    munmap(p, rounded);
}

// Before mapping `need` more bytes: unmaps cached blocks until live + cached + need fits under
// the largest live total so far plus a slack (1/16 of it and what misses taught, at most 1/8). Of
// the smallest mapped block that alone makes room and the fewest smallest mapped blocks that
// together do, it drops whichever holds fewer bytes (a dropped block is faulted in again when its
// size comes back); failing both, the largest blocks first, those under 8 MiB last. GPT-2
// 124M B8 T256 bf16-mixed: the first rule alone dropped the 148 MB head gradient to make 21 MB of
// room, then the 198 MB logits gradient for the head gradient, every step (~10% of the step in page
// clearing); now two or three 10-12 MB blocks go, same peak.
void make_room(Cache& c, size_t need) {
  const size_t peak = c.st.peak_live_bytes;
  const size_t slack = std::min(peak / kSlackDivisor + c.st.learned_slack, peak / kMaxSlackDivisor);
  const size_t limit = std::max(peak, c.st.live_bytes + need) + slack;
  auto over = [&] { return c.st.live_bytes + c.st.cached_bytes + need > limit; };
  if (!over()) return;
  auto drop = [&](std::multimap<size_t, void*>::iterator it) {
    unmap_block(it->second, it->first, c.enabled);
    ++c.dropped[it->first];
    c.st.cached_bytes -= it->first;
    c.free.erase(it);
    ++c.st.evictions;
  };
  const size_t excess = c.st.live_bytes + c.st.cached_bytes + need - limit;
  // A dropped block costs its bytes in page faults when its size is asked for again. Blocks under
  // kMapped go only when no larger block is left: when they came from malloc, a freed one stayed in
  // glibc's heap, fragmented by the next request of another size (GPT-2 124M B8 T256 32-true grew
  // ~4 MB a step while two such blocks evicted each other). Mapped now, they keep that order.
  const auto mapped = [&] { return c.free.lower_bound(kMapped); };
  size_t small_sum = 0;
  for (auto s = mapped(); s != c.free.end() && small_sum < excess; ++s) small_sum += s->first;
  auto it = c.free.lower_bound(std::max(excess, kMapped));
  if (it != c.free.end() && (small_sum < excess || it->first <= small_sum)) return drop(it);
  while (over() && mapped() != c.free.end())
    drop(small_sum >= excess ? mapped() : std::prev(c.free.end()));
  while (over() && !c.free.empty()) drop(std::prev(c.free.end()));
}

}  // namespace

size_t block_size(size_t nbytes) {
  return nbytes < kMinCached ? (std::max<size_t>(nbytes, 1) + 63) / 64 * 64 : round_size(nbytes);
}

void* allocate(size_t nbytes) {
  Cache& c = cache();
  void* p = nullptr;
  if (nbytes < kMinCached) {
    p = std::aligned_alloc(64, block_size(nbytes));
  } else {
    const size_t rounded = round_size(nbytes);
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.free.find(rounded);
    if (it != c.free.end()) {
      p = it->second;
      c.free.erase(it);
      c.st.cached_bytes -= rounded;
      ++c.st.hits;
    } else {
      ++c.st.misses;
      // A size dropped to make room is asked for again: the step's blocks did not fit under the
      // slack, and dropping more would fault them in again every step. Learn a larger slack.
      if (auto d = c.dropped.find(rounded); d != c.dropped.end()) {
        c.st.learned_slack =
            std::min(c.st.learned_slack + rounded, c.st.peak_live_bytes / kMaxSlackDivisor);
        if (--d->second == 0) c.dropped.erase(d);
      }
      make_room(c, rounded);
      p = map_block(rounded, c.enabled);
    }
    if (p) {
      c.st.live_bytes += rounded;
      c.st.peak_live_bytes = std::max(c.st.peak_live_bytes, c.st.live_bytes);
    }
  }
  if (!p)
    throw OutOfMemory("out of memory allocating a tensor of " + std::to_string(nbytes) +
                          " bytes; the run's sizes need more memory than is available: lower "
                          "train.batch_size or data.seq_len (activations) or the model.* sizes "
                          "(weights), and see `keel memory` for the estimate",
                      nbytes);
  if (c.poison) std::memset(p, 0xFF, nbytes);
  return p;
}

void release(void* p, size_t nbytes) {
  if (!p) return;
  if (nbytes < kMinCached) {
    std::free(p);
    return;
  }
  const size_t rounded = round_size(nbytes);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.st.live_bytes -= std::min(rounded, c.st.live_bytes);
  if (!c.enabled) {
    unmap_block(p, rounded, false);
    return;
  }
  c.free.emplace(rounded, p);
  c.st.cached_bytes += rounded;
}

Stats stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.st;
}

void empty_cache() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto& [size, p] : c.free) unmap_block(p, size, c.enabled);
  c.st.evictions += static_cast<int64_t>(c.free.size());
  c.free.clear();
  c.st.cached_bytes = 0;
  c.dropped.clear();
  c.st.learned_slack = 0;
}

bool cache_enabled() { return cache().enabled; }

ProcessMemory process_memory() {
  ProcessMemory m;
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return m;
  char line[256];
  while (std::fgets(line, sizeof line, f)) {
    unsigned long kb = 0;
    if (std::sscanf(line, "VmRSS: %lu kB", &kb) == 1) m.rss = kb * 1024;
    if (std::sscanf(line, "VmHWM: %lu kB", &kb) == 1) m.peak_rss = kb * 1024;
  }
  std::fclose(f);
  return m;
}

}  // namespace keel::host_memory
