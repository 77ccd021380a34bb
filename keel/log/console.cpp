#include "keel/log/console.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace keel::log {

std::string format_number(double v, int digits) {
  if (std::isnan(v)) return "nan";  // fmt would print "-nan" for a NaN with its sign bit set
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{:.{}g}", v, digits);
}

std::string format_scale(double scale) {
  if (std::isfinite(scale) && scale == std::floor(scale) && std::fabs(scale) < 1e15)
    return fmt::format("{:.0f}", scale);
  return format_number(scale, 3);
}

std::string format_percent(int64_t part, int64_t whole) {
  if (part > 0 && 2000 * part < whole) return "<0.1%";  // below 0.05%
  if (part < whole && 2000 * (whole - part) < whole) return ">99.9%";
  return fmt::format("{:.1f}%", whole > 0 ? 100.0 * static_cast<double>(part) / whole : 0.0);
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = std::llround(seconds);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  if (s < 86400) return fmt::format("{}h{:02}m", s / 3600, s % 3600 / 60);
  return fmt::format("{}d{:02}h", s / 86400, s % 86400 / 3600);
}

std::string format_tokens_per_s(double tps) {
  if (!std::isfinite(tps) || tps < 0) return format_number(tps, 3) + " tok/s";
  // Thresholds on the rounded value, so 999.7 prints "1.0k", not "1000".
  // Below 10 a whole number hides the figure: a 1B model on a busy CPU at 0.22 tok/s printed
  // "0 tok/s", as if nothing trained. Two significant digits there.
  if (tps > 0 && tps < 0.995) return fmt::format("{:.2f} tok/s", tps);
  if (tps > 0 && tps < 9.95) return fmt::format("{:.1f} tok/s", tps);
  if (tps < 999.5) return fmt::format("{:.0f} tok/s", tps);
  if (tps < 999.95e3) return fmt::format("{:.1f}k tok/s", tps / 1e3);
  return fmt::format("{:.2f}M tok/s", tps / 1e6);
}

std::string progress_line(const StepResult& r, int64_t total_steps, double eta_seconds,
                          bool show_scale) {
  std::string s = total_steps > 0 ? fmt::format("step {}/{}", r.step, total_steps)
                                  : fmt::format("step {}", r.step);
  s += " | loss " + format_number(r.loss, 4);
  s += " | grad_norm " + format_number(r.grad_norm, 3);
  s += " | lr " + format_number(r.lr, 3);
  if (show_scale) s += " | scale " + format_scale(r.loss_scale);
  if (r.skipped_steps > 0) s += fmt::format(" | skipped {}", r.skipped_steps);
  if (r.nan_steps > 0) s += fmt::format(" | nan {}", r.nan_steps);
  s += " | " + format_tokens_per_s(r.tokens_per_s);
  if (total_steps > 0 && std::isfinite(eta_seconds) && eta_seconds >= 0)
    s += " | eta " + format_duration(eta_seconds);
  // A step that did not update the weights says so, and why.
  if (r.found_inf && !r.stepped && r.loss_scale_after < r.loss_scale)
    s += " | SKIPPED: non-finite gradients, scale " + format_scale(r.loss_scale) + " -> " +
         format_scale(r.loss_scale_after);
  else if (r.found_inf && !r.stepped)
    s += std::string(" | NON-FINITE ") + (std::isfinite(r.loss) ? "gradients" : "loss") +
         ": update not applied";
  else if (r.found_inf)
    s += " | NON-FINITE gradients";
  else if (!r.stepped)
    s += " | SKIPPED: update not applied";
  return s;
}

ConsoleLogger::ConsoleLogger(Options opt, std::FILE* out) : opt_(opt), out_(out) {
  if (opt_.every < 1) opt_.every = 1;
}

double ConsoleLogger::eta_seconds(int64_t step) const {
  if (opt_.total_steps <= 0 || steps_seen_ == 0) return -1;
  const double per_step =
      steps_seen_ > 1 ? rest_seconds_ / double(steps_seen_ - 1) : first_seconds_;
  return per_step * double(std::max<int64_t>(opt_.total_steps - step, 0));
}

bool ConsoleLogger::log(const StepResult& r) {
  (steps_seen_ == 0 ? first_seconds_ : rest_seconds_) += r.seconds;
  ++steps_seen_;
  const bool abnormal = r.found_inf || !r.stepped;
  const bool due = r.step % opt_.every == 0 || steps_seen_ == 1 ||
                   (opt_.total_steps > 0 && r.step >= opt_.total_steps);
  if (!due && !abnormal && r.advice.empty()) return false;
  last_line_ = progress_line(r, opt_.total_steps, eta_seconds(r.step), opt_.show_scale);
  if (out_) {
    std::fputs((last_line_ + "\n").c_str(), out_);
    // One "advice:" line per finding (StepResult::advice holds them separated by '\n').
    for (size_t a = 0; a < r.advice.size();) {
      const size_t e = std::min(r.advice.find('\n', a), r.advice.size());
      std::fputs(("  advice: " + r.advice.substr(a, e - a) + "\n").c_str(), out_);
      a = e + 1;
    }
    std::fflush(out_);
  }
  return true;
}

}  // namespace keel::log
