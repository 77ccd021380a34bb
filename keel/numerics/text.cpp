#include "keel/numerics/text.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace keel {

size_t edit_distance(std::string_view a, std::string_view b) {
  // Two rows of the dynamic-programming table: prev[j] = distance(a[0, i - 1), b[0, j)).
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string json_error_detail(std::string_view what) {
  if (what.rfind("[json.exception.", 0) == 0)
    if (const size_t end = what.find("] "); end != std::string_view::npos)
      what.remove_prefix(end + 2);
  // A parse error quotes the token it was reading ("...; last read: '<token>'", maybe then
  // "; expected ..."): for a string, all of it so far, a megabyte for a long JSONL line. Its last
  // bytes place the problem.
  constexpr std::string_view kLastRead = "; last read: '";
  constexpr size_t kKeep = 40;
  const size_t at = what.find(kLastRead);
  if (at == std::string_view::npos) return std::string(what);
  const size_t begin = at + kLastRead.size();
  size_t end = what.rfind("'; expected ");
  if (end == std::string_view::npos || end < begin) end = what.size() - (what.back() == '\'');
  if (end < begin || end - begin <= kKeep + 3) return std::string(what);
  size_t cut = end - kKeep;
  while (cut < end && (static_cast<unsigned char>(what[cut]) & 0xC0) == 0x80) ++cut;  // UTF-8
  return std::string(what.substr(0, begin)) + "..." + std::string(what.substr(cut));
}

std::string visible(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[u >> 4];
      out += hex[u & 15];
    } else {
      out += c;
    }
  }
  return out;
}

std::string shell_word(std::string_view s) {
  const bool plain = !s.empty() && s.find_first_not_of(
                                       "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                       "0123456789_./:=@%+,-") == std::string_view::npos;
  if (plain) return std::string(s);
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string count_of(long long n, std::string_view noun, std::string_view nouns) {
  std::string out = std::to_string(n) + " ";
  if (n == 1) return out.append(noun);
  return nouns.empty() ? out.append(noun).append("s") : out.append(nouns);
}

}  // namespace keel
