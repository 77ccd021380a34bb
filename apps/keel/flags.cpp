#include "apps/keel/flags.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "keel/data/chat_template.h"
#include "keel/numerics/error.h"
#include "keel/train/config.h"

namespace keel::cli {

namespace {
// "12", "-3": the sign and the magnitude, or false for anything else ("", "0x10", "1e3", "12a").
bool parse_whole(const std::string& v, bool& negative, unsigned long long& mag, bool& overflow) {
  negative = !v.empty() && v[0] == '-';
  const std::string digits = v.substr(negative ? 1 : 0);
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return false;
  errno = 0;
  mag = std::strtoull(digits.c_str(), nullptr, 10);
  overflow = errno == ERANGE;
  return true;
}

// "0.5", "-1e-8", "3.": a finite decimal number; strtod alone also takes nan, inf and hex.
bool parse_real(const std::string& v, double& out) {
  if (v.empty() || v.find_first_not_of("0123456789.eE+-") != std::string::npos) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(v.c_str(), &end);
  return end == v.c_str() + v.size() && errno != ERANGE && std::isfinite(out);
}

std::string shown(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// The value as the refusal quotes it: as typed, or "" for an empty one.
std::string typed(const std::string& v) { return v.empty() ? "\"\"" : v; }
}  // namespace

FlagCheck whole_check(int64_t lo, uint64_t hi, const std::string& note) {
  return [lo, hi, note](const std::string& v) {
    bool negative = false, overflow = false;
    unsigned long long mag = 0;
    bool ok = parse_whole(v, negative, mag, overflow) && !overflow;
    if (ok && negative)  // -mag >= lo, in unsigned arithmetic (lo may be INT64_MIN)
      ok = mag == 0 || (lo < 0 && mag <= static_cast<uint64_t>(-(lo + 1)) + 1);
    else if (ok)
      ok = mag <= hi && (lo <= 0 || mag >= static_cast<uint64_t>(lo));
    return ok ? std::string()
              : typed(v) + ": use a whole number from " + std::to_string(lo) + " to " +
                    std::to_string(hi) + note;
  };
}

FlagCheck real_check(double lo, double hi, bool lo_open, bool hi_open, const std::string& note) {
  return [=](const std::string& v) {
    double x = 0;
    if (parse_real(v, x) && (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi))
      return std::string();
    const double big = std::numeric_limits<double>::max();
    const std::string range = lo == -big && hi == big ? "a finite number"
                              : hi == big
                                  ? std::string("a number ") + (lo_open ? "> " : ">= ") + shown(lo)
                                  : std::string("a number in ") + (lo_open ? "(" : "[") +
                                        shown(lo) + ", " + shown(hi) + (hi_open ? ")" : "]");
    return typed(v) + ": use " + range + note;
  };
}

namespace {
// Whether CLI11 reads `v` as typed: decimal digits only within int64 (whole), or a decimal
// number, nan or inf (real). A value that is spelled so is left to the command's own range check,
// which names the command ("init-model --n-layer 5000: model.n_layer must be in [1, 1024]").
bool spelled(const std::string& v, bool whole) {
  bool negative = false, overflow = false;
  unsigned long long mag = 0;
  if (whole)
    return parse_whole(v, negative, mag, overflow) && !overflow &&
           mag <= (negative ? 0x8000000000000000ull : 0x7fffffffffffffffull);
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  return !v.empty() && v.find_first_of("xX") == std::string::npos &&
         !std::isspace(static_cast<unsigned char>(v[0])) && end == v.c_str() + v.size() &&
         (std::isfinite(x) || v.find_first_of("0123456789") == std::string::npos);  // 1e999
}
}  // namespace

FlagCheck spelled_check(bool whole, const std::string& range) {
  return [whole, range](const std::string& v) {
    return spelled(v, whole) ? std::string() : typed(v) + ": use " + range;
  };
}

FlagCheck chat_date_check() {
  return [](const std::string& v) {
    return data::is_calendar_date(v)
               ? std::string()
               : typed(v) + ": use a day written YYYY-MM-DD, such as 2024-12-04";
  };
}

FlagCheck config_check(const std::string& key, bool whole) {
  return [key, whole](const std::string& v) {
    if (spelled(v, whole)) return std::string();
    try {  // a value below every key's range: refused with the range
      check_config_number(key, std::numeric_limits<double>::lowest(), typed(v), "");
    } catch (const Error& e) {
      std::string m = e.what();  // ": model.n_layer must be in [1, 1024], got 12abc"
      if (m.rfind(": ", 0) == 0) m.erase(0, 2);
      if (const size_t at = m.find(" must be "); whole && at != std::string::npos)
        m.insert(at + 9, "a whole number ");
      return m;
    }
    return std::string();
  };
}

}  // namespace keel::cli
