// numerics/input_file.h: which paths a reader accepts before it reads them whole. A device would be
// read until memory runs out (/dev/zero never ends); a pipe is a file the user meant.
#include "keel/numerics/input_file.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/types.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "keel/numerics/error.h"
#include "tests/support/check.h"

namespace keel {
namespace {

TEST(InputFile, RegularFilesAndPipesAreReadable) {
  const std::string dir = test::temp_dir("input-file");
  std::ofstream(dir + "/a.txt") << "hello\n";
  EXPECT_EQ(input_file_problem(dir + "/a.txt"), "");
  EXPECT_EQ(read_input_file(dir + "/a.txt", "dataset file", "data.path"), "hello\n");

  // A FIFO, as `keel train <(sed ... cfg.toml)` passes one: read to its writer's end.
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(input_file_problem(fifo), "");
  // ... unless pipes are refused (keel serve: no one writes into a pipe a request names).
  EXPECT_EQ(input_file_problem(fifo, /*pipes=*/false), "is a pipe (FIFO), not a regular file");
  EXPECT_EQ(input_file_problem(dir + "/a.txt", /*pipes=*/false), "");
  std::thread writer([&] { std::ofstream(fifo) << "from a pipe"; });
  EXPECT_EQ(read_input_file(fifo, "config file", "the config argument"), "from a pipe");
  writer.join();
}

TEST(InputFile, MissingDirectoriesAndDevicesAreRefusedNamingTheKey) {
  const std::string dir = test::temp_dir("input-file-bad");
  EXPECT_EQ(input_file_problem(dir + "/none.txt"), "does not exist");
  EXPECT_EQ(input_file_problem(dir + "/none/deeper.txt"), "does not exist");
  EXPECT_EQ(input_file_problem(dir), "is a directory");
  EXPECT_EQ(input_file_problem("/dev/zero"), "is a character device, not a file");

  // Before this check, /dev/zero as data.path was read until the OOM killer stopped the run.
  try {
    read_input_file("/dev/zero", "dataset file", "data.path");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind, Error::kUsage);
    EXPECT_EQ(std::string(e.what()),
              "dataset file /dev/zero is a character device, not a file; data.path must "
              "name a file");
  }
  EXPECT_EQ(test::error_of([&] { read_input_file(dir, "tokenizer file", "data.tokenizer"); }),
            "tokenizer file " + dir + " is a directory; data.tokenizer must name a file");
  EXPECT_CONTAINS(test::error_of([&] { read_input_file(dir + "/x", "dataset file", "data.path"); }),
                  "dataset file " + dir + "/x does not exist; data.path must name a file");
  // A relative path says where it was looked for (a config run from another directory).
  EXPECT_EQ(test::error_of([&] { read_input_file("no/such.txt", "dataset file", "data.path"); }),
            "dataset file no/such.txt does not exist (a relative path is read from the current "
            "directory, " +
                std::filesystem::current_path().string() + "); data.path must name a file");
}

}  // namespace
}  // namespace keel
