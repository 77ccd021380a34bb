// Ownership of an out_dir by one run (DESIGN §9): the run holds an exclusive lock on
// out_dir/.keel.lock (flock, released by the kernel when the process ends, however it ends) that
// records its pid, host and start time, so that a second run on the same out_dir is refused with
// an error naming the holder instead of destroying its saves.
#pragma once
#include <ctime>
#include <string>
#include <utility>
#include <vector>

namespace keel::io {

// The lock's file name in out_dir: keel's bookkeeping, not a file of the run (keel serve neither
// lists nor serves it as an artifact).
inline constexpr const char* kOutDirLockFile = ".keel.lock";

class OutDirLock {
 public:
  // Creates out_dir if needed and takes the lock; an Error (kUsage) naming the holder when another
  // process holds it. `key` and `owner` name the directory and its owner in messages (keel
  // serve locks its --root the same way: a second server on it stopped the first one's run).
  explicit OutDirLock(const std::string& out_dir, const std::string& key = "run.out_dir",
                      const std::string& owner = "run");
  ~OutDirLock();
  OutDirLock(const OutDirLock&) = delete;
  OutDirLock& operator=(const OutDirLock&) = delete;

 private:
  int fd_ = -1;
};

// A run that starts from scratch (no resume) in an out_dir holding a previous run's checkpoints or
// metrics.jsonl would overwrite the one and mix both runs in the other: refused (kUsage) unless
// `overwrite`; `resume` together with `overwrite` is refused too (kUsage). Returns what the
// previous run left (checkpoints/, metrics.jsonl, tb/, adapter/, debug/), for remove_previous_run
// once the new run has been built: a run that fails on its data or its model removes nothing (it
// removed them first, and a bad data file cost the good checkpoint).
// `inputs` (key, path: model.path, data.path, ...) are what the run reads: one inside what
// `overwrite` would remove is refused too (kUsage).
std::vector<std::string> claim_out_dir(
    const std::string& out_dir, bool resume, bool overwrite,
    const std::vector<std::pair<std::string, std::string>>& inputs = {});
void remove_previous_run(const std::vector<std::string>& previous);

// The out_dir of a run that names no run.out_dir: out/<UTC time t>, or out/<time>-N (N >= 2) for
// the Nth run started in that second. create_run_dir makes the first that does not exist (mkdir
// is the claim, so concurrent runs each get their own) and returns its N (1: no suffix); the
// ranks of a data-parallel run name rank 0's with run_dir_name. Runs in the same second shared
// one: a concurrent one was refused as "in use", a later one mixed its records into the first's
// metrics.jsonl and replaced its checkpoints.
int create_run_dir(std::time_t t);
std::string run_dir_name(std::time_t t, int n);

}  // namespace keel::io
