#include "keel/numerics/file_fingerprint.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <vector>

#include "keel/numerics/hash.h"

namespace keel {

namespace {

constexpr int64_t kWholeUpTo = int64_t{64} << 20, kEnds = int64_t{1} << 20,
                  kBlock = int64_t{64} << 10;
constexpr int kBlocks = 16;

// FNV-1a of bytes [offset, offset + n) of `in`, continuing `h`; false when they cannot be read.
bool hash_range(std::ifstream& in, int64_t offset, int64_t n, uint64_t& h) {
  in.clear();
  in.seekg(static_cast<std::streamoff>(offset));
  std::vector<char> buf(static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 20)));
  while (n > 0) {
    const auto want =
        static_cast<std::streamsize>(std::min<int64_t>(n, static_cast<int64_t>(buf.size())));
    in.read(buf.data(), want);
    if (in.gcount() != want) return false;
    h = fnv1a(buf.data(), static_cast<size_t>(want), h);
    n -= want;
  }
  return true;
}

}  // namespace

std::string FileFingerprint::text() const {
  return known() ? std::to_string(bytes) + " bytes, hash " + fnv1a64 : "not a regular file";
}

FileFingerprint file_fingerprint(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return {};
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  const auto size = static_cast<int64_t>(st.st_size);
  uint64_t h = kFnvOffsetBasis;
  bool ok = true;
  if (size <= kWholeUpTo) {
    ok = hash_range(in, 0, size, h);
  } else {
    ok = hash_range(in, 0, kEnds, h);
    const int64_t span = size - 2 * kEnds - kBlock;  // where the blocks may start, after the head
    for (int i = 0; ok && i < kBlocks; ++i)
      ok = hash_range(in, kEnds + span * (2 * i + 1) / (2 * kBlocks), kBlock, h);
    ok = ok && hash_range(in, size - kEnds, kEnds, h);
  }
  if (!ok) return {};
  FileFingerprint f;
  f.bytes = size;
  f.fnv1a64 = hash_hex(h);
  return f;
}

}  // namespace keel
