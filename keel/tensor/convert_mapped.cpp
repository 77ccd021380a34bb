#include "keel/tensor/convert_mapped.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace keel {

namespace {

const uintptr_t kPage = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));

// The pages wholly inside [p, p + n).
void drop_pages(uintptr_t p, uintptr_t n) {
  const uintptr_t lo = (p + kPage - 1) / kPage * kPage, hi = (p + n) / kPage * kPage;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

}  // namespace

void drop_mapped_pages(const Tensor& t) {
  if (t.defined() && t.is_external() && t.device().is_cpu() && t.numel() > 0)
    drop_pages(reinterpret_cast<uintptr_t>(t.data()), t.nbytes());
}

Tensor convert_mapped(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype || !t.is_external() || t.numel() == 0 || !t.device().is_cpu())
    return t.to_dtype(dtype);
  Tensor out = Tensor::empty(t.shape(), dtype);
  const int64_t n = t.numel(), es = static_cast<int64_t>(dtype_size(t.dtype()));
  const int64_t chunk = std::max<int64_t>(1, (int64_t{8} << 20) / es);
  const Tensor src = t.view({n});
  Tensor dst = out.view({n});
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data());
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t j = std::min(n, i + chunk);
    dst.slice_rows(i, j).copy_from(src.slice_rows(i, j));
    // A page this chunk shares with the next stays until the view dies, which drops the rest.
    drop_pages(base + static_cast<uintptr_t>(i * es), static_cast<uintptr_t>((j - i) * es));
  }
  return out;
}

}  // namespace keel
