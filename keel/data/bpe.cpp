#include "keel/data/bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <queue>

#include <nlohmann/json.hpp>

#include "keel/data/unicode_nfc.h"
#include "keel/data/utf8.h"
#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"

namespace keel::data {

namespace {

// Unicode White_Space (Rust's char::is_whitespace, which HF uses for lstrip/rstrip).
bool is_unicode_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Start of the UTF-8 character that ends at s[end - 1] (end > 0).
size_t char_start_before(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && end - i < 4 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // "▁" (U+2581)

// The byte-fallback token of byte b: "<0x0A>" (HF's format!("<{b:#04X}>")).
std::string byte_fallback_token(uint8_t b) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "<0x%02X>", b);
  return buf;
}

// `s` with every "▁" replaced by `with`.
std::string replace_metaspace(std::string_view s, std::string_view with) {
  std::string out;
  size_t at = 0;
  for (size_t hit; (hit = s.find(kMetaspace, at)) != std::string_view::npos;
       at = hit + kMetaspace.size())
    out.append(s.substr(at, hit - at)).append(with);
  return out.append(s.substr(at));
}

struct ByteAlphabet {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 512> to_byte{};  // code point -> byte, -1 when not in the alphabet
  ByteAlphabet() {
    to_byte.fill(-1);
    uint32_t n = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_cp[b] = printable ? b : 256 + n++;
      to_byte[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

std::string dq(std::string_view s) { return "\"" + std::string(s) + "\""; }

}  // namespace

uint32_t byte_to_codepoint(uint8_t b) { return alphabet().to_cp[b]; }

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) append_utf8(alphabet().to_cp[static_cast<unsigned char>(c)], &out);
  return out;
}

bool byte_level_to_bytes(std::string_view token, std::string* bytes) {
  bytes->clear();
  for (size_t i = 0; i < token.size();) {
    uint32_t cp = 0;
    const size_t len = decode_utf8(token, i, &cp);
    if (len == 0 || cp >= 512 || alphabet().to_byte[cp] < 0) return false;
    bytes->push_back(static_cast<char>(alphabet().to_byte[cp]));
    i += len;
  }
  return true;
}

std::string read_tokenizer_file(const std::string& path, const std::string& what,
                                const std::string& key) {
  return read_input_file(path, what, key);
}

// ---- SplitRegex

SplitRegex::SplitRegex(const std::string& pattern, bool literal, const std::string& where)
    : where_(where) {
  // PCRE2_MATCH_INVALID_UTF: text with invalid UTF-8 is still split (the bad bytes never match
  // and end up in gaps) instead of failing. PCRE2_LITERAL does not combine with UCP.
  uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
  opts |= literal ? PCRE2_LITERAL : PCRE2_UCP;
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts,
                                 &err, &offset, nullptr);
  if (!re)
    throw Error(where + ": the pattern " + dq(pattern) + " does not compile at offset " +
                std::to_string(offset) + ": " + pcre2_message(err) +
                " (PCRE2 syntax, UTF and UCP mode)");
  pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // when JIT is unavailable the interpreter runs
  code_ = re;
}

SplitRegex::~SplitRegex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

std::vector<std::pair<size_t, size_t>> SplitRegex::find_all(std::string_view text) const {
  auto* re = static_cast<pcre2_code*>(code_);
  std::vector<std::pair<size_t, size_t>> out;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
  if (!md) throw Error(where_ + ": out of memory for PCRE2 match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t n = text.size();
  size_t start = 0;
  while (start <= n) {
    const int rc = pcre2_match(re, subject, n, start, 0, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(md);
      throw Error(where_ + ": PCRE2 failed on a text of " + std::to_string(n) +
                  " bytes at offset " + std::to_string(start) + ": " + pcre2_message(rc));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    if (ov[1] > ov[0]) {
      out.emplace_back(ov[0], ov[1]);
      start = ov[1];
    } else {  // an empty match: move on by one character, as matchAll/finditer do
      start = ov[0] + 1;
      while (start < n && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) ++start;
    }
  }
  pcre2_match_data_free(md);
  return out;
}

bool SplitRegex::search(std::string_view text) const {
  auto* re = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
  if (!md) throw Error(where_ + ": out of memory for PCRE2 match data");
  const int rc =
      pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0, 0, md, nullptr);
  pcre2_match_data_free(md);
  if (rc < 0 && rc != PCRE2_ERROR_NOMATCH)
    throw Error(where_ + ": PCRE2 failed: " + pcre2_message(rc));
  return rc >= 0;
}

// ---- BpeTokenizer

int32_t token_id_from_json(const nlohmann::json& v, const std::string& where) {
  if (!v.is_number_integer()) throw Error(where + ": the id " + v.dump() + " is not an integer");
  if (v.is_number_unsigned() ? v.get<uint64_t>() > INT32_MAX
                             : (v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX))
    throw Error(where + ": the id " + v.dump() + " is outside 0 to 2147483647 (2^31 - 1)");
  return static_cast<int32_t>(v.get<int64_t>());
}

BpeTokenizer::BpeTokenizer(BpeSpec spec)
    : source_(std::move(spec.source)),
      bos_id_(spec.bos_id),
      eos_id_(spec.eos_id),
      pad_id_(spec.pad_id),
      prefix_id_(spec.prefix_id),
      ignore_merges_(spec.ignore_merges),
      nfc_(spec.nfc),
      chat_(std::move(spec.chat)),
      pre_tokenizer_(std::move(spec.pre_tokenizer)),
      added_(std::move(spec.added_tokens)),
      metaspace_(spec.metaspace) {
  int64_t max_id = -1;
  for (const auto& [tok, id] : spec.vocab) {
    if (id < 0)
      throw Error(source_ + ": vocabulary token " + dq(tok) + " has a negative id " +
                  std::to_string(id));
    max_id = std::max<int64_t>(max_id, id);
  }
  for (const AddedToken& a : added_) {
    if (a.id < 0)
      throw Error(source_ + ": added token " + dq(a.content) + " has a negative id " +
                  std::to_string(a.id));
    if (a.content.empty())
      throw Error(source_ + ": added token " + std::to_string(a.id) + " has empty content");
    max_id = std::max<int64_t>(max_id, a.id);
  }
  if (max_id < 0) throw Error(source_ + ": the vocabulary is empty");
  // The id table is sized by the largest id: ids may leave gaps (reserved ids), but not more than
  // 65536 of them, so a stray id of 2^31 - 1 is an error, not a request for tens of GB.
  const int64_t entries = static_cast<int64_t>(spec.vocab.size() + added_.size());
  if (max_id >= entries + 65536)
    throw Error(source_ + ": id " + std::to_string(max_id) + " is beyond the " +
                std::to_string(entries) +
                " tokens the file defines (ids number the vocabulary from 0, with gaps of at most "
                "65536)");
  vocab_size_ = max_id + 1;
  id_token_.resize(static_cast<size_t>(vocab_size_));
  id_bytes_.resize(static_cast<size_t>(vocab_size_));
  id_kind_.assign(static_cast<size_t>(vocab_size_), 0);

  // The model's vocabulary: spellings, and the bytes each spelling stands for.
  token_to_id_.reserve(spec.vocab.size() + added_.size());
  bytes_to_id_.reserve(spec.vocab.size());
  std::string bytes;
  for (const auto& [tok, id] : spec.vocab) {
    const auto i = static_cast<size_t>(id);
    if (id_kind_[i] != 0 && id_token_[i] != tok)
      throw Error(source_ + ": id " + std::to_string(id) + " is given to both " + dq(id_token_[i]) +
                  " and " + dq(tok) + "; ids must be unique");
    token_to_id_[tok] = id;
    id_token_[i] = tok;
    id_kind_[i] = 1;
    if (metaspace_.on) {
      // The decoder's view: <0x0A> is its byte (ByteFallback), "▁" a space (Replace, Metaspace).
      unsigned byte = 0;
      char close = 0;
      if (metaspace_.decode_bytes && tok.size() == 6 &&
          std::sscanf(tok.c_str(), "<0x%2X%c", &byte, &close) == 2 && close == '>')
        id_bytes_[i] = std::string(1, static_cast<char>(byte));
      else
        id_bytes_[i] = metaspace_.decode_metaspace ? replace_metaspace(tok, " ") : tok;
      continue;
    }
    // A spelling outside the byte-level alphabet decodes to its own UTF-8, as HF's ByteLevel
    // decoder does.
    if (byte_level_to_bytes(tok, &bytes)) {
      id_bytes_[i] = bytes;
      bytes_to_id_.emplace(bytes, id);
    } else {
      id_bytes_[i] = tok;
    }
  }
  // SentencePiece-style files whose tokens never hold a "▁" after another character (Llama-2's,
  // Mistral's: SentencePiece's split_by_whitespace) are merged a word at a time (encode_section).
  // (Not with ignore_merges, which looks the whole section up in the vocabulary.)
  if (metaspace_.on && !ignore_merges_ && token_to_id_.contains(std::string(kMetaspace))) {
    metaspace_words_ = true;
    for (size_t i = 0; i < id_token_.size() && metaspace_words_; ++i) {
      if (id_kind_[i] != 1) continue;
      const std::string& t = id_token_[i];
      for (size_t at = t.find(kMetaspace, 1); at != std::string::npos;
           at = t.find(kMetaspace, at + 1))
        if (at < kMetaspace.size() ||
            t.compare(at - kMetaspace.size(), kMetaspace.size(), kMetaspace) != 0) {
          metaspace_words_ = false;
          break;
        }
    }
  }
  // SentencePiece-style: characters are the symbols; a byte is a symbol only as the fallback
  // token of a character the vocabulary lacks (HF falls back to the unknown token when one of
  // its bytes has none).
  for (int b = 0; metaspace_.on && b < 256; ++b) {
    const auto it = token_to_id_.find(byte_fallback_token(static_cast<uint8_t>(b)));
    byte_id_[b] = it == token_to_id_.end() ? -1 : it->second;
  }
  for (int b = 0; !metaspace_.on && b < 256; ++b) {
    const auto it = bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id_.end()) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02x", b);
      throw Error(source_ + ": the vocabulary has no token for byte " + hex + " (spelled " +
                  dq(bytes_to_byte_level(std::string(1, static_cast<char>(b)))) +
                  "); a byte-level BPE vocabulary holds all 256 byte symbols");
    }
    byte_id_[b] = it->second;
  }

  // Merges: both parts and the result must be vocabulary tokens (as HF tokenizers requires). A
  // pair listed twice keeps its last rank, as HF, transformers.js and GPT-2's encoder.py do.
  merges_.reserve(spec.merges.size());
  for (size_t r = 0; r < spec.merges.size(); ++r) {
    // Plain references, not a structured binding: clang 14 cannot capture one in the lambda.
    const std::string& a = spec.merges[r].first;
    const std::string& b = spec.merges[r].second;
    const std::string place =
        r < spec.merge_places.size() ? spec.merge_places[r] : "merge " + std::to_string(r);
    const auto find = [&](const std::string& t) {
      const auto it = token_to_id_.find(t);
      if (it == token_to_id_.end())
        throw Error(source_ + ": " + place + ": the merge " + dq(a + " " + b) + " uses " + dq(t) +
                    ", which is not in the vocabulary");
      return it->second;
    };
    const int32_t ia = find(a), ib = find(b), merged = find(a + b);
    merges_[pair_key(ia, ib)] = {static_cast<int32_t>(r), merged};
  }

  // Added tokens take precedence over vocabulary spellings (as in HF).
  added_by_first_byte_.resize(256);
  for (size_t k = 0; k < added_.size(); ++k) {
    const AddedToken& a = added_[k];
    const auto i = static_cast<size_t>(a.id);
    // One id, one token: an added token on the id of another token (the vocabulary's or an
    // earlier added one) made that id decode as the added content ("a" encoded as 64 and decoded
    // as "<sep>"); a content the vocabulary spells under another id was encoded to the added id,
    // where HF keeps the vocabulary's id (and warns).
    if (id_kind_[i] != 0 && id_token_[i] != a.content)
      throw Error(source_ + ": added token " + dq(a.content) + " has id " + std::to_string(a.id) +
                  ", which is already the token " + dq(id_token_[i]) +
                  "'s; ids must be unique: give the added token an unused id");
    if (const auto it = token_to_id_.find(a.content);
        it != token_to_id_.end() && it->second != a.id)
      throw Error(source_ + ": added token " + dq(a.content) + " has id " + std::to_string(a.id) +
                  ", but the token is already id " + std::to_string(it->second) +
                  "; a token has one id: give the added token id " + std::to_string(it->second) +
                  " or remove it");
    token_to_id_[a.content] = a.id;
    id_token_[i] = a.content;
    id_bytes_[i] = a.content;
    id_kind_[i] = a.special ? 2 : 1;
    added_by_first_byte_[static_cast<unsigned char>(a.content[0])].push_back(
        static_cast<int32_t>(k));
    if (a.single_word && !word_char_)
      word_char_ =
          std::make_unique<SplitRegex>(R"(\A\w\z)", false, source_ + ": single_word check");
  }
  // Longest first: at one position the longest added token wins (HF's leftmost-longest).
  for (auto& v : added_by_first_byte_)
    std::stable_sort(v.begin(), v.end(), [&](int32_t x, int32_t y) {
      return added_[static_cast<size_t>(x)].content.size() >
             added_[static_cast<size_t>(y)].content.size();
    });

  for (const auto& [name, id] : {std::pair<const char*, int64_t>{"bos", bos_id_},
                                 {"eos", eos_id_},
                                 {"pad", pad_id_},
                                 {"prefix", prefix_id_},
                                 {"unk", metaspace_.unk_id}})
    if (id >= vocab_size_ || (id >= 0 && id_kind_[static_cast<size_t>(id)] == 0))
      throw Error(source_ + ": the " + name + " id " + std::to_string(id) +
                  " names no token of the vocabulary [0, " + std::to_string(vocab_size_) + ")");
}

BpeTokenizer::~BpeTokenizer() = default;

bool BpeTokenizer::is_special(int64_t id) const {
  return id >= 0 && id < vocab_size_ && id_kind_[static_cast<size_t>(id)] == 2;
}

int64_t BpeTokenizer::token_to_id(std::string_view token) const {
  const auto it = token_to_id_.find(std::string(token));
  return it == token_to_id_.end() ? -1 : it->second;
}

std::string BpeTokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id >= vocab_size_)
    throw Error(source_ + ": no token has id " + std::to_string(id) + " (the vocabulary is [0, " +
                std::to_string(vocab_size_) + "))");
  return id_token_[static_cast<size_t>(id)];
}

void BpeTokenizer::pre_tokenize_into(std::string_view text, bool prefix_space,
                                     std::vector<std::string>* out) const {
  std::vector<std::string> cur{std::string(text)}, next;
  for (const PreTokenizerStep& step : pre_tokenizer_) {
    next.clear();
    // Isolated keeps matches and gaps; Removed keeps the gaps (the matches with invert).
    const bool keep_gap = !step.removed || !step.invert;
    const bool keep_match = !step.removed || step.invert;
    for (std::string& piece : cur) {
      if (step.kind == PreTokenizerStep::Kind::kByteLevel && step.add_prefix_space &&
          prefix_space && (piece.empty() || piece[0] != ' '))
        piece.insert(piece.begin(), ' ');
      if (!step.regex) {
        next.push_back(std::move(piece));
        continue;
      }
      size_t prev = 0;
      for (const auto& [b, e] : step.regex->find_all(piece)) {
        if (b > prev && keep_gap) next.push_back(piece.substr(prev, b - prev));
        if (keep_match) next.push_back(piece.substr(b, e - b));
        prev = e;
      }
      if (prev < piece.size() && keep_gap) next.push_back(piece.substr(prev));
    }
    cur.swap(next);
  }
  for (std::string& p : cur)
    if (!p.empty()) out->push_back(std::move(p));
}

std::vector<std::string> BpeTokenizer::pre_tokenize(std::string_view text) const {
  std::vector<std::string> pieces;
  if (!text.empty())
    pre_tokenize_into(nfc_ ? nfc(text) : std::string(text), /*prefix_space=*/true, &pieces);
  return pieces;
}

std::vector<int32_t> BpeTokenizer::bpe(std::string_view bytes) const {
  std::vector<int32_t> ids;
  bpe_into(bytes, &ids);
  return ids;
}

// Merge results of recent pre-tokens, as HF and GPT-2 keep them: bounded, shared by threads.
template <class Compute>
void BpeTokenizer::cached(std::string_view key, std::vector<int32_t>* out,
                          Compute&& compute) const {
  constexpr size_t kMaxCached = 256, kCacheEntries = 1 << 16;
  const bool cacheable = key.size() < kMaxCached;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    const auto it = cache_.find(std::string(key));
    if (it != cache_.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  compute(&ids);
  out->insert(out->end(), ids.begin(), ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() >= kCacheEntries) cache_.clear();
    cache_.emplace(std::string(key), std::move(ids));
  }
}

void BpeTokenizer::bpe_into(std::string_view bytes, std::vector<int32_t>* out) const {
  if (bytes.empty()) return;
  if (ignore_merges_) {
    const auto it = bytes_to_id_.find(std::string(bytes));
    if (it != bytes_to_id_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  if (bytes.size() == 1) {
    out->push_back(byte_id_[static_cast<unsigned char>(bytes[0])]);
    return;
  }
  cached(bytes, out, [&](std::vector<int32_t>* ids) {
    for (char c : bytes) ids->push_back(byte_id_[static_cast<unsigned char>(c)]);
    merge(ids);
  });
}

void BpeTokenizer::metaspace_bpe_into(std::string_view normalized,
                                      std::vector<int32_t>* out) const {
  if (normalized.empty()) return;
  if (ignore_merges_) {
    const auto it = token_to_id_.find(std::string(normalized));
    if (it != token_to_id_.end() && id_kind_[static_cast<size_t>(it->second)] == 1) {
      out->push_back(it->second);
      return;
    }
  }
  cached(normalized, out, [&](std::vector<int32_t>* ids) {
    // HF's BPE merge_word: each character is its vocabulary token, else its bytes' fallback
    // tokens, else the unknown token (consecutive ones fused with fuse_unk).
    bool unk_pending = false;
    for (size_t i = 0; i < normalized.size();) {
      uint32_t cp = 0xFFFD;
      size_t len = decode_utf8(normalized, i, &cp);
      if (len == 0) len = 1;  // a stray byte: a character of its own, never in the vocabulary
      const std::string_view ch = normalized.substr(i, len);
      i += len;
      if (const auto it = token_to_id_.find(std::string(ch));
          it != token_to_id_.end() && id_kind_[static_cast<size_t>(it->second)] == 1) {
        unk_pending = false;
        ids->push_back(it->second);
        continue;
      }
      if (metaspace_.byte_fallback && std::all_of(ch.begin(), ch.end(), [&](char c) {
            return byte_id_[static_cast<unsigned char>(c)] >= 0;
          })) {
        unk_pending = false;
        for (char c : ch) ids->push_back(byte_id_[static_cast<unsigned char>(c)]);
        continue;
      }
      if (metaspace_.unk_id < 0) {
        char hex[16];
        std::snprintf(hex, sizeof hex, "U+%04X", static_cast<unsigned>(cp));
        throw Error(source_ + ": the character " + dq(std::string(ch)) + " (" + hex +
                        ") is not in the vocabulary, and the tokenizer has neither byte_fallback "
                        "nor an unk_token to stand for it; remove it from the text",
                    Error::kUsage);
      }
      if (!(unk_pending && metaspace_.fuse_unk))
        ids->push_back(static_cast<int32_t>(metaspace_.unk_id));
      unk_pending = true;
    }
    merge(ids);
  });
}

void BpeTokenizer::merge(std::vector<int32_t>* symbols) const {
  // Symbols in a linked list over the positions; candidate merges in a min-heap ordered by
  // (rank, position). A candidate is stale when its left symbol was merged away or its pair has
  // changed since it was pushed (HF tokenizers' word.rs, the same order as transformers.js).
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  struct Cand {
    int32_t rank, pos, id;
  };
  const auto later = [](const Cand& x, const Cand& y) {
    return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
  };
  const auto n = static_cast<int32_t>(symbols->size());
  if (n < 2) return;
  std::vector<Sym> sym(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i)
    sym[static_cast<size_t>(i)] = {(*symbols)[static_cast<size_t>(i)], i - 1,
                                   i + 1 < n ? i + 1 : -1, true};
  std::priority_queue<Cand, std::vector<Cand>, decltype(later)> heap(later);
  const auto push_pair = [&](int32_t left) {
    const int32_t right = sym[static_cast<size_t>(left)].next;
    if (right < 0) return;
    const auto it = merges_.find(
        pair_key(sym[static_cast<size_t>(left)].id, sym[static_cast<size_t>(right)].id));
    if (it != merges_.end()) heap.push({it->second.first, left, it->second.second});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& l = sym[static_cast<size_t>(c.pos)];
    if (!l.alive || l.next < 0) continue;
    Sym& r = sym[static_cast<size_t>(l.next)];
    const auto it = merges_.find(pair_key(l.id, r.id));
    if (it == merges_.end() || it->second.first != c.rank || it->second.second != c.id) continue;
    l.id = c.id;
    r.alive = false;
    l.next = r.next;
    if (l.next >= 0) sym[static_cast<size_t>(l.next)].prev = c.pos;
    if (l.prev >= 0) push_pair(l.prev);
    push_pair(c.pos);
  }
  symbols->clear();
  for (int32_t i = 0; i >= 0; i = sym[static_cast<size_t>(i)].next)
    symbols->push_back(sym[static_cast<size_t>(i)].id);
}

void BpeTokenizer::encode_section(std::string_view section, SectionAt at,
                                  std::vector<int32_t>* out) const {
  if (section.empty()) return;
  // HF normalizes each section between added tokens (so a mark after an added token composes
  // with nothing), then pre-tokenizes it.
  std::string composed;
  if (nfc_ && nfc_may_change(section)) {  // (most sections are NFC already: no copy)
    composed = nfc(section);
    section = composed;
  }
  if (!metaspace_.on) {
    std::vector<std::string> pieces;
    pre_tokenize_into(section, /*prefix_space=*/at != SectionAt::kContinuing, &pieces);
    for (const std::string& p : pieces) bpe_into(p, out);
    return;
  }
  std::string normalized;
  normalized.reserve(section.size() + 2 * kMetaspace.size());
  for (char c : section)
    if (c == ' ')
      normalized.append(kMetaspace);
    else
      normalized.push_back(c);
  using P = Metaspace::Prepend;
  const bool space_first = normalized.starts_with(kMetaspace);
  bool prepend = false;
  switch (metaspace_.prepend) {
    case P::kEvery:
      prepend = at != SectionAt::kContinuing;
      break;
    case P::kAlways:
      prepend = at != SectionAt::kContinuing && !space_first;
      break;
    case P::kFirst:
      prepend = at == SectionAt::kTextStart && !space_first;
      break;
    case P::kNever:
      break;
  }
  if (prepend) normalized.insert(0, kMetaspace);
  if (metaspace_.split) {  // a piece from each "▁" to the next (HF: MergedWithNext)
    size_t begin = 0;
    for (size_t pos = normalized.find(kMetaspace, 1); pos != std::string::npos;
         pos = normalized.find(kMetaspace, pos + kMetaspace.size())) {
      metaspace_bpe_into(std::string_view(normalized).substr(begin, pos - begin), out);
      begin = pos;
    }
    metaspace_bpe_into(std::string_view(normalized).substr(begin), out);
    return;
  }
  if (!metaspace_words_) {
    metaspace_bpe_into(normalized, out);
    return;
  }
  // Merged a word at a time, each word from a "▁" after another character to the next such: no
  // token spans that boundary, so no merge does, and the words' merges are independent.
  size_t begin = 0;
  for (size_t pos = normalized.find(kMetaspace, 1); pos != std::string::npos;
       pos = normalized.find(kMetaspace, pos + kMetaspace.size())) {
    const bool after_metaspace =
        pos >= kMetaspace.size() &&
        normalized.compare(pos - kMetaspace.size(), kMetaspace.size(), kMetaspace) == 0;
    if (after_metaspace) continue;  // a run of "▁" stays together ("▁▁" is a token)
    metaspace_bpe_into(std::string_view(normalized).substr(begin, pos - begin), out);
    begin = pos;
  }
  metaspace_bpe_into(std::string_view(normalized).substr(begin), out);
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  return encode_text(text, /*continuation=*/false);
}

std::vector<int32_t> BpeTokenizer::encode_continuation(std::string_view text) const {
  return encode_text(text, /*continuation=*/true);
}

std::vector<int32_t> BpeTokenizer::encode_text(std::string_view text, bool continuation) const {
  std::vector<int32_t> ids;
  const auto encode_text = [&](size_t b, size_t e) {
    if (e <= b) return;
    encode_section(text.substr(b, e - b),
                   b == 0 ? (continuation ? SectionAt::kContinuing : SectionAt::kTextStart)
                          : SectionAt::kAfterAddedToken,
                   &ids);
  };
  // Added tokens first, leftmost-longest, on the raw text (HF: before normalization and
  // pre-tokenization, so that the pre-tokenizer never splits "<|endoftext|>").
  const size_t n = text.size();
  size_t section = 0, i = 0;
  while (!added_.empty() && i < n) {
    const AddedToken* hit = nullptr;
    for (int32_t k : added_by_first_byte_[static_cast<unsigned char>(text[i])]) {
      const AddedToken& a = added_[static_cast<size_t>(k)];
      if (text.substr(i, a.content.size()) == a.content) {
        hit = &a;
        break;
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    size_t b = i, e = i + hit->content.size();
    if (hit->single_word) {
      // HF: a match glued to a word character on either side is not a split; its text is
      // tokenized as ordinary text.
      const bool word_before =
          b > 0 && word_char_->search(
                       text.substr(char_start_before(text, b), b - char_start_before(text, b)));
      uint32_t cp = 0;
      const size_t len = e < n ? decode_utf8(text, e, &cp) : 0;
      const bool word_after = len > 0 && word_char_->search(text.substr(e, len));
      if (word_before || word_after) {
        i = e;
        continue;
      }
    }
    if (hit->lstrip)
      while (b > section) {
        const size_t s = char_start_before(text, b);
        uint32_t cp = 0;
        if (decode_utf8(text, s, &cp) != b - s || !is_unicode_space(cp)) break;
        b = s;
      }
    if (hit->rstrip)
      while (e < n) {
        uint32_t cp = 0;
        const size_t len = decode_utf8(text, e, &cp);
        if (len == 0 || !is_unicode_space(cp)) break;
        e += len;
      }
    encode_text(section, b);
    ids.push_back(hit->id);
    section = i = e;
  }
  encode_text(section, n);
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  bool first = true;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size_ || id_kind_[static_cast<size_t>(id)] == 0)
      throw Error(source_ + ": cannot decode id " + std::to_string(id) + " at position " +
                  std::to_string(i) + ": it " +
                  (id < 0 || id >= vocab_size_ ? "is outside" : "names no token of") +
                  " the vocabulary [0, " + std::to_string(vocab_size_) +
                  "); was it produced by a model with another vocab_size?");
    if (id_kind_[static_cast<size_t>(id)] == 2) continue;
    // Metaspace's decoder drops the "▁" of the first token it is given (after the specials).
    if (metaspace_.drop_first_metaspace && first)
      out += replace_metaspace(id_token_[static_cast<size_t>(id)], "");
    else
      out += id_bytes_[static_cast<size_t>(id)];
    first = false;
  }
  // Strip (after Fuse): the text's first spaces, at most strip_leading of them.
  size_t spaces = 0;
  while (spaces < out.size() && spaces < static_cast<size_t>(metaspace_.strip_leading) &&
         out[spaces] == ' ')
    ++spaces;
  out.erase(0, spaces);
  return out;
}

}  // namespace keel::data
