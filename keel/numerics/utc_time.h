// Wall-clock time as UTC text, for the names of run directories and the metadata of captures.
#pragma once
#include <ctime>
#include <string>

namespace keel {

// `t` in UTC through strftime's `format`, e.g. "%Y-%m-%dT%H:%M:%SZ" (ISO 8601) or
// "%Y%m%d-%H%M%S" (a directory name that sorts by time). Thread-safe (gmtime_r).
std::string utc_time(const char* format, std::time_t t = std::time(nullptr));

inline constexpr const char* kUtcIso8601 = "%Y-%m-%dT%H:%M:%SZ";
inline constexpr const char* kUtcDirName = "%Y%m%d-%H%M%S";

}  // namespace keel
