#include "keel/serve/registry.h"

#include <sqlite3.h>

#include <chrono>

#include "keel/numerics/error.h"
#include "keel/numerics/utc_time.h"

namespace keel::serve {

bool is_active_state(const std::string& s) {
  return s == "queued" || s == "running" || s == "stopping";
}

std::string utc_now() {
  // Milliseconds too: runs are listed newest first, and several may start within a second.
  const auto now = std::chrono::system_clock::now();
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  return utc_time("%Y-%m-%dT%H:%M:%S", std::chrono::system_clock::to_time_t(now)) + "." +
         std::to_string(1000 + ms).substr(1) + "Z";
}

namespace {
constexpr const char* kColumns =
    "id, state, created_at, updated_at, idempotency_key, request, error, capture, pid, pid_start, "
    "exit_code, starts";

// One prepared statement, finalized at scope exit.
struct Stmt {
  sqlite3_stmt* s = nullptr;
  Stmt(sqlite3* db, const std::string& sql, const std::string& path) {
    if (sqlite3_prepare_v2(db, sql.c_str(), -1, &s, nullptr) != SQLITE_OK)
      throw Error(path + ": " + sqlite3_errmsg(db));
  }
  ~Stmt() { sqlite3_finalize(s); }
  void text(int i, const std::string& v) {
    sqlite3_bind_text(s, i, v.c_str(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  void integer(int i, int64_t v) { sqlite3_bind_int64(s, i, v); }
  std::string column_text(int i) const {
    const unsigned char* t = sqlite3_column_text(s, i);
    return t ? reinterpret_cast<const char*>(t) : "";
  }
};

void bind_record(Stmt& st, const RunRecord& r) {
  st.text(1, r.id);
  st.text(2, r.state);
  st.text(3, r.created_at);
  st.text(4, r.updated_at);
  // NULL, not "": the unique index allows any number of runs without a key.
  if (r.idempotency_key.empty())
    sqlite3_bind_null(st.s, 5);
  else
    st.text(5, r.idempotency_key);
  st.text(6, r.request);
  st.text(7, r.error);
  st.text(8, r.capture);
  st.integer(9, r.pid);
  st.text(10, r.pid_start);
  st.integer(11, r.exit_code);
  st.integer(12, r.starts);
}
}  // namespace

Registry::Registry(const std::string& db_path) : path_(db_path) {
  if (sqlite3_open_v2(db_path.c_str(), &db_,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    const std::string why = db_ ? sqlite3_errmsg(db_) : "out of memory";
    sqlite3_close(db_);
    throw Error("cannot open the run registry " + db_path + ": " + why +
                " (check that --root is writable)");
  }
  sqlite3_busy_timeout(db_, 5000);
  // WAL: readers never wait for the writer; FULL: a committed state survives a power cut too.
  exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;");
  exec(
      "CREATE TABLE IF NOT EXISTS runs (id TEXT PRIMARY KEY, state TEXT NOT NULL, "
      "created_at TEXT NOT NULL, updated_at TEXT NOT NULL, idempotency_key TEXT UNIQUE, "
      "request TEXT NOT NULL, error TEXT NOT NULL DEFAULT '', capture TEXT NOT NULL DEFAULT '', "
      "pid INTEGER NOT NULL DEFAULT 0, pid_start TEXT NOT NULL DEFAULT '', "
      "exit_code INTEGER NOT NULL DEFAULT -1, starts INTEGER NOT NULL DEFAULT 0)");
}

Registry::~Registry() { sqlite3_close(db_); }

void Registry::exec(const std::string& sql) const {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
    const std::string why = err ? err : "unknown error";
    sqlite3_free(err);
    throw Error("run registry " + path_ + ": " + why);
  }
}

void Registry::insert(const RunRecord& r) {
  Stmt st(db_, std::string("INSERT INTO runs (") + kColumns + ") VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
          path_);
  bind_record(st, r);
  if (sqlite3_step(st.s) != SQLITE_DONE)
    throw Error("run registry " + path_ + ": insert " + r.id + ": " + sqlite3_errmsg(db_));
}

void Registry::update(const RunRecord& r) {
  Stmt st(db_,
          "UPDATE runs SET id=?1, state=?2, created_at=?3, updated_at=?4, idempotency_key=?5, "
          "request=?6, error=?7, capture=?8, pid=?9, pid_start=?10, exit_code=?11, starts=?12 "
          "WHERE id=?1",
          path_);
  RunRecord u = r;
  u.updated_at = utc_now();
  bind_record(st, u);
  if (sqlite3_step(st.s) != SQLITE_DONE)
    throw Error("run registry " + path_ + ": update " + r.id + ": " + sqlite3_errmsg(db_));
}

std::vector<RunRecord> Registry::query(const std::string& where, const std::string& arg) const {
  Stmt st(db_, std::string("SELECT ") + kColumns + " FROM runs " + where, path_);
  if (!arg.empty()) st.text(1, arg);
  std::vector<RunRecord> out;
  int rc;
  while ((rc = sqlite3_step(st.s)) == SQLITE_ROW) {
    RunRecord r;
    r.id = st.column_text(0);
    r.state = st.column_text(1);
    r.created_at = st.column_text(2);
    r.updated_at = st.column_text(3);
    r.idempotency_key = st.column_text(4);
    r.request = st.column_text(5);
    r.error = st.column_text(6);
    r.capture = st.column_text(7);
    r.pid = sqlite3_column_int64(st.s, 8);
    r.pid_start = st.column_text(9);
    r.exit_code = sqlite3_column_int(st.s, 10);
    r.starts = sqlite3_column_int(st.s, 11);
    out.push_back(std::move(r));
  }
  if (rc != SQLITE_DONE) throw Error("run registry " + path_ + ": " + sqlite3_errmsg(db_));
  return out;
}

std::optional<RunRecord> Registry::get(const std::string& id) const {
  auto v = query("WHERE id = ?1", id);
  if (v.empty()) return std::nullopt;
  return v.front();
}

std::optional<RunRecord> Registry::by_idempotency_key(const std::string& key) const {
  auto v = query("WHERE idempotency_key = ?1", key);
  if (v.empty()) return std::nullopt;
  return v.front();
}

std::vector<RunRecord> Registry::list() const {
  return query("ORDER BY created_at DESC, id DESC", "");
}

}  // namespace keel::serve
