// The run registry (ROOT/keel-serve.db) under faults: locked by another process, damaged,
// read-only, deleted while the server runs, emptied between two servers. Each is an error naming
// the file and the fix, at startup where it can be, and never a run accepted and then forgotten.
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "keel/numerics/error.h"
#include "keel/serve/registry.h"
#include "tests/serve/serve_process.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

serve::RunRecord record(const std::string& id) {
  serve::RunRecord r;
  r.id = id;
  r.state = "succeeded";
  r.created_at = r.updated_at = "2026-01-01T00:00:00.000Z";
  r.request = "{}";
  return r;
}

// A registry of `n` runs at DIR/keel-serve.db; returns its path.
std::string registry_of(const std::string& dir, int n) {
  const std::string db = dir + "/keel-serve.db";
  serve::Registry reg(db);
  for (int i = 0; i < n; ++i) reg.insert(record("run-00000000000" + std::to_string(i)));
  return db;
}

// What opening `db` throws ("" when it opens).
std::string open_error(const std::string& db) {
  try {
    serve::Registry reg(db);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A sqlite3 shell holding a transaction said "database is locked" and nothing more.
TEST(ServeRegistry, ALockHeldByAnotherProcessNamesTheFileAndTheFix) {
  const std::string db = registry_of(test::temp_dir("registry-locked"), 1);
  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open(db.c_str(), &other), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(other, "PRAGMA locking_mode=EXCLUSIVE; BEGIN EXCLUSIVE; DELETE FROM runs;",
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  ::setenv("KEEL_TEST_REGISTRY_BUSY_MS", "100", 1);
  const std::string what = open_error(db);
  ::unsetenv("KEEL_TEST_REGISTRY_BUSY_MS");
  sqlite3_close(other);
  EXPECT_CONTAINS(what, db + ": database is locked (another process holds " + db + " locked");
  EXPECT_CONTAINS(what, "end it, then retry");
}

// A damaged file: garbage said only "file is not a database"; bytes overwritten inside it opened,
// listed some runs and failed every create with "database disk image is malformed".
TEST(ServeRegistry, ADamagedFileIsRefusedAtOpenNamingItAndTheFix) {
  const std::string dir = test::temp_dir("registry-damaged");
  const std::string db = registry_of(dir, 50);
  const std::string good = test::slurp(db);
  ASSERT_GT(good.size(), 8192u);
  std::string torn = good;
  for (size_t i = 4096; i < torn.size(); ++i) torn[i] = static_cast<char>(i * 131 % 251);
  for (const std::string& bytes : {std::string(4096, 'x'), good.substr(0, 100), torn}) {
    fs::remove(db + "-wal");
    fs::remove(db + "-shm");
    std::ofstream(db, std::ios::binary | std::ios::trunc) << bytes;
    const std::string what = open_error(db);
    EXPECT_CONTAINS(what, "run registry " + db);
    EXPECT_CONTAINS(what, db + " is damaged: restore it from a backup");
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;  // quick_check's report, one line
  }
  fs::remove(db);
  fs::create_directory(db);  // was "unable to open database file (check that --root is writable)"
  EXPECT_CONTAINS(open_error(db), "cannot open the run registry " + db + ": it is a directory");
}

// A registry file this user cannot write (here immutable, as root): SQLite opened it read-only
// without a word, and the server then answered every create with a 500.
TEST(ServeRegistry, AReadOnlyFileIsRefusedAtOpen) {
  const std::string db = registry_of(test::temp_dir("registry-readonly"), 1);
  if (std::system(("chattr +i '" + db + "' 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "needs chattr +i (root, a file system with the immutable flag)";
  struct Mutable {
    std::string f;
    ~Mutable() { std::system(("chattr -i '" + f + "'").c_str()); }
  } undo{db};
  EXPECT_CONTAINS(open_error(db), "cannot write the run registry " + db + ": it is read-only");
}

// Deleted while the server ran, SQLite wrote on to the unlinked file: every later run was
// accepted, then gone at the next start. And an update of a run the file no longer has (it was
// replaced by an empty one) changed nothing, without a word.
TEST(ServeRegistry, WritesToADeletedOrReplacedFileAreErrors) {
  const std::string dir = test::temp_dir("registry-deleted");
  const std::string db = dir + "/keel-serve.db";
  {
    serve::Registry reg(db);
    reg.insert(record("run-000000000001"));
    fs::remove(db);
    fs::remove(db + "-wal");
    fs::remove(db + "-shm");
    try {
      reg.insert(record("run-000000000002"));
      ADD_FAILURE() << "an insert into a deleted registry succeeded";
    } catch (const Error& e) {
      EXPECT_CONTAINS(std::string(e.what()),
                      db + ": insert run-000000000002: the file was deleted");
    }
  }
  serve::Registry reg(db);  // a new, empty one
  try {
    reg.update(record("run-000000000001"));
    ADD_FAILURE() << "an update of a run the registry does not have succeeded";
  } catch (const Error& e) {
    EXPECT_CONTAINS(std::string(e.what()), "the registry has no run run-000000000001");
  }
}

// A registry deleted or emptied (a zero-length file opens as a new database) between two servers:
// the next one started with every run of ROOT/runs forgotten. Now it refuses, naming them.
TEST(ServeRegistry, AServerRefusesARegistryThatForgotTheRunsOfItsRoot) {
  const std::string dir = test::temp_dir("registry-forgot");
  const std::string root = dir + "/root";
  std::ofstream(dir + "/keys") << test::kTestKey << "\n";
  const std::vector<std::string> args = {"--root", root, "--api-key-file", dir + "/keys"};
  fs::create_directories(root + "/runs/run-00000000000a");  // a run that was started
  std::ofstream(root + "/runs/run-00000000000a/stdout.log") << "step 1\n";
  fs::create_directories(root + "/runs/run-00000000000b");  // created, its insert failed
  std::ofstream(root + "/runs/run-00000000000b/run.toml") << "";
  std::ofstream(root + "/keel-serve.db") << "";
  const auto [code, out] = test::serve_refusal(args);
  EXPECT_NE(code, 0);
  EXPECT_CONTAINS(out, "the run registry " + root + "/keel-serve.db does not know 1 run that " +
                           root + "/runs holds (run-00000000000a)");
  EXPECT_EQ(out.find("run-00000000000b"), std::string::npos) << out;
  {
    serve::Registry reg(root + "/keel-serve.db");
    reg.insert(record("run-00000000000a"));
  }
  test::ServeProcess srv(args);
  EXPECT_TRUE(srv.started()) << srv.output();
}

// A server started with one registry test hook in its environment (NAME=VALUE, unset here once
// the server has it), its root in a fresh directory.
struct HookedServer {
  std::string dir, root, db;
  std::unique_ptr<test::ServeProcess> srv;
  HookedServer(const std::string& tag, const char* name, const char* value)
      : dir(test::temp_dir(tag)), root(dir + "/root"), db(root + "/keel-serve.db") {
    std::ofstream(dir + "/keys") << test::kTestKey << "\n";
    ::setenv(name, value, 1);  // inherited by the server
    srv = std::make_unique<test::ServeProcess>(
        std::vector<std::string>{"--root", root, "--api-key-file", dir + "/keys"});
    ::unsetenv(name);
  }
};

// A run's end that the registry could not record (here: a lock held by another process) was
// written only before the next create or resume: a server stopped first lost it, and the next
// start marked the run, which had succeeded, interrupted. Now the shutdown writes it.
TEST(ServeRegistry, ARunsEndNotRecordedIsWrittenAtShutdown) {
  const HookedServer h("registry-unsaved-end", "KEEL_TEST_REGISTRY_BUSY_MS", "100");
  test::ServeProcess& srv = *h.srv;
  const std::string& db = h.db;
  ASSERT_TRUE(srv.started()) << srv.output();
  const test::Api api{srv.port(), test::kTestKey};
  auto r = api.post("/v1/runs", test::tiny_config(100).dump());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 201) << r->body;
  const std::string id = nlohmann::json::parse(r->body)["id"];
  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open(db.c_str(), &other), SQLITE_OK);
  sqlite3_busy_timeout(other, 5000);
  // The write lock (WAL: the server still reads), as a sqlite3 shell's open transaction holds it.
  ASSERT_EQ(sqlite3_exec(other, "BEGIN IMMEDIATE;", nullptr, nullptr, nullptr), SQLITE_OK);
  for (int i = 0; i < 300 && srv.output().find("could not record it") == std::string::npos; ++i)
    ::usleep(100000);
  sqlite3_close(other);
  ASSERT_NE(srv.output().find("could not record it"), std::string::npos) << srv.output();
  EXPECT_EQ(srv.stop(), 0) << srv.output();
  serve::Registry reg(db);
  ASSERT_TRUE(reg.get(id).has_value());
  EXPECT_EQ(reg.get(id)->state, "succeeded");
}

// The registry refusing the write of a run's start (the child forked): create() recorded the run
// failed while it trained (and a second failure left it queued, refusing every later run as "one
// run at a time"). The start is kept for the answers and written with the run's end.
TEST(ServeRegistry, ARunWhoseStartTheRegistryRefusesRunsAndIsRecordedLater) {
  const HookedServer h("registry-unsaved-start", "KEEL_TEST_REGISTRY_FAIL_STATE", "running");
  test::ServeProcess& srv = *h.srv;
  ASSERT_TRUE(srv.started()) << srv.output();
  const test::Api api{srv.port(), test::kTestKey};
  auto r = api.post("/v1/runs", test::tiny_config(50).dump());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 201) << r->body;
  const nlohmann::json created = nlohmann::json::parse(r->body);
  EXPECT_EQ(created["state"], "running") << r->body;
  const std::string id = created["id"];
  EXPECT_CONTAINS(srv.output(), "run " + id + " started but the registry could not record it");
  const nlohmann::json run =
      api.wait_run(id, [](const nlohmann::json& j) { return j["state"] == "succeeded"; });
  EXPECT_EQ(run["state"], "succeeded") << run.dump();
  EXPECT_EQ(run["starts"], 1) << run.dump();
  auto next = api.post("/v1/runs", test::tiny_config(2).dump());  // not active any more
  ASSERT_TRUE(next);
  EXPECT_EQ(next->status, 201) << next->body;
  EXPECT_EQ(srv.stop(), 0) << srv.output();
  serve::Registry reg(h.db);
  ASSERT_TRUE(reg.get(id).has_value());
  EXPECT_EQ(reg.get(id)->state, "succeeded");
  EXPECT_EQ(reg.get(id)->starts, 1);
}

}  // namespace
}  // namespace keel
