// Byte-level BPE without network: the byte alphabet, the pre-tokenizer regexes, merges against the
// reference algorithm (test_bpe_reference.h), the committed fixture of ids that the reference
// JavaScript tokenizers give on a hand-made vocabulary (tokenizer_parity/gen_tiny.js), added
// tokens, round trips of arbitrary bytes, pad collisions, and the loaders' errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "keel/data/bpe.h"
#include "keel/data/dataset.h"
#include "keel/data/gpt2_tokenizer.h"
#include "keel/data/hf_tokenizer.h"
#include "keel/data/rng.h"
#include "keel/data/tokenizer.h"
#include "keel/numerics/error.h"
#include "tests/data/test_bpe_reference.h"
#include "tests/support/check.h"

namespace keel::data {
namespace {

using nlohmann::json;
using test::error_of;

const std::string kTiny = std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

std::string write_file(const std::string& dir, const std::string& name,
                       const std::string& content) {
  const std::string path = dir + "/" + name;
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

std::unique_ptr<BpeTokenizer> tiny_gpt2() {
  return load_gpt2_tokenizer_files(kTiny + "/encoder.json", kTiny + "/vocab.bpe");
}

// A tokenizer.json from the tiny Llama-style file with `edit` applied, in a fresh directory.
std::string tiny_hf_variant(const std::function<void(json&)>& edit) {
  json j = read_json(kTiny + "/llama_style/tokenizer.json");
  edit(j);
  return write_file(test::temp_dir("bpe"), "tokenizer.json", j.dump());
}

std::string random_bytes(SplitMix64& rng, size_t max_len, const std::string& alphabet = "") {
  std::string s(rng.below(max_len + 1), '\0');
  for (char& c : s)
    c = alphabet.empty() ? static_cast<char>(rng.below(256)) : alphabet[rng.below(alphabet.size())];
  return s;
}

TEST(ByteLevel, AlphabetIsGpt2s) {
  // GPT-2's bytes_to_unicode: printable Latin-1 stands for itself, the rest maps to 256 + n.
  EXPECT_EQ(byte_to_codepoint('A'), uint32_t{'A'});
  EXPECT_EQ(byte_to_codepoint('!'), uint32_t{'!'});
  EXPECT_EQ(byte_to_codepoint(0xE9), 0xE9u);   // é
  EXPECT_EQ(byte_to_codepoint(0), 256u);       // Ā
  EXPECT_EQ(byte_to_codepoint(' '), 0x120u);   // Ġ
  EXPECT_EQ(byte_to_codepoint('\n'), 0x10Au);  // Ċ
  EXPECT_EQ(byte_to_codepoint(0x7F), 289u);    // after the 33 control bytes and space
  EXPECT_EQ(byte_to_codepoint(0xAD), 323u);    // soft hyphen, the last one
  EXPECT_EQ(bytes_to_byte_level(" the\n"), "\xC4\xA0the\xC4\x8A");
  std::string all, back;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  ASSERT_TRUE(byte_level_to_bytes(bytes_to_byte_level(all), &back));
  EXPECT_EQ(back, all);
  EXPECT_FALSE(byte_level_to_bytes(" x", &back));            // a raw space is not in the alphabet
  EXPECT_FALSE(byte_level_to_bytes("\xE4\xB8\x96", &back));  // 世
  EXPECT_FALSE(byte_level_to_bytes("\xC4", &back));          // truncated UTF-8
}

TEST(SplitRegex, PatternsOfGpt2AndLlama3) {
  const std::string llama = read_json(
      kTiny +
      "/llama_style/tokenizer.json")["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"];
  const auto split = [](const std::string& pattern, const std::string& text) {
    SplitRegex re(pattern, false, "test");
    std::vector<std::string> out;
    size_t prev = 0;
    for (const auto& [b, e] : re.find_all(text)) {
      EXPECT_EQ(b, prev) << "a gap in " << text;  // both patterns cover valid UTF-8 entirely
      out.push_back(text.substr(b, e - b));
      prev = e;
    }
    EXPECT_EQ(prev, text.size());
    return out;
  };
  const std::string s = "I'M 1234567 x\n\n  y";
  // Worked out by hand from the patterns (leftmost alternative, greedy, look-ahead).
  EXPECT_EQ(split(llama, s),
            (std::vector<std::string>{"I", "'M", " ", "123", "456", "7", " x", "\n\n", " ", " y"}));
  EXPECT_EQ(split(kGpt2Pattern, s),
            (std::vector<std::string>{"I", "'", "M", " 1234567", " x", "\n\n ", " y"}));
  // \p{L} and \p{N} are Unicode classes (UCP): letters of any script, digits of any script.
  EXPECT_EQ(
      split(kGpt2Pattern, "h\xC3\xA9llo \xE4\xB8\x96\xE7\x95\x8C \xD9\xA3!"),
      (std::vector<std::string>{"h\xC3\xA9llo", " \xE4\xB8\x96\xE7\x95\x8C", " \xD9\xA3", "!"}));
  // Llama-3: a non-letter glued to the front of a word; digits by threes; case-insensitive
  // contractions.
  EXPECT_EQ(split(llama, "(hello it'S don'T"),
            (std::vector<std::string>{"(hello", " it", "'S", " don", "'T"}));
  // \s is Unicode White_Space, as in Python's `regex` (openai/gpt-2's encoder.py) and Oniguruma
  // (HF tokenizers): U+FEFF (BOM) is not a space; U+0085 (NEL) is. JavaScript's \s is the other
  // way round, so the reference JS tokenizers split a BOM differently (the one known divergence;
  // the parity corpus leaves it out). Python's regex.findall gives exactly these pieces.
  EXPECT_EQ(split(kGpt2Pattern, "bom\xEF\xBB\xBFhere \xEF\xBB\xBFx"),
            (std::vector<std::string>{"bom", "\xEF\xBB\xBF", "here", " \xEF\xBB\xBF", "x"}));
  EXPECT_EQ(split(kGpt2Pattern,
                  "a\xC2\x85\xC2\x85"
                  "b"),
            (std::vector<std::string>{"a", "\xC2\x85", "\xC2\x85", "b"}));
  // Invalid UTF-8 never matches: it stays in the gap.
  SplitRegex re(kGpt2Pattern, false, "test");
  const auto m = re.find_all("ab\xFF\xFE cd");
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0], (std::pair<size_t, size_t>{0, 2}));
  EXPECT_EQ(m[1], (std::pair<size_t, size_t>{4, 7}));
  // A literal pattern ({"String": ...}) is not a regex.
  SplitRegex lit(".+", true, "test");
  EXPECT_EQ(lit.find_all("a.+b.+").size(), 2u);
  EXPECT_CONTAINS(error_of([] { SplitRegex bad("(?<x", false, "tokenizer.json: pattern"); }),
                  "tokenizer.json: pattern");
}

// The committed ids of the reference JavaScript tokenizers on the hand-made vocabulary.
TEST(Bpe, TinyFixtureMatchesReferenceIds) {
  const json expected = read_json(kTiny + "/expected.json");
  // round_trip: false for add_prefix_space, whose space decode keeps (as HF's decoder does).
  const auto check = [&](const Tokenizer& tok, const std::string& name, bool round_trip) {
    const json& c = expected[name];
    ASSERT_EQ(c["strings"].size(), c["ids"].size());
    ASSERT_GE(c["strings"].size(), 10u);
    for (size_t i = 0; i < c["strings"].size(); ++i) {
      const std::string s = c["strings"][i];
      EXPECT_EQ(tok.encode(s), c["ids"][i].get<std::vector<int32_t>>())
          << name << " on \"" << s << "\"";
      if (round_trip && s.find('<') == std::string::npos) {
        EXPECT_EQ(tok.decode(tok.encode(s)), s) << name;
      }
    }
  };
  check(*tiny_gpt2(), "gpt2", true);
  check(*load_hf_tokenizer(kTiny + "/llama_style"), "llama_style", true);
  check(*load_hf_tokenizer(kTiny + "/gpt2_style/tokenizer.json"), "gpt2_style", false);
  // (decode gives the composed text: no round trip)
  check(*load_hf_tokenizer(kTiny + "/qwen_style"), "qwen_style", false);
  check(*load_hf_tokenizer(kTiny + "/starcoder_style"), "starcoder_style", true);
  check(*load_hf_tokenizer(kTiny + "/digit_runs_style"), "digit_runs_style", true);
  check(*load_hf_tokenizer(kTiny + "/cohere_style"), "cohere_style", false);  // (NFC's)
}

TEST(Bpe, DigitsPreTokenizerSplitsAtEveryNumericCharacter) {
  // HF's Digits splits at char::is_numeric: Unicode's Nd, Nl and No, not only ASCII (the
  // JavaScript reference above splits at \d, so its fixture holds ASCII digits only). Here
  // Arabic-Indic three and four (Nd), a Roman twelve (Nl), one half (No); a letter and CJK are not.
  const std::string three = "\xD9\xA3", four = "\xD9\xA4", twelve = "\xE2\x85\xAB",
                    half = "\xC2\xBD", world = "\xE4\xB8\x96";
  const auto each = load_hf_tokenizer(kTiny + "/starcoder_style");
  EXPECT_EQ(each->pre_tokenize("a" + three + four + twelve + half + "b" + world + "7"),
            (std::vector<std::string>{"a", three, four, twelve, half, "b" + world, "7"}));
  const auto runs = load_hf_tokenizer(kTiny + "/digit_runs_style");
  EXPECT_EQ(runs->pre_tokenize("a" + three + four + twelve + half + "b 12"),
            (std::vector<std::string>{"a", three + four + twelve + half, "b", " ", "12"}));
  // Before the ByteLevel step, GPT-2's pattern would have kept " 12" one piece; and "12" is a
  // merge that individual digits never reach.
  EXPECT_EQ(each->encode("12"),
            (std::vector<int32_t>{static_cast<int32_t>(each->token_to_id("1")),
                                  static_cast<int32_t>(each->token_to_id("2"))}));
  EXPECT_EQ(runs->encode("12"),
            (std::vector<int32_t>{static_cast<int32_t>(runs->token_to_id("12"))}));
  // Bytes that are not UTF-8 pass through as themselves.
  EXPECT_EQ(each->decode(each->encode("1\xFF"
                                      "2\xC3")),
            "1\xFF"
            "2\xC3");
}

TEST(Bpe, MergesMatchTheReferenceAlgorithm) {
  const auto tok = tiny_gpt2();
  const auto ref =
      test_ref::ReferenceBpe::from_gpt2_files(kTiny + "/encoder.json", kTiny + "/vocab.bpe");
  // Worked by hand: "a a" (rank 6) merges leftmost first, then "aa aa" (rank 7).
  const auto id = [&](const std::string& t) { return static_cast<int32_t>(tok->token_to_id(t)); };
  EXPECT_EQ(tok->bpe("aaaaa"), (std::vector<int32_t>{id("aaaa"), id("a")}));
  EXPECT_EQ(tok->bpe(" the"), (std::vector<int32_t>{id("\xC4\xA0the")}));
  EXPECT_EQ(tok->bpe("the"), (std::vector<int32_t>{id("t"), id("he")}));  // "h e" outranks "t h"
  // Random words over the letters the merges use, and random bytes.
  SplitMix64 rng(11);
  for (int trial = 0; trial < 3000; ++trial) {
    const std::string w = trial % 3 == 2 ? random_bytes(rng, 12)
                                         : random_bytes(rng, 24, "aaathheeing 123'sSworld\n!");
    const std::vector<int32_t> expect = ref.ids(w);
    ASSERT_EQ(tok->bpe(w), expect) << "word \"" << w << "\"";
    ASSERT_EQ(tok->bpe(w), expect) << "word \"" << w << "\" (cached)";
  }
  // A long word (beyond the cache) with many equal-rank candidates.
  const std::string long_word(3001, 'a');
  EXPECT_EQ(tok->bpe(long_word), ref.ids(long_word));
}

TEST(Bpe, RoundTripOfArbitraryBytes) {
  SplitMix64 rng(5);
  const auto gpt2 = tiny_gpt2();
  const auto llama = load_hf_tokenizer(kTiny + "/llama_style");
  for (int trial = 0; trial < 300; ++trial) {
    // Includes NUL, lone continuation bytes and truncated sequences: invalid UTF-8 is split into
    // its own pre-tokens and still encodes byte by byte.
    const std::string s = random_bytes(rng, 40);
    EXPECT_EQ(gpt2->decode(gpt2->encode(s)), s) << "trial " << trial;
    EXPECT_EQ(llama->decode(llama->encode(s)), s) << "trial " << trial;
  }
}

TEST(Bpe, AddedTokensAndSpecials) {
  const auto tok = load_hf_tokenizer(kTiny + "/llama_style");
  const int64_t eot = tok->token_to_id("<|eot|>"), eot2 = tok->token_to_id("<|eot|>!!"),
                sep = tok->token_to_id("<sep>");
  ASSERT_GE(eot, 0);
  EXPECT_EQ(tok->vocab_size(), eot + 3);
  EXPECT_TRUE(tok->is_special(eot));
  EXPECT_TRUE(tok->is_special(eot2));
  EXPECT_FALSE(tok->is_special(sep));
  EXPECT_FALSE(tok->is_special(tok->token_to_id("a")));
  EXPECT_EQ(tok->id_to_token(eot), "<|eot|>");
  EXPECT_EQ(tok->id_to_token(tok->token_to_id("\xC4\xA0the")), "\xC4\xA0the");
  EXPECT_EQ(tok->token_to_id("no such token"), -1);
  // No tokenizer_config.json: bos from the post-processor's template; no eos, no pad.
  EXPECT_EQ(tok->bos_id(), eot);
  EXPECT_EQ(tok->eos_id(), -1);
  EXPECT_EQ(tok->pad_id(), -1);
  // Longest match at a position; specials are skipped by decode, other added tokens are text.
  const std::vector<int32_t> ids = tok->encode("x<|eot|>!!<|eot|>!");
  EXPECT_EQ(ids, (std::vector<int32_t>{static_cast<int32_t>(tok->token_to_id("x")),
                                       static_cast<int32_t>(eot2), static_cast<int32_t>(eot),
                                       static_cast<int32_t>(tok->token_to_id("!"))}));
  EXPECT_EQ(tok->decode(ids), "x!");
  EXPECT_EQ(tok->decode(tok->encode("a <sep> b")), "a<sep>b");  // lstrip/rstrip ate the spaces
  EXPECT_CONTAINS(error_of([&] {
                    tok->decode({1, static_cast<int32_t>(tok->vocab_size())});
                  }),
                  "at position 1");
  EXPECT_THROW(tok->id_to_token(-1), Error);

  // tokenizer_config.json beside the file names bos/eos/pad (strings or AddedToken objects).
  const std::string dir = test::temp_dir("bpe");
  std::filesystem::copy_file(kTiny + "/llama_style/tokenizer.json", dir + "/tokenizer.json");
  write_file(dir, "tokenizer_config.json",
             R"({"bos_token": "<|eot|>", "eos_token": {"content": "<|eot|>!!"},
                 "pad_token": null})");
  const auto cfg = load_hf_tokenizer(dir);
  EXPECT_EQ(cfg->bos_id(), eot);
  EXPECT_EQ(cfg->eos_id(), eot2);
  EXPECT_EQ(cfg->pad_id(), -1);
  write_file(dir, "tokenizer_config.json", R"({"pad_token": "<nope>"})");
  EXPECT_CONTAINS(error_of([&] { load_hf_tokenizer(dir); }), "pad_token \"<nope>\"");
}

// A tokenizer_config.json that does not mention a special token leaves the tokenizer.json's own:
// GPT-2's on the Hub is {"model_max_length": 1024}, and beside it <|endoftext|> was neither eos nor
// bos, so no text or JSONL example could end. A token the config sets to null is none (Qwen2's
// bos_token), not the file's.
TEST(Bpe, AConfigThatDoesNotNameASpecialTokenKeepsTheFiles) {
  const std::string path = tiny_hf_variant([](json& j) {
    j["post_processor"] = nullptr;
    j["added_tokens"].push_back({{"id", 300}, {"content", "<|endoftext|>"}, {"special", true}});
  });
  const std::string dir = std::filesystem::path(path).parent_path().string();
  EXPECT_EQ(load_hf_tokenizer(dir)->eos_id(), 300);  // no config: <|endoftext|>
  write_file(dir, "tokenizer_config.json", R"({"model_max_length": 1024})");
  const auto gpt2 = load_hf_tokenizer(dir);
  EXPECT_EQ(gpt2->eos_id(), 300);
  EXPECT_EQ(gpt2->bos_id(), 300);
  EXPECT_EQ(gpt2->pad_id(), -1);
  write_file(dir, "tokenizer_config.json", R"({"bos_token": null, "eos_token": "<|eot|>"})");
  const auto qwen = load_hf_tokenizer(dir);
  EXPECT_EQ(qwen->bos_id(), -1);
  EXPECT_EQ(qwen->eos_id(), qwen->token_to_id("<|eot|>"));
}

TEST(Bpe, SingleWordAddedTokens) {
  // HF: a single_word token glued to a word character is ordinary text (not checked by the
  // JavaScript references, which ignore single_word). "ox" is no token of the vocabulary, so it
  // may have an id of its own.
  const std::string path = tiny_hf_variant([](json& j) {
    j["added_tokens"].push_back({{"id", 300},
                                 {"content", "ox"},
                                 {"single_word", true},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"special", false}});
  });
  const auto tok = load_hf_tokenizer(path);
  const auto plain = load_hf_tokenizer(kTiny + "/llama_style");
  std::vector<int32_t> split = {300};
  for (int32_t id : plain->encode(" said")) split.push_back(id);
  EXPECT_EQ(tok->encode("ox said"), split);
  EXPECT_EQ(tok->encode("fox"), plain->encode("fox"));                // 'f' before it
  EXPECT_EQ(tok->encode("oxen"), plain->encode("oxen"));              // 'e' after it
  EXPECT_EQ(tok->encode("\xC3\xA9ox"), plain->encode("\xC3\xA9ox"));  // é is a letter
  EXPECT_EQ(tok->encode("(ox)").size(), 3u);
  EXPECT_EQ(tok->encode("(ox)")[1], 300);
}

TEST(Bpe, PreTokenizerVariants) {
  // ByteLevel with add_prefix_space: every piece (here the whole section) gets a leading space.
  const auto g = load_hf_tokenizer(kTiny + "/gpt2_style");
  EXPECT_EQ(g->pre_tokenize("the end"), (std::vector<std::string>{" the", " end"}));
  EXPECT_EQ(g->pre_tokenize(" the"), (std::vector<std::string>{" the"}));
  // Split Removed drops the matches; with invert it keeps only them.
  const auto removed = load_hf_tokenizer(tiny_hf_variant([](json& j) {
    j["pre_tokenizer"]["pretokenizers"][0] = {
        {"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Removed"}};
  }));
  EXPECT_EQ(removed->pre_tokenize("a b  c"), (std::vector<std::string>{"a", "b", "c"}));
  const auto inverted = load_hf_tokenizer(tiny_hf_variant([](json& j) {
    j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Split"},
                                              {"pattern", {{"Regex", "\\p{N}+"}}},
                                              {"behavior", "Removed"},
                                              {"invert", true}};
  }));
  EXPECT_EQ(inverted->pre_tokenize("a12b345"), (std::vector<std::string>{"12", "345"}));
  // ignore_merges: " there" is a vocabulary token that no merge builds.
  const auto with = load_hf_tokenizer(kTiny + "/llama_style");
  const auto without =
      load_hf_tokenizer(tiny_hf_variant([](json& j) { j["model"]["ignore_merges"] = false; }));
  EXPECT_EQ(with->encode(" there"),
            (std::vector<int32_t>{static_cast<int32_t>(with->token_to_id("\xC4\xA0there"))}));
  EXPECT_EQ(without->encode(" there"),
            (std::vector<int32_t>{static_cast<int32_t>(with->token_to_id("\xC4\xA0the")),
                                  static_cast<int32_t>(with->token_to_id("re"))}));
}

TEST(Bpe, EncodeIsDeterministicAcrossThreads) {
  const auto tok = load_hf_tokenizer(kTiny + "/llama_style");
  SplitMix64 rng(9);
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i) texts.push_back(random_bytes(rng, 64, "the aaing 12!\n"));
  std::vector<std::vector<int32_t>> serial;
  for (const auto& t : texts) serial.push_back(tok->encode(t));
  std::vector<std::vector<std::vector<int32_t>>> got(4);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&, k] {
      for (const auto& t : texts) got[static_cast<size_t>(k)].push_back(tok->encode(t));
    });
  for (auto& t : threads) t.join();
  for (const auto& g : got) EXPECT_EQ(g, serial);
}

TEST(Tokenizer, PadCollides) {
  const ByteTokenizer byte;
  EXPECT_FALSE(pad_collides(byte, -1));   // no pad configured
  EXPECT_FALSE(pad_collides(byte, 256));  // its own pad
  EXPECT_TRUE(pad_collides(byte, 257));   // bos
  EXPECT_TRUE(pad_collides(byte, 258));   // eos
  EXPECT_TRUE(pad_collides(byte, 'A'));   // a byte of text
  EXPECT_FALSE(pad_collides(byte, 259));  // a new row past the vocabulary
  const auto tok = load_hf_tokenizer(kTiny + "/llama_style");
  EXPECT_TRUE(pad_collides(*tok, 0));                               // "!"
  EXPECT_TRUE(pad_collides(*tok, tok->bos_id()));                   // <|eot|> is bos here
  EXPECT_FALSE(pad_collides(*tok, tok->token_to_id("<|eot|>!!")));  // another special
  EXPECT_TRUE(pad_collides(*tok, tok->token_to_id("<sep>")));       // added, not special
  EXPECT_FALSE(pad_collides(*tok, tok->vocab_size()));
  // A hole in the ids names no token.
  const auto holes = load_hf_tokenizer(tiny_hf_variant([](json& j) {
    j["added_tokens"].push_back({{"id", 400}, {"content", "<pad>"}, {"special", true}});
  }));
  EXPECT_EQ(holes->vocab_size(), 401);
  EXPECT_EQ(holes->id_to_token(350), "");
  EXPECT_FALSE(pad_collides(*holes, 350));
  EXPECT_FALSE(pad_collides(*holes, 400));
  // Errors name the file and what is wrong, not keel's methods ("decode: id", "id_to_token: id").
  const std::string hole = error_of([&] { holes->decode({350}); });
  EXPECT_CONTAINS(hole, ": cannot decode id 350 at position 0");
  EXPECT_CONTAINS(error_of([&] { holes->id_to_token(401); }), ": no token has id 401");
  // A declared pad that ordinary text produces collides all the same.
  const std::string dir = test::temp_dir("bpe");
  std::filesystem::copy_file(kTiny + "/llama_style/tokenizer.json", dir + "/tokenizer.json");
  write_file(dir, "tokenizer_config.json", R"({"pad_token": "a", "eos_token": "<|eot|>!!"})");
  const auto declared = load_hf_tokenizer(dir);
  EXPECT_EQ(declared->pad_id(), declared->token_to_id("a"));
  EXPECT_TRUE(pad_collides(*declared, declared->pad_id()));
  EXPECT_TRUE(pad_collides(*declared, declared->eos_id()));  // pad = eos
}

TEST(Tokenizer, LoadTokenizerSpecs) {
  const auto byte = load_tokenizer("byte");
  EXPECT_EQ(byte->vocab_size(), 259);
  EXPECT_EQ(byte->token_to_id("a"), 'a');
  EXPECT_EQ(byte->token_to_id("<eos>"), 258);
  EXPECT_EQ(byte->id_to_token(257), "<bos>");
  EXPECT_EQ(byte->id_to_token('z'), "z");
  EXPECT_EQ(byte->token_to_id("ab"), -1);
  EXPECT_THROW(byte->id_to_token(259), Error);
  EXPECT_EQ(load_tokenizer("hf:" + kTiny + "/llama_style")->encode("the"),
            (std::vector<int32_t>{284}));
  EXPECT_EQ(load_tokenizer(kTiny + "/llama_style/tokenizer.json")->vocab_size(), 290);
  EXPECT_EQ(load_tokenizer(kTiny + "/gpt2_style")->encode("the"), (std::vector<int32_t>{258}));
  // GPT-2 directories: encoder.json + vocab.bpe, or HF's vocab.json + merges.txt.
  const std::string dir = test::temp_dir("bpe");
  std::filesystem::copy_file(kTiny + "/encoder.json", dir + "/vocab.json");
  std::filesystem::copy_file(kTiny + "/vocab.bpe", dir + "/merges.txt");
  EXPECT_EQ(load_tokenizer("gpt2:" + dir)->encode("aaaaa"), tiny_gpt2()->encode("aaaaa"));
  EXPECT_EQ(load_tokenizer(dir)->encode(" the"), (std::vector<int32_t>{258}));
  // Without <|endoftext|> in the vocabulary there is no bos/eos; GPT-2 has no pad.
  EXPECT_EQ(tiny_gpt2()->eos_id(), -1);
  EXPECT_EQ(tiny_gpt2()->pad_id(), -1);

  const auto usage = [](const std::string& spec) {
    try {
      load_tokenizer(spec);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind, Error::kUsage) << e.what();
      return std::string(e.what());
    }
    ADD_FAILURE() << spec << " accepted";
    return std::string();
  };
  EXPECT_CONTAINS(usage("gpt2"), "gpt2:DIR");
  EXPECT_CONTAINS(usage("gpt2:/no/such/dir"), "/no/such/dir");
  EXPECT_CONTAINS(usage("hf:/no/such/tokenizer.json"), "/no/such/tokenizer.json");
  EXPECT_CONTAINS(usage(test::temp_dir("bpe-empty")), "encoder.json");
}

// A file's token arrays are reserved from the tokens a byte of its first 64 KiB, not from the
// bound of one a byte: that bound asked for 4 bytes of address space a byte of text, which Linux
// refuses outright for a file of a quarter of the machine's memory.
TEST(Tokenizer, DatasetsReserveForTheTokensABpeTokenizerMakes) {
  const std::string dir = test::temp_dir("bpe-reserve");
  std::filesystem::copy_file(kTiny + "/llama_style/tokenizer.json", dir + "/tokenizer.json");
  write_file(dir, "tokenizer_config.json", R"({"eos_token": "<|eot|>"})");
  const auto tok = load_hf_tokenizer(dir);
  std::string text;
  while (text.size() < (1u << 20)) text += "the there the there\n\n";
  const std::string path = write_file(dir, "corpus.txt", text);
  const auto ds = load_text_dataset(path, *tok, 64, false);
  const auto* examples = dynamic_cast<const ExampleDataset*>(ds.get());
  ASSERT_NE(examples, nullptr);
  size_t tokens = 0;
  for (int64_t i = 0; i < ds->size(); ++i) tokens += ds->get(i).tokens.size();
  EXPECT_LT(tokens, text.size() / 2);  // the merges make fewer tokens than bytes
  EXPECT_GE(examples->token_capacity(), tokens);
  EXPECT_LT(examples->token_capacity(), 2 * tokens) << "reserved as if a token were a byte";
}

// The datasets take any Tokenizer: examples are the BPE ids followed by eos.
TEST(Tokenizer, DatasetsWithBpe) {
  const std::string dir = test::temp_dir("bpe");
  std::filesystem::copy_file(kTiny + "/llama_style/tokenizer.json", dir + "/tokenizer.json");
  const std::string data = write_file(dir, "data.jsonl",
                                      "{\"prompt\": \"the\", \"completion\": \" there\"}\n"
                                      "{\"text\": \"aaaaa!!\"}\n");
  // Without an eos the examples cannot end: an error naming the file.
  EXPECT_CONTAINS(error_of([&] { load_jsonl_dataset(data, *load_hf_tokenizer(dir), 16); }),
                  "data.jsonl: the tokenizer has no eos token");
  write_file(dir, "tokenizer_config.json", R"({"eos_token": "<|eot|>"})");
  const auto tok = load_hf_tokenizer(dir);
  const auto ds = load_jsonl_dataset(data, *tok, 16);
  ASSERT_EQ(ds->size(), 2);
  // Each text starts with the token the post-processor's template puts first (here <|eot|>, 287;
  // Llama-3's <|begin_of_text|>), as transformers' tokenizer(text) does.
  const auto prefix = static_cast<int32_t>(tok->prefix_id());
  ASSERT_EQ(prefix, 287);
  std::vector<int32_t> want = {prefix};
  for (int32_t id : tok->encode("the")) want.push_back(id);
  for (int32_t id : tok->encode(" there")) want.push_back(id);
  want.push_back(static_cast<int32_t>(tok->eos_id()));
  EXPECT_EQ(ds->get(0).copy().tokens, want);
  // prefix | "the" | " there" | eos
  EXPECT_EQ(ds->get(0).copy().target, (std::vector<uint8_t>{0, 0, 1, 1}));
  std::vector<int32_t> text = {prefix};
  for (int32_t id : tok->encode("aaaaa!!")) text.push_back(id);
  text.push_back(static_cast<int32_t>(tok->eos_id()));
  EXPECT_EQ(ds->get(1).copy().tokens, text);
  // Packed text needs no eos; the stream starts with the prefix.
  const std::string txt = write_file(dir, "data.txt", "the there the there");
  EXPECT_EQ(load_text_dataset(txt, *tok, 4, true)->get(0).copy().tokens,
            (std::vector<int32_t>{prefix, 284, 286, 258}));  // prefix, the, " there", " the"
  // A paragraph too.
  EXPECT_EQ(load_text_dataset(txt, *tok, 16, false)->get(0).copy().tokens,
            (std::vector<int32_t>{prefix, 284, 286, 258, 286, prefix}));  // ..., eos (287 too)
  // transformers' add_bos_token = false drops it; GPT-2's tokenizer adds none.
  write_file(dir, "tokenizer_config.json", R"({"eos_token": "<|eot|>", "add_bos_token": false})");
  const auto plain = load_hf_tokenizer(dir);
  EXPECT_EQ(plain->prefix_id(), -1);
  EXPECT_EQ(load_jsonl_dataset(data, *plain, 16)->get(1).copy().tokens.front(),
            tok->encode("aaaaa!!").front());
  EXPECT_EQ(load_hf_tokenizer(kTiny + "/gpt2_style")->prefix_id(), -1);
}

TEST(Tokenizer, LoaderErrorsNameTheFileAndPlace) {
  const std::string dir = test::temp_dir("bpe");
  const std::string enc = read_json(kTiny + "/encoder.json").dump();
  const std::string enc_path = write_file(dir, "encoder.json", enc);
  // A merge whose part is not in the vocabulary: named by file and line.
  const std::string bad_merge = write_file(dir, "bad.bpe", "#version: 0.2\na a\nq zz\n");
  EXPECT_CONTAINS(error_of([&] { load_gpt2_tokenizer_files(enc_path, bad_merge); }), "bad.bpe:3");
  const std::string bad_line = write_file(dir, "line.bpe", "#version: 0.2\na a\nabc\n");
  EXPECT_CONTAINS(error_of([&] { load_gpt2_tokenizer_files(enc_path, bad_line); }), "line.bpe:3");
  // Devices never end (read until the OOM killer stopped the run, before).
  EXPECT_CONTAINS(error_of([&] { load_gpt2_tokenizer_files(enc_path, "/dev/zero"); }),
                  "GPT-2 merges file /dev/zero is a character device, not a file; "
                  "data.tokenizer must name a file");
  EXPECT_CONTAINS(error_of([&] { load_hf_tokenizer("/dev/zero"); }),
                  "HF tokenizer file /dev/zero is a character device");
  // A vocabulary without all 256 byte symbols.
  json small = read_json(kTiny + "/encoder.json");
  small.erase("\xC4\xA0");
  EXPECT_CONTAINS(error_of([&] {
                    load_gpt2_tokenizer_files(write_file(dir, "small.json", small.dump()),
                                              kTiny + "/vocab.bpe");
                  }),
                  "byte 0x20");
  EXPECT_CONTAINS(error_of([&] {
                    load_gpt2_tokenizer_files(write_file(dir, "broken.json", "{\"a\": "),
                                              kTiny + "/vocab.bpe");
                  }),
                  "broken.json: not valid JSON");
  const std::string overflow = error_of([&] {
    load_gpt2_tokenizer_files(write_file(dir, "big.json", "{\"a\": 1e400}"), kTiny + "/vocab.bpe");
  });
  EXPECT_CONTAINS(overflow, "big.json: not valid JSON: number overflow");
  EXPECT_EQ(overflow.find("json.exception"), std::string::npos) << overflow;

  const auto hf_error = [&](const std::function<void(json&)>& edit) {
    return error_of([&] { load_hf_tokenizer(tiny_hf_variant(edit)); });
  };
  EXPECT_CONTAINS(hf_error([](json& j) { j["model"]["type"] = "WordPiece"; }),
                  "model.type: \"WordPiece\" is not supported");
  EXPECT_CONTAINS(hf_error([](json& j) {
                    j["normalizer"] = {{"type", "NFKC"}};
                  }),
                  "normalizer: the NFKC normalizer is not supported (keel reads null, NFC, or");
  EXPECT_CONTAINS(hf_error([](json& j) { j["model"]["merges"][3] = "abc"; }), "model.merges[3]");
  EXPECT_CONTAINS(hf_error([](json& j) {
                    j["model"]["merges"][2] = json::array({"q", "zz"});
                  }),
                  "model.merges[2]: the merge \"q zz\" uses \"zz\"");
  EXPECT_CONTAINS(hf_error([](json& j) { j["model"]["byte_fallback"] = true; }), "byte_fallback");
  EXPECT_CONTAINS(hf_error([](json& j) { j["pre_tokenizer"] = nullptr; }), "no ByteLevel step");
  EXPECT_CONTAINS(hf_error([](json& j) {
                    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
                  }),
                  "pre_tokenizer.pretokenizers[0].pattern");
  EXPECT_CONTAINS(hf_error([](json& j) {
                    j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithNext";
                  }),
                  "behavior: \"MergedWithNext\"");
  EXPECT_CONTAINS(
      hf_error([](json& j) {
        j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Metaspace"}, {"split", false}};
      }),
      "a ByteLevel step in a SentencePiece-style file");
  EXPECT_CONTAINS(hf_error([](json& j) {
                    j["pre_tokenizer"]["pretokenizers"].push_back(
                        {{"type", "Digits"}, {"individual_digits", true}});
                  }),
                  "pre_tokenizer.pretokenizers[2]: a Digits step after the ByteLevel "
                  "pre-tokenizer is not supported");
  EXPECT_CONTAINS(
      hf_error([](json& j) {
        j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Digits"}, {"individual_digits", "yes"}};
      }),
      "pre_tokenizer.pretokenizers[0].individual_digits: expected true or false");
  EXPECT_CONTAINS(hf_error([](json& j) {
                    j["normalizer"] = {
                        {"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}};
                    j["pre_tokenizer"] = {{"type", "Digits"}, {"individual_digits", true}};
                  }),
                  "pre_tokenizer: a Split or Digits step in a SentencePiece-style file");
  EXPECT_CONTAINS(hf_error([](json& j) { j["decoder"] = {{"type", "Metaspace"}}; }), "decoder");
  EXPECT_CONTAINS(hf_error([](json& j) { j["added_tokens"][0]["id"] = "x"; }),
                  "added_tokens[0].id");
  // A post-processor's "type" that is no string was nlohmann's raw "[json.exception.type_error.302]
  // type must be string, but is number".
  std::string m = hf_error([](json& j) { j["post_processor"]["type"] = 5; });
  EXPECT_CONTAINS(m, "tokenizer.json: post_processor.type: expected a string");
  EXPECT_NOT_CONTAINS(m, "json.exception");
  m = hf_error([](json& j) {
    j["post_processor"] = {{"type", "Sequence"},
                           {"processors", json::array({j["post_processor"], {{"type", true}}})}};
  });
  EXPECT_CONTAINS(m, "tokenizer.json: post_processor.processors[1].type: expected a string");
  EXPECT_NOT_CONTAINS(m, "json.exception");
  // A template naming a special token the file does not have left bos unset without a word.
  m = hf_error(
      [](json& j) { j["post_processor"]["single"][0]["SpecialToken"]["id"] = "<|no_such|>"; });
  EXPECT_CONTAINS(m,
                  "tokenizer.json: post_processor.single[0].SpecialToken.id: \"<|no_such|>\" "
                  "is not a token of the file");
}

// Ids come from the file: one above int32 is an error (never truncated: 2^40 + 258 is not 258),
// and the id table is bounded by the entries the file defines (an id of 2^31 - 1 is an error,
// not a 16 GB table).
TEST(Tokenizer, TokenIdsAreBoundedAndNeverTruncated) {
  const std::string dir = test::temp_dir("bpe-ids");
  json enc = read_json(kTiny + "/encoder.json");
  const std::string tok = enc.begin().key();
  enc[tok] = (int64_t{1} << 40) + 258;
  std::string m = error_of([&] {
    load_gpt2_tokenizer_files(write_file(dir, "big.json", enc.dump()), kTiny + "/vocab.bpe");
  });
  EXPECT_CONTAINS(m, dir + "/big.json");
  EXPECT_CONTAINS(m, "1099511628034");
  EXPECT_CONTAINS(m, "outside 0 to 2147483647");
  enc[tok] = 2147483647;
  m = error_of([&] {
    load_gpt2_tokenizer_files(write_file(dir, "sparse.json", enc.dump()), kTiny + "/vocab.bpe");
  });
  EXPECT_CONTAINS(m, "sparse.json");
  EXPECT_CONTAINS(m, "id 2147483647 is beyond the");
  const auto hf_error = [&](const std::function<void(json&)>& edit) {
    return error_of([&] { load_hf_tokenizer(tiny_hf_variant(edit)); });
  };
  EXPECT_CONTAINS(hf_error([](json& j) { j["added_tokens"][0]["id"] = (int64_t{1} << 40) + 258; }),
                  "added_tokens[0].id: the id 1099511628034 is outside 0 to 2147483647");
  EXPECT_CONTAINS(hf_error([](json& j) { j["model"]["vocab"].begin().value() = -1; }),
                  "outside 0 to 2147483647");
  EXPECT_CONTAINS(hf_error([](json& j) { j["model"]["vocab"].begin().value() = 1u << 30; }),
                  "id 1073741824 is beyond the");
  // Gaps of reserved ids are fine.
  EXPECT_NO_THROW(
      load_hf_tokenizer(tiny_hf_variant([](json& j) { j["added_tokens"][0]["id"] = 60000; })));
}

// One id, one token. An added token on a vocabulary id made the id decode as the added content
// ("a" encoded as 64 and decoded as "<sep>"); an added token spelling a
// vocabulary token under another id encoded it to the added id (HF keeps the vocabulary's).
TEST(Tokenizer, AnAddedTokenSharingAnIdOrAContentWithAnotherIsRefused) {
  const auto hf_error = [&](const std::function<void(json&)>& edit) {
    return error_of([&] { load_hf_tokenizer(tiny_hf_variant(edit)); });
  };
  const json tiny = read_json(kTiny + "/llama_style/tokenizer.json");
  const int64_t a_id = tiny["model"]["vocab"]["a"].get<int64_t>();
  ASSERT_EQ(tiny["added_tokens"][2]["content"], "<sep>");
  std::string m = hf_error([&](json& j) { j["added_tokens"][2]["id"] = a_id; });
  EXPECT_CONTAINS(m, "tokenizer.json: added token \"<sep>\" has id " + std::to_string(a_id) +
                         ", which is already the token \"a\"'s");
  m = hf_error([&](json& j) { j["added_tokens"][2]["content"] = "a"; });
  EXPECT_CONTAINS(m, "tokenizer.json: added token \"a\" has id 289, but the token is already id " +
                         std::to_string(a_id));
  // Two added tokens on one id.
  m = hf_error([&](json& j) { j["added_tokens"][2]["id"] = 287; });
  EXPECT_CONTAINS(m, "added token \"<sep>\" has id 287, which is already the token \"<|eot|>\"'s");
  // An added token that is the vocabulary's own token under its own id (GPT-2's <|endoftext|>) is
  // fine.
  EXPECT_NO_THROW(load_hf_tokenizer(tiny_hf_variant([&](json& j) {
    j["added_tokens"].push_back({{"id", a_id}, {"content", "a"}, {"special", false}});
  })));
}

}  // namespace
}  // namespace keel::data
