// OpenMP helpers with deterministic work splitting.
//
// parallel_for splits [0, n) into one contiguous static chunk per thread: element-wise results do
// not depend on the split. Reductions use fixed-size blocks whose partial sums are combined in
// block order, so their bits depend on neither the thread count nor timing.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace keel {

inline int num_threads() { return omp_get_max_threads(); }

// The thread count to use for `requested` threads (> 0) asked by `key`: more than the machine's
// cores is capped at the core count (libgomp's per-thread stacks overflow long before 100000
// threads, and oversubscription only slows a run down), with `warning` saying so.
inline int capped_threads(int requested, const std::string& key, std::string* warning) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (requested <= cores) return requested;
  *warning = key + " = " + std::to_string(requested) + " exceeds the " + std::to_string(cores) +
             " cores of this machine: using " + std::to_string(cores) +
             " threads (results are bit-identical only for a fixed thread count)";
  return cores;
}

template <class F>
void parallel_for(int64_t n, int64_t grain, F&& fn) {
  if (n <= 0) return;
  if (n <= grain || omp_get_max_threads() == 1 || omp_in_parallel()) {
    fn(int64_t{0}, n);
    return;
  }
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t chunk = (n + nt - 1) / nt;
    const int64_t lo = t * chunk, hi = lo + chunk < n ? lo + chunk : n;
    if (lo < hi) fn(lo, hi);
  }
}

// Sums block_fn(lo, hi) (a double) over fixed blocks of `block` elements, in block order.
template <class F>
double parallel_sum_blocks(int64_t n, int64_t block, F&& block_fn) {
  const int64_t nblocks = (n + block - 1) / block;
  std::vector<double> partial(nblocks > 0 ? nblocks : 1, 0.0);
  parallel_for(nblocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
      partial[b] = block_fn(lo, hi);
    }
  });
  double s = 0;
  for (int64_t b = 0; b < nblocks; ++b) s += partial[b];
  return s;
}

}  // namespace keel
