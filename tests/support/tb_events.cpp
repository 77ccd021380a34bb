#include "tests/support/tb_events.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace keel::test {
namespace {

struct Reader {
  const std::string& s;
  size_t pos = 0;
  bool done() const { return pos >= s.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos >= s.size()) throw std::runtime_error("truncated varint");
      const uint8_t b = static_cast<uint8_t>(s[pos++]);
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    throw std::runtime_error("varint longer than 10 bytes");
  }
  std::string bytes(size_t n) {
    if (pos + n > s.size()) throw std::runtime_error("truncated field");
    std::string out = s.substr(pos, n);
    pos += n;
    return out;
  }
  template <class T>
  T fixed() {
    T v;
    const std::string b = bytes(sizeof(T));
    std::memcpy(&v, b.data(), sizeof(T));
    return v;
  }
};

std::vector<std::pair<std::string, float>> decode_summary(const std::string& data) {
  std::vector<std::pair<std::string, float>> out;
  Reader r{data};
  while (!r.done()) {
    const uint64_t key = r.varint();
    EXPECT_EQ(key, (1u << 3) | 2u) << "Summary has only `repeated Value value = 1`";
    Reader v{r.bytes(r.varint())};
    std::string tag;
    float value = 0;
    bool has_value = false;
    while (!v.done()) {
      const uint64_t k = v.varint();
      if (k == ((1u << 3) | 2u)) {
        tag = v.bytes(v.varint());
      } else if (k == ((2u << 3) | 5u)) {
        value = v.fixed<float>();
        has_value = true;
      } else {
        ADD_FAILURE() << "unexpected Value field key " << k;
        return out;
      }
    }
    EXPECT_TRUE(has_value) << tag;
    out.emplace_back(tag, value);
  }
  return out;
}

}  // namespace

uint32_t ref_crc32c(const std::string& s) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char ch : s) {
    crc ^= ch;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t ref_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

Event decode_event(const std::string& data) {
  Event e;
  Reader r{data};
  while (!r.done()) {
    const uint64_t key = r.varint();
    switch (key) {
      case (1u << 3) | 1u:
        e.wall_time = r.fixed<double>();
        break;
      case (2u << 3) | 0u:
        e.step = static_cast<int64_t>(r.varint());
        e.has_step = true;
        break;
      case (3u << 3) | 2u:
        e.file_version = r.bytes(r.varint());
        break;
      case (5u << 3) | 2u:
        e.values = decode_summary(r.bytes(r.varint()));
        break;
      case (7u << 3) | 2u: {  // SessionLog { status = 1 }
        Reader log{r.bytes(r.varint())};
        while (!log.done()) {
          const uint64_t k = log.varint();
          if (k != ((1u << 3) | 0u)) {
            ADD_FAILURE() << "unexpected SessionLog field key " << k;
            return e;
          }
          e.session_start = log.varint() == 1;
        }
        break;
      }
      default:
        ADD_FAILURE() << "unexpected Event field key " << key;
        return e;
    }
  }
  return e;
}

// Splits a file into records, checking the framing and both masked CRCs of each.
std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string file = ss.str();
  std::vector<std::string> out;
  Reader r{file};
  while (!r.done()) {
    const std::string len_bytes = r.bytes(8);
    uint64_t len;
    std::memcpy(&len, len_bytes.data(), 8);
    EXPECT_EQ(r.fixed<uint32_t>(), ref_mask(ref_crc32c(len_bytes)))
        << "length CRC, record " << out.size();
    const std::string data = r.bytes(len);
    EXPECT_EQ(r.fixed<uint32_t>(), ref_mask(ref_crc32c(data))) << "data CRC, record " << out.size();
    out.push_back(data);
  }
  return out;
}

std::vector<std::pair<int64_t, float>> tensorboard_view(const std::string& tb_dir,
                                                        const std::string& tag) {
  std::vector<std::string> files;
  for (auto& f : std::filesystem::directory_iterator(tb_dir)) files.push_back(f.path().string());
  std::sort(files.begin(), files.end());
  std::vector<std::pair<int64_t, float>> kept;
  for (const std::string& f : files)
    for (const std::string& rec : read_records(f)) {
      const Event e = decode_event(rec);
      if (e.session_start)
        std::erase_if(kept, [&](const std::pair<int64_t, float>& p) { return p.first >= e.step; });
      for (auto& [t, v] : e.values)
        if (t == tag) kept.emplace_back(e.step, v);
    }
  return kept;
}

}  // namespace keel::test
