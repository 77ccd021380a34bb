// Kernel interface: cross-entropy from logits, one row per prediction.
//
// logits [n, v] have a floating dtype dt (read into f32); targets [n] are I32 or I64 (tdt). Rows
// whose target equals ignore_index count nowhere. Per row, with m the row max and
// s = sum_j exp(x[j] - m) (f32 lanes in fixed blocks, blocks summed in f64), the kernels keep
// stats[r] = (m, log s) so that log p_j = (x[j] - m) - log s.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct CrossEntropyKernels {
  // The first row whose target is neither ignore_index nor in [0, v), or -1.
  int64_t (*find_invalid)(const void* targets, DType tdt, int64_t n, int64_t v,
                          int64_t ignore_index);
  // Number of targets that are not ignore_index.
  int64_t (*count)(const void* targets, DType tdt, int64_t n, int64_t ignore_index);
  // Fills stats [n, 2] (f32) and returns sum over counted rows of -log p_target, summed in f64 in
  // row order (same bits for every thread count). Targets already validated.
  double (*forward)(float* stats, const void* logits, DType dt, const void* targets, DType tdt,
                    int64_t n, int64_t v, int64_t ignore_index);
  // dlogits[r, j] = (exp(log p_j) - [j == target]) * scale on counted rows, 0 on ignored rows;
  // stored in dt.   dlogits [n, v]; may be logits itself (each element is read before it is
  // written, and by nobody else).
  void (*backward)(void* dlogits, const void* logits, DType dt, const float* stats,
                   const void* targets, DType tdt, int64_t n, int64_t v, int64_t ignore_index,
                   float scale);
};

const CrossEntropyKernels& cross_entropy_kernels(Device dev);

}  // namespace keel
