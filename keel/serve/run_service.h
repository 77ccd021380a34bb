// The runs of keel serve: creating, stopping, resuming and recovering them, one active at a time.
// It ties the registry (SQLite rows), the supervisor (child processes) and the progress readers
// together; every change of state goes through its mutex and is written to the registry before
// it is answered. Reads are answered from memory: the runs' records (a copy of the registry's,
// kept at every write) and their feeds (run_feed.h), which one poller thread refreshes while a
// run is active, so no request reads a file or the database.
#pragma once
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>

#include "keel/serve/path_policy.h"
#include "keel/serve/registry.h"
#include "keel/serve/run_feed.h"
#include "keel/serve/supervisor.h"

namespace keel::serve {

struct RunServiceOptions {
  std::string root;                     // ROOT: keel-serve.db and runs/ID/
  std::vector<std::string> data_roots;  // where request paths may point
  std::string keel_binary;              // the `keel` that runs `train` ("" = /proc/self/exe)
  int stop_grace_s = 30;  // SIGTERM, then SIGKILL after this long (shutdown, recovery)
};

class RunService {
 public:
  explicit RunService(RunServiceOptions opt);
  ~RunService();  // shutdown() if not done

  // Runs left queued, running or stopping by a server that died become `interrupted` (their
  // child, if it still lives, is stopped first: it checkpoints on SIGTERM). Called once at start.
  void recover();
  // Stops the active run (checkpoint, then `interrupted`) and waits for it. Idempotent.
  void shutdown();

  // The routes' work; each returns the run's JSON or throws HttpError.
  // create: 201 and the new run, or 200 and the run an earlier create with the same
  // idempotency key made; 409 while another run is active.
  std::pair<int, nlohmann::json> create(const std::string& body, const std::string& idem_key);
  // A page of the runs, newest first: those after run `after` ("" = from the newest), at most
  // `limit` of them (0 = all), with has_more; 400 naming `after` when it is no run.
  nlohmann::json list(size_t limit = 0, const std::string& after = "");
  nlohmann::json get(const std::string& id);
  nlohmann::json stop(const std::string& id);
  nlohmann::json resume(const std::string& id);

  std::string state(const std::string& id);  // "" when there is no such run
  // The feed of run `id` (its events stream reads from it); 404 when there is no such run.
  std::shared_ptr<RunFeed> feed(const std::string& id);
  std::string run_dir(const std::string& id) const { return opt_.root + "/runs/" + id; }

 private:
  void check_registry_knows_runs();  // Error naming the runs of --root/runs it forgot
  nlohmann::json to_json(const RunRecord& r);
  RunRecord must_get(const std::string& id);   // 404 otherwise
  void save(const RunRecord& r, bool insert);  // to the registry, the cache and the feed
  void save_unsaved();                         // mu_ held; Error while the registry refuses
  // save(r), or where the registry cannot be written (a full or failing disk under --root, a lock
  // held elsewhere) r kept as the answers' and written before the next change of state; `what`
  // happened, for the server's log ("ended (failed)", "started").
  void save_or_keep(const RunRecord& r, const std::string& what);
  void start_child(RunRecord& r, bool resume);  // mu_ held
  void on_child_exit(pid_t pid, ChildExit e);
  std::shared_ptr<RunFeed> feed_of(const RunRecord& r);
  void poll_feeds();  // the poller thread: refreshes the active runs' feeds

  RunServiceOptions opt_;
  PathPolicy paths_;
  Registry registry_;
  mutable std::mutex mu_;
  std::condition_variable exited_;
  std::map<pid_t, std::string> children_;  // live child -> run id
  bool shutting_down_ = false;
  std::mutex records_mu_;
  std::map<std::string, RunRecord> records_;  // as last written to (or read from) the registry
  // Runs' ends the registry could not record (a full disk under --root): the answers say them,
  // and they are written before the next change of state (records_mu_).
  std::map<std::string, RunRecord> unsaved_;
  std::mutex feeds_mu_;
  std::map<std::string, std::shared_ptr<RunFeed>> feeds_;
  std::condition_variable poll_;  // with mu_: a child started, or the service ends
  bool stop_polling_ = false;     // mu_
  std::thread poller_;
  Supervisor supervisor_;  // last: its destructor joins waiters that call back into this object
};

}  // namespace keel::serve
