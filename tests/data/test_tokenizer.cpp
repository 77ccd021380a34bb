// ByteTokenizer: exact round trips of arbitrary bytes (UTF-8, NUL, 0x80..0xff), the specials,
// and decode's errors.
#include <gtest/gtest.h>

#include "keel/data/rng.h"
#include "keel/data/tokenizer.h"
#include "keel/numerics/error.h"

namespace keel::data {
namespace {

TEST(ByteTokenizer, Specials) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 259);
  EXPECT_EQ(tok.pad_id(), 256);
  EXPECT_EQ(tok.bos_id(), 257);
  EXPECT_EQ(tok.eos_id(), 258);
  EXPECT_FALSE(tok.is_special(255));
  EXPECT_TRUE(tok.is_special(256) && tok.is_special(258));
}

TEST(ByteTokenizer, EveryByteIsItsOwnId) {
  ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::vector<int32_t> ids = tok.encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);  // no sign extension of bytes >= 0x80
  EXPECT_EQ(tok.decode(ids), all);
}

TEST(ByteTokenizer, Utf8RoundTrip) {
  ByteTokenizer tok;
  const std::string s =
      "h\xc3\xa9llo, \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x99\x82\n";  // héllo, 世界 🙂
  const std::vector<int32_t> ids = tok.encode(s);
  ASSERT_EQ(ids.size(), s.size());  // one id per byte, not per code point
  EXPECT_EQ(ids[1], 0xc3);
  EXPECT_EQ(ids[2], 0xa9);
  EXPECT_EQ(tok.decode(ids), s);
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_EQ(tok.decode({}), "");
}

TEST(ByteTokenizer, RandomBytesRoundTrip) {
  ByteTokenizer tok;
  SplitMix64 rng(42);
  for (int trial = 0; trial < 200; ++trial) {
    std::string s(rng.below(64), '\0');
    for (char& c : s) c = static_cast<char>(rng.below(256));  // includes NUL and invalid UTF-8
    EXPECT_EQ(tok.decode(tok.encode(s)), s) << "trial " << trial;
  }
}

TEST(ByteTokenizer, DecodeSkipsSpecialsAndRejectsUnknownIds) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.decode({257, 'h', 'i', 256, 258, 256}), "hi");
  try {
    tok.decode({'a', 'b', 300});
    FAIL() << "id 300 accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("id 300"), std::string::npos) << msg;
    EXPECT_NE(msg.find("position 2"), std::string::npos) << msg;
  }
  EXPECT_THROW(tok.decode({-1}), Error);
}

// SplitMix64 is pinned: resumed runs depend on it. Reference outputs of the published algorithm
// (Vigna's splitmix64.c) for seed 0.
TEST(SplitMix64, MatchesReferenceOutputs) {
  SplitMix64 rng(0);
  EXPECT_EQ(rng.next(), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(rng.next(), 0x6e789e6aa1b965f4ULL);
  EXPECT_EQ(rng.next(), 0x06c45d188009454fULL);
}

TEST(SplitMix64, BelowIsInRangeAndUnbiased) {
  SplitMix64 rng(3);
  EXPECT_EQ(rng.below(1), 0u);
  std::vector<int64_t> counts(7, 0);
  const int64_t n = 70000;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t r = rng.below(7);
    ASSERT_LT(r, 7u);
    ++counts[r];
  }
  double chi2 = 0;  // 6 degrees of freedom: p(chi2 > 30) ~ 4e-5
  for (int64_t c : counts) chi2 += double(c - n / 7) * double(c - n / 7) / double(n / 7);
  EXPECT_LT(chi2, 30.0);
  // A range close to 2^64 exercises the rejection threshold.
  const uint64_t big = (uint64_t{1} << 63) + 12345;
  for (int i = 0; i < 100; ++i) EXPECT_LT(rng.below(big), big);
}

}  // namespace
}  // namespace keel::data
