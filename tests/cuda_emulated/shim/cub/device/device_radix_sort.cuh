// CUB's DeviceRadixSort::SortPairs for the host emulator: its contract (a stable sort of the pairs
// by the key bits [begin_bit, end_bit), keys and values written to the outputs; a call without
// temporary storage only sizes it), so that code around it (backend/cuda/embedding.cu's grouping)
// runs here. What CUB's kernels do inside is CUB's, not under test.
#pragma once
#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

#include "../../cuda_runtime.h"

namespace cub {

struct DeviceRadixSort {
  template <class K, class V>
  static cudaError_t SortPairs(void* temp, size_t& temp_bytes, const K* keys_in, K* keys_out,
                               const V* values_in, V* values_out, int n, int begin_bit = 0,
                               int end_bit = sizeof(K) * 8, cudaStream_t = nullptr) {
    if (!temp) {
      temp_bytes = 1;
      return cudaSuccess;
    }
    const int bits = end_bit - begin_bit;
    const K mask = bits >= static_cast<int>(sizeof(K) * 8) ? ~K{0} : (K{1} << bits) - 1;
    auto key = [&](int i) { return (keys_in[i] >> begin_bit) & mask; };
    std::vector<int> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key(a) < key(b); });
    for (int i = 0; i < n; ++i) {
      keys_out[i] = keys_in[order[i]];
      values_out[i] = values_in[order[i]];
    }
    return cudaSuccess;
  }
};

}  // namespace cub
