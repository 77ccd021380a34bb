#include "keel/io/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>

#include "keel/io/atomic_file.h"
#include "keel/io/safetensors.h"
#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"
#include "keel/numerics/text.h"

namespace keel::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kModel = "model.safetensors";
constexpr const char* kOptimizer = "optimizer.safetensors";
constexpr const char* kTrainer = "trainer.json";

void (*g_stage_hook)(const char*) = nullptr;

// Testing only: KEEL_TEST_CRASH_AT=STAGE:N ends the process (exit code 86, no cleanup, as a
// SIGKILL would) at the Nth time a save reaches STAGE, so that tests can crash a real run at each
// point of a save.
void crash_if_asked(const char* name) {
  static const std::string spec = [] {
    const char* v = std::getenv("KEEL_TEST_CRASH_AT");
    return std::string(v ? v : "");
  }();
  if (spec.empty()) return;
  static int seen = 0;
  const size_t colon = spec.find(':');
  if (spec.substr(0, colon) != name) return;
  const int nth = colon == std::string::npos ? 1 : std::atoi(spec.c_str() + colon + 1);
  if (++seen == nth) std::_Exit(86);
}

void stage(const char* name) {
  crash_if_asked(name);
  if (g_stage_hook) g_stage_hook(name);
}

// `dir` without a trailing slash, split into parent and name.
struct Place {
  fs::path dir, parent;
  std::string name;
};

Place place_of(const std::string& dir) {
  if (dir.empty())
    throw Error("checkpoint directory is empty (pass a path such as out/checkpoints/last)");
  fs::path d = fs::path(dir).lexically_normal();
  if (!d.has_filename()) d = d.parent_path();  // "a/b/" -> "a/b"
  Place p;
  p.dir = d;
  p.parent = d.has_parent_path() ? d.parent_path() : fs::path(".");
  p.name = d.filename().string();
  if (p.name.empty() || p.name == "." || p.name == "..")
    throw Error("checkpoint directory " + dir +
                " has no name (pass a path such as out/checkpoints/last)");
  return p;
}

bool complete(const fs::path& d) {
  std::error_code ec;
  return fs::is_regular_file(d / kModel, ec) && fs::is_regular_file(d / kOptimizer, ec) &&
         fs::is_regular_file(d / kTrainer, ec);
}

// Siblings of `p.dir` named `<name><tag><anything>`, e.g. tag ".tmp-".
std::vector<fs::path> siblings(const Place& p, const std::string& tag) {
  std::vector<fs::path> out;
  std::error_code ec;
  const std::string prefix = p.name + tag;
  for (fs::directory_iterator it(p.parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.size() > prefix.size() && n.compare(0, prefix.size(), prefix) == 0)
      out.push_back(it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A complete checkpoint renamed aside by a save that crashed before the new one took its place.
std::optional<fs::path> orphaned_old(const Place& p) {
  for (const fs::path& o : siblings(p, ".old-"))
    if (complete(o)) return o;
  return std::nullopt;
}

void rename_or_throw(const fs::path& from, const fs::path& to, const std::string& why) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec)
    throw Error("cannot save checkpoint: renaming " + from.string() + " to " + to.string() + " (" +
                why + ") failed: " + ec.message());
}

// Reports the first non-finite number in `j` (JSON cannot hold it), with its path.
void check_finite(const json& j, const std::string& path) {
  if (j.is_number_float() && !std::isfinite(j.get<double>()))
    throw Error("save_checkpoint: trainer state " + path + " is " + j.dump() +
                " (not finite; JSON cannot hold it — store it as a string or bit pattern)");
  if (j.is_object())
    for (auto& [k, v] : j.items()) check_finite(v, path + "/" + k);
  if (j.is_array())
    for (size_t i = 0; i < j.size(); ++i) check_finite(j[i], path + "/" + std::to_string(i));
}

}  // namespace

void set_checkpoint_stage_hook(void (*hook)(const char* stage)) { g_stage_hook = hook; }

void write_dir_atomic(const std::string& dir, const std::function<void(const std::string&)>& fill) {
  const Place p = place_of(dir);
  std::error_code ec;
  fs::create_directories(p.parent, ec);
  if (ec)
    throw Error("cannot write " + dir + ": creating " + p.parent.string() +
                " failed: " + ec.message());
  // Leftovers of a crashed save: put an orphaned old directory back first (so that a crash during
  // this save still leaves it), then drop partial temporaries and stale old copies.
  if (!path_exists(p.dir.string()))
    if (auto old = orphaned_old(p)) {
      rename_or_throw(*old, p.dir, "restoring the directory a crashed save moved aside");
      fsync_dir(p.parent.string());
    }
  for (const char* tag : {".tmp-", ".old-"})
    for (const fs::path& s : siblings(p, tag)) fs::remove_all(s, ec);

  const std::string pid = std::to_string(::getpid());
  const fs::path tmp = p.parent / (p.name + ".tmp-" + pid);
  const fs::path old = p.parent / (p.name + ".old-" + pid);
  fs::create_directory(tmp, ec);
  if (ec)
    throw Error("cannot write " + dir + ": creating " + tmp.string() + " failed: " + ec.message() +
                " (is the directory writable?)");
  try {
    // Each file is written to its own temporary, fsynced and renamed (write_file_atomic), and the
    // directory fsynced after each, so that `tmp` is durable before it is renamed into place.
    fill(tmp.string());
    fsync_dir(tmp.string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  stage("tmp_written");
  const bool had_old = path_exists(p.dir.string());
  if (had_old) {
    try {
      rename_or_throw(p.dir, old, "moving the previous directory aside");
    } catch (...) {
      fs::remove_all(tmp, ec);
      throw;
    }
    stage("moved_aside");
  }
  try {
    rename_or_throw(tmp, p.dir, "putting the new directory in place");
  } catch (...) {
    if (had_old) fs::rename(old, p.dir, ec);  // keep the previous directory where it was
    fs::remove_all(tmp, ec);
    throw;
  }
  fsync_dir(p.parent.string());
  stage("renamed");
  if (had_old) fs::remove_all(old, ec);  // a leftover is removed by the next save
  stage("done");
}

void save_checkpoint(const std::string& dir, const NamedTensors& model,
                     const NamedTensors& optimizer, const json& trainer_state,
                     const std::function<void(const std::string& tmp)>& extra_files) {
  check_finite(trainer_state, "");
  write_dir_atomic(dir, [&](const std::string& tmp) {
    if (extra_files) extra_files(tmp);
    const std::map<std::string, std::string> meta = {{"format", "pt"}};
    write_safetensors((fs::path(tmp) / kModel).string(), model, meta);
    write_safetensors((fs::path(tmp) / kOptimizer).string(), optimizer, meta);
    write_file_atomic((fs::path(tmp) / kTrainer).string(), trainer_state.dump(2) + "\n");
  });
}

void recover_checkpoints(const std::string& checkpoints_dir) {
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return;
  std::vector<fs::path> entries;
  for (fs::directory_iterator it(checkpoints_dir, ec), end; !ec && it != end; it.increment(ec))
    entries.push_back(it->path());
  std::sort(entries.begin(), entries.end());
  bool changed = false;
  // First put back every complete directory a crashed save moved aside, then drop the rest.
  for (const fs::path& e : entries) {
    const std::string n = e.filename().string();
    const size_t at = n.find(".old-");
    if (at == std::string::npos || at == 0) continue;
    const fs::path base = e.parent_path() / n.substr(0, at);
    if (!fs::exists(base, ec) && complete(e)) {
      rename_or_throw(e, base, "restoring the checkpoint a crashed save moved aside");
      changed = true;
    }
  }
  for (const fs::path& e : entries) {
    const std::string n = e.filename().string();
    if ((n.find(".tmp-") != std::string::npos || n.find(".old-") != std::string::npos) &&
        fs::exists(e, ec)) {
      fs::remove_all(e, ec);
      changed = true;
    }
  }
  if (changed) fsync_dir(checkpoints_dir);
}

void prune_step_checkpoints(const std::string& checkpoints_dir, int64_t keep) {
  if (keep <= 0) return;
  std::error_code ec;
  std::vector<std::pair<int64_t, fs::path>> steps;
  for (fs::directory_iterator it(checkpoints_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.rfind("step-", 0) != 0 || n.size() == 5 || n.size() > 23 ||
        n.find_first_not_of("0123456789", 5) != std::string::npos)
      continue;
    steps.emplace_back(std::stoll(n.substr(5)), it->path());
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i) {
    fs::remove_all(steps[i].second, ec);
    if (ec)
      throw Error("log.keep_checkpoints: cannot remove " + steps[i].second.string() + ": " +
                  ec.message());
  }
}

bool checkpoint_exists(const std::string& dir) {
  const Place p = place_of(dir);
  return complete(p.dir) || (!path_exists(p.dir.string()) && orphaned_old(p));
}

Checkpoint load_checkpoint(const std::string& dir) {
  const Place p = place_of(dir);
  fs::path src = p.dir;
  if (!path_exists(p.dir.string())) {
    // A save crashed between its two renames: the previous checkpoint is complete, aside.
    if (auto old = orphaned_old(p))
      src = *old;
    else
      throw Error("no checkpoint at " + dir +
                  " (the directory does not exist; check the path, or start without resume)");
  }
  if (!directory_exists(src.string()))
    throw Error("checkpoint " + src.string() + " is not a directory");
  for (const char* f : {kModel, kOptimizer, kTrainer})
    if (!path_exists((src / f).string()) || !fs::is_regular_file(src / f))
      throw Error("checkpoint " + src.string() + " is incomplete: " + (src / f).string() +
                  " is missing (resume from another checkpoint)");
  Checkpoint c;
  c.dir = src.string();
  c.model = read_safetensors((src / kModel).string()).tensors;
  c.optimizer = read_safetensors((src / kOptimizer).string()).tensors;
  const std::string trainer_path = (src / kTrainer).string();
  try {
    c.trainer_state = json::parse(read_file(trainer_path));
  } catch (const json::exception& e) {
    throw Error(trainer_path + ": invalid JSON (" + json_error_detail(e.what()) + "); " +
                kDamagedCheckpointResumeFix);
  }
  return c;
}

}  // namespace keel::io
