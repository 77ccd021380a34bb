#include "keel/serve/auth.h"

#include <algorithm>
#include <cctype>
#include <fstream>

#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"

namespace keel::serve {

bool constant_time_equal(std::string_view a, std::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned>(x ^ y);
  }
  return diff == 0;
}

ApiKeys ApiKeys::load(const std::string& path) {
  std::ifstream in(path);
  if (!in || !input_file_problem(path).empty())  // a directory would read as 'holds no key'
    throw Error("cannot read the API key file " + path +
                    " (one key per line; create it, e.g. `head -c 24 /dev/urandom | base64 > " +
                    path + "`)",
                Error::kUsage);
  std::vector<std::string> keys;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    const size_t b = line.find_first_not_of(" \t\r");
    if (b == std::string::npos || line[b] == '#') continue;
    const size_t e = line.find_last_not_of(" \t\r");
    keys.push_back(line.substr(b, e - b + 1));
    // Nothing limits how often a client may guess: a short key is found by trying them all.
    if (keys.back().size() < kMinKeyChars)
      throw Error("the API key file " + path + ": the key on line " + std::to_string(line_no) +
                      " has " + std::to_string(keys.back().size()) + " characters; use at least " +
                      std::to_string(kMinKeyChars) + " (e.g. `head -c 24 /dev/urandom | base64`)",
                  Error::kUsage);
  }
  if (keys.empty())
    throw Error("the API key file " + path + " holds no key (one per line; '#' starts a comment)",
                Error::kUsage);
  return ApiKeys(std::move(keys));
}

int ApiKeys::check(std::string_view authorization) const {
  // The scheme is case-insensitive and may be followed by several spaces (RFC 9110 11.1, 11.4):
  // "bearer KEY", as some HTTP clients send it, was 401 "missing or malformed" with the right key.
  constexpr std::string_view kBearer = "bearer";
  if (authorization.size() <= kBearer.size() || authorization[kBearer.size()] != ' ') return 401;
  for (size_t i = 0; i < kBearer.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(authorization[i])) != kBearer[i]) return 401;
  std::string_view key = authorization.substr(kBearer.size());
  key.remove_prefix(std::min(key.find_first_not_of(' '), key.size()));
  if (key.empty()) return 401;
  bool ok = false;
  for (const std::string& k : keys_) ok |= constant_time_equal(key, k);
  return ok ? 200 : 403;
}

}  // namespace keel::serve
