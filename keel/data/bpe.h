// BPE, the machinery shared by GPT-2's tokenizer (gpt2_tokenizer.h) and HF tokenizer.json BPE
// (hf_tokenizer.h). Byte-level BPE (GPT-2, Llama-3, Qwen2):
//   1. added tokens (specials such as <|endoftext|>) are cut out of the text first;
//   2. the rest is split into pre-tokens by regexes (PCRE2 in UTF + UCP mode, so \p{L}, \p{N},
//      (?i:...) and look-ahead behave as in the Python `regex` / Oniguruma engines the patterns
//      were written for);
//   3. each pre-token's bytes become symbols of GPT-2's byte-to-unicode alphabet and are merged by
//      rank (lowest rank first, leftmost first among equal ranks), as HF tokenizers does.
// Decoding maps each token back to its bytes, so decode(encode(s)) == s for any bytes.
// SentencePiece-style BPE (Llama-2, Mistral, TinyLlama: Metaspace below) instead merges the
// characters of each section of text with its spaces spelled "▁" and a "▁" put before it, and
// spells a character outside the vocabulary as its UTF-8 bytes (<0x0A>) or the unknown token.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "keel/data/tokenizer_base.h"

namespace keel::data {

// GPT-2's pre-tokenizer pattern (openai/gpt-2 encoder.py; HF ByteLevel with use_regex).
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode: the code point that stands for byte b in a byte-level vocabulary
// (printable Latin-1 bytes stand for themselves; the others map to 256 + n in byte order).
uint32_t byte_to_codepoint(uint8_t b);
// The byte-level spelling of raw bytes: " the" -> "Ġthe" (UTF-8).
std::string bytes_to_byte_level(std::string_view bytes);
// The inverse; false when `token` holds a character outside the byte-level alphabet (or is not
// valid UTF-8).
bool byte_level_to_bytes(std::string_view token, std::string* bytes);

// A compiled PCRE2 pattern for splitting text. UTF + UCP mode; invalid UTF-8 in the subject is
// tolerated (it never matches, so it stays in the gaps between matches).
class SplitRegex {
 public:
  // literal = true: `pattern` is a plain string to find (HF's {"String": ...} patterns).
  // A pattern PCRE2 rejects is an Error naming `where`, the offset and PCRE2's message.
  SplitRegex(const std::string& pattern, bool literal, const std::string& where);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  // The non-empty matches of the pattern in `text`, as [begin, end) byte offsets, left to right
  // (the scan resumes at the end of each match, as JavaScript's matchAll and Python's finditer).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;
  // Whether the pattern matches somewhere in text.
  bool search(std::string_view text) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*
  std::string where_;
};

// One step of the pre-tokenizer, applied to every piece the previous steps produced.
struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel };
  Kind kind = Kind::kSplit;
  // kSplit: pieces are the matches and the gaps between them (HF behavior "Isolated"), or the
  // gaps only ("Removed"); `invert` swaps the roles of matches and gaps.
  // kByteLevel: optionally prepend a space, then (use_regex) split by GPT-2's pattern, Isolated.
  std::shared_ptr<const SplitRegex> regex;  // null for a kByteLevel step without use_regex
  bool removed = false;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel only
};

// A token matched in the raw text before pre-tokenization (HF added_tokens).
struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false;
  bool lstrip = false, rstrip = false;  // swallow the whitespace on that side
  bool single_word = false;             // only when not inside a word
};

// SentencePiece-style BPE as an HF tokenizer.json writes it (Llama-2's normalizer Prepend("▁") +
// Replace(" ", "▁"), or transformers' legacy=false Metaspace pre-tokenizer), and its decoder.
// A section is the text between two added tokens.
struct Metaspace {
  bool on = false;  // off: byte-level BPE
  // Where a "▁" goes before a section: kEvery before every one (the Prepend normalizer), kAlways
  // before every one that does not start with "▁" already (Metaspace "always"), kFirst so before
  // the text's first section only (Metaspace "first"), kNever nowhere. A continuation
  // (encode_continuation) puts none before its first section.
  enum class Prepend { kNever, kFirst, kAlways, kEvery } prepend = Prepend::kNever;
  // Metaspace's split (tokenizers' default; transformers writes false for Llama and Mistral):
  // the section is cut before every "▁" and each piece merged alone, so that no token spans one
  // ("▁▁" then never forms: "  x" is "▁", "▁x").
  bool split = false;
  bool byte_fallback = false;  // an unknown character is its UTF-8 bytes as <0xNN> tokens...
  int64_t unk_id = -1;         // ...else the unknown token (-1: none, an encode error)
  bool fuse_unk = false;       // consecutive unknown characters are one unknown token
  // The decoder: "▁" decodes as a space and <0xNN> as its byte (decode_bytes: ByteFallback);
  // the first token's "▁" are dropped (Metaspace's decoder) or the text's first strip_leading
  // spaces (Strip, after Fuse: Llama-2's 1).
  bool decode_metaspace = false, decode_bytes = false, drop_first_metaspace = false;
  int strip_leading = 0;
};

// Everything a BPE tokenizer is made of; the loaders fill it from their files.
struct BpeSpec {
  std::string source;                                       // names the files in error messages
  std::vector<std::pair<std::string, int32_t>> vocab;       // byte-level spellings -> ids
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order (rank = index)
  std::vector<std::string> merge_places;  // where merge i was read ("vocab.bpe:12"), for errors
  bool ignore_merges = false;  // a pre-token that is itself a vocabulary token is not merged
  // The NFC normalizer (Qwen2's tokenizer.json): each section in Unicode's composed form before
  // it is pre-tokenized (unicode_nfc.h).
  bool nfc = false;
  std::vector<PreTokenizerStep> pre_tokenizer;
  Metaspace metaspace;
  std::vector<AddedToken> added_tokens;
  int64_t bos_id = -1, eos_id = -1, pad_id = -1;
  int64_t prefix_id = -1;                  // Tokenizer::prefix_id
  std::shared_ptr<const ChatFormat> chat;  // Tokenizer::chat_format; null for none
};

// A token id read from a JSON file: an integer in [0, 2^31 - 1] (ids are int32 in batches); a
// larger or non-integer id is an Error naming `where`, never truncated.
int32_t token_id_from_json(const nlohmann::json& v, const std::string& where);

// The whole file at `path`; `what` names it in the error when it is missing or unreadable, `key`
// the setting or flag that named it.
std::string read_tokenizer_file(const std::string& path, const std::string& what,
                                const std::string& key = "data.tokenizer");

class BpeTokenizer : public Tokenizer {
 public:
  // Checks the spec: every merge's parts and result are vocabulary tokens, all 256 byte symbols
  // are in the vocabulary, ids are non-negative and unique per spelling. Errors name spec.source
  // and the offending entry.
  explicit BpeTokenizer(BpeSpec spec);
  ~BpeTokenizer() override;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::vector<int32_t> encode_continuation(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t pad_id() const override { return pad_id_; }
  int64_t bos_id() const override { return bos_id_; }
  int64_t eos_id() const override { return eos_id_; }
  bool is_special(int64_t id) const override;
  int64_t prefix_id() const override { return prefix_id_; }
  const ChatFormat* chat_format() const override { return chat_.get(); }
  int64_t token_to_id(std::string_view token) const override;
  std::string id_to_token(int64_t id) const override;

  // The pre-tokens of `text` (added tokens excluded), for tests and diagnostics.
  std::vector<std::string> pre_tokenize(std::string_view text) const;
  // The ids of one pre-token given as raw bytes (BPE merges only).
  std::vector<int32_t> bpe(std::string_view bytes) const;

 private:
  std::vector<int32_t> encode_text(std::string_view text, bool continuation) const;
  // Where a section of text (no added token in it) stands: what goes before it depends on it.
  enum class SectionAt { kTextStart, kAfterAddedToken, kContinuing };
  void encode_section(std::string_view section, SectionAt at, std::vector<int32_t>* out) const;
  void pre_tokenize_into(std::string_view text, bool prefix_space,
                         std::vector<std::string>* pieces) const;
  void bpe_into(std::string_view bytes, std::vector<int32_t>* out) const;
  // Metaspace: the ids of a normalized section ("▁the▁there"): its characters, merged.
  void metaspace_bpe_into(std::string_view normalized, std::vector<int32_t>* out) const;
  // Merges `symbols` (ids) by rank, in place.
  void merge(std::vector<int32_t>* symbols) const;
  // The merged ids of `key` from the cache, or compute(ids) stored under it.
  template <class Compute>
  void cached(std::string_view key, std::vector<int32_t>* out, Compute&& compute) const;

  std::string source_;
  int64_t vocab_size_ = 0, bos_id_ = -1, eos_id_ = -1, pad_id_ = -1, prefix_id_ = -1;
  bool ignore_merges_ = false;
  bool nfc_ = false;
  std::shared_ptr<const ChatFormat> chat_;
  std::vector<PreTokenizerStep> pre_tokenizer_;
  std::vector<AddedToken> added_;
  std::vector<std::vector<int32_t>>
      added_by_first_byte_;                // [256] indices into added_, longest first
  std::unique_ptr<SplitRegex> word_char_;  // \w on one character (single_word checks)

  Metaspace metaspace_;
  bool metaspace_words_ = false;  // no token holds "▁" after another character (encode_section)
  int32_t byte_id_[256] = {};     // id of each single-byte symbol (Metaspace: of <0xNN>, or -1)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (left, right) -> (rank, id)
  std::unordered_map<std::string, int32_t> bytes_to_id_;  // raw bytes of vocab tokens -> id
  std::unordered_map<std::string, int32_t> token_to_id_;  // spellings (and added contents) -> id
  std::vector<std::string> id_token_;                     // [vocab_size] spelling ("" = hole)
  std::vector<std::string> id_bytes_;                     // [vocab_size] decoded bytes
  std::vector<uint8_t> id_kind_;                          // [vocab_size] 0 hole, 1 token, 2 special

  // Merge results of recent pre-tokens (as HF and GPT-2 keep): bounded, guarded for encode()
  // calls from several threads.
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace keel::data
