#include "keel/serve/run_service.h"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <random>
#include <set>

#include "keel/io/atomic_file.h"
#include "keel/numerics/text.h"
#include "keel/serve/http_error.h"
#include "keel/serve/run_request.h"

namespace keel::serve {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
std::string new_run_id() {
  static std::mutex mu;
  static std::random_device rd;
  std::lock_guard<std::mutex> lock(mu);
  std::uniform_int_distribution<int> hex(0, 15);
  std::string id = "run-";
  for (int i = 0; i < 12; ++i) id += "0123456789abcdef"[hex(rd)];
  return id;
}

// The state a child's exit leaves its run in, and why (DESIGN §6 exit codes).
std::pair<std::string, std::string> exit_state(ChildExit e, bool stop_requested_by_us,
                                               bool stopped_by_request, bool shutting_down,
                                               bool has_checkpoint, const std::string& last_error) {
  if (e.code == 0 && stopped_by_request)
    return shutting_down && !stop_requested_by_us
               ? std::pair<std::string, std::string>{"interrupted",
                                                     "the server shut down; the run checkpointed "
                                                     "and can be resumed"}
               : std::pair<std::string, std::string>{"stopped", ""};
  if (e.code == 0) return {"succeeded", ""};
  if (e.code == 3) return {"nonfinite", last_error};
  if (e.code >= 111 && e.code <= 113)
    return {"failed", "the keel binary could not be started (exit " + std::to_string(e.code) + ")"};
  // SIGTERM before the child installed its handler (still starting up): no checkpoint yet.
  if (e.signal == SIGTERM && stop_requested_by_us)
    return {"stopped",
            "stopped while starting, before its first step: a resume starts from step 0"};
  if (e.signal != 0) {
    std::string why = "the run's process was killed by signal " + std::to_string(e.signal);
    if (e.signal == SIGKILL) why += " (SIGKILL: out of memory, or killed by hand)";
    if (shutting_down) return {"interrupted", why};
    // Its last checkpoint stands (checkpoints are written whole): the run was interrupted, not
    // lost. An out-of-memory kill ended it "failed" and not resumable.
    if (has_checkpoint)
      return {"interrupted", why +
                                 "; its last checkpoint is kept: resume it with POST "
                                 "/v1/runs/ID/resume (after making room, if memory ran out)"};
    return {"failed", why};
  }
  return {"failed", last_error.empty() ? "exit code " + std::to_string(e.code) : last_error};
}
// A test hook (tests/serve/test_runs.cpp): the first feed built waits, up to 60 s, for the file
// GATE to exist, having written its run's id to GATE.entered; a feed built meanwhile by another
// request shows that no lock is held while a feed is built.
void test_feed_gate(const std::string& gate, const std::string& id) {
  static std::atomic<bool> used{false};
  if (used.exchange(true)) return;
  io::write_file_atomic(gate + ".entered", id);
  for (int i = 0; i < 6000 && !fs::exists(gate); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}
}  // namespace

RunService::RunService(RunServiceOptions opt)
    : opt_(std::move(opt)),
      paths_(opt_.data_roots),
      registry_((fs::create_directories(opt_.root + "/runs"), opt_.root + "/keel-serve.db")),
      supervisor_([this](pid_t pid, ChildExit e) { on_child_exit(pid, e); }) {
  if (opt_.keel_binary.empty()) opt_.keel_binary = fs::read_symlink("/proc/self/exe").string();
  check_registry_knows_runs();
  poller_ = std::thread([this] { poll_feeds(); });
}

void RunService::check_registry_knows_runs() {
  // A run that was started (its stdout.log) is in the registry: one that is not means the
  // registry was deleted, emptied or replaced, and the server came up with those runs forgotten.
  std::set<std::string> known;
  for (const RunRecord& r : registry_.list()) known.insert(r.id);
  std::vector<std::string> lost;
  std::error_code ec;
  for (fs::directory_iterator it(opt_.root + "/runs", ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string id = it->path().filename().string();
    std::error_code e;
    if (!known.count(id) && fs::exists(it->path() / "stdout.log", e)) lost.push_back(id);
  }
  if (lost.empty()) return;
  std::sort(lost.begin(), lost.end());
  std::string names;
  for (size_t i = 0; i < lost.size() && i < 5; ++i) names += (i ? ", " : "") + lost[i];
  if (lost.size() > 5) names += ", ...";
  const std::string db = opt_.root + "/keel-serve.db", runs = opt_.root + "/runs";
  throw Error("the run registry " + db + " does not know " + std::to_string(lost.size()) +
              (lost.size() == 1 ? " run" : " runs") + " that " + runs + " holds (" + names +
              "): it was deleted, emptied or replaced; put back the registry that lists them "
              "(a backup), or move those run directories out of " +
              runs + " to serve without them");
}

RunService::~RunService() {
  shutdown();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_polling_ = true;
  }
  poll_.notify_all();
  poller_.join();
}

// How often the active run's files are looked at (a stat each; a read when they grew). Status
// answers and events are at most this much behind the run.
constexpr auto kFeedPoll = std::chrono::milliseconds(20);

void RunService::poll_feeds() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_polling_) {
    if (children_.empty()) {
      poll_.wait(lock);  // nothing runs: nothing to read until a child starts
      continue;
    }
    std::vector<std::string> ids;
    for (const auto& [pid, id] : children_) ids.push_back(id);
    lock.unlock();
    for (const std::string& id : ids) {
      std::shared_ptr<RunFeed> f;
      {
        std::lock_guard<std::mutex> fl(feeds_mu_);
        auto it = feeds_.find(id);
        if (it != feeds_.end()) f = it->second;
      }
      if (f) f->refresh();
    }
    lock.lock();
    poll_.wait_for(lock, kFeedPoll, [&] { return stop_polling_; });
  }
}

std::shared_ptr<RunFeed> RunService::feed_of(const RunRecord& r) {
  {
    std::lock_guard<std::mutex> lock(feeds_mu_);
    auto it = feeds_.find(r.id);
    if (it != feeds_.end()) return it->second;
  }
  // Built outside feeds_mu_: a feed reads its run's files (a long finished run's metrics.jsonl
  // takes a while), and every status, events stream and the poller take feeds_mu_. The first
  // list after a restart builds one per run and held it for seconds. Two threads that build the
  // same feed at once keep the first one stored.
  if (const char* gate = std::getenv("KEEL_SERVE_TEST_FEED_GATE")) test_feed_gate(gate, r.id);
  auto built = std::make_shared<RunFeed>(run_dir(r.id));
  built->set_state(r.state);
  std::lock_guard<std::mutex> lock(feeds_mu_);
  return feeds_.emplace(r.id, std::move(built)).first->second;
}

std::shared_ptr<RunFeed> RunService::feed(const std::string& id) { return feed_of(must_get(id)); }

RunRecord RunService::must_get(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(records_mu_);
    auto it = records_.find(id);
    if (it != records_.end()) return it->second;
  }
  auto r = registry_.get(id);
  if (!r) throw HttpError(404, "no run " + id + " (GET /v1/runs lists them)");
  std::lock_guard<std::mutex> lock(records_mu_);
  return records_.emplace(id, *r).first->second;  // a save in between wins
}

void RunService::save_unsaved() {
  std::map<std::string, RunRecord> pending;
  {
    std::lock_guard<std::mutex> lock(records_mu_);
    pending = unsaved_;
  }
  for (const auto& [id, r] : pending) {
    registry_.update(r);  // its Error names the registry and why (a 500 for the request)
    std::lock_guard<std::mutex> lock(records_mu_);
    unsaved_.erase(id);
  }
}

void RunService::save(const RunRecord& r, bool insert) {
  if (insert)
    registry_.insert(r);
  else
    registry_.update(r);
  const RunRecord stored = registry_.get(r.id).value_or(r);  // with the updated_at it wrote
  {
    std::lock_guard<std::mutex> lock(records_mu_);
    records_[r.id] = stored;
    unsaved_.erase(r.id);  // written now, newer than what waited
  }
  feed_of(stored)->set_state(stored.state);
}

json RunService::to_json(const RunRecord& r) {
  json j = feed_of(r)->snapshot();
  j["id"] = r.id;
  j["object"] = "run";
  j["state"] = r.state;
  j["created_at"] = r.created_at;
  j["updated_at"] = r.updated_at;
  j["error"] = r.error.empty() ? json() : json(r.error);
  j["exit_code"] = r.exit_code < 0 ? json() : json(r.exit_code);
  j["starts"] = r.starts;
  j["resumable"] = r.state == "stopped" || r.state == "interrupted";
  j["artifacts"] = "/v1/runs/" + r.id + "/artifacts";
  if (!r.capture.empty())
    j["capture"] = {{"path", r.capture}, {"replay", "keel replay " + shell_word(r.capture)}};
  return j;
}

void RunService::start_child(RunRecord& r, bool resume) {
  const std::string dir = run_dir(r.id);
  std::vector<std::string> argv = {opt_.keel_binary, "train", dir + "/run.toml"};
  if (resume) argv.insert(argv.end(), {"--set", "run.resume=true"});
  feed_of(r)->new_start();
  const pid_t pid = supervisor_.start(argv, dir, dir + "/stdout.log", dir + "/stderr.log");
  children_[pid] = r.id;
  poll_.notify_all();
  r.state = "running";
  r.pid = pid;
  r.pid_start = process_start_time(pid);
  r.error.clear();
  r.exit_code = -1;
  ++r.starts;
  // The child runs from here on: a registry that refuses the write must not make it a run that
  // never started (create() then recorded it failed while it trained, or left it queued, which
  // refused every later run as "one run at a time").
  save_or_keep(r, "started");
}

void RunService::save_or_keep(const RunRecord& r, const std::string& what) {
  try {
    save(r, /*insert=*/false);
  } catch (const Error& e) {
    std::fprintf(stderr,
                 "keel serve | run %s %s but the registry could not record it: %s; it is "
                 "recorded once the registry can be written\n",
                 r.id.c_str(), what.c_str(), e.what());
    {
      std::lock_guard<std::mutex> lock(records_mu_);
      records_[r.id] = unsaved_[r.id] = r;
    }
    feed_of(r)->set_state(r.state);
  }
}

std::pair<int, json> RunService::create(const std::string& body, const std::string& idem_key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shutting_down_) throw HttpError(503, "the server is shutting down");
  save_unsaved();  // else the registry holds a run that ended as active: "one run at a time"
  if (!idem_key.empty()) {
    if (auto r = registry_.by_idempotency_key(idem_key)) {
      if (r->request != body)
        throw HttpError(422,
                        "Idempotency-Key " + idem_key + " was used by run " + r->id +
                            " with a different body; use a new key for a new run",
                        {{"run_id", r->id}, {"param", "Idempotency-Key"}});
      return {200, to_json(*r)};
    }
  }
  for (const RunRecord& r : registry_.list())
    if (is_active_state(r.state))
      throw HttpError(409,
                      "run " + r.id + " is " + r.state +
                          "; one run at a time (stop it with POST /v1/runs/" + r.id + "/stop)",
                      {{"active_run", r.id}});
  RunRecord r;
  r.id = new_run_id();
  const std::string dir = run_dir(r.id);
  const Config cfg = run_config_of_request(body, paths_, dir);  // 400/403 before anything exists
  fs::create_directories(dir);
  io::write_file_atomic(dir + "/run.toml", config_to_toml(cfg));
  r.state = "queued";
  r.created_at = r.updated_at = utc_now();
  r.idempotency_key = idem_key;
  r.request = body;
  save(r, /*insert=*/true);
  try {
    start_child(r, /*resume=*/false);
  } catch (const Error& e) {
    r.state = "failed";
    r.error = e.what();
    save(r, /*insert=*/false);
  }
  return {201, to_json(r)};
}

json RunService::list(size_t limit, const std::string& after) {
  std::vector<RunRecord> all = registry_.list();
  {
    std::lock_guard<std::mutex> lock(records_mu_);
    for (RunRecord& r : all)
      if (auto it = unsaved_.find(r.id); it != unsaved_.end()) r = it->second;
  }
  size_t begin = 0;
  if (!after.empty()) {
    // Runs are never deleted: an id that is no run is the client's mistake (a typo, another
    // server's run), not the end of the list.
    auto it =
        std::find_if(all.begin(), all.end(), [&](const RunRecord& r) { return r.id == after; });
    if (it == all.end())
      throw HttpError(400,
                      "after=" + visible(after) + ": no run " + visible(after) +
                          " (give the id of the last run of the previous page)",
                      {{"param", "after"}});
    begin = static_cast<size_t>(it - all.begin()) + 1;
  }
  const size_t end = limit == 0 ? all.size() : std::min(all.size(), begin + limit);
  json runs = json::array();
  for (size_t i = begin; i < end; ++i) runs.push_back(to_json(all[i]));
  return {{"object", "list"}, {"data", runs}, {"has_more", end < all.size()}};
}

json RunService::get(const std::string& id) { return to_json(must_get(id)); }

std::string RunService::state(const std::string& id) {
  try {
    return must_get(id).state;
  } catch (const HttpError&) {
    return "";
  }
}

json RunService::stop(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  RunRecord r = must_get(id);
  if (r.state == "stopping") return to_json(r);
  if (r.state != "running")
    throw HttpError(409, "run " + id + " is " + r.state + "; only a running run can be stopped",
                    {{"state", r.state}});
  r.state = "stopping";
  save(r, /*insert=*/false);
  ::kill(static_cast<pid_t>(r.pid), SIGTERM);  // the child checkpoints after its current step
  return to_json(r);
}

json RunService::resume(const std::string& id) {
  feed(id);  // read its files before taking mu_ (the poller and every change of state wait on it)
  std::lock_guard<std::mutex> lock(mu_);
  if (shutting_down_) throw HttpError(503, "the server is shutting down");
  RunRecord r = must_get(id);
  if (r.state != "stopped" && r.state != "interrupted")
    throw HttpError(
        409, "run " + id + " is " + r.state + "; only a stopped or interrupted run can be resumed",
        {{"state", r.state}});
  save_unsaved();
  for (const RunRecord& o : registry_.list())
    if (is_active_state(o.state))
      throw HttpError(409, "run " + o.id + " is " + o.state + "; one run at a time",
                      {{"active_run", o.id}});
  // Its paths are judged again: what they name may have become a link out of the roots since
  // the run was created (a refusal leaves the run resumable).
  Config cfg;
  try {
    cfg = load_config(run_dir(id) + "/run.toml");
  } catch (const Error& e) {
    throw HttpError(500, e.what());
  }
  confine_run_paths(cfg, paths_);
  try {
    start_child(r, /*resume=*/true);
  } catch (const Error& e) {
    throw HttpError(500, e.what());
  }
  return to_json(r);
}

void RunService::on_child_exit(pid_t pid, ChildExit e) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = children_.find(pid);
  if (it == children_.end()) return;
  const std::string id = it->second;
  children_.erase(it);
  std::optional<RunRecord> rec;
  {  // the answers' record: newer than the registry's while a write of it waits (save_or_keep)
    std::lock_guard<std::mutex> l(records_mu_);
    if (auto u = records_.find(id); u != records_.end()) rec = u->second;
  }
  if (!rec) rec = registry_.get(id);
  if (rec) {
    RunRecord r = *rec;
    auto p = feed_of(r);
    p->refresh();  // all the child wrote, before its run leaves the active states
    // checkpoints/last, or the previous one moved aside by a save the kill interrupted
    // (last.old-PID: the resume's recovery puts it back).
    std::error_code ec;
    const fs::path ck = fs::path(run_dir(id)) / "checkpoints";
    bool has_checkpoint = fs::exists(ck / "last" / "trainer.json", ec);
    for (fs::directory_iterator it(ck, ec), end; !ec && !has_checkpoint && it != end;
         it.increment(ec))
      has_checkpoint = it->path().filename().string().rfind("last.old-", 0) == 0;
    auto [state, why] = exit_state(e, r.state == "stopping", p->stopped_by_request(),
                                   shutting_down_, has_checkpoint, p->last_error());
    r.state = state;
    r.error = why;
    r.capture = p->capture();
    r.exit_code = e.signal ? 128 + e.signal : e.code;
    r.pid = 0;
    r.pid_start.clear();
    // A full or failing disk under --root (which also ends the run): thrown in this waiter
    // thread it was std::terminate, the server gone.
    save_or_keep(r, "ended (" + r.state + ")");
  }
  exited_.notify_all();
}

void RunService::recover() {
  std::lock_guard<std::mutex> lock(mu_);
  for (RunRecord r : registry_.list()) {
    if (!is_active_state(r.state)) continue;
    const auto pid = static_cast<pid_t>(r.pid);
    // A child of the dead server that still runs (its parent-death SIGTERM is on its way, or it
    // was started by something else): ask it to checkpoint and stop, then make sure.
    if (process_alive(pid, r.pid_start)) {
      ::kill(pid, SIGTERM);
      for (int i = 0; i < opt_.stop_grace_s * 10 && process_alive(pid, r.pid_start); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (process_alive(pid, r.pid_start)) ::kill(pid, SIGKILL);
    }
    const std::string was = r.state;
    // A stop asked for before the server died, which the child completed (checkpoint saved,
    // "stopped by request" printed just before its exit 0) after the server could see it: the
    // run is stopped, as the server would have recorded. It said `interrupted`.
    if (was == "stopping" && feed_of(r)->stopped_by_request()) {
      r.state = "stopped";
      r.error.clear();
      r.exit_code = 0;
    } else {
      r.state = "interrupted";
      r.error = "the server stopped while the run was " + was +
                "; resume it from its last checkpoint with POST /v1/runs/" + r.id + "/resume";
    }
    r.pid = 0;
    r.pid_start.clear();
    save(r, /*insert=*/false);
  }
}

void RunService::shutdown() {
  std::unique_lock<std::mutex> lock(mu_);
  if (shutting_down_ && children_.empty()) return;
  shutting_down_ = true;
  {
    std::lock_guard<std::mutex> fl(feeds_mu_);
    for (auto& [id, f] : feeds_) f->close();  // the events streams end now
  }
  for (const auto& [pid, id] : children_) ::kill(pid, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(opt_.stop_grace_s);
  if (!exited_.wait_until(lock, deadline, [&] { return children_.empty(); })) {
    for (const auto& [pid, id] : children_) ::kill(pid, SIGKILL);
    exited_.wait(lock, [&] { return children_.empty(); });
  }
  // Ends the registry could not record (a lock held elsewhere, a full disk) were written only
  // before the next create or resume: a server stopped first lost them, and its restart took a
  // run that had succeeded for one it left running ("interrupted"). This is their last chance.
  try {
    save_unsaved();
  } catch (const Error& e) {
    std::lock_guard<std::mutex> l(records_mu_);
    for (const auto& [id, r] : unsaved_)
      std::fprintf(stderr,
                   "keel serve | the end of run %s (%s) is not in the registry: %s; the next "
                   "start records it as interrupted\n",
                   id.c_str(), r.state.c_str(), e.what());
  }
}

}  // namespace keel::serve
