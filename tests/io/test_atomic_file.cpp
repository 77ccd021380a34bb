// io::write_file_atomic and fsync_dir: a directory that cannot be fsynced is an error, never a
// silent loss of the rename's durability; temporaries of killed writers are removed by the next.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cstdlib>

#include <filesystem>
#include <fstream>

#include "keel/io/atomic_file.h"
#include "keel/numerics/error.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

// fsync_dir returned quietly when the directory could not be opened (EMFILE under `ulimit -n`),
// so the rename before it was not durable and nothing said so.
TEST(AtomicFile, ADirectoryThatCannotBeOpenedIsAnErrorNamingItAndTheFix) {
  // UBSan's vptr check probes memory through a pipe, which needs two of the descriptors this test
  // takes away: the Error thrown then reads as "object has invalid vptr" (a false report).
  if (std::getenv("KEEL_TEST_SANITIZED"))
    GTEST_SKIP() << "UBSan needs descriptors to check the thrown Error";
  const std::string dir = test::temp_dir("atomic-emfile");
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  const int lowest_free = ::dup(0);  // every descriptor below it is open
  ASSERT_GE(lowest_free, 0);
  ::close(lowest_free);
  rlimit tight = old;
  tight.rlim_cur = static_cast<rlim_t>(lowest_free);  // the next open fails with EMFILE
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  std::string what;
  try {
    io::fsync_dir(dir);
  } catch (const Error& e) {
    what = e.what();
  }
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_CONTAINS(what, "cannot fsync directory " + dir);
  EXPECT_CONTAINS(what, "ulimit -n");
}

// A write killed between creating FILE.tmp.PID and renaming it left that file for good.
TEST(AtomicFile, TheTemporaryOfAKilledWriteIsRemovedByTheNext) {
  const std::string dir = test::temp_dir("atomic-stale");
  const std::string stale = dir + "/f.json.tmp." + std::to_string(test::dead_pid());
  const std::string live = dir + "/f.json.tmp." + std::to_string(::getppid());
  const std::string other = dir + "/g.json.tmp." + std::to_string(test::dead_pid());
  for (const std::string& f : {stale, live, other}) std::ofstream(f) << "half";
  io::write_file_atomic(dir + "/f.json", "{}");
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));   // another process's write in progress
  EXPECT_TRUE(fs::exists(other));  // another file's: removed by that file's next write
  EXPECT_EQ(test::slurp(dir + "/f.json"), "{}");
}

}  // namespace
}  // namespace keel
