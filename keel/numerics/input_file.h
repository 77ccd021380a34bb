// Reading a file the user named, whole: the one home of the checks every reader makes first. A
// directory reads as empty ("invalid JSON" or worse); a device such as /dev/zero or /dev/urandom
// never ends, so the run would read until the OOM killer stops it. A pipe is a file the user meant:
// `keel train <(sed s/0.1/0.2/ cfg.toml)` is read like any other.
#pragma once
#include <string>

namespace keel {

// Why `path` cannot be read whole, or "" when it can (a regular file or a pipe): "does not exist",
// "is a directory", "is a character device, not a file" (/dev/zero would never end), "is a block
// device", "is a socket". With `pipes` false a pipe is refused too ("is a pipe (FIFO), not a
// regular file"): keel serve's runs, whose files no one writes into a pipe for them; the run
// waited for a writer until it was stopped.
std::string input_file_problem(const std::string& path, bool pipes = true);

// Why `path` cannot be replaced by a file written beside it and renamed over it (how keel writes
// every file), or "" when it can (missing, or a regular file): a directory, or a device, pipe or
// socket the rename would replace. `keel tokenize --output /dev/null`, run as root, turned
// /dev/null into a regular file, and every later reader of /dev/null read what was written there.
std::string replaced_file_problem(const std::string& path);

// Whether `path` exists (following links), as std::filesystem::exists would say, except that a
// path that cannot be looked at (a symbolic link that leads back to itself, a component without
// search permission) is an Error naming the path and the fix instead of std::filesystem's raw
// "filesystem error: status: Too many levels of symbolic links [PATH]".
bool path_exists(const std::string& path);
// Whether `path` is a directory (following links); the same Error as path_exists otherwise.
bool directory_exists(const std::string& path);

// Throws read_input_file's usage Error when `path` cannot be read whole: for a reader that
// checks early (before loading a model) and reads later.
void check_input_file(const std::string& path, const std::string& what, const std::string& key);

// The whole of `path`, the user's `what` ("dataset file") named by `key` ("data.path", or a flag).
// Throws a usage Error naming the file, what is wrong with it and `key`.
std::string read_input_file(const std::string& path, const std::string& what,
                            const std::string& key);

}  // namespace keel
