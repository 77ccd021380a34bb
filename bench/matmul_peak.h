// The matmul rate an MFU figure divides by: the best GFLOP/s of an n³ NT product through keel's
// matmul kernels (the path linear takes), measured in the same process as the training it rates.
//
// One probe is not enough on a shared VM. Measured on this project's 2-vCPU VM (2026-11-30): the
// 1024³ bf16 product ran at 650–820 GFLOP/s for minutes at a time and at 2020–2040 GFLOP/s at
// others, in the same process, and a probe right after start-up can catch either. A best-of-5
// probe (5 ms) taken only before training then rated one run's bf16 steps at 51.8% MFU against
// 752 GFLOP/s. So a probe runs back-to-back calls for a fixed time, and callers probe before and
// after their steps and divide by the higher figure: an MFU is never inflated by a slow moment of
// the probe, and a run whose two probes disagree shows it.
#pragma once
#include <algorithm>
#include <chrono>

#include "keel/backend/cuda_api.h"
#include "keel/backend/matmul.h"
#include "keel/tensor/tensor.h"

namespace keel::bench {

// On a GPU (dev cuda:N) each call is waited for (a 1024³ product is microseconds there: pass a
// larger n, e.g. 8192, as bench_gpu does).
class MatmulPeak {
 public:
  explicit MatmulPeak(DType dt, int64_t n = 1024, Device dev = Device::cpu())
      : n_(n),
        dev_(dev),
        a_(Tensor::full({n, n}, 0.5f, dt).to(dev)),
        b_(Tensor::full({n, n}, 0.25f, dt).to(dev)),
        c_(Tensor::empty({n, n}, dt, dev)) {
    args_.c = c_.data();
    args_.a = a_.data();
    args_.b = b_.data();
    args_.in_dt = args_.out_dt = dt;
    args_.m = args_.n = args_.k = n;
    args_.trans_b = true;
  }

  // Best GFLOP/s over back-to-back calls for at least `seconds` (and at least 5 calls), after one
  // untimed call (JIT, first touch).
  double probe(double seconds = 0.3) {
    using clk = std::chrono::steady_clock;
    const auto& mm = matmul_kernels(dev_);
    auto wait = [&] {
      if (dev_.is_cuda()) cuda::synchronize(dev_.index);
    };
    mm.matmul(args_);
    wait();
    double best = 1e30;
    const auto start = clk::now();
    for (int calls = 0; calls < 5 || clk::now() - start < std::chrono::duration<double>(seconds);
         ++calls) {
      const auto t0 = clk::now();
      mm.matmul(args_);
      wait();
      best = std::min(best, std::chrono::duration<double>(clk::now() - t0).count());
    }
    return 2.0 * static_cast<double>(n_) * n_ * n_ / best / 1e9;
  }

 private:
  int64_t n_;
  Device dev_;
  Tensor a_, b_, c_;
  MatmulArgs args_;
};

}  // namespace keel::bench
