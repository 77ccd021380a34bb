// The run registry: one row per run in SQLite (ROOT/keel-serve.db), written at every change of
// state, so a server killed with SIGKILL finds every run again on restart (run_service.h turns
// the ones that were running into `interrupted`).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

struct sqlite3;

namespace keel::serve {

// queued -> running -> (stopping ->) stopped | succeeded | failed | nonfinite | interrupted;
// stopped and interrupted runs can be resumed (-> running).
struct RunRecord {
  std::string id;
  std::string state;
  std::string created_at, updated_at;  // UTC, ISO 8601
  std::string idempotency_key;         // "" = none
  std::string request;                 // the create body, as received (JSON)
  std::string error;                   // why it failed or was interrupted
  std::string capture;                 // NaN capture directory (nonfinite)
  int64_t pid = 0;                     // the child, while one runs
  std::string pid_start;               // its start time (/proc/PID/stat), to tell a reused pid
  int exit_code = -1;                  // the child's last exit status; -1 = none yet
  int starts = 0;                      // 1 + resumes
};

// Whether runs in `state` have a child process (or are about to).
bool is_active_state(const std::string& state);

class Registry {
 public:
  explicit Registry(const std::string& db_path);  // creates the file and table when missing
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  void insert(const RunRecord& r);
  void update(const RunRecord& r);  // every column, by id; sets updated_at
  std::optional<RunRecord> get(const std::string& id) const;
  std::optional<RunRecord> by_idempotency_key(const std::string& key) const;
  std::vector<RunRecord> list() const;  // newest first

 private:
  std::vector<RunRecord> query(const std::string& where, const std::string& arg) const;
  void exec(const std::string& sql) const;
  void check_in_place(const std::string& what) const;  // Error when the file was deleted
  sqlite3* db_ = nullptr;
  std::string path_;
};

std::string utc_now();

}  // namespace keel::serve
