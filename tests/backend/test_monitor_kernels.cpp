// backend/monitor.h on the CPU: the statistics kernel (one vectorized pass over bit patterns, per
// ISA, threaded for large tensors) against numerics' scalar tensor_stats, field by field, on every
// ISA this machine runs and at several thread counts; unscale_norm against a scalar reference.
#include "keel/backend/monitor.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "keel/backend/cpu/isa.h"
#include "keel/backend/elementwise.h"
#include "keel/backend/optim.h"
#include "keel/numerics/convert.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/tensor/tensor.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using test::IsaRestore;
using test::ThreadsGuard;

// Values spanning every class: zeros of both signs, subnormals of each format, normals over the
// whole exponent range, near-max of f16, bf16 and f32, inf and NaN of both signs (when `rare`, a
// third of the values are special, so that the non-finite path is taken too).
std::vector<float> mixed_values(int64_t n, bool rare, uint64_t seed) {
  uint64_t state = seed;
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  const float specials[] = {0.f,     -0.f,     1e-6f,    -3e-8f,    1e-39f,  -1e-45f,
                            65504.f, -40000.f, 32752.f,  32751.f,   6.1e-5f, 6.103515625e-05f,
                            3e38f,   -1.7e38f, INFINITY, -INFINITY, NAN,     -NAN};
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) {
    const uint64_t r = next();
    if (r % 8 == 0 || (rare && r % 3 == 0)) {
      x = specials[(r >> 8) % (sizeof specials / sizeof specials[0])];
    } else {
      // Random sign, exponent over [-149, 127], random mantissa.
      const uint32_t bits = static_cast<uint32_t>(r >> 11) & 0x807fffffu;
      const uint32_t e = static_cast<uint32_t>((r >> 40) % 255);
      x = f32_from_bits(bits | (e << 23));
    }
  }
  return v;
}

void expect_same_stats(const TensorStats& got, const TensorStats& ref, const std::string& what) {
  EXPECT_EQ(got.count, ref.count) << what;
  EXPECT_EQ(got.nan, ref.nan) << what;
  EXPECT_EQ(got.inf, ref.inf) << what;
  EXPECT_EQ(got.zero, ref.zero) << what;
  EXPECT_EQ(got.subnormal, ref.subnormal) << what;
  EXPECT_EQ(got.near_max, ref.near_max) << what;
  EXPECT_EQ(got.abs_min, ref.abs_min) << what;
  EXPECT_EQ(got.abs_max, ref.abs_max) << what;
  EXPECT_EQ(got.headroom_bits, ref.headroom_bits) << what;
}

std::vector<CpuIsa> isas_here(CpuIsa best) {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512})
    if (static_cast<int>(isa) <= static_cast<int>(best)) out.push_back(isa);
  return out;
}

TEST(MonitorKernels, StatsMatchTensorStatsOnEveryIsa) {
  IsaRestore restore;
  for (CpuIsa isa : isas_here(restore.saved)) {
    set_cpu_isa(isa);
    const MonitorKernels& k = monitor_kernels(Device::cpu());
    for (int64_t n : {0, 1, 7, 4099, 100003})
      for (int rare : {0, 1}) {
        const std::vector<float> v = mixed_values(n, rare, 88172645463325252ull + n);
        for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
          const Tensor t = Tensor::from_floats(v, {n}, dt);
          // f32 data is judged against any compute format; 16-bit data against its own (and,
          // through the scalar fallback, against another).
          const std::vector<DType> fmts = {DType::F32, DType::BF16, DType::F16};
          for (DType fmt : fmts) {
            const std::string what = std::string(cpu_isa_name(isa)) + ": " + dtype_name(dt) +
                                     " as " + dtype_name(fmt) + " n=" + std::to_string(n) +
                                     (rare ? " with non-finite" : "");
            const TensorStats ref = tensor_stats(t.data(), dt, n, fmt);
            expect_same_stats(k.stats(t.data(), dt, n, fmt), ref, what);
            if (n > 1000 && fmt == dt) {  // the classes were all there
              EXPECT_GT(ref.subnormal + ref.zero, 0) << what;
              EXPECT_GT(ref.near_max, 0) << what;
              EXPECT_GT(ref.nan, 0) << what;
            }
          }
        }
      }
  }
}

// A tensor large enough to be split over threads: the same result at 1 and 3 threads, on every
// ISA, equal to the scalar reference; finite (the vectorized path all the way) and with one NaN at
// the very end (the last block decides the fallback).
TEST(MonitorKernels, StatsOfALargeTensorAreTheSameForEveryThreadCount) {
  IsaRestore restore;
  const int64_t n = (int64_t{1} << 22) + 12345;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[i] = std::ldexp(static_cast<float>((i * 2654435761u) % 1000) - 500.f,
                      static_cast<int>(i % 61) - 40);
  v[17] = 1e-40f;  // an f32 subnormal
  for (bool with_nan : {false, true}) {
    if (with_nan) v.back() = NAN;
    const Tensor t = Tensor::from_floats(v, {n}, DType::F32);
    const TensorStats ref = tensor_stats(t.data(), DType::F32, n, DType::F16);
    ASSERT_GT(ref.near_max, 0);
    ASSERT_GT(ref.subnormal, 0);
    for (CpuIsa isa : isas_here(restore.saved)) {
      set_cpu_isa(isa);
      for (int threads : {1, 3}) {
        ThreadsGuard guard(threads);
        expect_same_stats(monitor_kernels(Device::cpu()).stats(t.data(), DType::F32, n, DType::F16),
                          ref,
                          std::string(cpu_isa_name(isa)) + ", " + std::to_string(threads) +
                              " threads" + (with_nan ? ", a NaN" : ""));
      }
    }
  }
}

// unscale_norm: non-finite values counted before scaling, every value scaled in place (NaN/inf
// too), the sum of squares of the scaled values; with no scale, the sum alone; on every ISA.
TEST(MonitorKernels, UnscaleNormMatchesAScalarReferenceOnEveryIsa) {
  IsaRestore restore;
  for (CpuIsa isa : isas_here(restore.saved)) {
    set_cpu_isa(isa);
    std::vector<float> a(5000), b(77);
    for (size_t i = 0; i < a.size(); ++i) a[i] = std::sin(0.37f * i) * 512.f;
    for (size_t i = 0; i < b.size(); ++i) b[i] = 0.25f * static_cast<float>(i) - 9.f;
    Tensor ta = Tensor::from_floats(a, {5000}, DType::F32);
    Tensor tb = Tensor::from_floats(b, {77}, DType::BF16);
    const std::vector<float> b16 = tb.to_floats();  // b as bf16 holds it
    void* bufs[] = {ta.data(), tb.data()};
    const DType dts[] = {DType::F32, DType::BF16};
    const int64_t ns[] = {5000, 77};
    const float inv = 1.f / 256;
    const GradSetStats s =
        monitor_kernels(Device::cpu()).unscale_norm(bufs, dts, ns, 2, inv, 0.f, nullptr);
    double ref = 0;
    const std::vector<float> ua = ta.to_floats(), ub = tb.to_floats();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(ua[i], a[i] * inv) << i;
      ref += static_cast<double>(ua[i]) * ua[i];
    }
    for (size_t i = 0; i < b.size(); ++i) {
      EXPECT_EQ(ub[i], b16[i] * inv) << i;  // a power of two: exact in bf16
      ref += static_cast<double>(ub[i]) * ub[i];
    }
    EXPECT_EQ(s.nonfinite, 0) << cpu_isa_name(isa);
    EXPECT_NEAR(s.sum_squares, ref, 1e-5 * ref) << cpu_isa_name(isa);

    // Non-finite values are counted (before scaling) and scaled too.
    std::vector<float> c = {1.f, NAN, -INFINITY, 2.f, INFINITY};
    Tensor tc = Tensor::from_floats(c, {5}, DType::F16);
    void* cb[] = {tc.data()};
    const DType cd[] = {DType::F16};
    const int64_t cn[] = {5};
    const GradSetStats sc =
        monitor_kernels(Device::cpu()).unscale_norm(cb, cd, cn, 1, 0.5f, 0.f, nullptr);
    EXPECT_EQ(sc.nonfinite, 3) << cpu_isa_name(isa);
    EXPECT_TRUE(std::isnan(sc.sum_squares)) << cpu_isa_name(isa);
    const std::vector<float> uc = tc.to_floats();
    EXPECT_EQ(uc[0], 0.5f);
    EXPECT_TRUE(std::isnan(uc[1]));
    EXPECT_EQ(uc[2], -INFINITY);
    EXPECT_EQ(uc[3], 1.f);

    // inv_scale == 1: nothing is written, and a non-finite value shows in the sum.
    const GradSetStats s1 =
        monitor_kernels(Device::cpu()).unscale_norm(cb, cd, cn, 1, 1.f, 0.f, nullptr);
    EXPECT_TRUE(std::isnan(s1.sum_squares)) << cpu_isa_name(isa);
    EXPECT_EQ(tc.to_floats()[0], 0.5f);
  }
}

// The per-buffer statistics of unscale_norm: each buffer's sum of squares has the bits of the
// pass without them (the total adds the same numbers), and the zeros and the non-zero values
// below normal_min are counted exactly, after scaling; the same on every ISA and thread count.
TEST(MonitorKernels, UnscaleNormCountsZerosAndSubnormalsPerBufferInTheSamePass) {
  IsaRestore restore;
  const float f16_min_normal = 6.103515625e-05f;  // 2^-14
  // 70,000 values (more than one reduce block, split over threads): a mix of exact zeros, f16
  // subnormals (below 2^-14), values below f16's smallest subnormal, and normal values.
  std::vector<float> a(70000), b(301);
  for (size_t i = 0; i < a.size(); ++i) {
    const float x = std::sin(0.11f * static_cast<float>(i));
    a[i] = i % 7 == 0 ? 0.f : i % 5 == 0 ? x * 1e-5f : i % 3 == 0 ? x * 1e-9f : x;
  }
  for (size_t i = 0; i < b.size(); ++i) b[i] = i % 4 == 0 ? 0.f : 3e-6f * static_cast<float>(i);
  for (const float inv : {1.f, 1.f / 1024}) {
    // The reference: the values as the pass leaves them (scaled), judged against normal_min.
    const float thr = static_cast<float>(f16_min_normal * static_cast<double>(inv));
    Tensor ra = Tensor::from_floats(a, {70000}, DType::F32);
    Tensor rb = Tensor::from_floats(b, {301}, DType::BF16);
    void* rbufs[] = {ra.data(), rb.data()};
    const DType dts[] = {DType::F32, DType::BF16};
    const int64_t ns[] = {70000, 301};
    const GradSetStats plain =
        monitor_kernels(Device::cpu()).unscale_norm(rbufs, dts, ns, 2, inv, 0.f, nullptr);
    int64_t zero[2] = {0, 0}, below[2] = {0, 0};
    const std::vector<float> va = ra.to_floats(), vb = rb.to_floats();
    for (int k = 0; k < 2; ++k)
      for (float v : k == 0 ? va : vb) {
        zero[k] += v == 0.f;
        below[k] += v != 0.f && std::fabs(v) < thr;
      }
    ASSERT_GT(zero[0], 0);
    ASSERT_GT(below[0], 0);
    ASSERT_GT(below[1], 0);
    for (CpuIsa isa : isas_here(restore.saved)) {
      set_cpu_isa(isa);
      for (int threads : {1, 3}) {
        ThreadsGuard guard(threads);
        const std::string where = std::string(cpu_isa_name(isa)) + ", " + std::to_string(threads) +
                                  " threads, inv " + std::to_string(inv);
        Tensor ta = Tensor::from_floats(a, {70000}, DType::F32);
        Tensor tb = Tensor::from_floats(b, {301}, DType::BF16);
        void* bufs[] = {ta.data(), tb.data()};
        GradBufStats per[2];
        const GradSetStats s =
            monitor_kernels(Device::cpu()).unscale_norm(bufs, dts, ns, 2, inv, thr, per);
        // Without the counts, on this ISA: the same bits.
        Tensor pa = Tensor::from_floats(a, {70000}, DType::F32);
        Tensor pb = Tensor::from_floats(b, {301}, DType::BF16);
        void* pbufs[] = {pa.data(), pb.data()};
        const GradSetStats p =
            monitor_kernels(Device::cpu()).unscale_norm(pbufs, dts, ns, 2, inv, 0.f, nullptr);
        EXPECT_EQ(s.sum_squares, p.sum_squares) << where;
        EXPECT_EQ(per[0].sum_squares + per[1].sum_squares, s.sum_squares) << where;
        EXPECT_EQ(s.nonfinite, 0) << where;
        for (int k = 0; k < 2; ++k) {
          EXPECT_EQ(per[k].zero, zero[k]) << where << ", buffer " << k;
          EXPECT_EQ(per[k].below_normal, below[k]) << where << ", buffer " << k;
        }
        if (isa == restore.saved && threads == 1) {
          EXPECT_EQ(s.sum_squares, plain.sum_squares);
        }
      }
    }
  }
}

// unscale_norm is one parallel loop over the blocks of every buffer, unscaling and summing each
// block while it is in cache. Its results must be those of the two passes it replaced, bit for
// bit: optim.unscale over each buffer, then elementwise.sum_squares over each; per buffer, in
// total (buffers added in list order) and in the non-finite count, on every ISA and thread count.
// Many buffers of every floating dtype, empty ones, sizes on and off the 4096-element blocks,
// non-finite values in a few.
TEST(MonitorKernels, UnscaleNormOverManyBuffersHasTheBitsOfUnscaleThenSumSquares) {
  IsaRestore restore;
  const int64_t sizes[] = {5000, 0, 1, 4096, 4097, 77, 12288, 3, 0, 30001, 768, 9000};
  const DType types[] = {DType::F32, DType::BF16, DType::F16};
  // Finite values in f16's range after the scale; with `bad`, non-finite ones in buffers 3 and 10.
  auto make = [&](bool bad) {
    std::vector<Tensor> out;
    for (size_t k = 0; k < std::size(sizes); ++k) {
      const bool special = bad && (k == 3 || k == 10);
      std::vector<float> v = mixed_values(sizes[k], special, 1000 + k);
      for (float& x : v) x = std::isfinite(x) || special ? std::fmod(x, 1000.f) : 1.5f;
      out.push_back(Tensor::from_floats(v, {sizes[k]}, types[k % 3]));
    }
    return out;
  };
  // A NaN sum is any NaN: its sign follows the instructions GCC picked for the loop (the generic
  // ISA's code gives +NaN in one kernel and -NaN in the other for the same values).
  auto bits = [](double d) { return std::isnan(d) ? uint64_t{1} : std::bit_cast<uint64_t>(d); };
  auto same_bytes = [](const Tensor& a, const Tensor& b) {
    return a.numel() == b.numel() && a.dtype() == b.dtype() &&
           std::memcmp(a.data(), b.data(),
                       static_cast<size_t>(a.numel()) * dtype_size(a.dtype())) == 0;
  };
  for (int run = 0; run < 6; ++run) {
    const bool bad = run >= 3;
    const float inv = run % 3 == 0 ? 1.f : run % 3 == 1 ? 1.f / 1024 : 3.f;
    for (CpuIsa isa : isas_here(restore.saved)) {
      set_cpu_isa(isa);
      for (int threads : {1, 3}) {
        ThreadsGuard guard(threads);
        const std::string where = std::string(cpu_isa_name(isa)) + ", " + std::to_string(threads) +
                                  " threads, inv " + std::to_string(inv) +
                                  (bad ? ", non-finite" : "");
        std::vector<Tensor> ref = make(bad), got = make(bad);
        int64_t ref_bad = 0;
        double ref_total = 0;
        std::vector<double> ref_of;
        for (Tensor& t : ref) {
          if (inv != 1.f)
            ref_bad += optim_kernels(Device::cpu()).unscale(t.data(), t.dtype(), t.numel(), inv);
          ref_of.push_back(
              elementwise_kernels(Device::cpu()).sum_squares(t.data(), t.dtype(), t.numel()));
          ref_total += ref_of.back();
        }
        std::vector<void*> bufs;
        std::vector<DType> dts;
        std::vector<int64_t> ns;
        for (Tensor& t : got)
          bufs.push_back(t.data()), dts.push_back(t.dtype()), ns.push_back(t.numel());
        std::vector<GradBufStats> per(got.size());
        const GradSetStats s =
            monitor_kernels(Device::cpu())
                .unscale_norm(bufs.data(), dts.data(), ns.data(), static_cast<int>(got.size()), inv,
                              0.f, per.data());
        if (inv != 1.f) {
          EXPECT_EQ(ref_bad > 0, bad) << where;
        }
        EXPECT_EQ(std::isfinite(ref_total), !bad) << where;
        EXPECT_EQ(s.nonfinite, ref_bad) << where;
        EXPECT_EQ(bits(s.sum_squares), bits(ref_total)) << where;
        for (size_t k = 0; k < got.size(); ++k) {
          EXPECT_EQ(bits(per[k].sum_squares), bits(ref_of[k])) << where << ", buffer " << k;
          EXPECT_TRUE(same_bytes(got[k], ref[k])) << where << ", buffer " << k;
        }
      }
    }
  }
}

}  // namespace
}  // namespace keel
