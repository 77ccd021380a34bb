// The console progress line (DESIGN §6):
//   step 120/500 | loss 2.314 | grad_norm 0.84 | lr 2.9e-05 | scale 65536 | 41.2k tok/s | eta 1m12s
// with `skipped N` / `nan N` counters when non-zero and a marker at the end of a step that was
// skipped or non-finite. Non-finite numbers print as nan / inf / -inf, never as 0.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

#include "keel/train/step_result.h"

namespace keel::log {

// Pieces of the line, exposed for tests and for other printers.
std::string format_duration(double seconds);      // 72 -> "1m12s", 5 -> "5s", 7384 -> "2h03m"
std::string format_tokens_per_s(double tps);      // 41234 -> "41.2k tok/s", 812 -> "812 tok/s"
std::string format_number(double v, int digits);  // %.<digits>g, but nan/inf/-inf spelled out
std::string format_scale(double scale);           // 65536 -> "65536" (integral), else 3 digits
// `part` of `whole` in percent with one decimal, never rounded into a claim the counts deny:
// 1 of 5000 -> "<0.1%" (not "0.0%"), 4999 of 5000 -> ">99.9%" (not "100.0%"), 0 -> "0.0%".
std::string format_percent(int64_t part, int64_t whole);

// The whole line for one step. `total_steps` <= 0: unknown (no "/N", no eta); `eta_seconds` < 0
// or non-finite: no eta.
std::string progress_line(const StepResult& r, int64_t total_steps, double eta_seconds,
                          bool show_scale = true);

class ConsoleLogger {
 public:
  struct Options {
    int64_t total_steps = 0;  // 0 = unknown
    int64_t every = 1;        // print every N steps
    bool show_scale = true;   // false without a loss scaler (the scale is always 1)
  };
  explicit ConsoleLogger(Options opt, std::FILE* out = stdout);

  // Prints the line of `r` when r.step is a multiple of `every`, the first or the last step, or the
  // step was skipped or non-finite (those are never hidden), followed by the advisor's line when
  // r.advice is set. Returns whether it printed.
  bool log(const StepResult& r);
  // Seconds left after `step`: the mean step time so far (excluding the first step, which pays
  // one-time setup, once there are others) times the steps left. -1 when unknown.
  double eta_seconds(int64_t step) const;
  const std::string& last_line() const { return last_line_; }

 private:
  Options opt_;
  std::FILE* out_;
  int64_t steps_seen_ = 0;
  double first_seconds_ = 0, rest_seconds_ = 0;
  std::string last_line_;
};

}  // namespace keel::log
