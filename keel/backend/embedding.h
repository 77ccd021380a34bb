// Kernel interface: embedding gather and its deterministic scatter-add.
//
// ids are I32 or I64 (`id_dt`); tables and gradients have one floating dtype `dt`. The gather
// copies rows bitwise; the scatter-add accumulates every row in f32, in increasing position order,
// and rounds once into dt, so its bits depend on neither the thread count nor timing.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct EmbeddingKernels {
  // The first position i with ids[i] outside [0, v), or -1 when every id is valid.
  int64_t (*find_invalid)(const void* ids, DType id_dt, int64_t n, int64_t v);
  // out[i, :] = weight[ids[i], :]      out [n, d], weight [v, d]; ids already validated.
  void (*gather)(void* out, const void* weight, const void* ids, DType id_dt, DType dt, int64_t n,
                 int64_t d);
  // dweight[r, :] += sum over {i : ids[i] == r} of grad[i, :]   (i ascending, f32 accumulation,
  // the sum rounded to dt and then added to the row: the bits of a dense add of the scattered
  // rows; rows no id names are not touched).   dweight [v, d], grad [n, d]
  void (*scatter_add)(void* dweight, const void* grad, const void* ids, DType id_dt, DType dt,
                      int64_t n, int64_t v, int64_t d);
};

const EmbeddingKernels& embedding_kernels(Device dev);

}  // namespace keel
