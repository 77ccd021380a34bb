// SentencePiece-style BPE in HF tokenizer.json (Llama-2, Mistral, TinyLlama, Gemma): the ids and
// the text the reference tokenizers give for the offline fixture (tokenizer_parity/gen_tiny_sp.js:
// Llama-2's legacy normalizer, transformers' Metaspace pre-tokenizer, no byte fallback, Gemma's
// Replace normalizer and Split(" ")), a
// continuation encoded as the middle of a text, and every unsupported form named at load.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "keel/data/dataset.h"
#include "keel/data/hf_tokenizer.h"
#include "keel/data/text_pieces.h"
#include "tests/support/check.h"

namespace keel::data {
namespace {

using nlohmann::json;

const std::string kSpTiny = std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";

json read_sp_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

class SentencePieceFixture : public ::testing::TestWithParam<const char*> {};

TEST_P(SentencePieceFixture, IdsAndTextAreTheReferences) {
  const std::string name = GetParam();
  const json expected = read_sp_json(kSpTiny + "/sp_expected.json").at(name);
  const auto tok = load_hf_tokenizer(kSpTiny + "/" + name + "/tokenizer.json");
  EXPECT_EQ(tok->prefix_id(), 1);  // <s>, the post-processor's
  const auto strings = expected.at("strings").get<std::vector<std::string>>();
  const auto ids = expected.at("ids").get<std::vector<std::vector<int32_t>>>();
  const auto decoded = expected.at("decoded").get<std::vector<std::string>>();
  ASSERT_EQ(strings.size(), ids.size());
  for (size_t i = 0; i < strings.size(); ++i) {
    EXPECT_EQ(tok->encode(strings[i]), ids[i]) << name << ": \"" << strings[i] << "\"";
    EXPECT_EQ(tok->decode(ids[i]), decoded[i]) << name << ": \"" << strings[i] << "\"";
  }
}

// (sp_metaspace_split and sp_metaspace_old: Metaspace's split, each piece from a "▁" to the next
// merged alone; references of gen_tiny_sp.js, whose JavaScript tokenizers ignore split: it runs
// their BPE piece by piece, and checks that emulation against them without split.)
INSTANTIATE_TEST_SUITE_P(Tiny, SentencePieceFixture,
                         ::testing::Values("sp_legacy", "sp_metaspace", "sp_unk", "sp_gemma",
                                           "sp_metaspace_split", "sp_metaspace_old"));

// A continuation gets no "▁" of its own: a completion after its prompt, a piece after a newline,
// tokenize as the middle of the whole text, as HF encodes the two joined.
TEST(SentencePiece, AContinuationIsEncodedAsTheMiddleOfAText) {
  for (const char* name : {"sp_legacy", "sp_metaspace", "sp_metaspace_split"}) {
    const auto tok = load_hf_tokenizer(kSpTiny + "/" + name + "/tokenizer.json");
    for (const auto& [head, tail] : std::vector<std::pair<std::string, std::string>>{
             {"the\n", "there is"}, {"is the", " there"}, {"there\n", " the"}}) {
      std::vector<int32_t> apart = tok->encode(head);
      const std::vector<int32_t> rest = tok->encode_continuation(tail);
      apart.insert(apart.end(), rest.begin(), rest.end());
      EXPECT_EQ(apart, tok->encode(head + tail))
          << name << ": \"" << head << "\" + \"" << tail << "\"";
    }
    // encode() of the tail alone starts it with the "▁" of a text.
    EXPECT_NE(tok->encode("there"), tok->encode_continuation("there")) << name;
    // A text cut into pieces at its newlines encodes as the text whole (keel tokenize --output).
    const std::string text = "the there\nis the\nthere is\n";
    std::istringstream in(text);
    std::vector<int32_t> pieces;
    encode_in_pieces(*tok, in, 4, [&](std::span<const int32_t> ids) {
      pieces.insert(pieces.end(), ids.begin(), ids.end());
    });
    EXPECT_EQ(pieces, tok->encode(text)) << name;
  }
}

// A prompt-completion line trains on the completion's tokens as they are in the joined text.
TEST(SentencePiece, ACompletionTokenizesAsInThePromptAndCompletionJoined) {
  // Llama-2's tokenizer.json names no eos: its tokenizer_config.json does.
  const std::string dir = test::temp_dir("sp-jsonl");
  std::filesystem::copy_file(kSpTiny + "/sp_legacy/tokenizer.json", dir + "/tokenizer.json");
  std::ofstream(dir + "/tokenizer_config.json") << R"({"bos_token": "<s>", "eos_token": "</s>"})";
  const auto tok = load_hf_tokenizer(dir);
  EXPECT_EQ(tok->eos_id(), 2);
  const std::string path = dir + "/pc.jsonl";
  std::ofstream(path) << R"({"prompt": "is the", "completion": " there"})"
                      << "\n";
  const Example e = load_jsonl_dataset(path, *tok, 64)->get(0).copy();
  std::vector<int32_t> joined = {static_cast<int32_t>(tok->prefix_id())};
  for (int32_t id : tok->encode("is the there")) joined.push_back(id);
  joined.push_back(static_cast<int32_t>(tok->eos_id()));
  EXPECT_EQ(e.tokens, joined);
}

TEST(SentencePiece, UnsupportedFormsAreNamedAtLoad) {
  const json base = read_sp_json(kSpTiny + "/sp_metaspace/tokenizer.json");
  auto error = [&](const std::function<void(json&)>& edit) {
    json j = base;
    edit(j);
    const std::string dir = test::temp_dir("sp-bad");
    std::ofstream(dir + "/tokenizer.json") << j.dump();
    return test::error_of([&] { load_hf_tokenizer(dir + "/tokenizer.json"); });
  };
  EXPECT_CONTAINS(error([](json& j) { j["pre_tokenizer"]["split"] = "yes"; }),
                  "pre_tokenizer.split");
  // A Split that would cut the words keel merges: after a Replace normalizer (only Gemma's
  // Split(" ") is read, finding no space there), or before the Metaspace step (never run).
  const json split_digits = {{"type", "Split"},
                             {"pattern", {{"Regex", "\\d"}}},
                             {"behavior", "Isolated"},
                             {"invert", false}};
  EXPECT_CONTAINS(error([&](json& j) {
                    j["normalizer"] = {
                        {"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}};
                    j["pre_tokenizer"] = split_digits;
                  }),
                  "pre_tokenizer: a Split in a SentencePiece-style file");
  EXPECT_CONTAINS(error([&](json& j) {  // Gemma's Split, inverted: not the no-op it is otherwise
                    j["normalizer"] = {
                        {"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}};
                    j["pre_tokenizer"] = {{"type", "Split"},
                                          {"pattern", {{"String", " "}}},
                                          {"behavior", "MergedWithPrevious"},
                                          {"invert", true}};
                  }),
                  "pre_tokenizer: a Split in a SentencePiece-style file");
  EXPECT_CONTAINS(error([&](json& j) {
                    j["pre_tokenizer"] = {{"type", "Sequence"},
                                          {"pretokenizers", {split_digits, j["pre_tokenizer"]}}};
                  }),
                  "pre_tokenizer: a Split or Digits step in a SentencePiece-style file");
  EXPECT_CONTAINS(error([](json& j) { j["pre_tokenizer"]["prepend_scheme"] = "sometimes"; }),
                  "pre_tokenizer.prepend_scheme: \"sometimes\" is not first, always or never");
  EXPECT_CONTAINS(error([](json& j) { j["pre_tokenizer"]["replacement"] = "_"; }),
                  "pre_tokenizer.replacement: only \"\u2581\"");
  EXPECT_CONTAINS(error([](json& j) {
                    j["decoder"]["decoders"][0] = {{"type", "WordPiece"}};
                  }),
                  "decoder.decoders[0]: the WordPiece decoder is not supported");
  EXPECT_CONTAINS(error([](json& j) {
                    j["decoder"]["decoders"] = json::array(
                        {{{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}});
                  }),
                  "only Strip(\" \", start, 0) after Fuse is supported");
  EXPECT_CONTAINS(error([](json& j) { j["model"]["unk_token"] = "<nope>"; }),
                  "model.unk_token: \"<nope>\" is not a token of the file");
  EXPECT_CONTAINS(error([](json& j) {
                    j["normalizer"] = {{"type", "NFKC"}};
                  }),
                  "normalizer: the NFKC normalizer is not supported");
  EXPECT_CONTAINS(error([](json& j) {
                    j["pre_tokenizer"] = nullptr;
                    j["normalizer"] = {{"type", "Prepend"}, {"prepend", "\u2581"}};
                  }),
                  "without Replace");
  // No byte fallback and no unknown token: a character outside the vocabulary is an error
  // naming it, not a token dropped in silence (HF drops it).
  json none = base;
  none["model"]["byte_fallback"] = false;
  none["model"]["unk_token"] = nullptr;
  const std::string dir = test::temp_dir("sp-none");
  std::ofstream(dir + "/tokenizer.json") << none.dump();
  const auto tok = load_hf_tokenizer(dir + "/tokenizer.json");
  EXPECT_EQ(tok->encode("the"), (std::vector<int32_t>{284}));
  EXPECT_CONTAINS(test::error_of([&] { tok->encode("the z"); }),
                  "the character \"z\" (U+007A) is not in the vocabulary");
}

}  // namespace
}  // namespace keel::data
