#include "keel/serve/path_policy.h"

#include <filesystem>

namespace keel::serve {

namespace fs = std::filesystem;

bool path_within(const std::string& p, const std::string& root) {
  if (p == root) return true;
  const std::string prefix = root.back() == '/' ? root : root + "/";
  return p.compare(0, prefix.size(), prefix) == 0;
}

PathPolicy::PathPolicy(const std::vector<std::string>& roots) {
  for (const std::string& r : roots) {
    std::error_code ec;
    const fs::path c = fs::canonical(r, ec);
    if (ec || !fs::is_directory(c))
      throw Error("--data-root " + r + " is not a directory (give an existing directory)",
                  Error::kUsage);
    roots_.push_back(c.string());
  }
}

std::string PathPolicy::confine(const std::string& key, const std::string& path) const {
  if (roots_.empty())
    throw PathDenied(key + " = \"" + path +
                     "\": this server accepts no paths (start it with --data-root DIR)");
  fs::path p = path;
  if (p.is_relative()) p = fs::path(roots_.front()) / p;
  // canonical() resolves every symlink but needs the path to exist; weakly_canonical() resolves
  // what exists, so a missing file is still judged by where it would be.
  std::error_code ec;
  fs::path real = fs::canonical(p, ec);
  const bool exists = !ec;
  if (!exists) real = fs::weakly_canonical(p, ec);
  const std::string s = real.lexically_normal().string();
  if (!inside(s))
    throw PathDenied(key + " = \"" + path + "\" resolves to " + s +
                     ", outside the server's data roots; put it under --data-root");
  if (!exists) throw Error(key + " = \"" + path + "\": " + s + " does not exist", Error::kUsage);
  if (fs::is_directory(real)) confine_entries(key, s);
  return s;
}

bool PathPolicy::inside(const std::string& canonical) const {
  for (const std::string& r : roots_)
    if (path_within(canonical, r)) return true;
  return false;
}

void PathPolicy::confine_entries(const std::string& key, const std::string& dir) const {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code rc;
    fs::path real = fs::canonical(it->path(), rc);
    if (rc) real = fs::weakly_canonical(it->path(), rc);  // a dangling link: where it points
    const std::string s = real.lexically_normal().string();
    if (!inside(s))
      throw PathDenied(key + ": " + it->path().string() + " resolves to " + s +
                       ", outside the server's data roots; copy the file under --data-root "
                       "instead of linking it, or give a --data-root that holds its target (an "
                       "HF cache's snapshots link into its blobs/)");
  }
}

}  // namespace keel::serve
