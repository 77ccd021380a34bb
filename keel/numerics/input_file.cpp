#include "keel/numerics/input_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "keel/numerics/error.h"

namespace keel {

std::string input_file_problem(const std::string& path, bool pipes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return errno == ENOENT || errno == ENOTDIR
               ? "does not exist"
               : std::string("cannot be opened: ") + std::strerror(errno);
  if (S_ISDIR(st.st_mode)) return "is a directory";
  if (S_ISCHR(st.st_mode)) return "is a character device, not a file";
  if (S_ISBLK(st.st_mode)) return "is a block device";
  if (S_ISSOCK(st.st_mode)) return "is a socket";
  if (S_ISFIFO(st.st_mode) && !pipes) return "is a pipe (FIFO), not a regular file";
  return "";
}

std::string replaced_file_problem(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)) return "";
  if (S_ISDIR(st.st_mode)) return "is a directory";
  if (S_ISCHR(st.st_mode)) return "is a character device, which the written file would replace";
  if (S_ISBLK(st.st_mode)) return "is a block device, which the written file would replace";
  if (S_ISFIFO(st.st_mode)) return "is a pipe, which the written file would replace";
  return "is a socket, which the written file would replace";
}

namespace {

// stat(path), or false when nothing is there; an Error when the path cannot be looked at.
bool stat_or_throw(const std::string& path, struct stat& st) {
  if (::stat(path.c_str(), &st) == 0) return true;
  const int err = errno;
  if (err == ENOENT || err == ENOTDIR) return false;
  throw Error("cannot look at " + path + ": " + std::strerror(err) +
              (err == ELOOP ? " (a symbolic link on the way leads back to itself; fix or remove it)"
                            : " (check the path and its permissions)"));
}

}  // namespace

bool path_exists(const std::string& path) {
  struct stat st {};
  return stat_or_throw(path, st);
}

bool directory_exists(const std::string& path) {
  struct stat st {};
  return stat_or_throw(path, st) && S_ISDIR(st.st_mode);
}

void check_input_file(const std::string& path, const std::string& what, const std::string& key) {
  std::string problem = input_file_problem(path);
  if (problem.empty()) return;
  // A config run from another directory than the one its relative paths were written for: the
  // message named the path as written, and nothing said where it had been looked for.
  if (problem == "does not exist" && !path.empty() && path[0] != '/') {
    std::error_code ec;
    const std::string cwd = std::filesystem::current_path(ec).string();
    if (!ec) problem += " (a relative path is read from the current directory, " + cwd + ")";
  }
  throw Error(what + " " + path + " " + problem + "; " + key + " must name a file", Error::kUsage);
}

std::string read_input_file(const std::string& path, const std::string& what,
                            const std::string& key) {
  check_input_file(path, what, key);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw Error(
        "cannot read " + what + " " + path + ": " + std::strerror(errno) + " (check " + key + ")",
        Error::kUsage);
  std::ostringstream all;
  all << in.rdbuf();
  if (in.bad())
    throw Error("cannot read " + what + " " + path + ": a read failed part-way (check " + key + ")",
                Error::kUsage);
  return all.str();
}

}  // namespace keel
