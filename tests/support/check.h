// Test helpers shared by every layer's tests: tolerance comparisons in llm.c's form
// (|a - r| <= atol + |r| * rtol), finite-difference gradient checks, and the PyTorch fixtures.
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <functional>
#include <string>
#include <vector>

#include "keel/backend/cpu/isa.h"
#include "keel/io/safetensors.h"
#include "keel/tensor/tensor.h"

namespace keel::test {

// EXPECTs that every element satisfies |actual - expected| <= atol + |expected| * rtol, reporting
// the first few offenders and the largest error. NaN/inf must match exactly (same class and sign).
void expect_close(const Tensor& actual, const Tensor& expected, double atol, double rtol,
                  const std::string& what);
void expect_close(const std::vector<float>& actual, const std::vector<float>& expected, double atol,
                  double rtol, const std::string& what);
// Bitwise equality (determinism tests).
void expect_bitwise_equal(const Tensor& a, const Tensor& b, const std::string& what);

// Runs `body` once per CPU ISA level this CPU supports (generic, AVX2, AVX-512, up to the best),
// with the kernels switched to that level; the best level is restored afterwards.
void for_each_cpu_isa(const std::function<void(CpuIsa)>& body);

// Determinism of a fixed computation (DESIGN §7): `run` returns its outputs (forward results and
// gradients); EXPECTs every one bit-identical to the first run on a rerun, on 1 and 3 OpenMP
// threads, and under every ISA level this CPU supports (the per-ISA kernels compute the same
// bits). `what` names the case (e.g. the dtype) in failures.
void expect_deterministic_across_threads_and_isas(const std::function<std::vector<Tensor>()>& run,
                                                  const std::string& what);

// The floating dtypes every op is tested in.
inline constexpr DType kDtypes[] = {DType::F32, DType::BF16, DType::F16};

// The rounding unit of a dtype, for tolerances of the form atol + |ref| * eps(dtype).
double eps_of(DType dt);

// Finite-difference gradient check. `f` builds an output from `inputs` (f32 leaves that require
// grad). The scalar L = sum_i w_i * out_i (w fixed random, accumulated in f64) is differentiated
// analytically by backward() and numerically by central differences of step `step` on every
// element of every input listed in `check` (all inputs when empty).
struct GradcheckOptions {
  double step = 1e-3;
  double atol = 2e-3;
  double rtol = 2e-2;
  std::vector<size_t> check;  // which inputs to perturb
  uint64_t seed = 7;
};
void expect_gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      std::vector<Tensor> inputs, const GradcheckOptions& opt = {},
                      const std::string& what = "");

// Deterministic random tensors (xorshift; normal via Box-Muller), rounded into dt.
Tensor randn(const Shape& shape, uint64_t seed, float stddev = 1.0f, DType dt = DType::F32);
Tensor rand_uniform(const Shape& shape, uint64_t seed, float lo, float hi, DType dt = DType::F32);

// Fixtures written by tests/fixtures/gen_fixtures.py: tests/fixtures/<family>.safetensors.
const io::Safetensors& fixture(const std::string& family);

// Parity with PyTorch on a fixture case (see tests/fixtures/fixture_util.py): feeds NAME.in0,
// NAME.in1, ... to `f` (floating inputs require grad), compares the output with NAME.out, runs
// backward with NAME.gout and compares each input's gradient with NAME.grad<i>. Tolerance per
// element: atol + |ref| * rtol. Default tolerances come from the output dtype: f32 1e-5/1e-5,
// bf16 and f16 a few units of their rounding (one-ulp disagreements in the last rounding are fine).
struct ParityTolerance {
  double atol = -1, rtol = -1;            // output (< 0: from dtype)
  double grad_atol = -1, grad_rtol = -1;  // gradients (< 0: same as output)
};
void expect_parity(const std::string& family, const std::string& name,
                   const std::function<Tensor(const std::vector<Tensor>&)>& f,
                   ParityTolerance tol = {});

// The message of the keel::Error that `f` throws (error-path tests check that it names the file,
// the place and the fix). Adds a test failure and returns "(no error)" when nothing is thrown.
std::string error_of(const std::function<void()>& f);
#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)
#define EXPECT_NOT_CONTAINS(haystack, needle) \
  EXPECT_EQ(std::string(haystack).find(needle), std::string::npos) << (haystack)

// The OpenMP thread count for a scope (thread-count independence tests).
struct ThreadsGuard {
  int saved = omp_get_max_threads();
  explicit ThreadsGuard(int n) { omp_set_num_threads(n); }
  ~ThreadsGuard() { omp_set_num_threads(saved); }
};
// Restores the kernels' ISA level at the end of a scope that switches it (set_cpu_isa).
struct IsaRestore {
  CpuIsa saved = cpu_isa();
  ~IsaRestore() { set_cpu_isa(saved); }
};

// Path of the built `keel` binary and a fresh temporary directory for a test.
std::string keel_binary();
std::string temp_dir(const std::string& tag);

// A pid that no process has now (a child that exited and was reaped): the owner of a temporary
// file left by a killed write.
int dead_pid();

}  // namespace keel::test
