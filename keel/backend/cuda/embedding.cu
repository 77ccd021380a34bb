// CUDA embedding: id checks, gather, and the deterministic scatter-add of the backward.
// Semantics as backend/cpu (backend/embedding.h).
#include <algorithm>
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
  find_invalid_kernel<<<grid_for(n), kThreads, 0, stream()>>>(
      s.as<unsigned long long>(), ids, dt == DType::I32, n, v, ignore, use_ignore);
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
    gather_kernel<<<grid_for(n * d), kThreads, 0, stream()>>>(
        (uint32_t*)out, (const uint32_t*)weight, ids, i32, n, d);
  else
    gather_kernel<<<grid_for(n * d), kThreads, 0, stream()>>>(
        (uint16_t*)out, (const uint16_t*)weight, ids, i32, n, d);
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
void emb_scatter_add(void* dweight, const void* grad, const void* ids, DType id_dt, DType dt,
                     int64_t n, int64_t v, int64_t d) {
  (void)v;
  if (n <= 0 || d <= 0) return;
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
                        scatter_kernel<<<ng, threads, 0, stream()>>>(
                            (T*)dweight, (const T*)grad, order, order + n, order + n + ng + 1, d));
  KEEL_CUDA_LAUNCHED();
  // meta must outlive the copy from pageable memory: cudaMemcpyAsync from pageable memory has
  // staged it before returning, so it may be freed here.
}
const EmbeddingKernels kEmbedding = {emb_find_invalid, emb_gather, emb_scatter_add};

}  // namespace

const EmbeddingKernels& embedding_table() { return kEmbedding; }

}  // namespace keel::cuda
