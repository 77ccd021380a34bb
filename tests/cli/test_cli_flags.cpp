// Every numeric flag refuses what it cannot take as typed, before any model loads: exit 2 with a
// message naming the flag, the value and its valid range. CLI11's own conversion read
// 99999999999999999999 as INT64_MAX (`generate --max-new-tokens` ran to max_seq_len), -1 into a
// uint64 as 2^64 - 1, 0x10 as 16, "" as 0, and floats took nan, inf and hex.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

using Args = std::vector<std::string>;

struct FlagCase {
  Args prefix;        // the command up to the flag (required arguments; nothing is read)
  std::string flag;   // "--max-new-tokens"
  std::string range;  // what the refusal says is valid
  Args bad;           // values refused
};

// Past int64 and uint64, negative, non-finite, an exponent, hex, empty, trailing garbage.
const Args kBadWhole = {"99999999999999999999",
                        "18446744073709551616",
                        "-1",
                        "nan",
                        "inf",
                        "1e3",
                        "0x10",
                        "",
                        "12abc",
                        "010x"};
// Non-finite, beyond f64, hex (a hex float too), empty, trailing garbage.
const Args kBadReal = {"nan", "inf", "-inf", "1e999", "0x10", "0x1p-2", "", "12abc", "0.5.5"};

Args with(Args a, const Args& more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::vector<FlagCase> cases() {
  const std::string out = test::temp_dir("cli-flags") + "/model";
  const Args gen = {"generate", "no-model", "a prompt"}, init = {"init-model", "--out", out},
             mem = {"memory", "--family", "llama", "--params",  "100M", "--batch",
                    "1",      "--seq",    "8",     "--adapter", "lora"},
             mem_sizes = {"memory", "--layers", "2", "--hidden", "64"},
             eval = {"eval", "no-model", "--data", "no-data"},
             serve = {"serve", "--root", test::temp_dir("cli-flags-serve")},
             scaler = {"numerics", "scaler", "--grad", "1"};
  const std::string i64 = "9223372036854775807";
  return {
      {gen, "--max-new-tokens", "from 0 to " + i64, kBadWhole},
      {gen, "--max-new-tokens", "from 0 to " + i64, {"18446744073709551615", "-0x1"}},
      {gen, "--top-k", "from 0 to " + i64, kBadWhole},
      {gen, "--seed", "from 0 to 18446744073709551615", kBadWhole},
      {gen, "--temperature", ">= 0", with(kBadReal, {"-1", "-1e-9"})},
      {gen, "--top-p", "in (0, 1]", with(kBadReal, {"0", "-0.5", "1.5"})},
      {init, "--n-layer", "in [1, 1024]", kBadWhole},
      {init, "--n-embd", "in [1, 65536]", kBadWhole},
      {init, "--n-head", "in [1, 1024]", kBadWhole},
      {init, "--n-kv-head", "in [0, 1024]", kBadWhole},
      {init, "--intermediate-size", "in [0, 1048576]", kBadWhole},
      {init, "--vocab-size", "in [0, 16777216]", kBadWhole},
      {init, "--max-seq-len", "in [2, 1048576]", kBadWhole},
      {init, "--rope-theta", "> 0", with(kBadReal, {"0", "-1"})},
      {init, "--norm-eps", "> 0", with(kBadReal, {"0", "-1"})},
      {init, "--init-std", ">= 0", with(kBadReal, {"-0.02"})},
      {init, "--seed", "from 0 to " + i64 + " (as run.seed)",
       with(kBadWhole, {"9223372036854775808"})},
      {init, "--shard-bytes", "0 (one file) or a positive number of bytes", kBadWhole},
      {mem_sizes, "--batch", "in [1, 65536]", with(kBadWhole, {"0"})},
      {mem_sizes, "--seq", "in [2, 1048576]", with(kBadWhole, {"1"})},
      {mem, "--grad-accum", "in [1, 65536]", with(kBadWhole, {"0"})},
      {mem, "--layers", "in [1, 1024]", kBadWhole},
      {mem, "--hidden", "in [1, 65536]", kBadWhole},
      {mem, "--heads", "in [1, 1024]", kBadWhole},
      {mem, "--kv-heads", "in [0, 1024]", kBadWhole},
      {mem, "--ffn", "in [0, 1048576]", kBadWhole},
      {mem, "--vocab", "in [0, 16777216]", kBadWhole},
      {mem, "--r", "in [1, ", with(kBadWhole, {"0"})},
      {mem, "--tie-embeddings", "use true or false", {"5", "-1", "", "0x1", "yes"}},
      {mem, "--adapter-dropout", "in [0, 1)", with(kBadReal, {"-0.1", "1"})},
      {mem_sizes, "--params", "a positive count", {"nan", "inf", "0x10", "", "12abc", "-1", "0"}},
      {mem_sizes, "--params", "at most 1e15", {"99999999999999999999", "1e30"}},
      {{"export", "no-model", "--out", out},
       "--max-shard-size",
       "give a size such as",
       {"nan", "inf", "1e999", "0x10", "", "12abc", "-1", " 5"}},
      {{"export", "no-model", "--out", out},
       "--max-shard-size",
       "larger than any file",
       {"99999999999999999999", "1e30"}},
      {eval, "--seq-len", "from 1 to " + i64, with(kBadWhole, {"0"})},
      {eval, "--batch-size", "from 1 to " + i64, with(kBadWhole, {"0"})},
      {serve,
       "--listen",
       "PORT a whole number from 0 to 65535",
       {"127.0.0.1:80abc", "127.0.0.1:0x50", "127.0.0.1:99999", "127.0.0.1:-1",
        "127.0.0.1:", "127.0.0.1: 80", "127.0.0.1:18446744073709551696", "127.0.0.1"}},
      {serve, "--threads", "from 4 to 4096", with(kBadWhole, {"3", "4097"})},
      {serve, "--max-body-bytes", "from 1024 to " + i64, with(kBadWhole, {"1023"})},
      {{"numerics", "scaler"}, "--grad", "a finite number", kBadReal},
      {scaler, "--init-scale", "from 1.2e-38 to 3.4e38", with(kBadReal, {"0", "-1"})},
      {scaler, "--backoff", "(0, 1)", with(kBadReal, {"0", "1", "-0.5"})},
  };
}

// Under the sanitizers (a keel process there starts in ~40 ms, and this was 402 of them, the
// sanitized suite's slowest test at 16 s) each command tries every value once and every flag its
// first value: the refusal paths still all run under ASan + UBSan, and the release build checks
// each flag with each value.
TEST(CliFlags, EveryNumericFlagRefusesBadValuesNamingFlagValueAndRange) {
  const bool sanitized = std::getenv("KEEL_TEST_SANITIZED") != nullptr;
  std::set<std::pair<std::string, std::string>> tried;  // (command, value)
  for (const FlagCase& c : cases())
    for (const std::string& v : c.bad) {
      const bool first = &v == &c.bad.front();
      if (!tried.insert({c.prefix[0], v}).second && sanitized && !first) continue;
      const test::KeelRun r = test::run_keel(with(c.prefix, {c.flag, v}));
      const std::string what = c.prefix[0] + " " + c.flag + " '" + v + "'";
      EXPECT_EQ(r.code, 2) << what << "\n" << r.output;
      EXPECT_NE(r.err.find(c.flag), std::string::npos) << what << "\n" << r.err;
      EXPECT_NE(r.err.find(v), std::string::npos) << what << "\n" << r.err;
      EXPECT_NE(r.err.find(c.range), std::string::npos) << what << "\n" << r.err;
      EXPECT_EQ(r.err.find("Could not convert"), std::string::npos) << what << "\n" << r.err;
    }
}

// Good values still parse as typed (decimal only, the whole range up to its ends).
TEST(CliFlags, PlainDecimalValuesAreTakenAsTyped) {
  const std::string out = test::temp_dir("cli-flags-ok") + "/model";
  const test::KeelRun r =
      test::run_keel({"init-model", "--out", out, "--n-layer", "3", "--norm-eps", "1e-6", "--seed",
                      "9223372036854775807", "--shard-bytes", "0", "--max-seq-len", "16"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.out.find("3 layers"), std::string::npos) << r.out;
  const test::KeelRun m = test::run_keel(
      {"memory", "--layers", "2", "--hidden", "64", "--batch", "1", "--seq", "8", "--json"});
  ASSERT_EQ(m.code, 0) << m.output;
}

// `tokenize --decode`: a comma after a JSON array was blamed on '[72', and a typed negative id got
// the tokenizer's "produced by a model with another vocab_size?".
TEST(CliFlags, DecodeNamesTheTrailingCommaAndNegativeIds) {
  const test::KeelRun comma = test::run_keel({"tokenize", "--decode", "[72, 105],"});
  EXPECT_EQ(comma.code, 2) << comma.output;
  EXPECT_NE(comma.err.find("',' after the list's closing ']'"), std::string::npos) << comma.err;
  EXPECT_EQ(comma.err.find("'[72'"), std::string::npos) << comma.err;
  for (const char* ids : {"-5", "72 -5", "-99999999999999999999"}) {
    const test::KeelRun neg = test::run_keel({"tokenize", "--decode", "--", ids});
    EXPECT_EQ(neg.code, 2) << ids << "\n" << neg.output;
    EXPECT_NE(neg.err.find(">= 0"), std::string::npos) << ids << "\n" << neg.err;
    EXPECT_EQ(neg.err.find("vocab_size"), std::string::npos) << ids << "\n" << neg.err;
  }
  const test::KeelRun ok = test::run_keel({"tokenize", "--decode", "[72, 105]"});
  EXPECT_EQ(ok.code, 0) << ok.output;
  EXPECT_EQ(ok.out.substr(0, 2), "Hi") << ok.out;
}

}  // namespace
}  // namespace keel
