// The matmul rate an MFU figure divides by: best-of-5 GFLOP/s of an n³ NT product through keel's
// matmul kernels (the path linear takes), measured in the same process as the training it rates.
#pragma once
#include <algorithm>
#include <chrono>

#include "keel/backend/matmul.h"
#include "keel/tensor/tensor.h"

namespace keel::bench {

inline double matmul_peak_gflops(DType dt, int64_t n = 1024) {
  using clk = std::chrono::steady_clock;
  Tensor a = Tensor::full({n, n}, 0.5f, dt), b = Tensor::full({n, n}, 0.25f, dt);
  Tensor c = Tensor::empty({n, n}, dt);
  MatmulArgs args;
  args.c = c.data();
  args.a = a.data();
  args.b = b.data();
  args.in_dt = args.out_dt = dt;
  args.m = args.n = args.k = n;
  args.trans_b = true;
  const auto& mm = matmul_kernels(Device::cpu());
  mm.matmul(args);  // JIT + first touch
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = clk::now();
    mm.matmul(args);
    best = std::min(best, std::chrono::duration<double>(clk::now() - t0).count());
  }
  return 2.0 * n * n * n / best / 1e9;
}

}  // namespace keel::bench
