// backend/cuda's activation, dropout, monitor, rope, elementwise, cross_entropy, embedding, norm,
// optim, softmax and shape kernels on the CPU through the host emulator (shim/, prelude.h), against
// the CPU's tables on the same inputs: the functions' values within a few units of rounding (the
// emulator's math is the host's libm, not CUDA's: what this checks is each kernel's indexing,
// vector tails and rounding points), dropout's masks and products bit for bit, the fused unscale +
// finite check + sums of squares with its per-buffer counts, tensor statistics field by field.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "keel/numerics/tensor_stats.h"
#include "tests/cuda_emulated/emulated.h"
#include "tests/support/check.h"

namespace keel {
namespace {

const DType kFloats[] = {DType::F32, DType::BF16, DType::F16};

double tol_of(DType dt) { return dt == DType::F32 ? 2e-6 : 2 * test::eps_of(dt); }

Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype()); }

void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  const double tol = tol_of(want.dtype());
  test::expect_close(got.to_dtype(DType::F32), want.to_dtype(DType::F32), tol, tol, what);
}

TEST(CudaEmulated, ActivationsMatchTheCpu) {
  const ActivationKernels &gpu = emucuda::activation_table(),
                          &cpu = activation_kernels(Device::cpu());
  const int64_t n = 1003;  // not a multiple of the 4-wide vector path: its tail too
  for (DType dt : kFloats) {
    const std::string name = dtype_name(dt);
    const Tensor x = test::randn({n}, 60, 2.5f, dt), u = test::randn({n}, 61, 1.f, dt),
                 g = test::randn({n}, 62, 1.f, dt);
    // Unary forwards and their backwards, on both tables.
    struct Fn {
      const char* what;
      void (*fwd)(const ActivationKernels&, void*, const void*, DType, int64_t);
      void (*bwd)(const ActivationKernels&, void*, const void*, const void*, DType, int64_t);
    };
    const Fn fns[] = {
        {"gelu tanh",
         [](auto& k, void* o, const void* a, DType d, int64_t m) { k.gelu(o, a, d, m, true); },
         [](auto& k, void* o, const void* gr, const void* a, DType d, int64_t m) {
           k.gelu_backward(o, gr, a, d, m, true);
         }},
        {"gelu erf",
         [](auto& k, void* o, const void* a, DType d, int64_t m) { k.gelu(o, a, d, m, false); },
         [](auto& k, void* o, const void* gr, const void* a, DType d, int64_t m) {
           k.gelu_backward(o, gr, a, d, m, false);
         }},
        {"silu", [](auto& k, void* o, const void* a, DType d, int64_t m) { k.silu(o, a, d, m); },
         [](auto& k, void* o, const void* gr, const void* a, DType d, int64_t m) {
           k.silu_backward(o, gr, a, d, m);
         }},
        {"softcap",
         [](auto& k, void* o, const void* a, DType d, int64_t m) { k.softcap(o, a, d, m, 3.f); },
         [](auto& k, void* o, const void* gr, const void* a, DType d, int64_t m) {
           k.softcap_backward(o, gr, a, d, m, 3.f);
         }},
        {"clamp",
         [](auto& k, void* o, const void* a, DType d, int64_t m) {
           k.clamp(o, a, d, m, -1.f, 1.5f);
         },
         [](auto& k, void* o, const void* gr, const void* a, DType d, int64_t m) {
           k.clamp_backward(o, gr, a, d, m, -1.f, 1.5f);
         }},
        {"exp", [](auto& k, void* o, const void* a, DType d, int64_t m) { k.exp(o, a, d, m); },
         nullptr},
        {"tanh", [](auto& k, void* o, const void* a, DType d, int64_t m) { k.tanh(o, a, d, m); },
         nullptr},
        {"erf", [](auto& k, void* o, const void* a, DType d, int64_t m) { k.erf(o, a, d, m); },
         nullptr},
    };
    for (const Fn& f : fns) {
      Tensor out[2] = {empty_like(x), empty_like(x)}, dx[2] = {empty_like(x), empty_like(x)};
      for (int side = 0; side < 2; ++side) {
        const ActivationKernels& k = side == 0 ? gpu : cpu;
        f.fwd(k, out[side].data(), x.data(), dt, n);
        if (f.bwd) f.bwd(k, dx[side].data(), g.data(), x.data(), dt, n);
      }
      expect_same(out[0], out[1], std::string(f.what) + " " + name);
      if (f.bwd) expect_same(dx[0], dx[1], std::string(f.what) + " backward " + name);
    }
    Tensor out[2] = {empty_like(x), empty_like(x)}, dgate[2] = {empty_like(x), empty_like(x)},
           dup[2] = {empty_like(x), empty_like(x)};
    for (int side = 0; side < 2; ++side) {
      const ActivationKernels& k = side == 0 ? gpu : cpu;
      k.swiglu(out[side].data(), x.data(), u.data(), dt, n);
      k.swiglu_backward(dgate[side].data(), dup[side].data(), g.data(), x.data(), u.data(), dt, n);
    }
    expect_same(out[0], out[1], "swiglu " + name);
    expect_same(dgate[0], dgate[1], "swiglu dgate " + name);
    expect_same(dup[0], dup[1], "swiglu dup " + name);
  }
}

// The mask is a pure function of (seed, index), the product one f32 multiply rounded once: the
// same bits on both tables, and apply_cast's kept mask byte for byte.
TEST(CudaEmulated, DropoutMatchesTheCpuBitForBit) {
  const DropoutKernels &gpu = emucuda::dropout_table(), &cpu = dropout_kernels(Device::cpu());
  const int64_t n = 1003;
  const uint32_t threshold = 0x4ccccccd;  // p = 0.3
  const float scale = 1.f / 0.7f;
  for (DType dt : kFloats)
    for (DType out_dt : {DType::F32, dt}) {
      const std::string name = std::string(dtype_name(dt)) + " -> " + dtype_name(out_dt);
      const Tensor x = test::randn({n}, 63, 1.f, dt);
      Tensor plain[2], cast[2], kept[2], keep[2];
      for (int side = 0; side < 2; ++side) {
        const DropoutKernels& k = side == 0 ? gpu : cpu;
        plain[side] = empty_like(x);
        k.apply(plain[side].data(), x.data(), dt, n, 77, threshold, scale);
        cast[side] = Tensor::empty({n}, out_dt);
        keep[side] = Tensor::zeros({(n + 7) / 8}, DType::U8);
        k.apply_cast(cast[side].data(), out_dt, x.data(), dt, n, 77, threshold, scale,
                     keep[side].data_as<uint8_t>());
        kept[side] = Tensor::empty({n}, out_dt);
        k.apply_kept(kept[side].data(), out_dt, x.data(), dt, n, keep[side].data_as<uint8_t>(),
                     scale);
      }
      test::expect_bitwise_equal(plain[0], plain[1], "dropout " + name);
      test::expect_bitwise_equal(cast[0], cast[1], "dropout_cast " + name);
      test::expect_bitwise_equal(keep[0], keep[1], "dropout_cast's mask " + name);
      test::expect_bitwise_equal(kept[0], kept[1], "dropout from the kept mask " + name);
      test::expect_bitwise_equal(kept[0], cast[0], "kept mask = hashed mask " + name);
    }
}

// The step's one pass over the gradients: non-finite count, unscaled values, sum of squares, and
// each buffer's sum, zeros and values below the compute dtype's smallest normal.
TEST(CudaEmulated, FusedUnscaleNormAndStatsMatchTheCpu) {
  const MonitorKernels &gpu = emucuda::monitor_table(), &cpu = monitor_kernels(Device::cpu());
  std::vector<Tensor> in = {test::randn({3000}, 40, 1000.f), test::randn({17, 9}, 41, 500.f),
                            test::randn({9000}, 42, 2.f, DType::BF16)};
  in[0].data_as<float>()[7] = 0.f;
  in[2].data_as<uint16_t>()[11] = 0;  // a bf16 zero
  in[2].data_as<uint16_t>()[12] = 1;  // and a subnormal
  for (bool with_nan : {false, true}) {
    std::vector<Tensor> bufs[2];
    for (auto& side : bufs)
      for (const Tensor& t : in) side.push_back(t.clone());
    if (with_nan)
      for (auto& side : bufs) side[1].data_as<float>()[5] = NAN;
    GradSetStats s[2];
    GradBufStats per[2][3];
    for (int side = 0; side < 2; ++side) {
      std::vector<void*> p;
      std::vector<DType> dts;
      std::vector<int64_t> ns;
      for (Tensor& t : bufs[side])
        p.push_back(t.data()), dts.push_back(t.dtype()), ns.push_back(t.numel());
      s[side] = (side == 0 ? gpu : cpu)
                    .unscale_norm(p.data(), dts.data(), ns.data(), 3, 1.f / 1024,
                                  6.1035156e-05f / 1024, per[side]);
    }
    const std::string name = with_nan ? "with a NaN" : "finite";
    EXPECT_EQ(s[0].nonfinite, s[1].nonfinite) << name;
    if (with_nan) {
      EXPECT_TRUE(std::isnan(s[0].sum_squares)) << name;
    } else {
      EXPECT_NEAR(s[0].sum_squares, s[1].sum_squares, 1e-6 * s[1].sum_squares) << name;
    }
    for (int i = 0; i < 3; ++i) {
      test::expect_bitwise_equal(bufs[0][i], bufs[1][i], name + " unscaled " + std::to_string(i));
      EXPECT_EQ(per[0][i].zero, per[1][i].zero) << name << " " << i;
      EXPECT_EQ(per[0][i].below_normal, per[1][i].below_normal) << name << " " << i;
      if (!(with_nan && i == 1)) {
        EXPECT_NEAR(per[0][i].sum_squares, per[1][i].sum_squares, 1e-6 * per[1][i].sum_squares)
            << name << " " << i;
      }
    }
  }
  for (DType dt : kFloats) {
    std::vector<float> v = test::randn({10007}, 50, 1e4f).to_floats();
    v[3] = 0.f, v[4] = 1e-41f, v[5] = INFINITY, v[6] = NAN, v[7] = 60000.f;
    const Tensor t = Tensor::from_floats(v, {10007}, dt);
    const TensorStats a = tensor_stats(t.data(), dt, t.numel(), DType::F16);
    const TensorStats b = gpu.stats(t.data(), dt, t.numel(), DType::F16);
    EXPECT_EQ(b.nan, a.nan) << dtype_name(dt);
    EXPECT_EQ(b.inf, a.inf) << dtype_name(dt);
    EXPECT_EQ(b.zero, a.zero) << dtype_name(dt);
    EXPECT_EQ(b.subnormal, a.subnormal) << dtype_name(dt);
    EXPECT_EQ(b.near_max, a.near_max) << dtype_name(dt);
    EXPECT_EQ(b.abs_min, a.abs_min) << dtype_name(dt);
    EXPECT_EQ(b.abs_max, a.abs_max) << dtype_name(dt);
  }
}

// Element-wise arithmetic, row broadcasts, column sums (two-stage, chunked), conversions and the
// fixed-tree f64 sums: odd sizes (vector tails), rows past one chunk.
TEST(CudaEmulated, ElementwiseMatchesTheCpu) {
  const ElementwiseKernels &gpu = emucuda::elementwise_table(),
                           &cpu = elementwise_kernels(Device::cpu());
  const int64_t rows = 131, cols = 37, n = rows * cols;
  for (DType dt : kFloats) {
    const std::string name = dtype_name(dt);
    const Tensor a = test::randn({n}, 70, 1.f, dt), b = test::randn({n}, 71, 1.f, dt),
                 row = test::randn({cols}, 72, 1.f, dt);
    // (Column sums of 131 rows add in another order than the CPU's: f32 rounding, 1e-4.)
    auto both = [&](const char* what, int64_t len, auto&& f) {
      Tensor out[2] = {Tensor::empty({len}, dt), Tensor::empty({len}, dt)};
      f(gpu, out[0].data());
      f(cpu, out[1].data());
      const double tol = len == cols && dt == DType::F32 ? 1e-4 : tol_of(dt);
      test::expect_close(out[0].to_dtype(DType::F32), out[1].to_dtype(DType::F32), tol, tol,
                         std::string(what) + " " + name);
    };
    both("add", n, [&](auto& k, void* o) { k.add(o, a.data(), b.data(), dt, n); });
    both("mul", n, [&](auto& k, void* o) { k.mul(o, a.data(), b.data(), dt, n); });
    both("axpby", n, [&](auto& k, void* o) { k.axpby(o, 0.3f, a.data(), -1.7f, b.data(), dt, n); });
    both("add_scaled", n,
         [&](auto& k, void* o) { k.add_scaled(o, a.data(), 0.25f, b.data(), dt, n); });
    both("add_row", n,
         [&](auto& k, void* o) { k.add_row(o, a.data(), row.data(), dt, rows, cols); });
    both("mul_row", n,
         [&](auto& k, void* o) { k.mul_row(o, a.data(), row.data(), dt, rows, cols); });
    both("sum_rows", cols, [&](auto& k, void* o) { k.sum_rows(o, a.data(), dt, rows, cols); });
    both("sum_rows_mul", cols,
         [&](auto& k, void* o) { k.sum_rows_mul(o, a.data(), b.data(), dt, rows, cols); });
    for (DType to : kFloats) {
      Tensor out[2] = {Tensor::empty({n}, to), Tensor::empty({n}, to)};
      gpu.convert(out[0].data(), to, a.data(), dt, n);
      cpu.convert(out[1].data(), to, a.data(), dt, n);
      test::expect_bitwise_equal(out[0], out[1],
                                 std::string("convert ") + name + " -> " + dtype_name(to));
    }
    // f32 within the device's blocks, f64 across them: 1e-3 of a sum of ~70, 1e-6 of the squares.
    EXPECT_NEAR(gpu.sum(a.data(), dt, n), cpu.sum(a.data(), dt, n), 1e-3) << name;
    const double sq = cpu.sum_squares(a.data(), dt, n);
    EXPECT_NEAR(gpu.sum_squares(a.data(), dt, n), sq, 1e-6 * sq) << name;
  }
}

// Cross-entropy: the loss over rows (per-row max and log-sum-exp, ignored rows), the gradient,
// the count of counted rows and the first invalid target; a vocabulary over 8192 (1024 threads a
// row) and one under.
TEST(CudaEmulated, CrossEntropyMatchesTheCpu) {
  const CrossEntropyKernels &gpu = emucuda::cross_entropy_table(),
                            &cpu = cross_entropy_kernels(Device::cpu());
  for (int64_t v : {int64_t{1031}, int64_t{8300}})
    for (DType dt : kFloats) {
      const std::string name = std::string(dtype_name(dt)) + " V=" + std::to_string(v);
      const int64_t n = 6;
      const Tensor logits = test::randn({n, v}, 73, 2.f, dt);
      const Tensor targets = Tensor::from_ints({5, -100, v - 1, 0, 77, -100}, {n});
      EXPECT_EQ(gpu.count(targets.data(), DType::I64, n, -100), 4) << name;
      EXPECT_EQ(gpu.find_invalid(targets.data(), DType::I64, n, v, -100), -1) << name;
      Tensor stats[2] = {Tensor::empty({n, 2}), Tensor::empty({n, 2})},
             grad[2] = {Tensor::empty({n, v}, dt), Tensor::empty({n, v}, dt)};
      double loss[2];
      for (int side = 0; side < 2; ++side) {
        const CrossEntropyKernels& k = side == 0 ? gpu : cpu;
        loss[side] = k.forward(stats[side].data_as<float>(), logits.data(), dt, targets.data(),
                               DType::I64, n, v, -100);
        k.backward(grad[side].data(), logits.data(), dt, stats[side].data_as<float>(),
                   targets.data(), DType::I64, n, v, -100, 0.25f);
      }
      EXPECT_NEAR(loss[0], loss[1], 1e-5 * std::abs(loss[1])) << name;
      test::expect_close(stats[0], stats[1], 1e-5, 1e-5, name + " stats");
      expect_same(grad[0], grad[1], "cross_entropy backward " + name);
    }
}

// LayerNorm and RMSNorm, forward (with their statistics) and backward (dx, and the weight and bias
// gradients' chunked column sums), with and without an affine transform; rows wider than a warp.
TEST(CudaEmulated, NormsMatchTheCpu) {
  const NormKernels &gpu = emucuda::norm_table(), &cpu = norm_kernels(Device::cpu());
  const int64_t rows = 70, cols = 300;  // (more than one 64-row chunk of the column sums)
  // f32 without an affine transform, bf16 with one (f16 takes bf16's template path).
  for (const auto& [dt, affine] : {std::pair{DType::F32, false}, std::pair{DType::BF16, true}}) {
    const std::string name = std::string(dtype_name(dt)) + (affine ? " affine" : "");
    const Tensor x = test::randn({rows, cols}, 80, 2.f, dt),
                 dy = test::randn({rows, cols}, 81, 1.f, dt), w = test::randn({cols}, 82, 1.f, dt),
                 b = test::randn({cols}, 83, 1.f, dt);
    const void* wp = affine ? w.data() : nullptr;
    const void* bp = affine ? b.data() : nullptr;
    Tensor y[2], mean[2], rstd[2], dx[2], dw[2], db[2], ry[2], rr[2], rdx[2], rdw[2];
    for (int side = 0; side < 2; ++side) {
      const NormKernels& k = side == 0 ? gpu : cpu;
      y[side] = empty_like(x), dx[side] = empty_like(x), ry[side] = empty_like(x),
      rdx[side] = empty_like(x);
      mean[side] = Tensor::empty({rows}), rstd[side] = Tensor::empty({rows}),
      rr[side] = Tensor::empty({rows});
      dw[side] = empty_like(w), db[side] = empty_like(b), rdw[side] = empty_like(w);
      k.layer_norm(y[side].data(), mean[side].data_as<float>(), rstd[side].data_as<float>(),
                   x.data(), wp, bp, dt, rows, cols, 1e-5f);
      k.layer_norm_backward(dx[side].data(), affine ? dw[side].data() : nullptr,
                            affine ? db[side].data() : nullptr, dy.data(), x.data(), wp,
                            mean[side].data_as<float>(), rstd[side].data_as<float>(), dt, rows,
                            cols);
      k.rms_norm(ry[side].data(), rr[side].data_as<float>(), x.data(), wp, dt, rows, cols, 1e-6f);
      k.rms_norm_backward(rdx[side].data(), affine ? rdw[side].data() : nullptr, dy.data(),
                          x.data(), wp, rr[side].data_as<float>(), dt, rows, cols);
    }
    const double col_tol = dt == DType::F32 ? 1e-4 : tol_of(dt);  // sums of 70 rows
    expect_same(y[0], y[1], "layer_norm " + name);
    test::expect_close(mean[0], mean[1], 1e-6, 1e-5, "layer_norm mean " + name);
    test::expect_close(rstd[0], rstd[1], 1e-6, 1e-5, "layer_norm rstd " + name);
    expect_same(dx[0], dx[1], "layer_norm dx " + name);
    expect_same(ry[0], ry[1], "rms_norm " + name);
    test::expect_close(rr[0], rr[1], 1e-6, 1e-5, "rms_norm rstd " + name);
    expect_same(rdx[0], rdx[1], "rms_norm dx " + name);
    if (affine) {
      for (const auto& [got, want, what] :
           {std::tuple{dw[0], dw[1], "layer_norm dw "}, std::tuple{db[0], db[1], "layer_norm db "},
            std::tuple{rdw[0], rdw[1], "rms_norm dw "}})
        test::expect_close(got.to_dtype(DType::F32), want.to_dtype(DType::F32), col_tol, col_tol,
                           what + name);
    }
  }
}

// AdamW and SGD (momentum, Nesterov, weight decay), plain and with stochastic rounding into bf16
// (and its count of rounded-away updates), and the scaler's unscale: the same bits as the CPU
// (the same operations in the same order, the rounded intrinsics never fused).
TEST(CudaEmulated, OptimizersMatchTheCpuBitForBit) {
  const OptimKernels &gpu = emucuda::optim_table(), &cpu = optim_kernels(Device::cpu());
  const int64_t n = 1003;
  for (DType dt : kFloats)
    for (bool sr : {false, true}) {
      if (sr && dt != DType::BF16) continue;
      const std::string name = std::string(dtype_name(dt)) + (sr ? " SR" : "");
      const Tensor p = test::randn({n}, 30, 1.f, dt), g = test::randn({n}, 31, 0.1f, dt),
                   m = test::randn({n}, 32, 0.01f, dt),
                   v = test::rand_uniform({n}, 33, 0.f, 1e-3f, dt);
      Tensor ps[2], ms[2], vs[2], sp[2], sb[2];
      int64_t away[2] = {0, 0}, sgd_away[2] = {0, 0};
      for (int side = 0; side < 2; ++side) {
        const OptimKernels& k = side == 0 ? gpu : cpu;
        ps[side] = p.clone(), ms[side] = m.clone(), vs[side] = v.clone();
        AdamWStep s;
        s.lr = 3e-3, s.weight_decay = 0.1, s.step = 7, s.stochastic_rounding = sr, s.seed = 5;
        s.grad_scale = 0.5f;
        s.rounded_away = &away[side];
        k.adamw(ps[side].data(), g.data(), ms[side].data(), vs[side].data(), dt, n, s);
        sp[side] = p.clone(), sb[side] = m.clone();
        SgdStep q;
        q.lr = 0.1, q.momentum = 0.9, q.dampening = 0.1, q.weight_decay = 0.01, q.nesterov = true;
        q.stochastic_rounding = sr, q.seed = 9, q.rounded_away = &sgd_away[side];
        k.sgd(sp[side].data(), g.data(), sb[side].data(), dt, n, q);
      }
      test::expect_bitwise_equal(ps[0], ps[1], "adamw p " + name);
      test::expect_bitwise_equal(ms[0], ms[1], "adamw m " + name);
      test::expect_bitwise_equal(vs[0], vs[1], "adamw v " + name);
      EXPECT_EQ(away[0], away[1]) << "adamw rounded away " << name;
      test::expect_bitwise_equal(sp[0], sp[1], "sgd p " + name);
      test::expect_bitwise_equal(sb[0], sb[1], "sgd buffer " + name);
      EXPECT_EQ(sgd_away[0], sgd_away[1]) << "sgd rounded away " << name;
      std::vector<float> gv = g.to_floats();
      gv[3] = NAN, gv[9] = INFINITY;
      Tensor u[2] = {Tensor::from_floats(gv, {n}, dt), Tensor::from_floats(gv, {n}, dt)};
      EXPECT_EQ(gpu.unscale(u[0].data(), dt, n, 1.f / 64),
                cpu.unscale(u[1].data(), dt, n, 1.f / 64))
          << "unscale's non-finite count " << name;
      test::expect_close(u[0], u[1], 0, 0, "unscaled " + name);
    }
}

// Row softmax and log-softmax with their backwards; rows wider than a block's threads.
TEST(CudaEmulated, SoftmaxMatchesTheCpu) {
  const SoftmaxKernels &gpu = emucuda::softmax_table(), &cpu = softmax_kernels(Device::cpu());
  const int64_t rows = 9, cols = 700;
  for (DType dt : kFloats)
    for (bool log : {false, true}) {
      const std::string name = std::string(log ? "log_softmax " : "softmax ") + dtype_name(dt);
      const Tensor x = test::randn({rows, cols}, 84, 3.f, dt),
                   dy = test::randn({rows, cols}, 85, 1.f, dt);
      Tensor y[2] = {empty_like(x), empty_like(x)}, dx[2] = {empty_like(x), empty_like(x)};
      for (int side = 0; side < 2; ++side) {
        const SoftmaxKernels& k = side == 0 ? gpu : cpu;
        (log ? k.log_softmax : k.softmax)(y[side].data(), x.data(), dt, rows, cols);
        (log ? k.log_softmax_backward : k.softmax_backward)(dx[side].data(), dy.data(),
                                                            y[side].data(), dt, rows, cols);
      }
      expect_same(y[0], y[1], name);
      expect_same(dx[0], dx[1], name + " backward");
    }
}

// swap_dims (split/merge heads, transposes) and copy_2d: bytes moved, bit for bit.
TEST(CudaEmulated, ShapeCopiesMatchTheCpuBitForBit) {
  const ShapeKernels &gpu = emucuda::shape_table(), &cpu = shape_kernels(Device::cpu());
  for (DType dt : kFloats) {
    const Tensor x = test::randn({2, 3, 5, 4, 7}, 86, 1.f, dt);
    Tensor out[2] = {empty_like(x), empty_like(x)};
    for (int side = 0; side < 2; ++side)
      (side == 0 ? gpu : cpu).swap_dims(out[side].data(), x.data(), dtype_size(dt), 2, 3, 5, 4, 7);
    test::expect_bitwise_equal(out[0], out[1], std::string("swap_dims ") + dtype_name(dt));
    Tensor dst[2] = {Tensor::zeros({6, 40}, dt), Tensor::zeros({6, 40}, dt)};
    for (int side = 0; side < 2; ++side)
      (side == 0 ? gpu : cpu).copy_2d(dst[side].data(), 40, x.data(), 35, dtype_size(dt), 6, 33);
    test::expect_bitwise_equal(dst[0], dst[1], std::string("copy_2d ") + dtype_name(dt));
  }
}

// The embedding: the gather bit for bit, the id check, and the backward's scatter-add grouped on
// the host (the ids read back) and on the device (KEEL_CUDA_DEVICE_GROUPING=1: shim/cub's radix
// sort, then a block per sorted position), each the CPU's bits; i32 and i64 ids with repeats.
TEST(CudaEmulated, EmbeddingMatchesTheCpuBitForBit) {
  const EmbeddingKernels &gpu = emucuda::embedding_table(), &cpu = embedding_kernels(Device::cpu());
  const int64_t v = 300, d = 40, n = 200;
  std::vector<int64_t> id_v(n);
  for (int64_t i = 0; i < n; ++i) id_v[i] = (i * 7919) % 59 * 5;  // 59 ids below v, each ~3 times
  id_v[7] = v - 1;
  for (DType dt : kFloats)
    for (DType id_dt : {DType::I32, DType::I64}) {
      const std::string name = std::string(dtype_name(dt)) + " " + dtype_name(id_dt) + " ids";
      const Tensor ids = Tensor::from_ints(id_v, {n}, id_dt), w = test::randn({v, d}, 87, 1.f, dt),
                   g = test::randn({n, d}, 88, 1.f, dt);
      Tensor rows[2] = {Tensor::empty({n, d}, dt), Tensor::empty({n, d}, dt)};
      gpu.gather(rows[0].data(), w.data(), ids.data(), id_dt, dt, n, d);
      cpu.gather(rows[1].data(), w.data(), ids.data(), id_dt, dt, n, d);
      test::expect_bitwise_equal(rows[0], rows[1], "gather " + name);
      EXPECT_EQ(gpu.find_invalid(ids.data(), id_dt, n, v), -1) << name;
      EXPECT_EQ(gpu.find_invalid(ids.data(), id_dt, n, v - 1), 7) << name;  // id v - 1 at 7
      Tensor want = test::randn({v, d}, 89, 1.f, dt);
      Tensor host = want.clone(), device = want.clone();
      cpu.scatter_add(want.data(), g.data(), ids.data(), id_dt, dt, n, v, d);
      gpu.scatter_add(host.data(), g.data(), ids.data(), id_dt, dt, n, v, d);
      emucuda::launched_files().clear();
      setenv("KEEL_CUDA_DEVICE_GROUPING", "1", 1);
      gpu.scatter_add(device.data(), g.data(), ids.data(), id_dt, dt, n, v, d);
      unsetenv("KEEL_CUDA_DEVICE_GROUPING");
      bool on_device = false;
      for (const std::string& f : emucuda::launched_files())
        on_device |= f == "embedding.cu scatter_add_grouped_on_device";
      EXPECT_TRUE(on_device) << name << ": the device grouping did not run";
      test::expect_bitwise_equal(host, want, "scatter_add grouped on the host " + name);
      test::expect_bitwise_equal(device, want, "scatter_add grouped on the device " + name);
    }
}

// RoPE over a whole head and a partial one (Phi-4-mini's: the last channels pass), both ways.
TEST(CudaEmulated, RopeMatchesTheCpu) {
  const RopeKernels &gpu = emucuda::rope_table(), &cpu = rope_kernels(Device::cpu());
  const int64_t rows = 6, t = 9, d = 16;
  for (DType dt : kFloats)
    for (int64_t rot : {d, int64_t{12}})
      for (bool inverse : {false, true}) {
        const Tensor x = test::randn({rows, t, d}, 64, 1.f, dt);
        const Tensor cs = test::randn({t, rot / 2}, 65, 1.f),
                     sn = test::randn({t, rot / 2}, 66, 1.f);
        Tensor out[2] = {empty_like(x), empty_like(x)};
        for (int side = 0; side < 2; ++side)
          (side == 0 ? gpu : cpu)
              .rotate(out[side].data(), x.data(), cs.data_as<float>(), sn.data_as<float>(), dt,
                      rows, t, d, rot, inverse);
        expect_same(out[0], out[1],
                    std::string("rope ") + dtype_name(dt) + " rot " + std::to_string(rot) +
                        (inverse ? " inverse" : ""));
      }
}

}  // namespace
}  // namespace keel
