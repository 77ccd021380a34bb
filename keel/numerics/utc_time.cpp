#include "keel/numerics/utc_time.h"

namespace keel {

std::string utc_time(const char* format, std::time_t t) {
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  const size_t n = std::strftime(buf, sizeof buf, format, &tm);
  return std::string(buf, n);
}

}  // namespace keel
