#include "keel/io/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"

namespace keel::io {

namespace fs = std::filesystem;

namespace {

// Testing only: KEEL_TEST_FAIL_FSYNC=N makes the Nth fsync of this process (and every later one)
// fail with EIO, as a failing disk does, so that tests see what a run does with it.
int fsync_checked(int fd) {
  static const long fail_from = [] {
    const char* v = std::getenv("KEEL_TEST_FAIL_FSYNC");
    return v && *v ? std::atol(v) : 0L;
  }();
  static long calls = 0;
  if (fail_from > 0 && ++calls >= fail_from) {
    errno = EIO;
    return -1;
  }
  return ::fsync(fd);
}

}  // namespace

void fsync_dir(const std::string& dir) {
  const std::string d = dir.empty() ? "." : dir;
  int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  // A directory that cannot be opened (the open-file limit reached, EMFILE) cannot be fsynced:
  // the rename just made into it is not durable, and returning quietly hid that.
  if (fd < 0)
    throw Error("cannot fsync directory " + d + ": " + write_failure(errno) +
                "; the file renamed into it may not survive a crash");
  const int rc = fsync_checked(fd), err = errno;
  ::close(fd);
  // Some file systems cannot fsync a directory (EINVAL): that is not a lost write.
  if (rc != 0 && err != EINVAL && err != ENOTSUP)
    throw Error("cannot fsync directory " + d + ": " + std::strerror(err) +
                " (the disk may be failing; the previous checkpoint, if any, is kept)");
}

void remove_dead_temps(const std::string& dir, const std::string& stem) {
  std::error_code ec;
  for (fs::directory_iterator it(dir.empty() ? "." : dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.size() <= stem.size() || n.compare(0, stem.size(), stem) != 0) continue;
    const std::string pid = n.substr(stem.size());
    if (pid.find_first_not_of("0123456789") != std::string::npos || pid.size() > 9) continue;
    const long p = std::strtol(pid.c_str(), nullptr, 10);
    if (p > 0 && ::kill(static_cast<pid_t>(p), 0) != 0 && errno == ESRCH) {
      std::error_code rm;
      fs::remove_all(it->path(), rm);
    }
  }
}

size_t write_file_atomic(const std::string& path, const void* const* chunks, const size_t* sizes,
                         size_t count) {
  const fs::path target(path);
  if (const std::string why = replaced_file_problem(path); !why.empty())
    throw Error("cannot write " + path + ": it " + why + "; give the path of a file",
                Error::kUsage);
  const std::string stem = target.filename().string() + ".tmp.";
  remove_dead_temps(target.parent_path().string(), stem);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw Error("cannot write " + path + ": " + write_failure(errno));
  size_t calls = 0;
  for (size_t c = 0; c < count; ++c) {
    const char* p = static_cast<const char*>(chunks[c]);
    size_t left = sizes[c];
    while (left > 0) {
      ssize_t w = ::write(fd, p, left);
      ++calls;
      if (w < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        throw Error("cannot write " + path + ": " + write_failure(err));
      }
      p += w;
      left -= static_cast<size_t>(w);
    }
  }
  const int synced = fsync_checked(fd), sync_err = errno;
  const int closed = ::close(fd);
  if (synced != 0 || closed != 0) {
    const std::string why = std::strerror(synced != 0 ? sync_err : errno);
    ::unlink(tmp.c_str());
    throw Error("cannot write " + path + ": fsync failed: " + why +
                " (the disk may be full or failing; nothing was replaced)");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw Error("cannot rename " + tmp + " to " + path + ": " + why);
  }
  fsync_dir(target.parent_path().string());
  return calls;
}

void write_file_atomic(const std::string& path, std::string_view content) {
  const void* chunk = content.data();
  const size_t size = content.size();
  write_file_atomic(path, &chunk, &size, 1);
}

std::string read_file(const std::string& path) {
  if (const std::string problem = input_file_problem(path); !problem.empty())
    throw Error("cannot read " + path + ": it " + problem + ", where a file was expected");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read " + path + ": " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace keel::io
