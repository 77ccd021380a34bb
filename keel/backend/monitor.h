// Kernel interface: the instability toolkit's passes over whole buffers (DESIGN §3 steps 4-5 and
// the tracer), so that a device computes them where the data lives and the host reads back a few
// numbers once.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/tensor/device.h"

namespace keel {

struct GradSetStats {
  int64_t nonfinite = 0;   // values that were nan or inf before scaling
  double sum_squares = 0;  // of the values after scaling (non-finite values propagate)
};

// One buffer's share of the pass: its sum of squares (the same bits the total adds up on the CPU)
// and how many of its values, after scaling, were exactly 0 or below `normal_min` without being 0
// (the compute format's smallest normal: subnormal there, or flushed to 0 on the way back).
struct GradBufStats {
  double sum_squares = 0;
  int64_t zero = 0, below_normal = 0;
};

struct MonitorKernels {
  // Over `count` gradient buffers (bufs[i]: ns[i] values of dtype dts[i]): counts the non-finite
  // values, multiplies every value by inv_scale in place unless inv_scale == 1 (as GradScaler's
  // unscale: non-finite values are scaled too), and sums the squares of the results (f32 within
  // fixed blocks, f64 across blocks and buffers). One pass, one result. With inv_scale == 1 a
  // device may leave `nonfinite` at 0 and let the sum carry the non-finite value (the CPU does:
  // its values are then read once).
  // With `per` (count entries, may be null) each buffer's sum of squares and its counts of zeros
  // and of non-zero values with |v| < normal_min, read from the values the sum reads (in cache,
  // no second pass over memory; normal_min = 0 counts zeros only).
  GradSetStats (*unscale_norm)(void* const* bufs, const DType* dts, const int64_t* ns, int count,
                               float inv_scale, float normal_min, GradBufStats* per);
  // numerics/tensor_stats' result, every field equal (counts, abs-min/abs-max over finite values,
  // thresholds of `fmt`). CPU (cpu/monitor.inc): one vectorized pass over the bit patterns per
  // ISA, split over threads only for large tensors; exact, so the same for every ISA and thread
  // count. CUDA: on the device, a few numbers copied back.
  TensorStats (*stats)(const void* data, DType dt, int64_t n, DType fmt);
};

const MonitorKernels& monitor_kernels(Device dev);

}  // namespace keel
