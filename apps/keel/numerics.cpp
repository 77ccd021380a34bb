// `keel numerics`: format tables, what a value becomes in f16/bf16/f32, and how a loss scaler backs
// off for a given gradient (DESIGN §4, numerics explainer).
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "apps/keel/commands.h"
#include "keel/log/console.h"
#include "keel/monitor/explain.h"
#include "keel/numerics/error.h"

namespace keel::cli {

namespace {
struct NumericsArgs {
  std::string value_text, to = "f16";
  double grad = 2.0, init_scale = 65536.0, backoff = 0.5;
};
}  // namespace

Command add_numerics(CLI::App& app) {
  auto args = std::make_shared<NumericsArgs>();
  CLI::App* sub =
      app.add_subcommand("numerics", "Explain floating formats, casts and loss scaling");
  sub->require_subcommand(1);
  CLI::App* formats =
      sub->add_subcommand("formats", "Max, min normal, min subnormal, epsilon, bits");
  // --to f32 is taken (what a decimal value becomes as an f32 master weight): the help said only
  // "f16 or bf16".
  CLI::App* cast = sub->add_subcommand("cast", "What a value becomes in f16, bf16 or f32");
  cast->add_option("VALUE", args->value_text, "the value (e.g. 1e-8, 131072, 1.001)")->required();
  cast->add_option("--to", args->to, "target format: f16 | bf16 | f32")->capture_default_str();
  CLI::App* scaler = sub->add_subcommand(
      "scaler", "Trace a GradScaler's back-off for a true gradient stored in f16");
  scaler->add_option("--grad", args->grad, "the true (unscaled) gradient value")
      ->required()
      ->check(real_check());
  scaler->add_option("--init-scale", args->init_scale, "initial loss scale")
      ->check(spelled_check(false, "a positive finite f32 value, from 1.2e-38 to 3.4e38"))
      ->capture_default_str();
  scaler->add_option("--backoff", args->backoff, "backoff factor")
      ->check(spelled_check(false, "a number in (0, 1)"))
      ->capture_default_str();
  auto run = [=]() -> int {
    if (formats->parsed()) {
      std::fputs(monitor::format_table().c_str(), stdout);
      return 0;
    }
    if (cast->parsed()) {
      double v;
      try {
        size_t used = 0;
        v = std::stod(args->value_text, &used);
        if (used != args->value_text.size()) throw std::invalid_argument("trailing text");
      } catch (const std::out_of_range&) {  // beyond f64, or below its smallest subnormal
        throw Error("numerics cast: '" + args->value_text +
                        "' is beyond f64's range (magnitudes from about 4.9e-324 to 1.8e308); "
                        "every format here would hold it as inf or 0",
                    Error::kUsage);
      } catch (const std::exception&) {
        throw Error("numerics cast: '" + args->value_text + "' is not a number (try 1e-8 or 65504)",
                    Error::kUsage);
      }
      auto dt = dtype_from_name(args->to);
      if (!dt || !dtype_is_floating(*dt))
        throw Error("numerics cast --to " + args->to + ": use f16, bf16 or f32", Error::kUsage);
      monitor::CastReport r = monitor::cast_value(v, *dt);
      // The value as read, in the fewest digits that give it back: %.9g showed 65519.99999 as
      // "65520", the very value that rounds to inf, beside an answer for the one below it.
      char in[32];
      for (int digits = 9; digits <= 17; ++digits) {
        std::snprintf(in, sizeof in, "%.*g", digits, v);
        if (std::strtod(in, nullptr) == v) break;
      }
      std::printf("%s -> %s: stored %.9g (bits 0x%0*x): %s\n", in, dtype_name(*dt), r.stored,
                  *dt == DType::F32 ? 8 : 4, r.bits, r.outcome.c_str());
      std::printf("%s\n", r.explanation.c_str());
      return 0;
    }
    // The flags' own names (GradScaler's messages name the config keys scaler.*).
    if (!is_f32_scale(args->init_scale))
      throw Error("numerics scaler --init-scale " + log::format_number(args->init_scale, 6) +
                      ": a loss scale must be a positive finite f32 value, from 1.2e-38 to 3.4e38 "
                      "(e.g. 65536)",
                  Error::kUsage);
    if (!(args->backoff > 0 && args->backoff < 1))
      throw Error("numerics scaler --backoff " + log::format_number(args->backoff, 6) +
                      ": the backoff factor must be in (0, 1) (PyTorch's default: 0.5)",
                  Error::kUsage);
    GradScalerOptions o;
    o.init_scale = args->init_scale;
    o.backoff_factor = args->backoff;
    auto trials = monitor::scaler_trace(args->grad, o);
    // %.8g: a scale of 0.5 printed as "0" and 1e30 as 31 digits.
    std::printf("true gradient %.6g under 16-mixed (f16 gradients, scale starts at %.8g):\n",
                args->grad, args->init_scale);
    for (auto& t : trials) {
      const char* what = !t.finite ? (t.outcome == "nan" ? "nan -> step skipped, scale backs off"
                                                         : "inf -> step skipped, scale backs off")
                         : t.outcome == "underflow"
                             ? "0: underflow -> applied, the gradient is lost"
                         : t.outcome == "subnormal" ? "subnormal -> applied with fewer bits"
                                                    : "finite -> update applied";
      std::printf("  step %lld: scale %-10.6g grad x scale in f16 = %-12.6g %s\n",
                  static_cast<long long>(t.step), t.scale, t.scaled_grad, what);
    }
    std::printf("%s\n", monitor::scaler_verdict(args->grad, trials).c_str());
    return 0;
  };
  return {sub, run};
}

}  // namespace keel::cli
