// API keys for keel serve: `Authorization: Bearer KEY`, several keys (one per line of the key
// file), compared in constant time so the time of a refusal says nothing about how much of a key
// was right.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace keel::serve {

// Equal without an early exit: the time depends on the lengths only.
bool constant_time_equal(std::string_view a, std::string_view b);

class ApiKeys {
 public:
  // The shortest key the key file may hold (the README's `head -c 24 /dev/urandom | base64` gives
  // 32 characters).
  static constexpr size_t kMinKeyChars = 16;
  ApiKeys() = default;
  // One key per line; blank lines and lines starting with '#' are skipped, surrounding spaces
  // trimmed. Throws Error (kUsage) naming the file when it cannot be read, holds no key, or holds
  // a key shorter than kMinKeyChars (naming its line).
  static ApiKeys load(const std::string& path);
  explicit ApiKeys(std::vector<std::string> keys) : keys_(std::move(keys)) {}

  bool empty() const { return keys_.empty(); }
  size_t size() const { return keys_.size(); }
  // The HTTP status of a request with this Authorization header value: 200 allowed, 401 missing
  // or not "Bearer KEY", 403 a key that is none of ours (the server answers both 401, telling
  // them apart by message and code). Every key is compared, always.
  int check(std::string_view authorization) const;

 private:
  std::vector<std::string> keys_;
};

}  // namespace keel::serve
