#include "tests/support/check.h"

#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <vector>

#include "keel/autograd/node.h"

namespace keel::test {

double eps_of(DType dt) {
  switch (dt) {
    case DType::BF16:
      return 1.0 / 128;  // 2^-7
    case DType::F16:
      return 1.0 / 1024;  // 2^-10
    default:
      return 1.0 / 8388608;  // 2^-23
  }
}

void expect_close(const std::vector<float>& a, const std::vector<float>& r, double atol,
                  double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), r.size()) << what << ": element count differs";
  int bad = 0;
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], y = r[i];
    bool ok;
    if (std::isnan(y) || std::isnan(x)) {
      ok = std::isnan(x) && std::isnan(y);
    } else if (std::isinf(y) || std::isinf(x)) {
      ok = x == y;
    } else {
      const double err = std::fabs(x - y), tol = atol + std::fabs(y) * rtol;
      ok = err <= tol;
      if (err / (tol > 0 ? tol : 1) > worst) {
        worst = err / (tol > 0 ? tol : 1);
        worst_i = i;
      }
    }
    if (!ok && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << x << ", expected " << y << " (atol " << atol
                    << ", rtol " << rtol << ")";
  }
  if (bad > 5) ADD_FAILURE() << what << ": " << bad << " of " << a.size() << " elements differ";
  if (bad)
    ADD_FAILURE() << what << ": worst at [" << worst_i << "] = " << worst << "x the tolerance";
}

void expect_close(const Tensor& actual, const Tensor& expected, double atol, double rtol,
                  const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << ": result is undefined";
  ASSERT_TRUE(expected.defined()) << what << ": reference is undefined";
  ASSERT_EQ(actual.numel(), expected.numel())
      << what << ": shape " << shape_str(actual.shape()) << " vs " << shape_str(expected.shape());
  expect_close(actual.to_floats(), expected.to_floats(), atol, rtol, what);
}

void expect_bitwise_equal(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_TRUE(a.defined() && b.defined()) << what;
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << what << ": bits differ";
}

namespace {
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
};
}  // namespace

Tensor randn(const Shape& shape, uint64_t seed, float stddev, DType dt) {
  Rng r(seed);
  std::vector<float> v(shape_numel(shape));
  for (auto& x : v) {
    const double u1 = r.uniform() + 1e-12, u2 = r.uniform();
    x = static_cast<float>(stddev * std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2));
  }
  return Tensor::from_floats(v, shape, dt);
}

Tensor rand_uniform(const Shape& shape, uint64_t seed, float lo, float hi, DType dt) {
  Rng r(seed);
  std::vector<float> v(shape_numel(shape));
  for (auto& x : v) x = static_cast<float>(lo + (hi - lo) * r.uniform());
  return Tensor::from_floats(v, shape, dt);
}

void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      std::vector<Tensor> inputs, const GradcheckOptions& opt,
                      const std::string& what) {
  std::vector<size_t> check = opt.check;
  if (check.empty())
    for (size_t i = 0; i < inputs.size(); ++i) check.push_back(i);
  for (size_t i : check) {
    ASSERT_EQ(inputs[i].dtype(), DType::F32) << what << ": gradcheck inputs must be f32";
    inputs[i].set_requires_grad(true);
    inputs[i].set_grad(Tensor());
  }
  Tensor out = f(inputs);
  ASSERT_TRUE(out.requires_grad()) << what << ": output does not require grad";
  Tensor w = randn(out.shape(), opt.seed, 1.0f, DType::F32);
  auto weighted = [&](const Tensor& o) {
    const auto ov = o.to_floats(), wv = w.to_floats();
    double s = 0;
    for (size_t j = 0; j < ov.size(); ++j) s += static_cast<double>(ov[j]) * wv[j];
    return s;
  };
  backward(out, out.dtype() == DType::F32 ? w : w.to_dtype(out.dtype()));
  NoGradGuard no_grad;
  for (size_t i : check) {
    Tensor& x = inputs[i];
    ASSERT_TRUE(x.grad().defined()) << what << ": input " << i << " received no gradient";
    const std::vector<float> analytic = x.grad().to_floats();
    std::vector<float> numeric(x.numel());
    float* p = x.data_as<float>();
    for (int64_t j = 0; j < x.numel(); ++j) {
      const float orig = p[j];
      p[j] = static_cast<float>(orig + opt.step);
      const double lp = weighted(f(inputs));
      p[j] = static_cast<float>(orig - opt.step);
      const double lm = weighted(f(inputs));
      p[j] = orig;
      numeric[j] = static_cast<float>((lp - lm) / (2 * opt.step));
    }
    expect_close(analytic, numeric, opt.atol, opt.rtol, what + " d/d input" + std::to_string(i));
  }
}

const io::Safetensors& fixture(const std::string& family) {
  static std::mutex mu;
  static std::map<std::string, io::Safetensors> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(family);
  if (it == cache.end())
    it = cache
             .emplace(family, io::read_safetensors(std::string(KEEL_FIXTURES_DIR) + "/" + family +
                                                   ".safetensors"))
             .first;
  return it->second;
}

void expect_parity(const std::string& family, const std::string& name,
                   const std::function<Tensor(const std::vector<Tensor>&)>& f,
                   ParityTolerance tol) {
  const io::Safetensors& fx = fixture(family);
  std::vector<Tensor> inputs;
  for (int i = 0;; ++i) {
    const Tensor* t = fx.find(name + ".in" + std::to_string(i));
    if (!t) break;
    Tensor x = t->clone();
    if (dtype_is_floating(x.dtype())) x.set_requires_grad(true);
    inputs.push_back(x);
  }
  ASSERT_FALSE(inputs.empty()) << family << ": no fixture case '" << name
                               << "' (regenerate with tests/fixtures/gen_fixtures.py)";
  const Tensor& ref_out = fx.at(name + ".out");
  const DType dt = ref_out.dtype();
  const double e = eps_of(dt);
  if (tol.atol < 0) tol.atol = dt == DType::F32 ? 1e-5 : 2 * e;
  if (tol.rtol < 0) tol.rtol = dt == DType::F32 ? 1e-5 : 2 * e;
  if (tol.grad_atol < 0) tol.grad_atol = tol.atol;
  if (tol.grad_rtol < 0) tol.grad_rtol = tol.rtol;
  Tensor out = f(inputs);
  ASSERT_EQ(out.shape(), ref_out.shape()) << name;
  EXPECT_EQ(out.dtype(), dt) << name << ": output dtype";
  expect_close(out, ref_out, tol.atol, tol.rtol, name + " forward");
  const Tensor* gout = fx.find(name + ".gout");
  if (!gout || !out.requires_grad()) return;
  backward(out, gout->clone());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor* g = fx.find(name + ".grad" + std::to_string(i));
    if (!g) continue;
    ASSERT_TRUE(inputs[i].grad().defined()) << name << ": input " << i << " got no gradient";
    EXPECT_EQ(inputs[i].grad().dtype(), g->dtype()) << name << ": grad dtype of input " << i;
    expect_close(inputs[i].grad(), *g, tol.grad_atol, tol.grad_rtol,
                 name + " grad of input " + std::to_string(i));
  }
}

void for_each_cpu_isa(const std::function<void(CpuIsa)>& body) {
  const CpuIsa best = cpu_isa();
  for (CpuIsa isa : {CpuIsa::Generic, CpuIsa::Avx2, CpuIsa::Avx512}) {
    if (static_cast<int>(isa) > static_cast<int>(best)) continue;
    set_cpu_isa(isa);
    body(isa);
  }
  set_cpu_isa(best);
}

void expect_deterministic_across_threads_and_isas(const std::function<std::vector<Tensor>()>& run,
                                                  const std::string& what) {
  const std::vector<Tensor> ref = run();
  auto expect_same = [&](const std::vector<Tensor>& r, const std::string& how) {
    ASSERT_EQ(r.size(), ref.size()) << how << " " << what;
    for (size_t i = 0; i < ref.size(); ++i)
      expect_bitwise_equal(r[i], ref[i], how + " " + what + " output " + std::to_string(i));
  };
  expect_same(run(), "rerun");
  const int threads = omp_get_max_threads();
  for (int nt : {1, 3}) {
    omp_set_num_threads(nt);
    expect_same(run(), std::to_string(nt) + " threads");
  }
  omp_set_num_threads(threads);
  const std::string best = cpu_isa_name(cpu_isa());
  for_each_cpu_isa(
      [&](CpuIsa isa) { expect_same(run(), std::string(cpu_isa_name(isa)) + " vs " + best); });
}

std::string keel_binary() { return std::string(KEEL_BINARY_DIR) + "/keel"; }

namespace {
// The directories this process made (and files and directories named after them), removed when it
// exits with every test passed (a failed test's files are kept for reading; KEEL_KEEP_TEST_DIRS=1
// keeps them all). Kept, one suite run left ~2 GB in /tmp (models, checkpoints), and a day of runs
// filled the disk.
struct TempDirs {
  std::mutex mu;
  std::vector<std::filesystem::path> dirs;
  pid_t owner = ::getpid();  // a forked child (a death test) exits without removing them
  ~TempDirs() {
    const char* keep = std::getenv("KEEL_KEEP_TEST_DIRS");
    if (::getpid() != owner || (keep && std::string(keep) == "1") ||
        !::testing::UnitTest::GetInstance()->Passed())
      return;
    std::error_code ec;
    for (const auto& d : dirs) std::filesystem::remove_all(d, ec);
    // Tests also write beside their directory (DIR-traced, DIR-corpus.txt): those go with it.
    std::vector<std::filesystem::path> beside;
    for (const auto& e :
         std::filesystem::directory_iterator(std::filesystem::temp_directory_path(), ec)) {
      const std::string name = e.path().filename().string();
      for (const auto& d : dirs)
        if (name.rfind(d.filename().string() + "-", 0) == 0) beside.push_back(e.path());
    }
    for (const auto& p : beside) std::filesystem::remove_all(p, ec);
  }
};
TempDirs& temp_dirs() {
  static TempDirs t;
  return t;
}
}  // namespace

int dead_pid() {
  const pid_t p = ::fork();
  if (p == 0) ::_exit(0);
  ::waitpid(p, nullptr, 0);
  return p;
}

std::string temp_dir(const std::string& tag) {
  static int counter = 0;
  TempDirs& made = temp_dirs();
  std::lock_guard<std::mutex> lock(made.mu);
  auto dir =
      std::filesystem::temp_directory_path() /
      ("keel-test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  made.dirs.push_back(dir);
  return dir.string();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no keel::Error thrown";
  return "(no error)";
}

}  // namespace keel::test
