#include "keel/serve/registry.h"

#include <sqlite3.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>

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
// sqlite3_errmsg with the fix for its cause: "database is locked" alone left the user to find out
// that a sqlite3 shell held a transaction open.
std::string failure(sqlite3* db, const std::string& path) {
  const std::string why = db ? sqlite3_errmsg(db) : "out of memory";
  switch (db ? sqlite3_errcode(db) & 0xff : SQLITE_NOMEM) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return why + " (another process holds " + path +
             " locked, e.g. a sqlite3 shell in a transaction: end it, then retry)";
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return why + " (" + path +
             " is damaged: restore it from a backup, or recover its rows with `sqlite3 " + path +
             " .recover | sqlite3 NEW.db` and put NEW.db in its place)";
    case SQLITE_READONLY:
      return why + " (make " + path + " and its directory writable by this user)";
    case SQLITE_FULL:
      return why + " (the disk under --root is full: free space)";
    case SQLITE_IOERR:
      return why + " (the disk may be failing)";
    case SQLITE_CANTOPEN:
      return why + " (check that --root is writable)";
    default:
      return why;
  }
}

// SQLite's multi-line reports ("*** in database main ***\nPage 3: ...") as one line.
std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n') c = ' ';
  return s;
}

constexpr const char* kColumns =
    "id, state, created_at, updated_at, idempotency_key, request, error, capture, pid, pid_start, "
    "exit_code, starts";

// One prepared statement, finalized at scope exit.
struct Stmt {
  sqlite3_stmt* s = nullptr;
  Stmt(sqlite3* db, const std::string& sql, const std::string& path) {
    if (sqlite3_prepare_v2(db, sql.c_str(), -1, &s, nullptr) != SQLITE_OK)
      throw Error("run registry " + path + ": " + failure(db, path));
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
  // A directory there was "unable to open database file (check that --root is writable)".
  std::error_code ec;
  if (std::filesystem::is_directory(db_path, ec))
    throw Error("cannot open the run registry " + db_path +
                ": it is a directory; move it away (keel serve creates the file)");
  if (sqlite3_open_v2(db_path.c_str(), &db_,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    const std::string why = failure(db_, db_path);
    sqlite3_close(db_);
    db_ = nullptr;
    throw Error("cannot open the run registry " + db_path + ": " + why);
  }
  // Past here a throw skips the destructor: the connection is closed on the way out.
  struct CloseOnThrow {
    sqlite3*& db;
    bool armed = true;
    ~CloseOnThrow() {
      if (armed) sqlite3_close(db), db = nullptr;
    }
  } close_on_throw{db_};
  // SQLite opens a file it cannot write read-only, without a word: every run created then failed
  // with "attempt to write a readonly database" while the server looked healthy.
  if (sqlite3_db_readonly(db_, "main") == 1)
    throw Error("cannot write the run registry " + db_path +
                ": it is read-only to this user; make it writable (chmod u+w, chattr -i), or "
                "give another --root");
  // Testing only: KEEL_TEST_REGISTRY_BUSY_MS shortens the wait for a lock held elsewhere.
  const char* busy_ms = std::getenv("KEEL_TEST_REGISTRY_BUSY_MS");
  sqlite3_busy_timeout(db_, busy_ms && *busy_ms ? std::atoi(busy_ms) : 5000);
  // WAL: readers never wait for the writer; FULL: a committed state survives a power cut too.
  exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;");
  exec(
      "CREATE TABLE IF NOT EXISTS runs (id TEXT PRIMARY KEY, state TEXT NOT NULL, "
      "created_at TEXT NOT NULL, updated_at TEXT NOT NULL, idempotency_key TEXT UNIQUE, "
      "request TEXT NOT NULL, error TEXT NOT NULL DEFAULT '', capture TEXT NOT NULL DEFAULT '', "
      "pid INTEGER NOT NULL DEFAULT 0, pid_start TEXT NOT NULL DEFAULT '', "
      "exit_code INTEGER NOT NULL DEFAULT -1, starts INTEGER NOT NULL DEFAULT 0)");
  // A damaged file (a torn copy, bytes overwritten) opened, listed some runs and failed each
  // create with "database disk image is malformed": it is refused here instead.
  {
    Stmt st(db_, "PRAGMA quick_check", path_);
    const int rc = sqlite3_step(st.s);
    if (rc != SQLITE_ROW) throw Error("run registry " + path_ + ": " + failure(db_, path_));
    if (std::string ok = st.column_text(0); ok != "ok")
      throw Error("run registry " + path_ + ": " + one_line(ok) + " (" + path_ +
                  " is damaged: restore it from a backup, or recover its rows with `sqlite3 " +
                  path_ + " .recover | sqlite3 NEW.db` and put NEW.db in its place)");
  }
  close_on_throw.armed = false;
}

void Registry::check_in_place(const std::string& what) const {
  // Deleted or replaced while the server runs, SQLite writes on to the unlinked file: every run
  // after it was accepted, then gone at the next start.
  int moved = 0;
  if (sqlite3_file_control(db_, "main", SQLITE_FCNTL_HAS_MOVED, &moved) == SQLITE_OK && moved)
    throw Error("run registry " + path_ + ": " + what + ": the file was deleted or replaced " +
                "while keel serve ran, so what is written now would be lost: stop keel serve, " +
                "restore the file (from a backup), then start it again");
}

Registry::~Registry() { sqlite3_close(db_); }

void Registry::exec(const std::string& sql) const {
  if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, nullptr) != SQLITE_OK)
    throw Error("run registry " + path_ + ": " + failure(db_, path_));
}

void Registry::insert(const RunRecord& r) {
  check_in_place("insert " + r.id);
  Stmt st(db_, std::string("INSERT INTO runs (") + kColumns + ") VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
          path_);
  bind_record(st, r);
  if (sqlite3_step(st.s) != SQLITE_DONE)
    throw Error("run registry " + path_ + ": insert " + r.id + ": " + failure(db_, path_));
}

void Registry::update(const RunRecord& r) {
  check_in_place("update " + r.id);
  // Testing only: KEEL_TEST_REGISTRY_FAIL_STATE=S fails the first update to state S as a full
  // disk would, so that a write refused between two others can be tested.
  static std::atomic<bool> failed_once{false};
  if (const char* s = std::getenv("KEEL_TEST_REGISTRY_FAIL_STATE");
      s && r.state == s && !failed_once.exchange(true))
    throw Error("run registry " + path_ + ": update " + r.id +
                ": database or disk is full (KEEL_TEST_REGISTRY_FAIL_STATE)");
  Stmt st(db_,
          "UPDATE runs SET id=?1, state=?2, created_at=?3, updated_at=?4, idempotency_key=?5, "
          "request=?6, error=?7, capture=?8, pid=?9, pid_start=?10, exit_code=?11, starts=?12 "
          "WHERE id=?1",
          path_);
  RunRecord u = r;
  u.updated_at = utc_now();
  bind_record(st, u);
  if (sqlite3_step(st.s) != SQLITE_DONE)
    throw Error("run registry " + path_ + ": update " + r.id + ": " + failure(db_, path_));
  // An update of no row (the file emptied or replaced under the server) said nothing.
  if (sqlite3_changes(db_) == 0)
    throw Error("run registry " + path_ + ": update " + r.id + ": the registry has no run " + r.id +
                " (was " + path_ + " replaced while keel serve ran? restart keel serve)");
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
  if (rc != SQLITE_DONE) throw Error("run registry " + path_ + ": " + failure(db_, path_));
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
