// Converting a tensor that is a view of a file mapping (io/safetensors.h MappedSafetensors) without
// holding the whole tensor as stored: an f32 file loaded into a bf16 frozen base.
#pragma once
#include "keel/tensor/tensor.h"

namespace keel {

// `t` in `dtype`. A view of external memory (Tensor::from_external: a file mapping) is converted a
// few MB at a time, each chunk's pages dropped from memory once read (madvise MADV_DONTNEED; a
// later read of them would fault them in from the file again), so the peak is the result plus one
// chunk rather than the result plus the whole tensor as stored: 46 MB less for one 2048 x 5632 f32
// MLP weight. Any other tensor is t.to_dtype(dtype).
Tensor convert_mapped(const Tensor& t, DType dtype);

// Drops the pages wholly inside external `t` from memory (nothing for any other tensor): after a
// pass that read a mapped weight it will not read again soon (DoRA's magnitude, the row norms of
// the weights it adapts, before the base is cast), so the pass leaves nothing resident. The pages
// are read-only file pages (keel's only external memory is io/safetensors' mappings): a later read
// faults them in from the file again, with the same values.
void drop_mapped_pages(const Tensor& t);

}  // namespace keel
