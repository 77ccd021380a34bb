#include "keel/data/unicode_nfc.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "keel/data/utf8.h"

namespace keel::data {

namespace {

struct CombiningClass {
  uint32_t cp = 0;
  uint8_t ccc;
};
struct Decomposition {
  uint32_t cp, first, second;  // second 0: a singleton
};
struct Composition {
  uint32_t first, second, composite;
};
struct CodePointRange {
  uint32_t lo, hi;
};

#include "keel/data/unicode_nfc_tables.inc"

// Hangul syllables (Unicode 3.12): S = SBase + (L * VCount + V) * TCount + T.
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

// A unit of the text: a code point, or (kRawByte | b) for a byte that is not UTF-8.
constexpr uint32_t kRawByte = 0x80000000u;

uint8_t combining_class(uint32_t cp) {
  const auto it = std::lower_bound(std::begin(kCombiningClasses), std::end(kCombiningClasses), cp,
                                   [](const CombiningClass& c, uint32_t v) { return c.cp < v; });
  return it != std::end(kCombiningClasses) && it->cp == cp ? it->ccc : 0;
}

bool affected(uint32_t cp) {
  if (cp < kNfcAffected[0].lo) return false;
  const auto it = std::upper_bound(std::begin(kNfcAffected), std::end(kNfcAffected), cp,
                                   [](uint32_t v, const CodePointRange& r) { return v < r.lo; });
  return it != std::begin(kNfcAffected) && cp <= std::prev(it)->hi;
}

// Appends the full canonical decomposition of `cp` to `out`.
void decompose(uint32_t cp, std::vector<uint32_t>* out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out->push_back(kLBase + s / kNCount);
    out->push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out->push_back(kTBase + s % kTCount);
    return;
  }
  const auto it = std::lower_bound(std::begin(kDecompositions), std::end(kDecompositions), cp,
                                   [](const Decomposition& d, uint32_t v) { return d.cp < v; });
  if (it == std::end(kDecompositions) || it->cp != cp) {
    out->push_back(cp);
    return;
  }
  decompose(it->first, out);
  if (it->second != 0) decompose(it->second, out);
}

// The primary composite of (first, second), or 0.
uint32_t compose(uint32_t first, uint32_t second) {
  if (first >= kLBase && first < kLBase + kLCount && second >= kVBase &&
      second < kVBase + kVCount)  // L + V: an LV syllable
    return kSBase + ((first - kLBase) * kVCount + (second - kVBase)) * kTCount;
  if (first >= kSBase && first < kSBase + kSCount && (first - kSBase) % kTCount == 0 &&
      second > kTBase && second < kTBase + kTCount)  // LV + T: an LVT syllable
    return first + (second - kTBase);
  const auto it =
      std::lower_bound(std::begin(kCompositions), std::end(kCompositions), std::pair{first, second},
                       [](const Composition& c, const std::pair<uint32_t, uint32_t>& v) {
                         return c.first != v.first ? c.first < v.first : c.second < v.second;
                       });
  return it != std::end(kCompositions) && it->first == first && it->second == second ? it->composite
                                                                                     : 0;
}

uint8_t unit_class(uint32_t unit) { return unit & kRawByte ? 0 : combining_class(unit); }

}  // namespace

const char* nfc_unicode_version() { return kNfcUnicodeVersion; }

bool nfc_may_change(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    if (static_cast<unsigned char>(text[i]) < 0xCC) {  // below U+0300: never affected
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const size_t n = decode_utf8(text, i, &cp);
    if (n > 0 && affected(cp)) return true;
    i += n > 0 ? n : 1;
  }
  return false;
}

std::string nfc(std::string_view text) {
  // Most text (ASCII, CJK ideographs, precomposed Latin) holds no code point NFC can change.
  if (!nfc_may_change(text)) return std::string(text);
  // 1. Canonical decomposition.
  std::vector<uint32_t> units;
  units.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    uint32_t cp = 0;
    const size_t n = decode_utf8(text, i, &cp);
    if (n == 0) {
      units.push_back(kRawByte | static_cast<unsigned char>(text[i]));
      ++i;
      continue;
    }
    decompose(cp, &units);
    i += n;
  }
  // 2. Canonical ordering: each run of combining marks stably sorted by class.
  for (size_t i = 0; i < units.size();) {
    if (unit_class(units[i]) == 0) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < units.size() && unit_class(units[end]) != 0) ++end;
    std::stable_sort(units.begin() + static_cast<std::ptrdiff_t>(i),
                     units.begin() + static_cast<std::ptrdiff_t>(end),
                     [](uint32_t a, uint32_t b) { return unit_class(a) < unit_class(b); });
    i = end;
  }
  // 3. Canonical composition: each mark joins the last starter unless a mark of the same or a
  // higher class stands between them (blocked); a starter joins only the one just before it.
  size_t kept = 0, starter = 0;
  bool have_starter = false;
  int last_class = -1;  // of the last unit kept after the starter (-1: none)
  for (size_t i = 0; i < units.size(); ++i) {
    const uint32_t u = units[i];
    const int cls = unit_class(u);
    if (have_starter && !(u & kRawByte) && !(units[starter] & kRawByte) &&
        (last_class == -1 || last_class < cls)) {
      if (const uint32_t c = compose(units[starter], u); c != 0) {
        units[starter] = c;
        continue;
      }
    }
    if (cls == 0) {
      starter = kept;
      have_starter = true;
      last_class = -1;
    } else {
      last_class = cls;
    }
    units[kept++] = u;
  }
  units.resize(kept);
  std::string out;
  out.reserve(text.size());
  for (uint32_t u : units) {
    if (u & kRawByte)
      out.push_back(static_cast<char>(u & 0xFF));
    else
      append_utf8(u, &out);
  }
  return out;
}

}  // namespace keel::data
