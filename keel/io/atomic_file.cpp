#include "keel/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "keel/numerics/error.h"

namespace keel::io {

namespace fs = std::filesystem;

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_file_atomic(const std::string& path, const void* const* chunks, const size_t* sizes,
                       size_t count) {
  const fs::path target(path);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    throw Error("cannot write " + path + ": " + std::strerror(errno) +
                " (check that the directory exists and is writable)");
  for (size_t c = 0; c < count; ++c) {
    const char* p = static_cast<const char*>(chunks[c]);
    size_t left = sizes[c];
    while (left > 0) {
      ssize_t w = ::write(fd, p, left);
      if (w < 0) {
        if (errno == EINTR) continue;
        const std::string why = std::strerror(errno);
        ::close(fd);
        ::unlink(tmp.c_str());
        throw Error("cannot write " + path + ": " + why + " (is the disk full?)");
      }
      p += w;
      left -= static_cast<size_t>(w);
    }
  }
  ::fsync(fd);
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw Error("cannot rename " + tmp + " to " + path + ": " + why);
  }
  fsync_dir(target.parent_path().string());
}

void write_file_atomic(const std::string& path, std::string_view content) {
  const void* chunk = content.data();
  const size_t size = content.size();
  write_file_atomic(path, &chunk, &size, 1);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read " + path + ": " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace keel::io
