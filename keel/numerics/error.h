// keel::Error: every user-facing failure. The message names the file or object, the place and the
// fix; the CLI maps `kind` to the exit codes of DESIGN §6 (usage/config errors exit 2, others 1).
#pragma once
#include <stdexcept>
#include <string>

namespace keel {

struct Error : std::runtime_error {
  enum Kind { kRuntime, kUsage };
  Kind kind;
  explicit Error(const std::string& msg, Kind k = kRuntime) : std::runtime_error(msg), kind(k) {}
};

// KEEL_CHECK(cond, msg): internal invariant with file:line (programming errors, not user input).
#define KEEL_CHECK(cond, msg)                                                              \
  do {                                                                                     \
    if (!(cond))                                                                           \
      throw ::keel::Error(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " + \
                          (msg));                                                          \
  } while (0)

}  // namespace keel
