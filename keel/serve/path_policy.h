// Which files a request may name: every path in a run's config (model.path, data.path, the
// tokenizer's path) must resolve, symlinks followed, inside one of the server's data roots
// (`keel serve --data-root DIR`). A relative path is taken under the first root.
#pragma once
#include <string>
#include <vector>

#include "keel/numerics/error.h"

namespace keel::serve {

// A path outside the roots (HTTP 403).
struct PathDenied : Error {
  using Error::Error;
};

class PathPolicy {
 public:
  // Each root must be an existing directory (Error kUsage naming it otherwise).
  explicit PathPolicy(const std::vector<std::string>& roots);
  const std::vector<std::string>& roots() const { return roots_; }

  // The real path (symlinks resolved) of `path`, given as config key `key`. Throws PathDenied
  // when it lies outside every root, Error (kUsage) when it is inside but does not exist. A
  // directory's entries are confined too (confine_entries).
  std::string confine(const std::string& key, const std::string& path) const;

 private:
  // Throws PathDenied when an entry of directory `dir` (not recursively) resolves outside every
  // root: the files a loader opens inside a confined directory (a model's config.json and shards,
  // a tokenizer's vocab.bpe or tokenizer_config.json) are the request's paths as much as the
  // directory is; a symlink among them to /etc/passwd had its first line quoted in the run's error.
  void confine_entries(const std::string& key, const std::string& dir) const;
  bool inside(const std::string& canonical) const;  // within some root
  std::vector<std::string> roots_;                  // canonical
};

// Whether canonical path `p` is `root` or lies below it.
bool path_within(const std::string& p, const std::string& root);

}  // namespace keel::serve
