// The CPU block cache behind tensor storage: a released block is handed to the next request of its
// size, large blocks are huge-page aligned, and the cache never holds the process more than 1/16
// above the most it ever had live (a miss unmaps cached blocks first), unless sizes that evict each
// other every step taught it more, and never more than 1/8.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "keel/tensor/host_memory.h"
#include "keel/tensor/tensor.h"

namespace keel {
namespace {

namespace hm = host_memory;

#define SKIP_WITHOUT_CACHE() \
  if (!hm::cache_enabled())  \
  GTEST_SKIP() << "cache off (AddressSanitizer build or KEEL_HOST_CACHE=0)"

TEST(HostMemory, ReleasedBlockIsHandedToTheNextRequestOfItsSize) {
  SKIP_WITHOUT_CACHE();
  hm::empty_cache();
  void* a = hm::allocate(1'000'000);
  hm::release(a, 1'000'000);
  const auto before = hm::stats();
  void* b = hm::allocate(1'010'000);  // same size class (sizes round to 1/16 of their octave)
  EXPECT_EQ(a, b);
  EXPECT_EQ(hm::stats().hits, before.hits + 1);
  hm::release(b, 1'010'000);
}

// block_size is what allocate takes (the live bytes it adds), pinned on each side of the rounding
// regimes: malloc's 64-byte multiples below 64 KiB, 1/16 of the octave up to 8 MiB, 2 MiB above.
TEST(HostMemory, BlockSizeIsWhatAllocateTakes) {
  const size_t kib = 1024, mib = kib * kib;
  EXPECT_EQ(hm::block_size(0), 64u);
  EXPECT_EQ(hm::block_size(1), 64u);
  EXPECT_EQ(hm::block_size(8192), 8192u);
  EXPECT_EQ(hm::block_size(64 * kib - 1), 64 * kib);
  EXPECT_EQ(hm::block_size(64 * kib), 64 * kib);
  EXPECT_EQ(hm::block_size(100'000), 25 * 4096u);     // 4 KiB steps in [64, 128) KiB
  EXPECT_EQ(hm::block_size(796'000), 25 * 32 * kib);  // 32 KiB steps in [512 KiB, 1 MiB)
  EXPECT_EQ(hm::block_size(8 * mib - 1), 8 * mib);    // 256 KiB steps in [4, 8) MiB
  EXPECT_EQ(hm::block_size(9 * mib), 10 * mib);       // 2 MiB steps from 8 MiB
  EXPECT_EQ(hm::block_size(32 * mib), 32 * mib);
  for (size_t n : {64 * kib, size_t{100'000}, size_t{796'000}, 8 * mib - 1, 9 * mib, 9 * mib + 5}) {
    const size_t before = hm::stats().live_bytes;
    void* p = hm::allocate(n);
    EXPECT_EQ(hm::stats().live_bytes - before, hm::block_size(n)) << n;
    hm::release(p, n);
    EXPECT_EQ(hm::stats().live_bytes, before) << n;
  }
}

TEST(HostMemory, TensorsReuseTheStorageOfFreedTensorsOfTheSameShape) {
  SKIP_WITHOUT_CACHE();
  hm::empty_cache();
  const void* first = nullptr;
  {
    Tensor t = Tensor::empty({256, 768});
    first = t.data();
  }
  Tensor u = Tensor::empty({256, 768});
  EXPECT_EQ(u.data(), first);
  Tensor z = Tensor::zeros({256, 768});  // a reused block is still zeroed by zeros()
  for (float v : z.to_floats()) ASSERT_EQ(v, 0.f);
}

TEST(HostMemory, LargeBlocksAreHugePageAlignedAndReused) {
  SKIP_WITHOUT_CACHE();
  hm::empty_cache();
  const size_t n = size_t{51} << 20;  // a GPT-2 logits buffer
  void* a = hm::allocate(n);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % (size_t{2} << 20), 0u);
  static_cast<char*>(a)[n - 1] = 1;  // the whole request is mapped
  hm::release(a, n);
  void* b = hm::allocate(n);
  EXPECT_EQ(a, b);
  hm::release(b, n);
}

TEST(HostMemory, MissesEvictSoMappedBytesStayNearThePeakLive) {
  SKIP_WITHOUT_CACHE();
  hm::empty_cache();
  auto check = [&] {
    const auto s = hm::stats();
    EXPECT_LE(s.live_bytes + s.cached_bytes,
              s.peak_live_bytes + s.peak_live_bytes / hm::kMaxSlackDivisor);
  };
  // A forward-like phase of one size, then a backward-like phase of another size, three times
  // (larger than anything earlier tests allocated, so they set the peak).
  const size_t act = size_t{12} << 20, grad = size_t{20} << 20;
  for (int round = 0; round < 3; ++round) {
    std::vector<void*> acts, grads;
    for (int i = 0; i < 6; ++i) acts.push_back(hm::allocate(act)), check();
    for (void* p : acts) hm::release(p, act), check();
    for (int i = 0; i < 4; ++i) grads.push_back(hm::allocate(grad)), check();
    for (void* p : grads) hm::release(p, grad), check();
  }
  EXPECT_GE(hm::stats().peak_live_bytes, 4 * grad);
  EXPECT_GT(hm::stats().evictions, 0);
  hm::empty_cache();
  EXPECT_EQ(hm::stats().cached_bytes, 0u);
}

// Room for a new size is made by dropping as few cached bytes as possible: three 16 MB blocks
// rather than one 160 MB block (which a later request of its size would fault in again).
TEST(HostMemory, AMissDropsTheFewestCachedBytesThatMakeRoom) {
  SKIP_WITHOUT_CACHE();
  hm::empty_cache();
  const size_t mb = size_t{1} << 20, peak = 400 * mb;  // sizes that round to themselves
  if (hm::stats().peak_live_bytes > peak) GTEST_SKIP() << "an earlier test set a larger peak";
  hm::release(hm::allocate(peak), peak);  // the peak: slack = 25 MB
  hm::empty_cache();
  const size_t big = 160 * mb, small = 16 * mb, filler = 192 * mb, fresh = 60 * mb;
  void* b = hm::allocate(big);
  std::vector<void*> smalls{hm::allocate(small), hm::allocate(small), hm::allocate(small)};
  void* f = hm::allocate(filler);  // live 400 MB
  hm::release(b, big);
  for (void* p : smalls) hm::release(p, small);  // live 192 + cached 208
  const auto before = hm::stats();
  void* n = hm::allocate(fresh);  // 460 MB mapped would exceed 425: 35 MB must go
  const auto after = hm::stats();
  EXPECT_EQ(after.evictions - before.evictions, 3);
  EXPECT_EQ(after.cached_bytes, big);
  void* b2 = hm::allocate(big);  // still cached
  EXPECT_EQ(b2, b);
  EXPECT_EQ(hm::stats().hits, after.hits + 1);
  for (auto [p, size] : {std::pair{n, fresh}, {b2, big}, {f, filler}}) hm::release(p, size);
  hm::empty_cache();
}

// A block under 8 MiB comes from malloc, and freeing it does not give its pages back (they stay in
// glibc's heap and fragment): room is made by unmapping a mapped block even when a malloc block
// alone would cover the excess. Before, two such blocks evicting each other grew GPT-2 124M's
// RSS ~4 MB every step.
TEST(HostMemory, RoomIsMadeFromMappedBlocksBeforeMallocOnes) {
  SKIP_WITHOUT_CACHE();
  hm::empty_cache();
  const size_t mb = size_t{1} << 20, peak = 600 * mb;
  if (hm::stats().peak_live_bytes > peak) GTEST_SKIP() << "an earlier test set a larger peak";
  hm::release(hm::allocate(peak), peak);
  hm::empty_cache();
  const size_t slack = peak / hm::kSlackDivisor;
  const size_t from_malloc = 4 * mb, mapped = 48 * mb, filler = peak - from_malloc - mapped;
  void* s = hm::allocate(from_malloc);
  void* m = hm::allocate(mapped);
  void* f = hm::allocate(filler);  // live = the peak
  hm::release(s, from_malloc);
  hm::release(m, mapped);
  const auto before = hm::stats();
  // live + cached + fresh: 1-3 MB over the peak + slack (fresh is a whole number of 2 MiB pages),
  // so the 4 MB block alone would cover the excess
  const size_t fresh = (slack + 3 * mb) / (2 * mb) * (2 * mb);
  void* n = hm::allocate(fresh);
  const auto after = hm::stats();
  EXPECT_EQ(after.evictions - before.evictions, 1);
  EXPECT_EQ(after.cached_bytes, from_malloc) << "the mapped block went, the malloc one stayed";
  void* s2 = hm::allocate(from_malloc);
  EXPECT_EQ(s2, s);
  for (auto [p, size] : {std::pair{n, fresh}, {s2, from_malloc}, {f, filler}}) hm::release(p, size);
  hm::empty_cache();
}

// One "step" that needs three sizes mapped at once: live F + A, then F + B. With A = P/8 and
// B = 3P/32 the three blocks need P + 3P/32 mapped, more than the base slack of P/16 allows, so
// under the base slack A and B evict each other and both fault in again every step. The first miss
// for a dropped size teaches the cache a larger slack (at most P/8 in all); from the third step on,
// every request is a hit.
constexpr size_t kMb2 = size_t{2} << 20;  // mapped sizes round to 2 MiB

// Sets the peak to at least 256 MB (a multiple of 64 MiB, so that its eighths and 32nds are whole
// 2 MiB pages) and empties the cache (which also forgets the learned slack); returns the peak.
size_t start_from_a_round_peak() {
  hm::empty_cache();
  const size_t step = 32 * kMb2;
  const size_t peak =
      (std::max(hm::stats().peak_live_bytes, size_t{256} << 20) + step - 1) / step * step;
  hm::release(hm::allocate(peak), peak);
  hm::empty_cache();
  return peak;
}

TEST(HostMemory, SizesThatEvictEachOtherEveryStepTeachALargerSlack) {
  SKIP_WITHOUT_CACHE();
  const size_t P = start_from_a_round_peak();
  const size_t A = P / 8, B = 3 * P / 32, F = P - A;
  auto within_bound = [&] {
    const auto s = hm::stats();
    EXPECT_LE(s.live_bytes + s.cached_bytes,
              s.peak_live_bytes + s.peak_live_bytes / hm::kMaxSlackDivisor);
  };
  std::vector<int64_t> misses;
  for (int step = 0; step < 5; ++step) {
    const int64_t before = hm::stats().misses;
    void* f = hm::allocate(F);
    void* a = hm::allocate(A);
    within_bound();
    hm::release(a, A);
    void* b = hm::allocate(B);
    within_bound();
    hm::release(b, B);
    hm::release(f, F);
    misses.push_back(hm::stats().misses - before);
  }
  EXPECT_GT(misses[0], 0);
  EXPECT_EQ(misses[2] + misses[3] + misses[4], 0) << "A and B still evict each other";
  const auto s = hm::stats();
  EXPECT_GT(s.learned_slack, 0u);
  EXPECT_LE(s.learned_slack, s.peak_live_bytes / hm::kMaxSlackDivisor);
  hm::empty_cache();
  EXPECT_EQ(hm::stats().learned_slack, 0u) << "empty_cache forgets what was learned";
}

// A step that would need more than P/8 above its peak keeps thrashing, but the cache never maps
// more than the peak plus 1/8 of it.
TEST(HostMemory, TheLearnedSlackStopsAtAnEighthOfThePeak) {
  SKIP_WITHOUT_CACHE();
  const size_t P = start_from_a_round_peak();
  const size_t A = P / 4, B = P / 4 - kMb2, F = P - A;
  for (int step = 0; step < 4; ++step) {
    void* f = hm::allocate(F);
    void* a = hm::allocate(A);
    hm::release(a, A);
    void* b = hm::allocate(B);
    const auto s = hm::stats();
    EXPECT_LE(s.live_bytes + s.cached_bytes,
              s.peak_live_bytes + s.peak_live_bytes / hm::kMaxSlackDivisor);
    EXPECT_LE(s.learned_slack, s.peak_live_bytes / hm::kMaxSlackDivisor);
    hm::release(b, B);
    hm::release(f, F);
  }
  EXPECT_GT(hm::stats().learned_slack, 0u);
  hm::empty_cache();
}

TEST(HostMemory, SmallBlocksBypassTheCache) {
  hm::empty_cache();
  const auto before = hm::stats();
  void* p = hm::allocate(1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  hm::release(p, 1000);
  const auto after = hm::stats();
  EXPECT_EQ(after.hits + after.misses, before.hits + before.misses);
  EXPECT_EQ(after.cached_bytes, 0u);
}

}  // namespace
}  // namespace keel
