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

}  // namespace

int64_t fnv1a_file_range(std::istream& in, int64_t offset, int64_t n, uint64_t& h) {
  in.clear();
  in.seekg(static_cast<std::streamoff>(offset));
  std::vector<char> buf(static_cast<size_t>(std::clamp<int64_t>(n, 1, int64_t{1} << 20)));
  int64_t hashed = 0;
  while (hashed < n && in) {
    in.read(buf.data(), static_cast<std::streamsize>(
                            std::min<int64_t>(n - hashed, static_cast<int64_t>(buf.size()))));
    const auto got = static_cast<int64_t>(in.gcount());
    if (got == 0) break;
    h = fnv1a(buf.data(), static_cast<size_t>(got), h);
    hashed += got;
  }
  return hashed;
}

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
  // Every range read whole, else nothing to compare.
  auto hash = [&](int64_t offset, int64_t n) { return fnv1a_file_range(in, offset, n, h) == n; };
  bool ok = true;
  if (size <= kWholeUpTo) {
    ok = hash(0, size);
  } else {
    ok = hash(0, kEnds);
    const int64_t span = size - 2 * kEnds - kBlock;  // where the blocks may start, after the head
    for (int i = 0; ok && i < kBlocks; ++i)
      ok = hash(kEnds + span * (2 * i + 1) / (2 * kBlocks), kBlock);
    ok = ok && hash(size - kEnds, kEnds);
  }
  if (!ok) return {};
  FileFingerprint f;
  f.bytes = size;
  f.fnv1a64 = hash_hex(h);
  return f;
}

}  // namespace keel
