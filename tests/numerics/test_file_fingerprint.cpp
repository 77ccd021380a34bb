// file_fingerprint: equal bytes give equal fingerprints whatever the file's name or time; one
// changed byte anywhere in a small file, and at the head, the tail or a sampled block of a large
// one, changes it; a pipe or a missing file has none.
#include "keel/numerics/file_fingerprint.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <fstream>

#include "tests/support/check.h"

namespace keel {
namespace {

void poke(const std::string& path, int64_t at, char c) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(at);
  f.put(c);
}

TEST(FileFingerprint, EqualBytesAreEqualAndEveryChangedByteOfASmallFileDiffers) {
  const std::string dir = test::temp_dir("fingerprint");
  const std::string a = dir + "/a.txt", b = dir + "/b.txt";
  std::ofstream(a) << std::string(5000, 'x');
  std::ofstream(b) << std::string(5000, 'x');
  const FileFingerprint fa = file_fingerprint(a);
  EXPECT_TRUE(fa.known());
  EXPECT_EQ(fa.bytes, 5000);
  EXPECT_EQ(fa.fnv1a64.size(), 16u);
  EXPECT_EQ(fa, file_fingerprint(b));
  ::utimes(a.c_str(), nullptr);
  EXPECT_EQ(fa, file_fingerprint(a));
  for (int64_t at : {0, 2500, 4999}) {
    poke(b, at, 'y');
    EXPECT_NE(fa, file_fingerprint(b)) << at;
    poke(b, at, 'x');
  }
  EXPECT_EQ(fa.text(), "5000 bytes, hash " + fa.fnv1a64);
}

TEST(FileFingerprint, ALargeFileIsSampledAtItsEndsAndBlocksBetween) {
  const std::string path = test::temp_dir("fingerprint") + "/large.bin";
  const int64_t size = int64_t{200} << 20;  // sparse: no 200 MB written
  { std::ofstream(path, std::ios::binary); }
  ASSERT_EQ(::truncate(path.c_str(), size), 0);
  const FileFingerprint f = file_fingerprint(path);
  ASSERT_TRUE(f.known());
  EXPECT_EQ(f.bytes, size);
  // The head, the tail, and the middle of the first sampled block (1 MiB + span / 32).
  const int64_t span = size - (int64_t{2} << 20) - (64 << 10);
  for (int64_t at : {int64_t{10}, size - 10, (int64_t{1} << 20) + span / 32 + 100}) {
    poke(path, at, 'z');
    EXPECT_NE(f, file_fingerprint(path)) << at;
    poke(path, at, '\0');
    EXPECT_EQ(f, file_fingerprint(path)) << at;
  }
  ASSERT_EQ(::truncate(path.c_str(), size + 1), 0);
  EXPECT_NE(f, file_fingerprint(path));
}

TEST(FileFingerprint, APipeOrAMissingFileHasNone) {
  const std::string fifo = test::temp_dir("fingerprint") + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_FALSE(file_fingerprint(fifo).known());
  EXPECT_FALSE(file_fingerprint("/no/such/file").known());
  EXPECT_EQ(file_fingerprint("/no/such/file").text(), "not a regular file");
}

}  // namespace
}  // namespace keel
