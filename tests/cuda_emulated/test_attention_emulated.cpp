// backend/cuda's attention kernels run on the CPU through the host emulator of shim/ (emulator.h:
// a block of std::threads meeting at barriers, warp shuffles through slots, WMMA tiles held whole
// in every lane), called through their kernel table as ops::attention calls them on a GPU, and
// compared with the CPU's table on the same inputs: the flash backend on CUDA cores (the default)
// and on tensor cores (KEEL_CUDA_FLASH_MMA=1: attention_mma.cu), forward output and lse and the
// dQ, dK, dV of the backward; the eager/math backends' softmax pair. Grouped-query heads, one
// batch row or two, a row whose first keys are padding (whole tiles of rows that see nothing) and
// one padding key inside, one partial tile and several. This checks the kernels' logic on every
// machine, GPU or not; CudaOps.* (tests/cuda) checks them on the hardware.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "keel/backend/attention.h"
#include "tests/cuda_emulated/emulated.h"
#include "tests/support/check.h"

namespace keel {
namespace {

struct Case {
  DType dt;
  int64_t t, d;
  bool padded;
  int64_t batch = 1;  // 2 for some: a second row's offsets (each row costs emulation time)
};

std::string name_of(const char* what, const Case& c) {
  return std::string(what) + " " + dtype_name(c.dt) + " B=" + std::to_string(c.batch) +
         " T=" + std::to_string(c.t) + " D=" + std::to_string(c.d) + (c.padded ? " padded" : "");
}

// c.batch rows, 2 query heads over 1 key/value head; with padding, the last row's first
// min(70, T - 5) keys and its third-to-last are padding. (Sizes are small: the emulator runs a
// block's threads on the host's cores, meeting at a barrier at every shuffle.)
struct Problem {
  static constexpr int64_t hq = 2, hkv = 1;
  Case c;
  int64_t b, padding;
  Tensor mask, q, k, v, dout;
  AttentionDims dims;
  explicit Problem(const Case& cs) : c(cs), b(cs.batch), padding(std::min<int64_t>(70, cs.t - 5)) {
    const int64_t t = c.t;
    std::vector<int64_t> mask_v(b * t, 1);
    for (int64_t j = 0; j < padding; ++j) mask_v[(b - 1) * t + j] = 0;
    mask_v[b * t - 3] = 0;
    mask = Tensor::from_ints(mask_v, {b, t}, DType::U8);
    q = test::randn({b, hq, t, c.d}, 25, 1.f, c.dt);
    k = test::randn({b, hkv, t, c.d}, 26, 1.f, c.dt);
    v = test::randn({b, hkv, t, c.d}, 27, 1.f, c.dt);
    dout = test::randn({b, hq, t, c.d}, 99, 1.f, c.dt);
    dims.batch = b, dims.heads_q = hq, dims.heads_kv = hkv, dims.seq = t, dims.head_dim = c.d;
    dims.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
    dims.key_padding_mask = c.padded ? mask.data_as<uint8_t>() : nullptr;
  }
  bool sees_nothing(int64_t row) const {  // row of [B, Hq, T]
    return c.padded && row / (hq * c.t) == b - 1 && row % c.t < padding;
  }
};

// The flash pair through one table: o, lse, dq, dk, dv.
std::vector<Tensor> flash(const AttentionKernels& kt, const Problem& p) {
  Tensor o = Tensor::empty(p.q.shape(), p.c.dt), lse = Tensor::empty({p.b, p.hq, p.c.t});
  kt.flash_forward(o.data(), lse.data_as<float>(), p.q.data(), p.k.data(), p.v.data(), p.c.dt,
                   p.dims);
  Tensor dq = Tensor::empty(p.q.shape(), p.c.dt), dk = Tensor::empty(p.k.shape(), p.c.dt),
         dv = Tensor::empty(p.v.shape(), p.c.dt);
  kt.flash_backward(dq.data(), dk.data(), dv.data(), p.q.data(), p.k.data(), p.v.data(), o.data(),
                    p.dout.data(), lse.data_as<float>(), p.c.dt, p.dims);
  return {o, lse, dq, dk, dv};
}

void expect_flash_matches_the_cpu(const Case& c, const char* what, const char* kernel_file) {
  const Problem p(c);
  const std::string name = name_of(what, c);
  emucuda::launched_files().clear();
  const std::vector<Tensor> got = flash(emucuda::attention_table(), p);
  int launches = 0;
  for (const std::string& f : emucuda::launched_files())
    launches += f.rfind(std::string(kernel_file) + " ", 0) == 0;
  EXPECT_GE(launches, 3) << name << ": the forward, dK/dV and dQ kernels of " << kernel_file;
  const std::vector<Tensor> want = flash(attention_kernels(Device::cpu()), p);
  const double tol = c.dt == DType::F32 ? 1e-5 : 4 * test::eps_of(c.dt);
  const char* names[] = {"output", "lse", "dQ", "dK", "dV"};
  for (int i : {0, 2, 3, 4})
    test::expect_close(got[i].to_dtype(DType::F32), want[i].to_dtype(DType::F32), tol, tol,
                       name + " " + names[i]);
  const std::vector<float> lg = got[1].to_floats(), lw = want[1].to_floats();
  for (size_t r = 0; r < lg.size(); ++r) {
    if (p.sees_nothing(static_cast<int64_t>(r))) {
      EXPECT_TRUE(std::isinf(lg[r]) && lg[r] < 0) << name << " lse row " << r << ": " << lg[r];
    } else {
      EXPECT_NEAR(lg[r], lw[r], 1e-5 * (1 + std::abs(lw[r]))) << name << " lse row " << r;
    }
  }
}

TEST(CudaEmulated, FlashOnCudaCoresMatchesTheCpu) {
  for (const Case& c : {Case{DType::BF16, 40, 16, true, 2}, Case{DType::F32, 33, 80, false}})
    expect_flash_matches_the_cpu(c, "flash on CUDA cores", "attention.cu");
}

TEST(CudaEmulated, FlashOnTensorCoresMatchesTheCpu) {
  setenv("KEEL_CUDA_FLASH_MMA", "1", 1);
  for (const Case& c : {Case{DType::BF16, 37, 64, true}, Case{DType::BF16, 150, 64, true, 2},
                        Case{DType::F16, 100, 128, false}})
    expect_flash_matches_the_cpu(c, "flash on tensor cores", "attention_mma.cu");
  unsetenv("KEEL_CUDA_FLASH_MMA");
}

// The eager/math backends' softmax pair: p32 and its rounded copy from raw f32 scores, then ds
// from dp and P rounded for dV, with each row's keys in registers (a block of 128 threads a row).
TEST(CudaEmulated, AttentionSoftmaxPairMatchesTheCpu) {
  for (const Case& c : {Case{DType::BF16, 24, 8, true, 2}, Case{DType::F16, 33, 8, false}}) {
    const std::string name = name_of("attention softmax", c);
    const Problem p(c);
    const int64_t rows = p.b * p.hq * c.t;
    const Tensor s = test::randn({rows, c.t}, 31, 3.f),
                 dp = test::randn({rows, c.t}, 32, 1.f, c.dt);
    Tensor p32[2], plp[2], ds[2], pdv[2];
    for (int side = 0; side < 2; ++side) {
      const AttentionKernels& kt =
          side == 0 ? emucuda::attention_table() : attention_kernels(Device::cpu());
      p32[side] = Tensor::empty({rows, c.t});
      plp[side] = Tensor::empty({rows, c.t}, c.dt);
      kt.softmax_forward(p32[side].data_as<float>(), plp[side].data(), c.dt, s.data(), DType::F32,
                         c.dt, p.dims);
      ds[side] = Tensor::empty({rows, c.t}, c.dt);
      pdv[side] = Tensor::empty({rows, c.t}, c.dt);
      kt.softmax_backward(ds[side].data(), c.dt, p32[side].data_as<float>(), dp.data(), c.dt,
                          pdv[side].data(), p.dims);
    }
    const double tol = c.dt == DType::F32 ? 1e-5 : 4 * test::eps_of(c.dt);
    test::expect_close(p32[0], p32[1], 1e-6, 1e-5, name + " p32");
    for (const auto& [got, want, what] :
         {std::tuple{plp[0], plp[1], " p rounded"}, std::tuple{ds[0], ds[1], " ds"},
          std::tuple{pdv[0], pdv[1], " p for dV"}})
      test::expect_close(got.to_dtype(DType::F32), want.to_dtype(DType::F32), tol, tol,
                         name + what);
  }
}

}  // namespace
}  // namespace keel
