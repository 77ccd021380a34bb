// keel::Error: every user-facing failure. The message names the file or object, the place and the
// fix; the CLI maps `kind` to the exit codes of DESIGN §6 (usage/config errors exit 2, others 1).
#pragma once
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace keel {

struct Error : std::runtime_error {
  enum Kind { kRuntime, kUsage };
  Kind kind;
  explicit Error(const std::string& msg, Kind k = kRuntime) : std::runtime_error(msg), kind(k) {}
};

// The error of a failed KEEL_CHECK: its message, prefixed with keel's source file and line only
// when KEEL_DEBUG_ERRORS=1 (a user reads about their input, not about keel's sources).
inline Error check_failure(const char* file, int line, const std::string& msg) {
  const char* debug = std::getenv("KEEL_DEBUG_ERRORS");
  if (debug && std::string(debug) == "1")
    return Error(std::string(file) + ":" + std::to_string(line) + ": " + msg);
  return Error(msg);
}

// Why a file could not be created or written (errno `err`), with the fix for that cause: every
// failure said "check that the directory is writable" or "is the disk full?", also the open-file
// limit (ulimit -n) and a read-only file system.
inline std::string write_failure(int err) {
  const char* fix = nullptr;
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      fix = "the disk or quota is full: free space, or write elsewhere";
      break;
    case EFBIG:
      fix = "the process's file-size limit, ulimit -f, is reached";
      break;
    case EMFILE:
    case ENFILE:
      fix = "too many files open at once: raise the limit (ulimit -n)";
      break;
    case EROFS:
      fix = "the file system is read-only: give a writable directory";
      break;
    case EACCES:
    case EPERM:
      fix = "check that the directory is writable";
      break;
    case ENOENT:
    case ENOTDIR:
      fix = "check that the directory exists";
      break;
    case EIO:
      fix = "the disk may be failing";
      break;
    default:
      fix = "check that the directory exists, is writable and has space";
  }
  return std::string(std::strerror(err)) + " (" + fix + ")";
}

// KEEL_CHECK(cond, msg): an invariant (programming errors, not user input: inputs are checked
// where their file and key are known).
#define KEEL_CHECK(cond, msg)                                            \
  do {                                                                   \
    if (!(cond)) throw ::keel::check_failure(__FILE__, __LINE__, (msg)); \
  } while (0)

}  // namespace keel
