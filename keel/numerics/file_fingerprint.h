// What a file held, cheaply: its size and an FNV-1a hash of its bytes (the whole file up to
// 64 MiB; beyond that its first and last MiB and 16 blocks of 64 KiB spread between, so that a
// corpus of gigabytes costs 3 MiB of reading). A resume compares the fingerprint of data.path
// with the one the checkpoint recorded: the saved batch position means something only in the file
// the run was trained on.
#pragma once
#include <cstdint>
#include <istream>
#include <string>

namespace keel {

struct FileFingerprint {
  int64_t bytes = -1;   // -1: not a regular file (a pipe), or unreadable: nothing to compare
  std::string fnv1a64;  // 16 hex digits
  bool known() const { return bytes >= 0; }
  bool operator==(const FileFingerprint&) const = default;
  std::string text() const;  // "1234 bytes, hash 0123456789abcdef"
};

FileFingerprint file_fingerprint(const std::string& path);

// FNV-1a of bytes [offset, offset + n) of the file open in `in`, continuing `h`: the bytes hashed,
// fewer than n where the file ends sooner or a read fails (the one home of a file's range hash:
// data fingerprints here, an adapter's base reference in io/base_reference.cpp).
int64_t fnv1a_file_range(std::istream& in, int64_t offset, int64_t n, uint64_t& h);

}  // namespace keel
