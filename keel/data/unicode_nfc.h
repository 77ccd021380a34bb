// Unicode Normalization Form C (UAX #15), the NFC normalizer of HF tokenizer.json files (Qwen2's,
// Qwen2.5's and Qwen3's): canonical decomposition, canonical ordering of combining marks, then
// canonical composition, from the Unicode data of scripts/gen_unicode_nfc.py. "e" + U+0301 becomes
// "é" (U+00E9), U+212B (ANGSTROM SIGN) "Å", Hangul jamo their syllable.
#pragma once
#include <string>
#include <string_view>

namespace keel::data {

// Whether `text` holds a code point NFC can change (a mark, a decomposable or composable
// character): false for ASCII and most text, after one scan that decodes only bytes >= 0xCC.
bool nfc_may_change(std::string_view text);

// `text` in NFC. Bytes that are not UTF-8 pass through unchanged (each stands alone: nothing
// composes with it).
std::string nfc(std::string_view text);

// The Unicode version of the tables ("14.0.0"): code points assigned later are left as they are.
const char* nfc_unicode_version();

}  // namespace keel::data
