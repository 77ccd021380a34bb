// The tensor-core flash kernels (keel/backend/cuda/attention_mma.cu) run on the CPU through the
// host emulator of shim/ (emulator.h: a block of std::threads meeting at barriers, WMMA tiles in
// every lane), against the CPU's flash attention: forward output and lse, and the dQ, dK, dV of
// the backward, in bf16 and f16, head dims 64 and 128, one partial 64-row tile and several,
// grouped-query heads, a batch row whose first 70 keys are padding (a whole tile of rows that see
// nothing) and one padding key inside. This checks the kernels' logic on every machine, GPU or
// not; the GPU test CudaOps.FlashOnTensorCoresMatchesTheCpu checks them on the hardware.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

// (The shim's cuda_runtime.h, cuda_bf16.h, cuda_fp16.h and mma.h come first on this test's
// include path: tests/CMakeLists.txt.)
#include "keel/autograd/node.h"
#include "keel/backend/cuda/attention_mma.cu"
#include "keel/ops/attention.h"
#include "tests/support/check.h"

namespace keel {
namespace {

struct Case {
  DType dt;
  int64_t t, d;
  bool padded;
};

template <class T>
T* as(Tensor& t) {
  return reinterpret_cast<T*>(t.data());
}
template <class T>
const T* as(const Tensor& t) {
  return reinterpret_cast<const T*>(t.data());
}

template <class T, int D>
void run_case(const Case& c) {
  const int64_t b = 2, hq = 4, hkv = 2, t = c.t;
  const std::string what = std::string("emulated flash on tensor cores ") + dtype_name(c.dt) +
                           " T=" + std::to_string(t) + " D=" + std::to_string(D) +
                           (c.padded ? " padded" : "");
  const int64_t padding = std::min<int64_t>(70, t - 5);  // batch row 1's first keys
  std::vector<int64_t> mask_v(2 * t, 1);
  for (int64_t j = 0; j < padding; ++j) mask_v[t + j] = 0;
  mask_v[t + t - 3] = 0;
  const Tensor mask = Tensor::from_ints(mask_v, {b, t}, DType::U8);
  Tensor q = test::randn({b, hq, t, D}, 25, 1.f, c.dt),
         k = test::randn({b, hkv, t, D}, 26, 1.f, c.dt),
         v = test::randn({b, hkv, t, D}, 27, 1.f, c.dt);
  const Tensor dout = test::randn({b, hq, t, D}, 99, 1.f, c.dt);

  // The CPU's flash backend, forward and backward.
  for (Tensor* x : {&q, &k, &v}) x->set_requires_grad(true);
  const Tensor want =
      ops::attention(q, k, v, c.padded ? mask : Tensor(), ops::AttentionBackend::kFlash);
  backward(want, dout);

  // The kernels, on the emulator.
  cuda::AttnDims a{b,
                   hq,
                   hkv,
                   t,
                   D,
                   static_cast<float>(1.0 / std::sqrt(double(D))),
                   c.padded ? mask.data_as<uint8_t>() : nullptr};
  Tensor o = Tensor::empty(q.shape(), c.dt), lse = Tensor::empty({b, hq, t}, DType::F32);
  const unsigned q_blocks = static_cast<unsigned>(b * hq * ((t + 63) / 64));
  emu::launch(cuda::flash_mma_fwd_kernel<T, D>, q_blocks, cuda::kThreads,
              cuda::FwdSmem<T, D>::kBytes, as<T>(o), lse.data_as<float>(), as<T>(q), as<T>(k),
              as<T>(v), a);
  test::expect_close(o.to_dtype(DType::F32), want.to_dtype(DType::F32), 4 * test::eps_of(c.dt),
                     4 * test::eps_of(c.dt), what + " output");
  // lse of the rows that see nothing is -inf; of the others finite.
  const std::vector<float> lv = lse.to_floats();
  for (int64_t r = 0; r < b * hq * t; ++r) {
    const bool sees_nothing = c.padded && r / (hq * t) == 1 && r % t < padding;
    EXPECT_EQ(std::isinf(lv[r]) && lv[r] < 0, sees_nothing) << what << " lse row " << r;
  }

  // drow = sum_d dO * O per row (attention.cu's flash_drow_kernel), then dK/dV and dQ.
  const std::vector<float> of = o.to_floats(), df = dout.to_floats();
  std::vector<float> drow(static_cast<size_t>(b * hq * t));
  for (size_t r = 0; r < drow.size(); ++r) {
    float s = 0.f;
    for (int64_t x = 0; x < D; ++x) s += df[r * D + x] * of[r * D + x];
    drow[r] = s;
  }
  Tensor dq = Tensor::empty(q.shape(), c.dt), dk = Tensor::empty(k.shape(), c.dt),
         dv = Tensor::empty(v.shape(), c.dt);
  const unsigned kv_blocks = static_cast<unsigned>(b * hkv * ((t + 63) / 64));
  emu::launch(cuda::flash_mma_dkdv_kernel<T, D>, kv_blocks, cuda::kThreads,
              cuda::BwdSmem<T, D>::kBytes, as<T>(dk), as<T>(dv), as<T>(q), as<T>(k), as<T>(v),
              as<T>(dout), lse.data_as<float>(), drow.data(), a);
  emu::launch(cuda::flash_mma_dq_kernel<T, D>, q_blocks, cuda::kThreads,
              cuda::BwdSmem<T, D>::kBytes, as<T>(dq), as<T>(q), as<T>(k), as<T>(v), as<T>(dout),
              lse.data_as<float>(), drow.data(), a);
  const double tol = 4 * test::eps_of(c.dt);
  test::expect_close(dq.to_dtype(DType::F32), q.grad().to_dtype(DType::F32), tol, tol,
                     what + " dQ");
  test::expect_close(dk.to_dtype(DType::F32), k.grad().to_dtype(DType::F32), tol, tol,
                     what + " dK");
  test::expect_close(dv.to_dtype(DType::F32), v.grad().to_dtype(DType::F32), tol, tol,
                     what + " dV");
}

TEST(FlashOnTensorCoresEmulated, MatchesTheCpuFlashForwardAndBackward) {
  for (const Case& c : {Case{DType::BF16, 37, 64, true}, Case{DType::BF16, 150, 64, true},
                        Case{DType::F16, 150, 64, false}, Case{DType::BF16, 100, 128, true}}) {
    if (c.dt == DType::BF16) {
      if (c.d == 64)
        run_case<__nv_bfloat16, 64>(c);
      else
        run_case<__nv_bfloat16, 128>(c);
    } else {
      run_case<__half, 64>(c);
    }
  }
}

}  // namespace
}  // namespace keel
