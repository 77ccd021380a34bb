// Kernel benchmarks (DESIGN §7: speed is measured here, against a peer in the same process).
//
//   OMP_NUM_THREADS=2 ./build/bench/bench_kernels [--benchmark_filter=matmul]
//
// matmul: keel's matmul_kernels (the path ops::linear takes) against a bare oneDNN matmul
// primitive created once, on the transformer shapes M x K x N, NN (B stored [K, N]) and NT (B
// stored [N, K], nn.Linear's weight layout), f32 and bf16 (f32 accumulation, output in the input
// dtype as linear stores it). Counter: GFLOP/s = 2 M N K / s.
// Element-wise kernels and the fused AdamW update: GB/s of compulsory traffic (bytes read +
// bytes written once). At the end a summary prints the two ratios bench/README.md tracks:
// bf16 / f32 speed of keel's matmul, and keel f32 / bare oneDNN f32.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <dnnl.hpp>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "keel/backend/cpu/isa.h"
#include "keel/backend/dropout.h"
#include "keel/backend/elementwise.h"
#include "keel/backend/matmul.h"
#include "keel/backend/optim.h"
#include "keel/backend/parallel.h"
#include "keel/numerics/convert.h"

namespace {

using keel::DType;

// A buffer of n values of dtype dt, filled with N(0, scale) values rounded to dt.
struct Buffer {
  std::vector<uint8_t> bytes;
  Buffer(int64_t n, DType dt, float scale = 1.f, uint32_t seed = 1)
      : bytes(n * keel::dtype_size(dt)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, scale);
    for (int64_t i = 0; i < n; ++i) {
      const float v = nd(rng);
      switch (dt) {
        case DType::F32:
          reinterpret_cast<float*>(bytes.data())[i] = v;
          break;
        case DType::BF16:
          keel::store_f32(reinterpret_cast<keel::bf16_t*>(bytes.data()) + i, v);
          break;
        case DType::F16:
          keel::store_f32(reinterpret_cast<keel::f16_t*>(bytes.data()) + i, v);
          break;
        default:
          break;
      }
    }
  }
  void* data() { return bytes.data(); }
};

struct Shape3 {
  int64_t m, k, n;
};
const Shape3 kShapes[] = {{256, 768, 768}, {256, 768, 3072}, {1024, 1024, 1024}};

std::string shape_name(const Shape3& s) {
  return std::to_string(s.m) + "x" + std::to_string(s.k) + "x" + std::to_string(s.n);
}

// GFLOP/s: the mean over the timed iterations. best: from the fastest single call, which on a
// shared machine (other work taking the cores in bursts) approximates an undisturbed run.
void set_gflops(benchmark::State& st, const Shape3& s, double min_seconds) {
  const double gflop = 2.0 * s.m * s.n * s.k * 1e-9;
  st.counters["GFLOP/s"] = benchmark::Counter(gflop, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["best"] = gflop / min_seconds;
}

// Times one call (wall clock) and keeps the minimum.
struct MinTimer {
  double min_s = 1e30;
  template <class F>
  void run(F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    min_s = std::min(min_s, dt);
  }
};
void set_gbytes(benchmark::State& st, double bytes) {
  st.counters["GB/s"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// keel: the kernel table ops::linear / ops::matmul call.
void bm_keel_matmul(benchmark::State& st, Shape3 s, DType dt, bool nt) {
  Buffer a(s.m * s.k, dt, 1.f, 1), b(s.k * s.n, dt, 0.05f, 2), c(s.m * s.n, dt);
  keel::MatmulArgs args;
  args.a = a.data();
  args.b = b.data();
  args.c = c.data();
  args.in_dt = dt;
  args.out_dt = dt;
  args.m = s.m;
  args.k = s.k;
  args.n = s.n;
  args.trans_b = nt;
  const auto& mm = keel::matmul_kernels(keel::Device::cpu());
  mm.matmul(args);  // primitive creation (JIT) outside the timed loop, as in training
  MinTimer t;
  for (auto _ : st) {
    t.run([&] { mm.matmul(args); });
    benchmark::ClobberMemory();
  }
  set_gflops(st, s, t.min_s);
}

// Repetitions also report their maximum (the counters' best-call GFLOP/s over all repetitions).
double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// The peer: a bare oneDNN matmul, primitive and memory objects created once.
void bm_onednn_matmul(benchmark::State& st, Shape3 s, DType dt, bool nt) {
  using tag = dnnl::memory::format_tag;
  const auto ddt = dt == DType::BF16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream strm(eng);
  dnnl::memory::desc ad({s.m, s.k}, ddt, tag::ab);
  dnnl::memory::desc bd({s.k, s.n}, ddt, nt ? tag::ba : tag::ab);
  dnnl::memory::desc cd({s.m, s.n}, ddt, tag::ab);
  Buffer a(s.m * s.k, dt, 1.f, 1), b(s.k * s.n, dt, 0.05f, 2), c(s.m * s.n, dt);
  dnnl::matmul prim(dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), eng));
  dnnl::memory am(ad, eng, a.data()), bm(bd, eng, b.data()), cm(cd, eng, c.data());
  const std::unordered_map<int, dnnl::memory> margs = {
      {DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
  prim.execute(strm, margs);
  strm.wait();
  MinTimer t;
  for (auto _ : st) {
    t.run([&] {
      prim.execute(strm, margs);
      strm.wait();
    });
    benchmark::ClobberMemory();
  }
  set_gflops(st, s, t.min_s);
}

constexpr int64_t kN = int64_t{1} << 22;  // 4 Mi elements: 16 MiB per f32 array (past L2)

void bm_add(benchmark::State& st) {
  Buffer a(kN, DType::F32), b(kN, DType::F32, 1.f, 2), o(kN, DType::F32);
  const auto& ew = keel::elementwise_kernels(keel::Device::cpu());
  for (auto _ : st) ew.add(o.data(), a.data(), b.data(), DType::F32, kN);
  set_gbytes(st, 12.0 * kN);
}
void bm_mul(benchmark::State& st) {
  Buffer a(kN, DType::F32), b(kN, DType::F32, 1.f, 2), o(kN, DType::F32);
  const auto& ew = keel::elementwise_kernels(keel::Device::cpu());
  for (auto _ : st) ew.mul(o.data(), a.data(), b.data(), DType::F32, kN);
  set_gbytes(st, 12.0 * kN);
}
void bm_convert(benchmark::State& st, DType to) {
  Buffer a(kN, DType::F32), o(kN, to);
  const auto& ew = keel::elementwise_kernels(keel::Device::cpu());
  for (auto _ : st) ew.convert(o.data(), to, a.data(), DType::F32, kN);
  set_gbytes(st, 6.0 * kN);
}
// LoRA's input path: inverted dropout of an f32 activation rounded into bf16 (the mask hashed
// per element), beside convert/f32->bf16, the same bytes without the hash.
// `kept`: the backward's form, the mask read from the bits the forward kept instead of hashed.
void bm_dropout_cast(benchmark::State& st, bool kept) {
  Buffer a(kN, DType::F32), o(kN, DType::BF16);
  std::vector<uint8_t> keep(keel::dropout_keep_bytes(kN));
  const auto& dk = keel::dropout_kernels(keel::Device::cpu());
  dk.apply_cast(o.data(), DType::BF16, a.data(), DType::F32, kN, 7, 1u << 28, 1.05f, keep.data());
  for (auto _ : st) {
    if (kept)
      dk.apply_kept(o.data(), DType::BF16, a.data(), DType::F32, kN, keep.data(), 1.05f);
    else
      dk.apply_cast(o.data(), DType::BF16, a.data(), DType::F32, kN, 7, 1u << 28, 1.05f, nullptr);
  }
  set_gbytes(st, 6.0 * kN);
}
void bm_sum_squares(benchmark::State& st) {
  Buffer a(kN, DType::F32);
  const auto& ew = keel::elementwise_kernels(keel::Device::cpu());
  for (auto _ : st) benchmark::DoNotOptimize(ew.sum_squares(a.data(), DType::F32, kN));
  set_gbytes(st, 4.0 * kN);
}
// One fused AdamW update: reads p, g, m, v and writes p, m, v (7 tensors of the dtype). `counted`:
// with the rounded-away counter the trainer's optimizer always passes (issue 21 item 4).
void bm_adamw(benchmark::State& st, DType dt, bool counted) {
  Buffer p(kN, dt), g(kN, dt, 0.01f, 2), m(kN, dt, 0.001f, 3), v(kN, dt, 0.001f, 4);
  {  // v >= 0
    Buffer tmp(kN, DType::F32, 0.001f, 4);
    const float* t = reinterpret_cast<const float*>(tmp.data());
    std::vector<float> sq(kN);
    for (int64_t i = 0; i < kN; ++i) sq[i] = t[i] * t[i];
    keel::elementwise_kernels(keel::Device::cpu()).convert(v.data(), dt, sq.data(), DType::F32, kN);
  }
  keel::AdamWStep s;
  s.lr = 1e-4;  // small enough that repeated updates stay well-conditioned
  s.weight_decay = 0.01;
  const auto& k = keel::optim_kernels(keel::Device::cpu());
  int64_t step = 0, away = 0;
  if (counted) s.rounded_away = &away;
  for (auto _ : st) {
    s.step = ++step;
    k.adamw(p.data(), g.data(), m.data(), v.data(), dt, kN, s);
  }
  set_gbytes(st, 7.0 * keel::dtype_size(dt) * kN);
}

// Console output plus a summary of the ratios, computed from each benchmark's best single call
// (over every repetition when --benchmark_repetitions=N).
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      // Single runs, or the "max" aggregate of repetitions (only aggregates reach this reporter
      // under --benchmark_display_aggregates_only).
      if (r.run_type != Run::RT_Iteration && r.aggregate_name != "max") continue;
      auto it = r.counters.find("best");
      if (it == r.counters.end()) continue;
      double& v = best_[base_name(r.benchmark_name())];
      v = std::max(v, it->second.value);  // best over repetitions too
    }
    ConsoleReporter::ReportRuns(runs);
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    if (best_.empty()) return;
    std::printf(
        "\nmatmul ratios of the best-call GFLOP/s   bf16/f32 (keel)   keel/oneDNN f32   "
        "keel/oneDNN bf16\n");
    for (const Shape3& s : kShapes)
      for (const char* t : {"NN", "NT"}) {
        const std::string sh = shape_name(s);
        const double kf = get("matmul/keel/f32/" + std::string(t) + "/" + sh);
        const double kb = get("matmul/keel/bf16/" + std::string(t) + "/" + sh);
        const double of = get("matmul/onednn/f32/" + std::string(t) + "/" + sh);
        const double ob = get("matmul/onednn/bf16/" + std::string(t) + "/" + sh);
        std::printf("  %-2s %-16s                     %6.2fx           %6.3f            %6.3f\n", t,
                    sh.c_str(), kb / kf, kf / of, kb / ob);
      }
  }

 private:
  // "matmul/keel/f32/NN/256x768x768/min_time:0.500/real_time_median" -> up to the shape.
  static std::string base_name(std::string n) {
    for (const char* suffix : {"/min_time", "/real_time", "/repeats"})
      if (auto p = n.find(suffix); p != std::string::npos) n = n.substr(0, p);
    return n;
  }
  double get(const std::string& k) const {
    auto it = best_.find(k);
    return it == best_.end() ? std::numeric_limits<double>::quiet_NaN() : it->second;
  }
  std::map<std::string, double> best_;
};

}  // namespace

int main(int argc, char** argv) {
  for (const Shape3& s : kShapes)
    for (bool nt : {false, true})
      for (DType dt : {DType::F32, DType::BF16}) {
        const std::string suffix = std::string(dt == DType::F32 ? "f32" : "bf16") + "/" +
                                   (nt ? "NT" : "NN") + "/" + shape_name(s);
        benchmark::RegisterBenchmark(("matmul/keel/" + suffix).c_str(), bm_keel_matmul, s, dt, nt)
            ->UseRealTime()
            ->MinTime(0.3)
            ->ComputeStatistics("max", max_of);
        benchmark::RegisterBenchmark(("matmul/onednn/" + suffix).c_str(), bm_onednn_matmul, s, dt,
                                     nt)
            ->UseRealTime()
            ->MinTime(0.3)
            ->ComputeStatistics("max", max_of);
      }
  // A tiny product: the time is keel's per-call overhead (primitive cache lookup, memory objects)
  // against the bare primitive's.
  const Shape3 tiny{8, 8, 8};
  benchmark::RegisterBenchmark("matmul_overhead/keel/f32/NT/8x8x8", bm_keel_matmul, tiny,
                               DType::F32, true)
      ->UseRealTime();
  benchmark::RegisterBenchmark("matmul_overhead/onednn/f32/NT/8x8x8", bm_onednn_matmul, tiny,
                               DType::F32, true)
      ->UseRealTime();
  benchmark::RegisterBenchmark("elementwise/add/f32", bm_add)->UseRealTime();
  benchmark::RegisterBenchmark("elementwise/mul/f32", bm_mul)->UseRealTime();
  benchmark::RegisterBenchmark("elementwise/convert/f32->bf16", bm_convert, DType::BF16)
      ->UseRealTime();
  benchmark::RegisterBenchmark("elementwise/convert/f32->f16", bm_convert, DType::F16)
      ->UseRealTime();
  benchmark::RegisterBenchmark("elementwise/dropout_cast/f32->bf16", bm_dropout_cast, false)
      ->UseRealTime();
  benchmark::RegisterBenchmark("elementwise/dropout_kept/f32->bf16", bm_dropout_cast, true)
      ->UseRealTime();
  benchmark::RegisterBenchmark("elementwise/sum_squares/f32", bm_sum_squares)->UseRealTime();
  benchmark::RegisterBenchmark("optim/adamw/f32", bm_adamw, DType::F32, false)->UseRealTime();
  benchmark::RegisterBenchmark("optim/adamw/bf16", bm_adamw, DType::BF16, false)->UseRealTime();
  benchmark::RegisterBenchmark("optim/adamw_counted/f32", bm_adamw, DType::F32, true)
      ->UseRealTime();
  benchmark::RegisterBenchmark("optim/adamw_counted/bf16", bm_adamw, DType::BF16, true)
      ->UseRealTime();

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("keel kernels: isa %s, %d OpenMP threads, matmul: %s\n",
              keel::cpu_isa_name(keel::cpu_isa()), keel::num_threads(),
              keel::matmul_kernels(keel::Device::cpu()).describe());
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
