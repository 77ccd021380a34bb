// `keel selfcheck`: a quick engine demo — format facts, a matmul in each precision against an f64
// reference, and one backward pass — so a fresh install can be checked in a second.
#include <cmath>
#include <cstdio>

#include "apps/keel/commands.h"
#include "keel/autograd/node.h"
#include "keel/backend/cpu/isa.h"
#include "keel/backend/matmul.h"
#include "keel/numerics/format_info.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/linear.h"

namespace keel::cli {

static int run_selfcheck() {
  std::printf("keel %s | cpu isa %s | avx512_bf16 %s | %s\n", KEEL_VERSION, cpu_isa_name(cpu_isa()),
              cpu_has_avx512_bf16() ? "yes" : "no", matmul_kernels(Device::cpu()).describe());
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    const FormatInfo& f = format_info(dt);
    std::printf("%-5s max %-12.6g min normal %-12.6g min subnormal %-12.6g eps %g\n",
                dtype_name(dt), f.max, f.min_normal, f.min_subnormal, f.epsilon);
  }
  const int64_t m = 64, k = 96, n = 48;
  std::vector<float> xa(m * k), wa(n * k);
  for (int64_t i = 0; i < m * k; ++i) xa[i] = std::sin(0.37f * i);
  for (int64_t i = 0; i < n * k; ++i) wa[i] = std::cos(0.11f * i) * 0.1f;
  bool ok = true;
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    Tensor x = Tensor::from_floats(xa, {m, k}, dt), w = Tensor::from_floats(wa, {n, k}, dt);
    Tensor y = ops::linear(x, w);
    const auto xr = x.to_floats(), wr = w.to_floats(), yv = y.to_floats();
    double worst = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double ref = 0, mag = 0;  // error is measured against sum |x w|, the sum's own scale
        for (int64_t p = 0; p < k; ++p) {
          ref += double(xr[i * k + p]) * wr[j * k + p];
          mag += std::fabs(double(xr[i * k + p]) * wr[j * k + p]);
        }
        worst = std::max(worst, std::fabs(yv[i * n + j] - ref) / (1e-30 + mag));
      }
    const double tol = format_info(dt).epsilon + k * format_info(DType::F32).epsilon;
    std::printf("linear %-5s max rel err vs f64: %.2e (tol %.1e) %s\n", dtype_name(dt), worst, tol,
                worst <= tol ? "ok" : "FAIL");
    ok = ok && worst <= tol;
  }
  Tensor w = Tensor::from_floats(wa, {n, k}).set_requires_grad(true);
  Tensor x = Tensor::from_floats(xa, {m, k});
  Tensor y = ops::linear(x, w);
  Tensor loss_grad = Tensor::full(y.shape(), 1.0f);
  backward(y, loss_grad);
  std::printf("backward: |dW|^2 = %.6g %s\n", ops::sum_squares(w.grad()),
              std::isfinite(ops::sum_squares(w.grad())) ? "ok" : "FAIL");
  std::printf("%s\n", ok ? "selfcheck passed" : "selfcheck FAILED");
  return ok ? 0 : 1;
}

Command add_selfcheck(CLI::App& app) {
  CLI::App* sub = app.add_subcommand("selfcheck", "Check the engine on this machine (a few ms)");
  return {sub, run_selfcheck};
}

}  // namespace keel::cli
