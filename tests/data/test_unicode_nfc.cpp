// keel's NFC (keel/data/unicode_nfc.h) against JavaScript's String.prototype.normalize (ICU) on
// the texts of tests/data/tokenizer_parity/nfc_cases.json (gen_nfc_cases.py), and the cases HF
// tokenizer files meet: decomposed accents, reordered marks, singletons, Hangul, invalid UTF-8.
#include "keel/data/unicode_nfc.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace keel::data {
namespace {

std::string hex(const std::string& s) {
  std::string out;
  char buf[4];
  for (unsigned char c : s) {
    std::snprintf(buf, sizeof buf, "%02x ", c);
    out += buf;
  }
  return out;
}

TEST(UnicodeNfc, AgreesWithIcuOnEveryBlockWithDecompositionsAndOnMixedMarks) {
  std::ifstream in(std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/nfc_cases.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  const auto& cases = j.at("cases");
  ASSERT_GT(cases.size(), 3000u);
  int bad = 0;
  for (const auto& c : cases) {
    const std::string in = c.at(0), want = c.at(1);
    const std::string got = nfc(in);
    if (got != want && ++bad <= 10)
      ADD_FAILURE() << "nfc(" << hex(in) << ") = " << hex(got) << ", ICU (Unicode "
                    << j.at("icu_unicode").get<std::string>() << "): " << hex(want);
  }
  EXPECT_EQ(bad, 0);
}

TEST(UnicodeNfc, ComposesReordersAndLeavesTheRest) {
  EXPECT_EQ(nfc("cafe\u0301"), "caf\u00e9");
  EXPECT_EQ(nfc("a\u0301\u0328"), "\u0105\u0301");  // ogonek (202) before acute (230), composed
  EXPECT_EQ(nfc("\u212b"), "\u00c5");               // a singleton: ANGSTROM SIGN
  EXPECT_EQ(nfc("\u1100\u1161\u11a8"), "\uac01");   // L V T jamo: their syllable
  EXPECT_EQ(nfc("\u0958"), "\u0915\u093c");         // a composition exclusion stays apart
  EXPECT_EQ(nfc("\u0301e"), "\u0301e");             // a leading mark composes with nothing
  const std::string plain = "plain ASCII, \u4e16\u754c, \u00e9t\u00e9";
  EXPECT_EQ(nfc(plain), plain);
  EXPECT_FALSE(nfc_may_change(plain));  // the tokenizer then copies nothing
  EXPECT_TRUE(nfc_may_change("cafe\u0301"));
  EXPECT_TRUE(nfc_may_change("\u212b"));
  EXPECT_TRUE(nfc_may_change("\u1100\u1161"));  // a vowel jamo composes with its consonant
  // Bytes that are not UTF-8 stay where they were, and nothing composes across them.
  const std::string invalid = std::string("e\xff") + "\u0301" + "\xc3";
  EXPECT_EQ(nfc(invalid), invalid);
  EXPECT_EQ(nfc(std::string("\xfe") + "e\u0301"), std::string("\xfe") + "\u00e9");
  EXPECT_EQ(nfc(""), "");
  EXPECT_STREQ(nfc_unicode_version(), "14.0.0");
}

}  // namespace
}  // namespace keel::data
