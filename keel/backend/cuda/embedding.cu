// CUDA embedding: id checks, gather, and the deterministic scatter-add of the backward.
// Semantics as backend/cpu (backend/embedding.h).
//
// The scatter-add groups positions by id (a stable sort) and sums each group in position order.
// By default the grouping is done on the host (the ids read back: a synchronization in the middle
// of the backward). With KEEL_CUDA_DEVICE_GROUPING=1 it stays on the device: CUB's radix sort of
// (id, position) pairs is stable, so each id's positions come out ascending and the sums are the
// same bits; a block per sorted position, of which only the first of each id's run works. Written
// without a GPU (session 45): off until CudaOps.EmbeddingGroupedOnTheDeviceAsOnTheHost has run.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "keel/backend/cuda/kernels.cuh"
#include "keel/backend/cuda/tables.h"

namespace keel::cuda {

// First index i with bad(i), or -1: the minimum is order-independent, so atomicMin is
// deterministic.
namespace {
__global__ void find_invalid_kernel(unsigned long long* first, const void* ids, bool i32, int64_t n,
                                    int64_t v, int64_t ignore, bool use_ignore) {
  KEEL_CUDA_FOR(i, n) {
    const int64_t t = id_at(ids, i32, i);
    if (!(use_ignore && t == ignore) && (t < 0 || t >= v))
      atomicMin(first, static_cast<unsigned long long>(i));
  }
}
}  // namespace

int64_t find_invalid_ids(const void* ids, DType dt, int64_t n, int64_t v, int64_t ignore,
                         bool use_ignore) {
  KEEL_CHECK(dt == DType::I32 || dt == DType::I64,
             std::string("cuda: ids/targets must be i32 or i64, got ") + dtype_name(dt));
  if (n <= 0) return -1;
  Scratch s(8);
  const unsigned long long none = ~0ull;
  KEEL_CUDA_CHECK(cudaMemsetAsync(s.as<void>(), 0xff, 8, stream()));  // = none, no host sync
  KEEL_LAUNCH(grid_for(n), kThreads, 0, find_invalid_kernel)
  (s.as<unsigned long long>(), ids, dt == DType::I32, n, v, ignore, use_ignore);
  KEEL_CUDA_LAUNCHED();
  unsigned long long out = 0;
  read_back(&out, s.as<void>(), 8);
  return out == none ? -1 : static_cast<int64_t>(out);
}

namespace {

int64_t emb_find_invalid(const void* ids, DType id_dt, int64_t n, int64_t v) {
  return find_invalid_ids(ids, id_dt, n, v, 0, false);
}

template <class E>
__global__ void gather_kernel(E* out, const E* w, const void* ids, bool i32, int64_t n, int64_t d) {
  KEEL_CUDA_FOR(e, n * d) out[e] = w[id_at(ids, i32, e / d) * d + e % d];
}
void emb_gather(void* out, const void* weight, const void* ids, DType id_dt, DType dt, int64_t n,
                int64_t d) {
  if (n * d <= 0) return;
  const bool i32 = id_dt == DType::I32;
  if (dtype_size(dt) == 4)
    KEEL_LAUNCH(grid_for(n * d), kThreads, 0, gather_kernel<uint32_t>)
    ((uint32_t*)out, (const uint32_t*)weight, ids, i32, n, d);
  else
    KEEL_LAUNCH(grid_for(n * d), kThreads, 0, gather_kernel<uint16_t>)
    ((uint16_t*)out, (const uint16_t*)weight, ids, i32, n, d);
  KEEL_CUDA_LAUNCHED();
}

// One block per distinct id: its positions' gradients summed in increasing position order (f32)
// and rounded to T, then added to the row; as the CPU kernel.
template <class T>
__global__ void scatter_kernel(T* dw, const T* g, const int64_t* order, const int64_t* group,
                               const int64_t* row_of_group, int64_t d) {
  const int64_t k = blockIdx.x, first = group[k], last = group[k + 1];
  T* row = dw + row_of_group[k] * d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float acc = 0.f;
    for (int64_t p = first; p < last; ++p) acc += ld(g + order[p] * d + j);
    T sum;  // rounded to T, then added to the row as a dense add would
    st(&sum, acc);
    st(row + j, ld(row + j) + ld(&sum));
  }
}
// ---- grouping on the device ------------------------------------------------------------------

__global__ void sort_inputs_kernel(uint32_t* keys, int32_t* positions, const void* ids, bool i32,
                                   int64_t n) {
  KEEL_CUDA_FOR(i, n) {
    keys[i] = static_cast<uint32_t>(id_at(ids, i32, i));  // validated: in [0, v), v < 2^31
    positions[i] = static_cast<int32_t>(i);
  }
}

// Block p of the sorted positions: the first of its id's run sums the run (ascending positions)
// per column, as scatter_kernel sums a group.
template <class T>
__global__ void sorted_scatter_kernel(T* dw, const T* g, const uint32_t* keys,
                                      const int32_t* positions, int64_t n, int64_t d) {
  const int64_t p = blockIdx.x;
  const uint32_t id = keys[p];
  if (p > 0 && keys[p - 1] == id) return;  // not the first of its run
  T* row = dw + static_cast<int64_t>(id) * d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float acc = 0.f;
    for (int64_t q = p; q < n && keys[q] == id; ++q) acc += ld(g + positions[q] * d + j);
    T sum;
    st(&sum, acc);
    st(row + j, ld(row + j) + ld(&sum));
  }
}

bool device_grouping_enabled() {
  const char* e = std::getenv("KEEL_CUDA_DEVICE_GROUPING");  // read at each call: tests switch it
  return e && std::strcmp(e, "1") == 0;
}

void scatter_add_grouped_on_device(void* dweight, const void* grad, const void* ids, DType id_dt,
                                   DType dt, int64_t n, int64_t v, int64_t d) {
  int end_bit = 1;  // the bits an id < v needs
  while (end_bit < 32 && (int64_t{1} << end_bit) < v) ++end_bit;
  const int count = static_cast<int>(n);
  size_t sort_bytes = 0;
  KEEL_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), count, 0, end_bit,
      stream()));
  const size_t pairs = static_cast<size_t>(n) * 4;  // bytes of one array of keys or positions
  Scratch buf(4 * pairs + sort_bytes);
  uint32_t* keys_in = buf.as<uint32_t>();
  uint32_t* keys = keys_in + n;
  int32_t* pos_in = reinterpret_cast<int32_t*>(keys + n);
  int32_t* pos = pos_in + n;
  void* sort_tmp = pos + n;
  KEEL_LAUNCH(grid_for(n), kThreads, 0, sort_inputs_kernel)
  (keys_in, pos_in, ids, id_dt == DType::I32, n);
  KEEL_CUDA_LAUNCHED();
  KEEL_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_tmp, sort_bytes, keys_in, keys, pos_in, pos,
                                                  count, 0, end_bit, stream()));
  const int threads = d >= 256 ? 256 : 128;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        KEEL_LAUNCH(n, threads, 0, sorted_scatter_kernel<T>)(
                            (T*)dweight, (const T*)grad, keys, pos, n, d));
  KEEL_CUDA_LAUNCHED();
}

void emb_scatter_add(void* dweight, const void* grad, const void* ids, DType id_dt, DType dt,
                     int64_t n, int64_t v, int64_t d) {
  if (n <= 0 || d <= 0) return;
  if (device_grouping_enabled() && n < (int64_t{1} << 31) && v <= (int64_t{1} << 31))
    return scatter_add_grouped_on_device(dweight, grad, ids, id_dt, dt, n, v, d);
  // The grouping (a stable sort of the ids) on the host: ids are small next to the gradients.
  std::vector<int64_t> h(n);
  if (id_dt == DType::I32) {
    std::vector<int32_t> h32(n);
    read_back(h32.data(), ids, n * 4);
    for (int64_t i = 0; i < n; ++i) h[i] = h32[i];
  } else {
    read_back(h.data(), ids, n * 8);
  }
  std::vector<int64_t> meta(n);  // order, then group starts, then row of each group
  std::iota(meta.begin(), meta.end(), 0);
  std::stable_sort(meta.begin(), meta.end(), [&](int64_t a, int64_t b) { return h[a] < h[b]; });
  std::vector<int64_t> group, rows;
  for (int64_t p = 0; p < n; ++p)
    if (p == 0 || h[meta[p]] != h[meta[p - 1]]) group.push_back(p), rows.push_back(h[meta[p]]);
  const int64_t ng = static_cast<int64_t>(group.size());
  group.push_back(n);
  meta.insert(meta.end(), group.begin(), group.end());
  meta.insert(meta.end(), rows.begin(), rows.end());
  Scratch dev(meta.size() * 8);
  KEEL_CUDA_CHECK(cudaMemcpyAsync(dev.as<void>(), meta.data(), meta.size() * 8,
                                  cudaMemcpyHostToDevice, stream()));
  const int64_t* order = dev.as<int64_t>();
  const int threads = d >= 256 ? 256 : 128;
  KEEL_CUDA_FLOAT_TYPES(dt, T,
                        KEEL_LAUNCH(ng, threads, 0, scatter_kernel<T>)(
                            (T*)dweight, (const T*)grad, order, order + n, order + n + ng + 1, d));
  KEEL_CUDA_LAUNCHED();
  // meta must outlive the copy from pageable memory: cudaMemcpyAsync from pageable memory has
  // staged it before returning, so it may be freed here.
}
const EmbeddingKernels kEmbedding = {emb_find_invalid, emb_gather, emb_scatter_add};

}  // namespace

const EmbeddingKernels& embedding_table() { return kEmbedding; }

}  // namespace keel::cuda
