// Embedding gather and scatter-add on the CPU. Memory-bound copies: one plain implementation (no
// per-ISA variants); the scatter-add is parallel over distinct ids, so each row of dweight is
// summed by one thread in position order, whatever the thread count.
#include "keel/backend/embedding.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "keel/backend/parallel.h"
#include "keel/numerics/convert.h"
#include "keel/numerics/error.h"
#ifdef KEEL_HAVE_CUDA
#include "keel/backend/cuda/tables.h"
#endif

namespace keel {

namespace {

inline int64_t id_at(const void* ids, DType id_dt, int64_t i) {
  return id_dt == DType::I32 ? static_cast<const int32_t*>(ids)[i]
                             : static_cast<const int64_t*>(ids)[i];
}

void check_id_dtype(DType id_dt) {
  KEEL_CHECK(id_dt == DType::I32 || id_dt == DType::I64,
             std::string("embedding kernels: ids must be i32 or i64, got ") + dtype_name(id_dt));
}

int64_t find_invalid(const void* ids, DType id_dt, int64_t n, int64_t v) {
  check_id_dtype(id_dt);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = id_at(ids, id_dt, i);
    if (id < 0 || id >= v) return i;
  }
  return -1;
}

void gather(void* out, const void* weight, const void* ids, DType id_dt, DType dt, int64_t n,
            int64_t d) {
  check_id_dtype(id_dt);
  const size_t row = static_cast<size_t>(d) * dtype_size(dt);
  char* o = static_cast<char*>(out);
  const char* w = static_cast<const char*>(weight);
  parallel_for(n, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
               [&](int64_t lo, int64_t hi) {
                 for (int64_t i = lo; i < hi; ++i)
                   std::memcpy(o + i * row, w + id_at(ids, id_dt, i) * row, row);
               });
}

// Rows of one id, summed in f32 in position order and rounded to T, then added to the row (one
// more rounding): the bits of adding a zero-filled gradient's rows to the row.
template <class T>
void scatter_rows(T* dw, const T* g, const int64_t* order, const int64_t* group, int64_t ngroups,
                  const void* ids, DType id_dt, int64_t d) {
  parallel_for(ngroups, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
               [&](int64_t g0, int64_t g1) {
                 std::vector<float> acc(d);  // [d]
                 for (int64_t k = g0; k < g1; ++k) {
                   const int64_t first = group[k], last = group[k + 1];
                   T* row = dw + id_at(ids, id_dt, order[first]) * d;
                   std::fill(acc.begin(), acc.end(), 0.f);
                   for (int64_t p = first; p < last; ++p) {
                     const T* src = g + order[p] * d;
                     for (int64_t j = 0; j < d; ++j) acc[j] += load_f32(src + j);
                   }
                   for (int64_t j = 0; j < d; ++j) {
                     T sum;  // the group's sum rounded to T, then added as a dense add would
                     store_f32(&sum, acc[j]);
                     store_f32(row + j, load_f32(row + j) + load_f32(&sum));
                   }
                 }
               });
}

void scatter_add(void* dweight, const void* grad, const void* ids, DType id_dt, DType dt, int64_t n,
                 int64_t v, int64_t d) {
  check_id_dtype(id_dt);
  (void)v;
  // Positions sorted by (id, position): equal ids form contiguous groups in position order.
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t ia = id_at(ids, id_dt, a), ib = id_at(ids, id_dt, b);
    return ia != ib ? ia < ib : a < b;
  });
  std::vector<int64_t> group;  // start of each group in `order`, then n
  for (int64_t p = 0; p < n; ++p)
    if (p == 0 || id_at(ids, id_dt, order[p]) != id_at(ids, id_dt, order[p - 1]))
      group.push_back(p);
  const int64_t ngroups = static_cast<int64_t>(group.size());
  group.push_back(n);
  switch (dt) {
    case DType::F32:
      scatter_rows(static_cast<float*>(dweight), static_cast<const float*>(grad), order.data(),
                   group.data(), ngroups, ids, id_dt, d);
      break;
    case DType::BF16:
      scatter_rows(static_cast<bf16_t*>(dweight), static_cast<const bf16_t*>(grad), order.data(),
                   group.data(), ngroups, ids, id_dt, d);
      break;
    case DType::F16:
      scatter_rows(static_cast<f16_t*>(dweight), static_cast<const f16_t*>(grad), order.data(),
                   group.data(), ngroups, ids, id_dt, d);
      break;
    default:
      KEEL_CHECK(false, std::string("embedding scatter_add: floating dtype required, got ") +
                            dtype_name(dt));
  }
}

const EmbeddingKernels kCpuEmbedding = {find_invalid, gather, scatter_add};

}  // namespace

const EmbeddingKernels& embedding_kernels(Device dev) {
#ifdef KEEL_HAVE_CUDA
  if (dev.is_cuda()) return cuda::embedding_table();
#endif
  KEEL_CHECK(dev.is_cpu(), "no embedding kernels for " + dev.str() + " in this build");
  return kCpuEmbedding;
}

}  // namespace keel
