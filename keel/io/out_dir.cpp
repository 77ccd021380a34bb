#include "keel/io/out_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <vector>

#include "keel/numerics/error.h"
#include "keel/numerics/utc_time.h"

namespace keel::io {

namespace fs = std::filesystem;

OutDirLock::OutDirLock(const std::string& out_dir, const std::string& key,
                       const std::string& owner) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) {
    // A file where the directory (or one above it) goes read "cannot create ...: Not a
    // directory", naming no file: name the one in the way.
    for (fs::path p = out_dir; !p.empty(); p = p.parent_path()) {
      std::error_code sec;
      const fs::file_status st = fs::status(p, sec);
      if (fs::exists(st)) {
        if (!fs::is_directory(st))
          throw Error(key + " " + out_dir +
                          (p == fs::path(out_dir) ? std::string() : ": " + p.string()) +
                          " is a file, not a directory; give a directory path",
                      Error::kUsage);
        break;
      }
      if (p == p.parent_path()) break;
    }
    throw Error("cannot create " + key + " " + out_dir + ": " + ec.message() +
                    " (choose a writable directory)",
                Error::kUsage);
  }
  const std::string path = out_dir + "/" + kOutDirLockFile;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw Error("cannot open " + path + ", the lock of " + key + ": " + write_failure(errno),
                Error::kUsage);
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char holder[512] = {};
    const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
    std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : "an unknown process";
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK)
      throw Error("cannot lock " + path + ": " + std::strerror(err), Error::kUsage);
    throw Error(key + " " + out_dir + " is in use by another " + owner + " (" + who + ", holding " +
                    path + "); wait for it to finish, or choose another " + key,
                Error::kUsage);
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  char when[64] = {};
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  const std::string text =
      "pid " + std::to_string(::getpid()) + " on " + host + ", started " + when + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) < 0) {
    // The lock holds; only the holder's description is missing.
  }
}

OutDirLock::~OutDirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the flock
}

std::vector<std::string> claim_out_dir(
    const std::string& out_dir, bool resume, bool overwrite,
    const std::vector<std::pair<std::string, std::string>>& inputs) {
  // Continue the previous run or replace it: asked for both, the resume went ahead and the
  // overwrite was ignored without a word.
  if (resume && overwrite)
    throw Error(
        "run.resume = true and run.overwrite = true contradict each other (continue the "
        "run in run.out_dir " +
            out_dir +
            ", or replace it); set run.overwrite = false to resume, or run.resume = false "
            "to start over",
        Error::kUsage);
  if (resume) return {};
  const fs::path d(out_dir);
  std::error_code ec;
  std::vector<std::string> previous;
  // Everything a run writes there but its config.toml (rewritten): an adapter/ or debug/ left
  // behind sat beside the new run's checkpoints as if it were its own (a full fine-tune kept the
  // replaced LoRA run's PEFT adapter; the tracer appended to the old run's log).
  for (const char* f : {"checkpoints", "metrics.jsonl", "tb", "adapter", "debug"})
    if (fs::exists(d / f, ec)) previous.push_back((d / f).string());
  if (!previous.empty() && !overwrite)
    throw Error("run.out_dir " + out_dir + " holds a previous run (" + previous.front() +
                    "); set run.resume = true to continue it, run.overwrite = true to replace it, "
                    "or choose another run.out_dir",
                Error::kUsage);
  // A run that starts from its out_dir's own checkpoint (model.path = OUT/checkpoints/last, or
  // OUT) with run.overwrite removed the weights it started from once it was built: they were lost.
  auto within = [](const fs::path& a, const fs::path& b) {  // a is b or lies inside it
    return std::mismatch(b.begin(), b.end(), a.begin(), a.end()).first == b.end();
  };
  for (const auto& [key, path] : inputs) {
    if (path.empty()) continue;
    const fs::path in = fs::weakly_canonical(path, ec);
    if (ec || in.empty()) continue;  // unresolvable: the run's own load names it
    for (const std::string& p : previous) {
      const fs::path gone = fs::weakly_canonical(p, ec);
      if (!ec && !gone.empty() && (within(in, gone) || within(gone, in)))
        throw Error("run.overwrite = true would remove " + key + " = " + path + " (in " + p +
                        ", the previous run's), which this run reads; copy it out of run.out_dir " +
                        out_dir + " first, or choose another run.out_dir",
                    Error::kUsage);
    }
  }
  return previous;
}

void remove_previous_run(const std::vector<std::string>& previous) {
  for (const std::string& p : previous) {
    std::error_code ec;
    fs::remove_all(p, ec);
    if (ec) throw Error("run.overwrite = true: cannot remove " + p + ": " + ec.message());
  }
}

std::string run_dir_name(std::time_t t, int n) {
  return "out/" + utc_time(kUtcDirName, t) + (n > 1 ? "-" + std::to_string(n) : "");
}

int create_run_dir(std::time_t t) {
  std::error_code ec;
  fs::create_directories("out", ec);
  if (ec)
    throw Error("cannot create out/ for the run (run.out_dir is not set): " + ec.message() +
                    " (run from a writable directory, or set run.out_dir)",
                Error::kUsage);
  for (int n = 1;; ++n) {
    const std::string dir = run_dir_name(t, n);
    if (::mkdir(dir.c_str(), 0755) == 0) return n;
    if (errno != EEXIST)
      throw Error("cannot create " + dir + " for the run (run.out_dir is not set): " +
                      std::strerror(errno) + " (run from a writable directory, or set run.out_dir)",
                  Error::kUsage);
  }
}

}  // namespace keel::io
