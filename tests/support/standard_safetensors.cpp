#include "tests/support/standard_safetensors.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

namespace keel::test {

void expect_standard_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string raw = ss.str();
  ASSERT_GE(raw.size(), 8u) << path << ": HeaderTooSmall";
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  ASSERT_LE(n, 100'000'000u) << path << ": HeaderTooLarge";
  ASSERT_LE(n + 8, raw.size()) << path << ": InvalidHeaderLength";
  const std::string text = raw.substr(8, n);
  ASSERT_FALSE(text.empty()) << path;
  EXPECT_EQ(text[0], '{') << path << ": InvalidHeaderStart";
  const nlohmann::json header = nlohmann::json::parse(text);  // throws on invalid JSON
  ASSERT_TRUE(header.is_object()) << path;
  static const std::map<std::string, uint64_t> kSize = {
      {"F32", 4}, {"BF16", 2}, {"F16", 2}, {"I32", 4}, {"I64", 8}, {"U8", 1}, {"BOOL", 1}};
  std::vector<std::pair<uint64_t, uint64_t>> offsets;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      for (auto& [k, mv] : v.items()) EXPECT_TRUE(mv.is_string()) << path << ": metadata " << k;
      continue;
    }
    ASSERT_TRUE(kSize.count(v.at("dtype").get<std::string>())) << path << ": " << name;
    uint64_t bytes = kSize.at(v.at("dtype").get<std::string>());
    for (auto& d : v.at("shape")) bytes *= d.get<uint64_t>();
    const uint64_t b = v.at("data_offsets")[0].get<uint64_t>(),
                   e = v.at("data_offsets")[1].get<uint64_t>();
    EXPECT_EQ(e - b, bytes) << path << ": TensorInvalidInfo for " << name;
    offsets.emplace_back(b, e);
  }
  std::sort(offsets.begin(), offsets.end());
  uint64_t start = 0;
  for (auto [b, e] : offsets) {
    EXPECT_EQ(b, start) << path << ": InvalidOffset (a hole or an overlap at data byte " << start
                        << ")";
    EXPECT_GE(e, b) << path;
    start = e;
  }
  EXPECT_EQ(start + 8 + n, raw.size()) << path << ": MetadataIncompleteBuffer";
}

}  // namespace keel::test
