// The CUDA backend (issue 7): every op of the engine core against the CPU backend (forward and
// backward, f32 within 1e-5 relative plus an absolute floor, bf16/f16 within a few units of their
// rounding), the toolkit passes on the device, one training step of GPT-2 and Llama identical in
// policy behaviour to the CPU, and NaN capture + replay on the GPU.
//
// The GPU tests skip with the runtime's own reason where no GPU is usable (e.g. "no usable CUDA
// device: cudaGetDeviceCount: error 35 (cudaErrorInsufficientDriver: ...)"). The behaviour without
// a GPU is tested everywhere: a clean error for a cuda tensor, and `keel train` with
// run.device = "cuda" training on the CPU after one line.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/backend/cuda_api.h"
#include "keel/backend/embedding.h"
#include "keel/backend/matmul.h"
#include "keel/backend/monitor.h"
#include "keel/backend/optim.h"
#include "keel/models/generate.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/ops/activation.h"
#include "keel/ops/attention.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/dropout.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/embedding.h"
#include "keel/ops/linear.h"
#include "keel/ops/norm.h"
#include "keel/ops/rope.h"
#include "keel/ops/shape.h"
#include "keel/ops/softmax.h"
#include "keel/optim/clip.h"
#include "keel/train/trainer.h"
#include "tests/support/check.h"
#include "tests/support/tiny_models.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

#define REQUIRE_GPU()                                                     \
  do {                                                                    \
    if (!cuda::status().usable)                                           \
      GTEST_SKIP() << "no usable CUDA device: " << cuda::status().reason; \
  } while (0)

const Device kGpu = Device::cuda(0);

// One of the CUDA kernels' switches (KEEL_CUDA_FLASH_MMA, ...: read at each call) set to 1 for a
// scope.
struct SwitchOn {
  const char* name;
  explicit SwitchOn(const char* n) : name(n) { setenv(name, "1", 1); }
  ~SwitchOn() { unsetenv(name); }
};

// ---- without a GPU ----------------------------------------------------------------------------

TEST(CudaRuntime, AnUnusableGpuIsReportedWithTheRuntimesReason) {
  const cuda::Status& s = cuda::status();
  if (s.usable) GTEST_SKIP() << "a GPU is usable here: the GPU tests below cover it";
  EXPECT_FALSE(s.reason.empty());
#ifdef KEEL_HAVE_CUDA
  EXPECT_TRUE(s.built);
  // No driver: error 35 (cudaErrorInsufficientDriver); no device: 100. Either way the runtime's
  // number and words are in the reason.
  EXPECT_NE(s.reason.find("cudaGetDeviceCount: "), std::string::npos) << s.reason;
#else
  EXPECT_FALSE(s.built);
#endif
  try {
    Tensor t = Tensor::empty({4}, DType::F32, kGpu);
    ADD_FAILURE() << "a cuda tensor was allocated without a usable GPU";
  } catch (const Error& e) {
    const std::string m = e.what();
#ifdef KEEL_HAVE_CUDA
    EXPECT_NE(m.find(s.reason), std::string::npos) << m;
#endif
    EXPECT_NE(m.find("cpu"), std::string::npos) << m;  // says what to use instead
  }
}

struct Ran {
  int code = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

Ran run_keel(const std::vector<std::string>& args) {
  static int counter = 0;
  const std::string base = test::temp_dir("cuda-cli") + "/run" + std::to_string(counter++);
  Ran r;
  const pid_t pid = fork();
  if (pid == 0) {
    if (!std::freopen((base + ".out").c_str(), "w", stdout) ||
        !std::freopen((base + ".err").c_str(), "w", stderr))
      _exit(127);
    std::vector<char*> argv;
    const std::string bin = test::keel_binary();
    argv.push_back(const_cast<char*>(bin.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(bin.c_str(), argv.data());
    _exit(127);
  }
  int status = 0;
  if (pid > 0 && waitpid(pid, &status, 0) == pid)
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(base + ".out");
  r.err = slurp(base + ".err");
  return r;
}

std::vector<std::string> train_args(const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> sets = {
      "run.out_dir=" + out, "run.threads=1",         "model.n_layer=2",      "model.n_embd=32",
      "model.n_head=2",     "data.num_examples=64",  "data.eval_examples=0", "train.batch_size=4",
      "data.seq_len=32",    "log.tensorboard=false", "log.every=1"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  std::vector<std::string> args = {"train"};
  for (const std::string& s : sets) args.push_back("--set"), args.push_back(s);
  return args;
}

std::vector<json> metrics(const std::string& dir) {
  std::vector<json> out;
  std::ifstream f(dir + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);)
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

// Runs without a GPU: cuBLASLt (540 MB on disk, ~210 MB resident once mapped) is not mapped
// until the first matmul needs it, so CPU-only runs of a CUDA build stay small.
TEST(CudaRuntime, CublasLtIsLoadedOnFirstUseOnly) {
  auto mapped = [] {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line))
      if (line.find("libcublasLt") != std::string::npos) return true;
    return false;
  };
  if (!cuda::status().built) GTEST_SKIP() << cuda::status().reason;
  ASSERT_FALSE(mapped()) << "libcublasLt is mapped at process start (linked instead of dlopen'ed)";
  EXPECT_GE(cuda::cublaslt_version(), 110000u);  // CUDA 11 or later
  EXPECT_TRUE(mapped());
}

TEST(CudaFallback, TrainWithRunDeviceCudaSaysOneLineAndTrainsOnTheCpu) {
  if (cuda::status().usable) GTEST_SKIP() << "a GPU is usable here: keel train uses it";
  const std::string dir = test::temp_dir("cuda-fallback");
  const Ran r = run_keel(train_args(dir, {"run.device=cuda", "train.max_steps=2"}));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  const std::string line = "keel: run.device = cuda but no usable CUDA device (" +
                           cuda::status().reason + "); training on the CPU";
  const std::string all = r.out + r.err;
  const size_t at = all.find(line);
  EXPECT_NE(at, std::string::npos) << all;
  EXPECT_EQ(all.find("no usable CUDA device", at + line.size()), std::string::npos)
      << "said twice: " << all;
  const auto m = metrics(dir);
  ASSERT_EQ(m.size(), 2u) << r.err;
  for (const json& j : m) {
    EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
  }
}

// ---- ops against the CPU backend --------------------------------------------------------------

struct Tol {
  double atol, rtol;
};
Tol tol_for(DType dt, double f32_atol = 1e-5) {
  if (dt == DType::F32) return {f32_atol, 1e-5};
  const double e = test::eps_of(dt);
  return {4 * e, 4 * e};  // a few units of the format's rounding (one-ulp ties in each rounding)
}

Tensor on(const Tensor& t, Device d) { return t.device() == d ? t.clone() : t.to(d); }

// Runs f on CPU copies and GPU copies of `inputs` (floating inputs require grad), backward with
// the same random output gradient, and compares the output and every input gradient.
void expect_matches_cpu(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                        const std::vector<Tensor>& inputs, Tol tol, const std::string& what,
                        bool backward_too = true) {
  std::vector<Tensor> outs, grads_cpu;
  std::vector<Tensor> results[2];
  for (int side = 0; side < 2; ++side) {
    const Device dev = side == 0 ? Device::cpu() : kGpu;
    std::vector<Tensor> leaves;
    for (const Tensor& t : inputs) {
      Tensor l = on(t, dev);
      if (backward_too && dtype_is_floating(l.dtype())) l.set_requires_grad(true);
      leaves.push_back(l);
    }
    Tensor out = f(leaves);
    if (out.dim() > 0) {  // (a loss is a host scalar)
      ASSERT_EQ(out.device(), dev) << what;
    }
    results[side].push_back(out.to(Device::cpu()));
    if (backward_too && out.requires_grad()) {
      Tensor g = test::randn(out.shape(), 99, 1.f, out.dtype());
      backward(out, on(g, dev));
      for (const Tensor& l : leaves)
        if (l.requires_grad()) {
          results[side].push_back(l.grad().defined() ? l.grad().to(Device::cpu()) : Tensor());
        }
    }
  }
  ASSERT_EQ(results[0].size(), results[1].size()) << what;
  for (size_t i = 0; i < results[0].size(); ++i) {
    if (!results[0][i].defined()) continue;
    const std::string name = what + (i == 0 ? " output" : " grad " + std::to_string(i - 1));
    test::expect_close(results[1][i], results[0][i], tol.atol, tol.rtol, name);
  }
}

const DType kFloats[] = {DType::F32, DType::BF16, DType::F16};

TEST(CudaOps, ElementwiseAndCast) {
  REQUIRE_GPU();
  for (DType dt : kFloats) {
    const std::string n = dtype_name(dt);
    Tensor a = test::randn({3, 37}, 1, 1.f, dt), b = test::randn({3, 37}, 2, 1.f, dt);
    expect_matches_cpu([](auto& x) { return ops::add(x[0], x[1]); }, {a, b}, tol_for(dt),
                       "add " + n);
    expect_matches_cpu([](auto& x) { return ops::mul(x[0], x[1]); }, {a, b}, tol_for(dt),
                       "mul " + n);
    expect_matches_cpu([](auto& x) { return ops::scale(x[0], -0.37f); }, {a}, tol_for(dt),
                       "scale " + n);
    expect_matches_cpu([](auto& x) { return ops::add_scaled(x[0], x[1], -0.37f); }, {a, b},
                       tol_for(dt), "add_scaled " + n);
    for (DType to : kFloats)
      expect_matches_cpu([to](auto& x) { return ops::cast(x[0], to); }, {a}, tol_for(dt),
                         "cast " + n + "->" + dtype_name(to));
    const double s_cpu = ops::sum_squares(a), s_gpu = ops::sum_squares(a.to(kGpu));
    EXPECT_NEAR(s_gpu, s_cpu, 1e-5 * s_cpu) << n;
  }
  // Non-finite values propagate, and an f16 overflow rounds to inf on the GPU as on the CPU.
  Tensor big = Tensor::from_floats({60000.f, 1.f, NAN, -INFINITY}, {4});
  expect_matches_cpu([](auto& x) { return ops::cast(ops::scale(x[0], 2.f), DType::F16); }, {big},
                     {0, 0}, "f16 overflow and NaN", false);
}

// A CPU operand beside a GPU one is an error naming both devices, not a kernel reading host
// memory (DoRA's forward once built its 1/n and its -1 row on the host: ops/op_util.h).
TEST(CudaOps, OperandsOnTwoDevicesAreAnError) {
  REQUIRE_GPU();
  Tensor cpu = Tensor::full({4}, 1.f), gpu = Tensor::full({4}, 2.f).to(kGpu);
  for (const auto& [what, f] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"add", [&] { ops::add(gpu, cpu); }},
           {"mul", [&] { ops::mul(cpu, gpu); }},
           {"linear", [&] {
              ops::linear(gpu.view({1, 4}), Tensor::full({3, 4}, 1.f));
            }}}) {
    try {
      f();
      ADD_FAILURE() << what << ": no error";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_TRUE(m.find("different devices (") != std::string::npos &&
                  m.find("cuda:0") != std::string::npos && m.find("cpu") != std::string::npos)
          << what << ": " << m;
    }
  }
}

TEST(CudaOps, LinearAndMatmul) {
  REQUIRE_GPU();
  for (DType dt : kFloats) {
    const std::string n = dtype_name(dt);
    Tensor x = test::randn({2, 5, 64}, 3, 1.f, dt), w = test::randn({48, 64}, 4, 0.2f, dt),
           bias = test::randn({48}, 5, 1.f, dt);
    expect_matches_cpu([](auto& v) { return ops::linear(v[0], v[1], v[2]); }, {x, w, bias},
                       tol_for(dt, 1e-4), "linear " + n);
    Tensor a = test::randn({3, 17, 33}, 6, 1.f, dt), b = test::randn({3, 33, 29}, 7, 1.f, dt);
    expect_matches_cpu([](auto& v) { return ops::matmul(v[0], v[1]); }, {a, b}, tol_for(dt, 1e-4),
                       "bmm " + n);
    Tensor at = test::randn({3, 33, 17}, 8, 1.f, dt), bt = test::randn({3, 29, 33}, 9, 1.f, dt);
    expect_matches_cpu([](auto& v) { return ops::matmul(v[0], v[1], true, true); }, {at, bt},
                       tol_for(dt, 1e-4), "bmm TT " + n);
  }
}

// The bias in cuBLASLt's epilogue (backend/cuda/matmul.cu, on with KEEL_CUDA_BIAS_EPILOGUE=1):
// linear forward and backward against the CPU in each dtype, small and with an odd N large enough
// to run padded (the bias padded with it), and the product is the fused one (its launch site says
// "+bias"), not the separate add.
TEST(CudaOps, LinearWithTheBiasInCublasLtsEpilogue) {
  REQUIRE_GPU();
  const SwitchOn on("KEEL_CUDA_BIAS_EPILOGUE");
  struct Case {
    int64_t m, n, k;
  };
  for (DType dt : kFloats)
    for (const Case& c : {Case{10, 48, 64}, Case{512, 1001, 272}}) {
      const std::string what = std::string("linear with the bias fused ") + dtype_name(dt) + " " +
                               std::to_string(c.m) + "x" + std::to_string(c.n) + "x" +
                               std::to_string(c.k);
      Tensor x = test::randn({c.m, c.k}, 3, 1.f, dt), w = test::randn({c.n, c.k}, 4, 0.2f, dt),
             bias = test::randn({c.n}, 5, 1.f, dt);
      expect_matches_cpu([](auto& v) { return ops::linear(v[0], v[1], v[2]); }, {x, w, bias},
                         tol_for(dt, 1e-4), what);
      Tensor xg = x.to(kGpu), wg = w.to(kGpu), bg = bias.to(kGpu);
      cuda::profile_begin();
      ops::linear(xg, wg, bg);
      int fused = 0;
      for (const auto& r : cuda::profile_end())
        if (r.site.find("+bias") != std::string::npos) fused += r.calls;
      EXPECT_EQ(fused, 1) << what;
    }
}

// Large products with an odd N or K (GPT-2's 50,257-token vocabulary) run on zero-padded copies
// (backend/cuda/matmul.cu): each operand in turn, plain and accumulating, against the CPU backend.
TEST(CudaOps, MatmulWithUnalignedRowsMatchesTheCpu) {
  REQUIRE_GPU();
  struct Case {
    const char* what;
    int64_t m, n, k;
    bool trans_a, trans_b, accumulate;
  };
  const Case cases[] = {
      {"C rows odd (x Wt)", 512, 1001, 272, false, true, false},
      {"C rows odd, accumulating", 512, 1001, 272, false, true, true},
      {"A rows odd (dY W)", 512, 272, 1001, false, false, false},
      {"A rows odd, transposed (dYt X)", 1001, 272, 512, true, false, false},
      {"B and C rows odd", 512, 1001, 272, false, false, true},
      {"K odd (x Wt)", 512, 272, 1001, false, true, false},
      {"everything odd, transposed", 333, 1001, 777, true, true, true},
  };
  for (DType in_dt : {DType::F32, DType::BF16})
    for (DType out_dt : {DType::F32, in_dt})
      for (const Case& c : cases) {
        const std::string what =
            std::string(c.what) + " " + dtype_name(in_dt) + "->" + dtype_name(out_dt);
        Tensor a = test::randn(c.trans_a ? Shape{c.k, c.m} : Shape{c.m, c.k}, 21, 1.f, in_dt);
        Tensor b = test::randn(c.trans_b ? Shape{c.n, c.k} : Shape{c.k, c.n}, 22, 1.f, in_dt);
        Tensor c0 = test::randn({c.m, c.n}, 23, 1.f, out_dt);
        Tensor out[2];
        for (int side = 0; side < 2; ++side) {
          const Device dev = side == 0 ? Device::cpu() : kGpu;
          Tensor ad = on(a, dev), bd = on(b, dev);
          out[side] = on(c0, dev);
          MatmulArgs args;
          args.c = out[side].data(), args.a = ad.data(), args.b = bd.data();
          args.in_dt = in_dt, args.out_dt = out_dt;
          args.m = c.m, args.n = c.n, args.k = c.k;
          args.trans_a = c.trans_a, args.trans_b = c.trans_b, args.accumulate = c.accumulate;
          matmul_kernels(dev).matmul(args);
        }
        const Tol t = out_dt == DType::F32 ? Tol{1e-3, 1e-4} : tol_for(out_dt);
        test::expect_close(out[1].to(Device::cpu()), out[0], t.atol, t.rtol, what);
      }
}

TEST(CudaOps, Activations) {
  REQUIRE_GPU();
  for (DType dt : kFloats) {
    const std::string n = dtype_name(dt);
    Tensor x = test::randn({4, 33}, 11, 2.f, dt), u = test::randn({4, 33}, 12, 1.f, dt);
    expect_matches_cpu([](auto& v) { return ops::gelu(v[0], ops::GeluApprox::Tanh); }, {x},
                       tol_for(dt), "gelu tanh " + n);
    expect_matches_cpu([](auto& v) { return ops::gelu(v[0], ops::GeluApprox::None); }, {x},
                       tol_for(dt), "gelu erf " + n);
    expect_matches_cpu([](auto& v) { return ops::silu(v[0]); }, {x}, tol_for(dt), "silu " + n);
    expect_matches_cpu([](auto& v) { return ops::swiglu(v[0], v[1]); }, {x, u}, tol_for(dt),
                       "swiglu " + n);
  }
}

TEST(CudaOps, SoftmaxAndNorms) {
  REQUIRE_GPU();
  for (DType dt : kFloats) {
    const std::string n = dtype_name(dt);
    Tensor x = test::randn({6, 700}, 13, 3.f, dt);
    expect_matches_cpu([](auto& v) { return ops::softmax(v[0]); }, {x}, tol_for(dt),
                       "softmax " + n);
    expect_matches_cpu([](auto& v) { return ops::log_softmax(v[0]); }, {x}, tol_for(dt),
                       "log_softmax " + n);
    Tensor h = test::randn({9, 96}, 14, 2.f, dt), w = test::randn({96}, 15, 1.f, dt),
           b = test::randn({96}, 16, 1.f, dt);
    expect_matches_cpu([](auto& v) { return ops::layer_norm(v[0], v[1], v[2]); }, {h, w, b},
                       tol_for(dt, 2e-5), "layer_norm " + n);
    expect_matches_cpu([](auto& v) { return ops::rms_norm(v[0], v[1]); }, {h, w}, tol_for(dt, 2e-5),
                       "rms_norm " + n);
  }
  // A row of -inf: zeros / -inf, never NaN.
  Tensor ninf = Tensor::full({2, 8}, -INFINITY);
  expect_matches_cpu([](auto& v) { return ops::softmax(v[0]); }, {ninf}, {0, 0}, "softmax -inf row",
                     false);
}

// The embedding's backward grouped on the device (backend/cuda/embedding.cu, on with
// KEEL_CUDA_DEVICE_GROUPING=1): the same bits as the host-grouped GPU path (each id's positions
// summed in ascending order, the same kernel arithmetic) and the CPU's within rounding, i32 and
// i64 ids, many repeats over a GPT-2-sized vocabulary, the rows no id names untouched; and no id
// read back to the host (no "read_back" site).
TEST(CudaOps, EmbeddingGroupedOnTheDeviceAsOnTheHost) {
  REQUIRE_GPU();
  const int64_t v = 50257, d = 96, n = 3000;
  std::vector<int64_t> id_v(n);
  for (int64_t i = 0; i < n; ++i) id_v[i] = (i * 7919) % 613 * 61;  // 613 ids, each ~5 times
  id_v[5] = v - 1;
  for (DType dt : kFloats)
    for (DType id_dt : {DType::I32, DType::I64}) {
      const std::string what = std::string("embedding grouped on the device ") + dtype_name(dt) +
                               " " + dtype_name(id_dt) + " ids";
      const Tensor ids = Tensor::from_ints(id_v, {n}, id_dt);
      const Tensor g = test::randn({n, d}, 32, 1.f, dt);
      Tensor grads[3];  // CPU, GPU grouped on the host, GPU grouped on the device
      for (int side = 0; side < 3; ++side) {
        const Device dev = side == 0 ? Device::cpu() : kGpu;
        Tensor dw = test::randn({v, d}, 33, 1.f, dt).to(dev);  // accumulated into
        const Tensor gd = g.to(dev), idd = ids.to(dev);
        std::vector<cuda::ProfileRow> rows;
        {
          std::optional<SwitchOn> on;
          if (side == 2) on.emplace("KEEL_CUDA_DEVICE_GROUPING");
          cuda::profile_begin();
          embedding_kernels(dev).scatter_add(dw.data(), gd.data(), idd.data(), id_dt, dt, n, v, d);
          rows = cuda::profile_end();
        }
        if (side == 2) {
          bool on_device = false;
          for (const auto& r : rows) {
            EXPECT_EQ(r.site.find("read_back"), std::string::npos) << what << ": " << r.site;
            on_device |= r.site.find("grouped_on_device") != std::string::npos;
          }
          EXPECT_TRUE(on_device) << what << ": the device grouping did not run";
        }
        grads[side] = dw.to(Device::cpu());
      }
      test::expect_bitwise_equal(grads[2], grads[1], what + " vs grouped on the host");
      const Tol tol = tol_for(dt);
      test::expect_close(grads[2], grads[0], tol.atol, tol.rtol, what + " vs the CPU");
    }
}

TEST(CudaOps, EmbeddingRopeDropoutShapes) {
  REQUIRE_GPU();
  for (DType dt : kFloats) {
    const std::string n = dtype_name(dt);
    Tensor table = test::randn({11, 24}, 17, 1.f, dt);
    Tensor ids = Tensor::from_ints({3, 0, 3, 10, 7, 3, 0, 1}, {2, 4});  // repeats: scatter order
    expect_matches_cpu([](auto& v) { return ops::embedding(v[0], v[1]); }, {ids, table},
                       tol_for(dt), "embedding " + n);
    Tensor q = test::randn({2, 3, 7, 16}, 18, 1.f, dt);
    expect_matches_cpu([](auto& v) { return ops::rope(v[0], 10000.f, 3); }, {q}, tol_for(dt),
                       "rope " + n);
    Tensor x = test::randn({5, 301}, 19, 1.f, dt);
    // The mask is a pure function of (seed, index): bit-identical on both devices.
    expect_matches_cpu([](auto& v) { return ops::dropout(v[0], 0.3f, 1234); }, {x}, {0, 0},
                       "dropout " + n);
    Tensor s = test::randn({2, 5, 12}, 20, 1.f, dt);
    expect_matches_cpu([](auto& v) { return ops::merge_heads(ops::split_heads(v[0], 3)); }, {s},
                       {0, 0}, "split/merge heads " + n);
    expect_matches_cpu([](auto& v) { return ops::transpose(v[0], 0, 2); }, {s}, {0, 0},
                       "transpose " + n);
    // Heads of 64 (GPT-2's): moved in 16-byte units.
    Tensor s64 = test::randn({2, 9, 4 * 64}, 24, 1.f, dt);
    expect_matches_cpu([](auto& v) { return ops::merge_heads(ops::split_heads(v[0], 4)); }, {s64},
                       {0, 0}, "split/merge heads of 64 " + n);
    expect_matches_cpu(
        [](auto& v) {
          return ops::split_last(v[0], {5, 7})[1];
        },
        {s}, {0, 0}, "split_last " + n);
  }
  // A bad id is reported with its value from the device.
  Tensor bad = Tensor::from_ints({1, 42}, {2}).to(kGpu);
  try {
    ops::embedding(bad, Tensor::zeros({11, 4}, DType::F32, kGpu));
    ADD_FAILURE() << "no error for id 42";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("id 42"), std::string::npos) << e.what();
  }
}

TEST(CudaOps, CrossEntropy) {
  REQUIRE_GPU();
  for (DType dt : kFloats) {
    Tensor logits = test::randn({6, 1031}, 21, 2.f, dt);
    Tensor targets = Tensor::from_ints({5, -100, 1030, 0, 77, -100}, {6});
    expect_matches_cpu(
        [](auto& v) { return ops::cross_entropy(v[0], v[1], -100, ops::Reduction::kSum); },
        {logits, targets}, tol_for(dt, 1e-4), std::string("cross_entropy ") + dtype_name(dt));
  }
}

TEST(CudaOps, AttentionEveryBackendWithPaddingAndGqa) {
  REQUIRE_GPU();
  // Batch 1's first three keys are padding: its rows 0-2 see no key (output and gradients 0).
  std::vector<int64_t> mask_v(2 * 37, 1);
  for (int j = 0; j < 3; ++j) mask_v[37 + j] = 0;
  mask_v[37 + 20] = 0;
  Tensor mask = Tensor::from_ints(mask_v, {2, 37}, DType::U8);
  for (DType dt : kFloats)
    for (auto backend : {ops::AttentionBackend::kEager, ops::AttentionBackend::kMath,
                         ops::AttentionBackend::kFlash})
      for (int64_t d : {16, 64, 80}) {
        Tensor q = test::randn({2, 4, 37, d}, 22, 1.f, dt),
               k = test::randn({2, 2, 37, d}, 23, 1.f, dt),
               v = test::randn({2, 2, 37, d}, 24, 1.f, dt);
        const std::string what = std::string("attention ") + ops::attention_backend_name(backend) +
                                 " " + dtype_name(dt) + " D=" + std::to_string(d);
        expect_matches_cpu([&](auto& x) { return ops::attention(x[0], x[1], x[2], x[3], backend); },
                           {q, k, v, mask}, tol_for(dt, 1e-4), what);
      }
}

// Flash on tensor cores (backend/cuda/attention_mma.cu, on with KEEL_CUDA_FLASH_MMA=1): one
// partial 64-row tile (T=37) and several (T=150), grouped-query heads, batch 1's first 70 keys
// padding (a whole tile of rows that see nothing, output and gradients 0) and one in the middle,
// head dims 64 and 128, bf16 and f16, forward and backward against the CPU; the same bits twice;
// and the launches are the tensor-core kernels', not a silent fallback to the CUDA-core ones.
TEST(CudaOps, FlashOnTensorCoresMatchesTheCpu) {
  REQUIRE_GPU();
  const SwitchOn on("KEEL_CUDA_FLASH_MMA");
  for (int64_t t : {37, 150}) {
    std::vector<int64_t> mask_v(2 * t, 1);
    for (int64_t j = 0; j < std::min<int64_t>(70, t - 5); ++j) mask_v[t + j] = 0;
    mask_v[t + t - 3] = 0;
    Tensor mask = Tensor::from_ints(mask_v, {2, t}, DType::U8);
    for (DType dt : {DType::BF16, DType::F16})
      for (int64_t d : {64, 128})
        for (bool masked : {false, true}) {
          Tensor q = test::randn({2, 4, t, d}, 25, 1.f, dt),
                 k = test::randn({2, 2, t, d}, 26, 1.f, dt),
                 v = test::randn({2, 2, t, d}, 27, 1.f, dt);
          const std::string what = std::string("flash on tensor cores ") + dtype_name(dt) +
                                   " T=" + std::to_string(t) + " D=" + std::to_string(d) +
                                   (masked ? " padded" : "");
          auto f = [&](auto& x) {
            return ops::attention(x[0], x[1], x[2], masked ? x[3] : Tensor(),
                                  ops::AttentionBackend::kFlash);
          };
          expect_matches_cpu(f, {q, k, v, mask}, tol_for(dt, 1e-4), what);

          // On the GPU again, profiled: the tensor-core kernels ran, forward and backward, and
          // gave the same bits as before (fixed order, no atomics).
          std::vector<Tensor> runs[2];
          for (int rep = 0; rep < 2; ++rep) {
            std::vector<Tensor> x;
            for (const Tensor& in : {q, k, v}) {
              Tensor g = in.to(kGpu);
              g.set_requires_grad(true);
              x.push_back(g);
            }
            x.push_back(mask.to(kGpu));
            cuda::profile_begin();
            Tensor out = f(x);
            backward(out, test::randn(out.shape(), 99, 1.f, dt).to(kGpu));
            const std::vector<cuda::ProfileRow> rows = cuda::profile_end();
            int mma_launches = 0;
            for (const auto& r : rows)
              if (r.site.find("attention_mma.cu") != std::string::npos) mma_launches += r.calls;
            EXPECT_EQ(mma_launches, 3) << what << ": forward, dK/dV and dQ on tensor cores";
            runs[rep] = {out.to(Device::cpu()), x[0].grad().to(Device::cpu()),
                         x[1].grad().to(Device::cpu()), x[2].grad().to(Device::cpu())};
          }
          for (size_t n = 0; n < 4; ++n)
            test::expect_bitwise_equal(runs[1][n], runs[0][n],
                                       what + " rerun " + std::to_string(n));
        }
  }
}

// Rows longer than 2048 keys do not fit the eager softmax's registers and take its block-per-row
// kernels (backend/cuda/attention.cu), forward and backward.
TEST(CudaOps, EagerSoftmaxOfRowsLongerThanItsRegisters) {
  REQUIRE_GPU();
  const int64_t t = 2100;
  for (DType dt : kFloats) {
    Tensor q = test::randn({1, 1, t, 16}, 41, 1.f, dt), k = test::randn({1, 1, t, 16}, 42, 1.f, dt),
           v = test::randn({1, 1, t, 16}, 43, 1.f, dt);
    expect_matches_cpu(
        [&](auto& x) {
          return ops::attention(x[0], x[1], x[2], Tensor(), ops::AttentionBackend::kEager);
        },
        {q, k, v}, tol_for(dt, 1e-4), std::string("eager T=2100 ") + dtype_name(dt));
  }
}

// ---- optimizer and toolkit kernels ------------------------------------------------------------

TEST(CudaKernels, AdamWMatchesTheCpuBitForBitInF32) {
  REQUIRE_GPU();
  for (DType dt : kFloats)
    for (bool sr : {false, true}) {
      if (sr && dt != DType::BF16) continue;
      Tensor p = test::randn({5000}, 30, 1.f, dt), g = test::randn({5000}, 31, 0.1f, dt),
             m = test::randn({5000}, 32, 0.01f, dt),
             v = test::rand_uniform({5000}, 33, 0.f, 1e-3f, dt);
      Tensor pc = p.clone(), mc = m.clone(), vc = v.clone();
      Tensor pg = p.to(kGpu), gg = g.to(kGpu), mg = m.to(kGpu), vg = v.to(kGpu);
      AdamWStep s;
      s.lr = 3e-3, s.weight_decay = 0.1, s.step = 7, s.stochastic_rounding = sr, s.seed = 5;
      // The rounded-away counts too: a host counter for the CPU, a device int64 for the GPU.
      int64_t cpu_away = 0;
      Tensor gpu_away = Tensor::zeros({1}, DType::I64, kGpu);
      s.rounded_away = &cpu_away;
      optim_kernels(Device::cpu()).adamw(pc.data(), g.data(), mc.data(), vc.data(), dt, 5000, s);
      s.rounded_away = static_cast<int64_t*>(gpu_away.data());
      optim_kernels(kGpu).adamw(pg.data(), gg.data(), mg.data(), vg.data(), dt, 5000, s);
      const std::string what = std::string("adamw ") + dtype_name(dt) + (sr ? " SR" : "");
      EXPECT_EQ(gpu_away.to_ints()[0], cpu_away) << what;
      // Same operations in the same order without FMA contraction: the same bits.
      test::expect_bitwise_equal(pg.to(Device::cpu()), pc, what + " p");
      test::expect_bitwise_equal(mg.to(Device::cpu()), mc, what + " m");
      test::expect_bitwise_equal(vg.to(Device::cpu()), vc, what + " v");
    }
}

TEST(CudaKernels, FusedUnscaleFiniteCheckAndNormInOnePass) {
  REQUIRE_GPU();
  std::vector<Tensor> cpu = {test::randn({3000}, 40, 1000.f), test::randn({17, 9}, 41, 500.f),
                             test::randn({9000}, 42, 2.f, DType::BF16)};
  cpu[1].data_as<float>()[5] = NAN;
  std::vector<Tensor> gpu;
  for (auto& t : cpu) gpu.push_back(t.to(kGpu));
  std::vector<void*> bufs;
  std::vector<DType> dts;
  std::vector<int64_t> ns;
  for (auto& t : gpu) bufs.push_back(t.data()), dts.push_back(t.dtype()), ns.push_back(t.numel());
  GradBufStats per[3];
  const GradSetStats s = monitor_kernels(kGpu).unscale_norm(bufs.data(), dts.data(), ns.data(), 3,
                                                            1.f / 1024, 6.1035156e-05f / 1024, per);
  int64_t bad = 0;
  for (auto& t : cpu)
    bad += optim_kernels(Device::cpu()).unscale(t.data(), t.dtype(), t.numel(), 1.f / 1024);
  EXPECT_EQ(s.nonfinite, bad);
  EXPECT_TRUE(std::isnan(s.sum_squares));
  for (size_t i = 0; i < cpu.size(); ++i) {  // exact (a GPU's NaN has another payload)
    test::expect_close(gpu[i].to(Device::cpu()), cpu[i], 0, 0, "unscaled " + std::to_string(i));
    // The per-buffer counts, in the same pass: as the CPU's on the unscaled values.
    GradBufStats c;
    void* one[] = {cpu[i].data()};
    const DType dt[] = {cpu[i].dtype()};
    const int64_t n[] = {cpu[i].numel()};
    monitor_kernels(Device::cpu()).unscale_norm(one, dt, n, 1, 1.f, 6.1035156e-05f / 1024, &c);
    EXPECT_EQ(per[i].zero, c.zero) << i;
    EXPECT_EQ(per[i].below_normal, c.below_normal) << i;
    if (i != 1) {  // cpu[1] holds the NaN
      EXPECT_NEAR(per[i].sum_squares, c.sum_squares, 1e-5 * c.sum_squares) << i;
    }
  }
  // Finite gradients: the norm matches optim's.
  std::vector<Tensor> fin = {test::randn({3000}, 43, 3.f),
                             test::randn({7, 7}, 44, 1.f, DType::BF16)};
  std::vector<Tensor> fin_gpu = {fin[0].to(kGpu), fin[1].to(kGpu)};
  EXPECT_NEAR(optim::global_grad_norm(fin_gpu), optim::global_grad_norm(fin),
              1e-6 * optim::global_grad_norm(fin));
}

TEST(CudaKernels, TensorStatsOnTheDeviceMatchNumerics) {
  REQUIRE_GPU();
  for (DType dt : kFloats) {
    Tensor t = test::randn({10007}, 50, 1e4f, dt);
    std::vector<float> v = t.to_floats();
    v[3] = 0.f, v[4] = 1e-41f, v[5] = INFINITY, v[6] = NAN, v[7] = 60000.f;
    t = Tensor::from_floats(v, {10007}, dt);
    const TensorStats a = tensor_stats(t.data(), dt, t.numel(), DType::F16);
    const Tensor g = t.to(kGpu);
    const TensorStats b = monitor_kernels(kGpu).stats(g.data(), dt, g.numel(), DType::F16);
    EXPECT_EQ(b.nan, a.nan);
    EXPECT_EQ(b.inf, a.inf);
    EXPECT_EQ(b.zero, a.zero);
    EXPECT_EQ(b.subnormal, a.subnormal);
    EXPECT_EQ(b.near_max, a.near_max);
    EXPECT_EQ(b.abs_min, a.abs_min);
    EXPECT_EQ(b.abs_max, a.abs_max);
  }
}

// ---- training on the GPU ----------------------------------------------------------------------

Config step_config(const std::string& family, const std::string& precision,
                   const std::string& device, const std::string& tag) {
  std::vector<std::string> sets = {"run.out_dir=" + test::temp_dir("cuda-step-" + tag),
                                   "run.device=" + device,
                                   "run.threads=1",
                                   "model.family=" + family,
                                   "model.n_layer=2",
                                   "model.n_embd=64",
                                   "model.n_head=4",
                                   "data.num_examples=64",
                                   "data.eval_examples=0",
                                   "train.batch_size=4",
                                   "train.grad_accum=2",
                                   "data.seq_len=32",
                                   "train.precision=" + precision,
                                   "model.attention=flash",
                                   "log.tensorboard=false"};
  if (family == "llama") sets.push_back("model.n_kv_head=2");
  return load_config("", sets);
}

TEST(CudaTraining, OneStepOfGpt2AndLlamaBehavesAsOnTheCpu) {
  REQUIRE_GPU();
  for (const char* family : {"gpt2", "llama"})
    for (const char* precision : {"32-true", "bf16-mixed", "16-mixed"}) {
      const std::string what = std::string(family) + " " + precision;
      Trainer cpu(step_config(family, precision, "cpu", what + "-cpu"));
      Trainer gpu(step_config(family, precision, "cuda", what + "-gpu"));
      ASSERT_TRUE(gpu.device().is_cuda()) << what;
      EXPECT_EQ(gpu.policy().name(), cpu.policy().name()) << what;
      const auto window =
          std::vector<data::Batch>{cpu.loader().batch(0, 0), cpu.loader().batch(0, 1)};
      for (int step = 0; step < 2; ++step) {
        const StepResult a = cpu.train_step(window, 0), b = gpu.train_step(window, 0);
        const double rt = std::string(precision) == "32-true" ? 1e-5 : 2e-2;
        EXPECT_NEAR(b.loss, a.loss, rt * std::fabs(a.loss)) << what << " step " << step;
        EXPECT_NEAR(b.grad_norm, a.grad_norm, 5 * rt * a.grad_norm) << what << " step " << step;
        // Policy behaviour: the same branch, scale and counters.
        EXPECT_EQ(b.found_inf, a.found_inf) << what;
        EXPECT_EQ(b.stepped, a.stepped) << what;
        EXPECT_EQ(b.clipped, a.clipped) << what;
        EXPECT_EQ(b.loss_scale, a.loss_scale) << what;
        EXPECT_EQ(b.lr, a.lr) << what;
      }
      // Parameter dtypes and devices as the policy says.
      for (auto& [name, p] : gpu.trainable()) {
        EXPECT_TRUE(p.device().is_cuda()) << name;
        EXPECT_EQ(p.dtype(), cpu.policy().param_dtype) << name;
      }
    }
}

// The Llama family's own tensors on the device: Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
// heads wider than n_embd / n_head (Qwen3-0.6B's head_dim), Phi-3's fused projections and longrope
// (past and within its original context), Gemma's 1 + w norms, GeGLU and scaled embedding,
// Cohere's parallel blocks, bias-free LayerNorms and adjacent-pair RoPE (its q and k reordered),
// Phi's and GPT-NeoX's biased LayerNorms, gelu MLPs and (GPT-NeoX) per-head fused q/k/v, OLMo's
// weightless LayerNorms and clamped q/k/v (ops::clamp's kernels), GLM-4-0414's partial
// adjacent-pair RoPE (ops::concat_last) and sandwich norms, with every attention backend: the loss
// and every gradient of one forward and backward as on the CPU (the same weights), in f32 and under
// bf16 autocast.
TEST(CudaTraining, LlamaFamilyModelsComputeAsOnTheCpu) {
  REQUIRE_GPU();
  const Tensor ids = Tensor::from_ints({1, 5, 9, 2, 7, 3, 3, 8, 4, 4, 6, 1, 0, 2, 0, 0}, {2, 8});
  const Tensor labels =
      Tensor::from_ints({5, 9, 2, 7, 3, 3, 8, -100, 4, 6, 1, 0, 2, -100, -100, -100}, {16});
  Tensor mask = Tensor::zeros({2, 8}, DType::U8);
  for (int64_t i = 0; i < 14; ++i) mask.data_as<uint8_t>()[i] = 1;
  for (const char* family :
       {"qwen2",     "qwen3",       "qwen3_d8",  "phi3_lr", "phi3_sr",   "phi4m",
        "gemma",     "smollm3",     "granite",   "olmo2",   "yarn",      "cohere",
        "phi",       "gpt_neox",    "olmo_clip", "glm4",    "falcon40b", "gptj",
        "cohere_qk", "stablelm_qk", "codegen"})  // (starcoder2 slides: CUDA's attention does not)
    for (const char* backend : {"eager", "math", "flash"})
      for (const bool mixed : {false, true}) {
        const std::string what =
            std::string(family) + " " + backend + (mixed ? " bf16-mixed" : " f32");
        models::ModelSpec spec = test::tiny_model_spec(family);
        spec.init_std = 0.3;
        spec.attention = ops::attention_backend_from_name(backend);
        double loss[2] = {0, 0};
        std::map<std::string, Tensor> grads[2];
        for (int side = 0; side < 2; ++side) {
          const Device dev = side == 0 ? Device::cpu() : kGpu;
          auto m = models::make_causal_lm(spec, 1);
          if (side == 1) nn::move_to_device(*m, dev);
          amp::AutocastGuard autocast(mixed, DType::BF16);
          Tensor logits = m->forward(on(ids, dev), on(mask, dev));
          Tensor flat =
              amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, logits.size(-1)}));
          Tensor l = ops::cross_entropy(flat, on(labels, dev));
          backward(l);
          loss[side] = l.item();
          for (auto& [name, p] : m->named_parameters())
            grads[side][name] = p.grad().to(Device::cpu());
        }
        const double rt = mixed ? 2e-2 : 1e-5;
        EXPECT_NEAR(loss[1], loss[0], rt * std::fabs(loss[0])) << what;
        for (auto& [name, g] : grads[0]) {
          double amax = 0;
          for (float v : g.to_floats()) amax = std::max(amax, double(std::fabs(v)));
          test::expect_close(grads[1].at(name), g, mixed ? 0.06 * amax + 1e-4 : 1e-5 * amax + 1e-7,
                             mixed ? 0.06 : 1e-4, what + " grad " + name);
        }
      }
}

// Gemma-2's capped attention scores, which the CUDA kernels do not cap yet: refused, naming the
// fix, instead of computed uncapped.
TEST(CudaTraining, Gemma2sSoftCappedAttentionIsRefused) {
  REQUIRE_GPU();
  auto m = models::make_causal_lm(test::tiny_model_spec("gemma2"), 1);
  nn::move_to_device(*m, kGpu);
  NoGradGuard no_grad;
  EXPECT_CONTAINS(test::error_of([&] {
                    m->forward(on(Tensor::from_ints({1, 2, 3}, {1, 3}), kGpu), Tensor());
                  }),
                  "attends on the CPU only");
}

// Dropout on the attention probabilities runs on the CPU only: a training forward on the GPU says
// so (keel train refuses the key with run.device = cuda before it starts).
TEST(CudaTraining, AttentionDropoutIsRefused) {
  REQUIRE_GPU();
  models::ModelSpec spec = test::tiny_model_spec("llama");
  spec.attention_dropout = 0.1;
  auto m = models::make_causal_lm(spec, 1);
  nn::move_to_device(*m, kGpu);
  m->train(true);
  EXPECT_CONTAINS(test::error_of([&] {
                    m->forward(on(Tensor::from_ints({1, 2, 3}, {1, 3}), kGpu), Tensor());
                  }),
                  "dropout on the attention probabilities (model.attention_dropout) runs on the "
                  "CPU only");
  m->train(false);  // evaluation drops nothing: it runs
  NoGradGuard no_grad;
  EXPECT_EQ(m->forward(on(Tensor::from_ints({1, 2, 3}, {1, 3}), kGpu), Tensor()).size(1), 3);
}

TEST(CudaTraining, ActivationCheckpointingIsBitIdenticalOnTheGpu) {
  // train.activation_checkpointing takes the same code path on every device: on the GPU too the
  // losses and every gradient of a checkpointed run equal the plain run's bit for bit.
  REQUIRE_GPU();
  for (const char* family : {"gpt2", "llama"})
    for (const char* precision : {"32-true", "bf16-mixed", "16-mixed", "bf16-true"})
      for (const char* adapter : {"none", "lora", "dora", "lokr"}) {
        const std::string what = std::string(family) + " " + precision + " " + adapter;
        auto config = [&](const char* ckpt) {
          Config c = step_config(family, precision, "cuda", what + "-ckpt-" + ckpt);
          if (std::string(family) == "gpt2") c.model.dropout = 0.1;  // (a Llama has none)
          c.model.adapter.kind = adapter;
          if (std::string(adapter) != "none") {
            c.model.adapter.dropout = std::string(adapter) == "lokr" ? 0.0 : 0.1;
            c.model.adapter.target_modules =
                std::string(family) == "gpt2"
                    ? std::vector<std::string>{"c_attn", "c_proj", "c_fc"}
                    : std::vector<std::string>{"q_proj", "v_proj", "up_proj", "down_proj"};
          }
          c.train.activation_checkpointing = ckpt;
          return c;
        };
        Trainer plain(config("none"));
        Trainer ckpt(config("blocks"));
        ASSERT_TRUE(ckpt.device().is_cuda()) << what;
        const auto window =
            std::vector<data::Batch>{plain.loader().batch(0, 0), plain.loader().batch(0, 1)};
        for (int step = 0; step < 2; ++step) {
          const StepResult a = plain.train_step(window, 0), b = ckpt.train_step(window, 0);
          EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof a.loss), 0) << what << " step " << step;
          EXPECT_EQ(std::memcmp(&a.grad_norm, &b.grad_norm, sizeof a.grad_norm), 0)
              << what << " step " << step;
          for (size_t i = 0; i < plain.trainable().size(); ++i) {
            const Tensor ga = plain.trainable()[i].second.grad(),
                         gb = ckpt.trainable()[i].second.grad();
            ASSERT_EQ(ga.defined(), gb.defined()) << what << " " << plain.trainable()[i].first;
            if (ga.defined())
              test::expect_bitwise_equal(gb.to(Device::cpu()), ga.to(Device::cpu()),
                                         what + " " + plain.trainable()[i].first);
          }
        }
      }
}

TEST(CudaTraining, NanCaptureAndReplayOnTheGpu) {
  REQUIRE_GPU();
  const std::string dir = test::temp_dir("cuda-nan");
  const Ran r =
      run_keel(train_args(dir, {"run.device=cuda", "train.max_steps=6",
                                "debug.inject.module=transformer.h.1.attn", "debug.inject.step=3",
                                "debug.inject.kind=nan", "debug.underflow_overflow.enabled=true"}));
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  const std::string capture = dir + "/debug/nan_capture/rank0";
  for (const char* f :
       {"capture.json", "model.safetensors", "optimizer.safetensors", "microbatches.safetensors"}) {
    EXPECT_TRUE(fs::exists(capture + "/" + f)) << f << "\n" << r.err;
  }
  EXPECT_EQ(json::parse(slurp(capture + "/capture.json")).at("step").get<int64_t>(), 3);
  EXPECT_NE(slurp(dir + "/debug/underflow_overflow_rank0.log").find("transformer.h.1.attn"),
            std::string::npos);
  const Ran rep = run_keel({"replay", capture, "--json"});
  EXPECT_EQ(rep.code, 0) << rep.out << rep.err;
  const json j = json::parse(rep.out);
  EXPECT_TRUE(j.value("reproduced", false)) << j.dump(2);
  EXPECT_TRUE(j.value("bit_exact", false)) << j.dump(2);
  EXPECT_EQ(j.value("first_module", std::string()), "transformer.h.1.attn") << j.dump(2);
}

// A mixture of experts routes on the CPU only: keel train with run.device = cuda refuses it before
// loading, and a model moved to the GPU says so at its first forward.
TEST(CudaTraining, MixtureOfExpertsIsRefusedNamingTheFix) {
  REQUIRE_GPU();
  const std::string dir = test::temp_dir("cuda-moe");
  const Ran init = run_keel({"init-model", "--out", dir + "/m", "--family", "qwen3_moe"});
  ASSERT_EQ(init.code, 0) << init.err;
  const Ran r =
      run_keel(train_args(dir + "/out", {"run.device=cuda", "model.path=" + dir + "/m",
                                         "model.n_layer=2", "model.n_embd=64", "model.n_head=4"}));
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_CONTAINS(r.err,
                  "is a mixture of experts (qwen3_moe, 4 experts a layer), whose routing "
                  "keel runs on the CPU only");
  auto m = models::make_causal_lm(test::tiny_model_spec("qwen3_moe"), 1);
  nn::move_to_device(*m, kGpu);
  NoGradGuard no_grad;
  EXPECT_CONTAINS(test::error_of([&] {
                    m->forward(on(Tensor::from_ints({1, 2, 3}, {1, 3}), kGpu), Tensor());
                  }),
                  "routing runs on the CPU only");
}

// keel generate --device cuda (issue 23): greedy decoding with the key/value cache on the GPU
// chooses the CPU's tokens from logits within rounding of the CPU's, and the same tokens without
// the cache; in f32 and under bf16 autocast, for GPT-2 and Llama-family layouts. Then the CLI: an
// init-model directory's continuation on the GPU is the CPU's.
TEST(CudaGenerate, GreedyDecodingWithTheCacheAsOnTheCpu) {
  REQUIRE_GPU();
  const std::vector<int32_t> prompt = {1, 5, 9, 2, 7};
  for (const char* family : {"gpt2", "llama", "qwen3", "gemma", "smollm3", "olmo2"})
    for (const bool mixed : {false, true}) {
      const std::string what = std::string(family) + (mixed ? " bf16-mixed" : " f32");
      models::ModelSpec spec = test::tiny_model_spec(family);
      spec.init_std = 0.3;  // logits far apart: greedy choices are not near-ties
      models::GenerateOptions opt;
      opt.max_new_tokens = 12;
      opt.keep_logits = true;
      models::GenerateResult out[2];
      for (int side = 0; side < 2; ++side) {
        auto m = models::make_causal_lm(spec, 1);
        if (side == 1) nn::move_to_device(*m, kGpu);
        amp::AutocastGuard autocast(mixed, DType::BF16);
        out[side] = models::generate(*m, prompt, opt);
        if (side == 1) {
          models::GenerateOptions plain = opt;
          plain.use_cache = false;
          EXPECT_EQ(models::generate(*m, prompt, plain).tokens, out[1].tokens) << what;
        }
      }
      ASSERT_EQ(out[1].stop, out[0].stop) << what;
      EXPECT_EQ(out[1].tokens, out[0].tokens) << what;
      const double rt = mixed ? 3e-2 : 1e-4;
      for (size_t i = 0; i < out[0].logits.size() && i < out[1].logits.size(); ++i) {
        double amax = 0, diff = 0;
        for (size_t v = 0; v < out[0].logits[i].size(); ++v) {
          amax = std::max(amax, double(std::fabs(out[0].logits[i][v])));
          diff = std::max(diff, double(std::fabs(out[1].logits[i][v] - out[0].logits[i][v])));
        }
        EXPECT_LE(diff, rt * amax + 1e-5) << what << " step " << i;
      }
    }
  const std::string dir = test::temp_dir("cuda-generate");
  const Ran init =
      run_keel({"init-model", "--out", dir + "/m", "--family", "llama", "--init-std", "0.3"});
  ASSERT_EQ(init.code, 0) << init.err;
  auto continuation = [&](const char* device) {
    const Ran r = run_keel({"generate", dir + "/m", "the 12 and", "--tokenizer", "byte",
                            "--max-new-tokens", "16", "--device", device});
    EXPECT_EQ(r.code, 0) << device << ": " << r.err;
    return r.out;
  };
  EXPECT_EQ(continuation("cuda"), continuation("cpu"));
}

}  // namespace
}  // namespace keel
