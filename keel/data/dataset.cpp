#include "keel/data/dataset.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "keel/data/chat.h"
#include "keel/data/text_pieces.h"
#include "keel/data/token_file.h"
#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"
#include "keel/numerics/json_duplicates.h"
#include "keel/numerics/text.h"

namespace keel::data {

Dataset::~Dataset() = default;

std::string Dataset::where(int64_t i) const { return "example " + std::to_string(i); }

ExampleDataset::ExampleDataset(std::string source) : source_(std::move(source)) {}

ExampleDataset::ExampleDataset(const std::vector<Example>& examples, std::string source,
                               std::vector<int64_t> lines)
    : source_(std::move(source)) {
  size_t total = 0;
  for (const Example& e : examples) total += e.tokens.size();
  reserve(total);
  for (size_t i = 0; i < examples.size(); ++i) {
    KEEL_CHECK(examples[i].tokens.size() == examples[i].target.size(),
               source_ + ": example " + std::to_string(i) + " has " +
                   std::to_string(examples[i].tokens.size()) + " tokens but " +
                   std::to_string(examples[i].target.size()) + " target flags");
    add(examples[i].tokens, examples[i].target);
  }
  lines_ = std::move(lines);
}

void ExampleDataset::reserve(size_t tokens) {
  tokens_.reserve(tokens);
  target_.reserve(tokens);
}

void ExampleDataset::add(std::span<const int32_t> tokens, std::span<const uint8_t> target,
                         int64_t line) {
  KEEL_CHECK(tokens.size() == target.size(), source_ + ": an example's target differs in length");
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  target_.insert(target_.end(), target.begin(), target.end());
  starts_.push_back(tokens_.size());
  if (line > 0) lines_.push_back(line);
}

void ExampleDataset::add_all_targets(std::span<const int32_t> tokens, int64_t line) {
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  target_.resize(tokens_.size(), 1);
  starts_.push_back(tokens_.size());
  if (line > 0) lines_.push_back(line);
}

void check_example_index(int64_t i, int64_t size, const std::string& source) {
  if (i < 0 || i >= size)
    throw Error(source + ": example index " + std::to_string(i) + " is outside [0, " +
                std::to_string(size) + ")");
}

int64_t packed_rows(size_t n, size_t len) {
  return n < 2 ? 0 : static_cast<int64_t>((n - 2) / (len - 1) + 1);  // starts s with s + 1 < n
}

std::pair<size_t, size_t> packed_row(int64_t k, size_t n, size_t len) {
  const size_t start = static_cast<size_t>(k) * (len - 1);
  return {start, std::min(len, n - start)};
}

namespace {

std::string where_in(const std::string& source, const std::vector<int64_t>& lines, int64_t i) {
  if (i >= 0 && i < static_cast<int64_t>(lines.size()))
    return source + ":" + std::to_string(lines[static_cast<size_t>(i)]);
  return source + " example " + std::to_string(i);
}

// A packed text file: one token stream, cut into rows of `len` tokens starting every len - 1
// (load_text_dataset's comment). Each row is a view of the stream; every token is a target. Held
// as Examples, the rows cost 5 bytes a token and a pair of allocations each, beside the stream
// they were copied from while loading: 11 times a byte-tokenized file's size at the peak. The
// stream is held in 16 bits a token when the vocabulary fits (the byte and GPT-2 tokenizers), in
// 32 otherwise (Llama 3's 128,256 ids).
template <class Id>
class PackedDataset : public Dataset {
 public:
  PackedDataset(std::vector<Id> ids, size_t len, std::string source, std::vector<int64_t> lines)
      : ids_(std::move(ids)),
        len_(len),
        all_targets_(len, 1),
        source_(std::move(source)),
        lines_(std::move(lines)) {}
  int64_t size() const override { return static_cast<int64_t>(lines_.size()); }
  ExampleView get(int64_t i) const override {
    check_example_index(i, size(), source_);
    const auto [start, n] = packed_row(i, ids_.size(), len_);
    return {std::span<const Id>(ids_).subspan(start, n),
            std::span<const uint8_t>(all_targets_).first(n)};
  }
  std::string where(int64_t i) const override { return where_in(source_, lines_, i); }
  int64_t held_bytes() const override {
    return static_cast<int64_t>(ids_.size() * sizeof(Id) + lines_.size() * sizeof(int64_t));
  }
  int64_t held_tokens() const override { return static_cast<int64_t>(ids_.size()); }

 private:
  std::vector<Id> ids_;  // [n] the whole file
  size_t len_;           // tokens a row (seq_len)
  std::vector<uint8_t> all_targets_;
  std::string source_;
  std::vector<int64_t> lines_;  // the line each row starts on: one per row
};

}  // namespace

std::string ExampleDataset::where(int64_t i) const {
  if (!packed()) return where_in(source_, lines_, i);
  check_example_index(i, size(), source_);
  const size_t first = rows_[static_cast<size_t>(i)], n = rows_[static_cast<size_t>(i) + 1] - first;
  return where_in(source_, lines_, static_cast<int64_t>(first)) +
         (n > 1 ? " (packed with " + count_of(static_cast<int64_t>(n) - 1, "more example") + ")"
                : "");
}

std::vector<std::vector<size_t>> best_fit_decreasing(const std::vector<size_t>& lengths,
                                                     size_t capacity) {
  auto length = [&](size_t e) { return std::min(lengths[e], capacity); };
  std::vector<size_t> order(lengths.size());
  for (size_t e = 0; e < order.size(); ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return length(a) > length(b); });
  // Best fit: the open row with the least room that still holds the example ((room, row) ordered,
  // so a tie goes to the row opened first).
  std::set<std::pair<size_t, size_t>> room;
  std::vector<std::vector<size_t>> rows;
  for (size_t e : order) {
    const size_t len = length(e);
    size_t r = rows.size(), left = capacity;  // a new row, unless one fits
    if (auto it = room.lower_bound({len, 0}); it != room.end()) {
      std::tie(left, r) = *it;
      room.erase(it);
    } else {
      rows.emplace_back();
    }
    rows[r].push_back(e);
    if (left > len) room.insert({left - len, r});
  }
  return rows;
}

void ExampleDataset::pack_rows(int64_t seq_len) {
  KEEL_CHECK(!packed() && seq_len >= 2, source_ + ": packing needs seq_len >= 2, once");
  const size_t n = starts_.size() - 1;
  std::vector<size_t> lengths(n);
  for (size_t e = 0; e < n; ++e) lengths[e] = starts_[e + 1] - starts_[e];
  const std::vector<std::vector<size_t>> rows =
      best_fit_decreasing(lengths, static_cast<size_t>(seq_len));
  // The storage in row order: each row's examples one after another.
  std::vector<int32_t> tokens;
  std::vector<uint8_t> target;
  std::vector<size_t> starts{0};
  std::vector<int64_t> lines;
  tokens.reserve(tokens_.size());
  target.reserve(target_.size());
  starts.reserve(starts_.size());
  rows_.assign(1, 0);
  for (const std::vector<size_t>& row : rows) {
    for (size_t e : row) {
      tokens.insert(tokens.end(), tokens_.begin() + static_cast<std::ptrdiff_t>(starts_[e]),
                    tokens_.begin() + static_cast<std::ptrdiff_t>(starts_[e + 1]));
      target.insert(target.end(), target_.begin() + static_cast<std::ptrdiff_t>(starts_[e]),
                    target_.begin() + static_cast<std::ptrdiff_t>(starts_[e + 1]));
      starts.push_back(tokens.size());
      if (e < lines_.size()) lines.push_back(lines_[e]);
    }
    rows_.push_back(starts.size() - 1);
  }
  tokens_ = std::move(tokens);
  target_ = std::move(target);
  starts_ = std::move(starts);
  if (lines.size() == n) lines_ = std::move(lines);
}

std::unique_ptr<ExampleDataset> ExampleDataset::split_off(int64_t n, std::string source) {
  KEEL_CHECK(!packed() && n >= 0 && n <= size(),
             source_ + ": cannot split off " + std::to_string(n) + " examples");
  auto tail = std::make_unique<ExampleDataset>(std::move(source));
  const size_t first = static_cast<size_t>(size() - n), begin = starts_[first];
  tail->tokens_.assign(tokens_.begin() + static_cast<std::ptrdiff_t>(begin), tokens_.end());
  tail->target_.assign(target_.begin() + static_cast<std::ptrdiff_t>(begin), target_.end());
  for (size_t e = first + 1; e < starts_.size(); ++e) tail->starts_.push_back(starts_[e] - begin);
  if (lines_.size() == starts_.size() - 1) {
    tail->lines_.assign(lines_.begin() + static_cast<std::ptrdiff_t>(first), lines_.end());
    lines_.resize(first);
  }
  tokens_.resize(begin);
  target_.resize(begin);
  starts_.resize(first + 1);
  tail->left_out_ = left_out_;
  return tail;
}

int64_t ExampleDataset::held_tokens() const { return static_cast<int64_t>(tokens_.size()); }

int64_t ExampleDataset::held_bytes() const {
  return static_cast<int64_t>(tokens_.size() * sizeof(int32_t) + target_.size() +
                              (starts_.size() + lines_.size() + rows_.size()) * sizeof(int64_t));
}

ExampleView ExampleDataset::get(int64_t i) const {
  check_example_index(i, size(), source_);
  // A packed row: examples [rows_[i], rows_[i + 1]) one after another.
  const size_t first = packed() ? rows_[static_cast<size_t>(i)] : static_cast<size_t>(i);
  const size_t last = packed() ? rows_[static_cast<size_t>(i) + 1] : first + 1;
  const size_t begin = starts_[first], n = starts_[last] - begin;
  ExampleView v(std::span<const int32_t>(tokens_).subspan(begin, n),
                std::span<const uint8_t>(target_).subspan(begin, n));
  if (packed())
    v.example_starts = std::span<const size_t>(starts_).subspan(first, last - first + 1);
  return v;
}

namespace {

// Examples end with eos: a tokenizer without one cannot mark where a text stops.
void check_eos(const Tokenizer& tok, const std::string& path) {
  if (tok.eos_id() < 0)
    throw Error(path +
                    ": the tokenizer has no eos token, which ends every example; name one "
                    "(an HF tokenizer.json: eos_token in the tokenizer_config.json beside it; a "
                    "GPT-2 encoder.json: an \"<|endoftext|>\" entry)",
                Error::kUsage);
}

void check_seq_len(int64_t seq_len, const std::string& path) {
  if (seq_len < 2)
    throw Error(path + ": seq_len is " + std::to_string(seq_len) +
                    "; next-token prediction needs at least 2 positions (set data.seq_len >= 2)",
                Error::kUsage);
}

std::string read_whole_file(const std::string& path, const std::string& key) {
  return read_input_file(path, "dataset file", key);
}

bool is_blank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

// Calls f(line, line_number) for each line (1-based; '\n' separated, the last line may lack it).
template <class F>
void for_each_line(const std::string& text, F&& f) {
  size_t pos = 0;
  int64_t number = 1;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    f(std::string_view(text).substr(pos, end - pos), number++);
    pos = end + 1;
  }
}

// Tokens the loader will use as labels: positions 1..min(len, seq_len)-1 with target set (token 0
// has no preceding position to predict it from; tokens past seq_len are truncated).
int64_t trainable_tokens(const Example& e, int64_t seq_len) {
  const int64_t len = std::min<int64_t>(static_cast<int64_t>(e.tokens.size()), seq_len);
  int64_t n = 0;
  for (int64_t t = 1; t < len; ++t) n += e.target[static_cast<size_t>(t)] != 0;
  return n;
}

// At most the tokens a text file's examples hold: a token covers at least one byte, and each line
// may add a few beyond its bytes (a tokenizer's prefix, a JSONL prompt's and completion's, eos).
size_t token_bound(const std::string& text) {
  return text.size() + 3 * (static_cast<size_t>(std::count(text.begin(), text.end(), '\n')) + 1);
}

// The bytes of `prefix` (the start of a longer text) up to its last line's end, 0 when it holds no
// line's end: a sample that parses as the whole does, as a cut JSON line would not.
size_t whole_lines(std::string_view prefix) {
  const size_t end = prefix.rfind('\n');
  return end == std::string_view::npos ? 0 : end + 1;
}

// Room for the tokens of a text of `bytes` bytes that starts with `head` (at least its first
// kTokenProbe bytes): the tokens `tokens_of` gives for the whole lines of its first 64 KiB (built
// as the whole will be), scaled to its size with a quarter more in case what follows is denser,
// and at most `bound`. The bound alone asks for 4 bytes of address space a byte of text: for a
// 7 GB file, 28 GB, which Linux refuses outright on a 24 GB machine although a BPE tokenizer's
// tokens of it fit. An estimate that falls short only grows.
constexpr size_t kTokenProbe = 64 << 10;
template <class TokensOf>
size_t token_reserve(size_t bytes, std::string_view head, size_t bound, TokensOf&& tokens_of) {
  if (bytes <= 4 * kTokenProbe) return bound;
  const size_t probe_bytes = whole_lines(head.substr(0, kTokenProbe));
  if (probe_bytes == 0) return bound;
  const auto tokens = static_cast<double>(tokens_of(std::string(head.substr(0, probe_bytes))));
  const double per_byte = tokens / static_cast<double>(probe_bytes);
  return std::min(bound, static_cast<size_t>(1.25 * per_byte * static_cast<double>(bytes)) + 64);
}
// The same for a whole text in memory, its examples built by `build`.
template <class Build>
size_t token_reserve(const std::string& text, Build&& build) {
  return token_reserve(text.size(), text, token_bound(text),
                       [&](const std::string& t) { return build(t)->held_tokens(); });
}

// What an example keeps of its tokens: the loader reads the first seq_len, and one more says the
// example was longer (truncated_examples counts it). A 105 MB paragraph held all its ids (5 bytes
// a token) to train on 512 of them.
template <class T>
std::span<const T> kept_of(const std::vector<T>& v, int64_t seq_len) {
  return std::span<const T>(v).first(std::min(v.size(), static_cast<size_t>(seq_len) + 1));
}

Example all_targets(std::vector<int32_t> tokens) {
  Example e;
  e.target.assign(tokens.size(), 1);
  e.tokens = std::move(tokens);
  return e;
}

// The packed dataset of the text read from `in` (`size`: its bytes when known, else 0), encoded
// a piece at a time (encode_in_pieces: the ids of encoding it whole) into the stream the dataset
// keeps: the text is never held whole, nor its ids in 32 bits when 16 hold them. `key` names where
// the path came from in a read error.
std::unique_ptr<Dataset> packed_dataset_of(std::istream& in, size_t size, const std::string& path,
                                           const std::string& key, const Tokenizer& tok,
                                           int64_t seq_len) {
  auto build = [&](auto id_tag) -> std::unique_ptr<Dataset> {
    using Id = decltype(id_tag);
    std::vector<Id> ids;  // [n]
    // Room for the stream, estimated from its first 64 KiB (token_reserve; at most a token a byte
    // and a prefix), so that it does not grow by copies; a pipe (no size) grows. The probe is read
    // and the stream rewound, which a file allows.
    if (size > 4 * kTokenProbe) {
      std::string head(kTokenProbe, '\0');
      in.read(head.data(), static_cast<std::streamsize>(head.size()));
      head.resize(static_cast<size_t>(in.gcount()));
      in.clear();
      in.seekg(0);
      ids.reserve(token_reserve(size, head, size + 16,
                                [&](const std::string& t) { return tok.encode(t).size(); }));
    }
    // The stream starts as the tokenizer's convention starts a text (Llama-3's <|begin_of_text|>).
    if (tok.prefix_id() >= 0) ids.push_back(static_cast<Id>(tok.prefix_id()));
    // A small file needs no whole piece of read buffer.
    const size_t piece = size > 0 ? std::min(kTextPieceBytes, size + 1) : kTextPieceBytes;
    try {
      encode_in_pieces(tok, in, piece, [&](std::span<const int32_t> p) {
        ids.insert(ids.end(), p.begin(), p.end());  // every id < vocab_size(): fits Id
      });
    } catch (const Error& e) {
      throw Error("cannot read dataset file " + path + ": " + e.what() + " (check " + key + ")",
                  Error::kUsage);
    }
    std::vector<int64_t> lines;  // the line each row starts on
    const size_t n = ids.size(), len = static_cast<size_t>(seq_len), stride = len - 1;
    // A row's line: 1 + the newlines its preceding tokens decode to (one decode per distinct id).
    std::unordered_map<int32_t, int64_t> newlines_of;
    int64_t line = 1;
    size_t counted = 0;
    // Rows overlap by one token: row k's last token is row k+1's first, whose label lives in row
    // k (the last position of a row has none). A row needs 2 tokens to predict anything.
    for (size_t start = 0; start + 1 < n; start += stride) {
      for (; counted < start; ++counted) {
        const auto id = static_cast<int32_t>(ids[counted]);
        auto [it, fresh] = newlines_of.try_emplace(id, 0);
        if (fresh) {
          const std::string s = tok.decode({id});
          it->second = std::count(s.begin(), s.end(), '\n');
        }
        line += it->second;
      }
      lines.push_back(line);
    }
    if (lines.empty())
      throw Error("dataset file " + path + " (" + key + "): holds " + std::to_string(n) +
                      (n == 1 ? " token" : " tokens") +
                      "; packing needs at least 2 tokens (one to predict the other); give a file "
                      "with more text",
                  Error::kUsage);
    // Paragraph mode refuses a file of blank lines as no text; packed, its spaces, tabs and
    // newlines trained with exit 0. A token is blank when its text is (one decode per distinct
    // id); the first token of real text ends the look.
    std::unordered_map<int32_t, bool> blank_of;
    bool blank = true;
    for (size_t i = 0; i < n && blank; ++i) {
      const auto id = static_cast<int32_t>(ids[i]);
      auto [it, fresh] = blank_of.try_emplace(id, false);
      if (fresh) {
        const std::string s = tok.decode({id});
        it->second = s.find_first_not_of(" \t\r\n") == std::string::npos;
      }
      blank = it->second;
    }
    if (blank)
      throw Error("dataset file " + path + " (" + key +
                      "): holds no text (only spaces, tabs and newlines); give a file with text",
                  Error::kUsage);
    return std::make_unique<PackedDataset<Id>>(std::move(ids), len, path, std::move(lines));
  };
  if (tok.vocab_size() <= 65536) return build(uint16_t{});
  return build(int32_t{});
}

// The datasets of `text`, the contents of `path` (or its first lines: dataset_footprint's sample).
std::unique_ptr<Dataset> text_dataset_of(const std::string& text, const std::string& path,
                                         const std::string& key, const Tokenizer& tok,
                                         int64_t seq_len, bool pack) {
  if (pack) {
    std::istringstream in(text);
    return packed_dataset_of(in, text.size(), path, key, tok, seq_len);
  }
  auto ds = std::make_unique<ExampleDataset>(path);
  ds->reserve(token_reserve(text, [&](const std::string& t) {
    return text_dataset_of(t, path, key, tok, seq_len, false);
  }));
  // A paragraph of one line is encoded from the text itself; lines are joined into `para` only
  // from the second on (a 105 MB line was copied whole before encoding).
  std::string para;
  std::string_view first;
  int64_t lines = 0;
  bool open = false;
  int64_t first_line = 0;
  auto flush = [&] {
    if (!open) return;
    std::vector<int32_t> ids = encode_with_prefix(tok, lines == 1 ? first : std::string_view(para));
    // Its eos only where it is kept: on 420 MB of ids, a push_back would copy them into 840.
    if (static_cast<int64_t>(ids.size()) < seq_len + 1)
      ids.push_back(static_cast<int32_t>(tok.eos_id()));
    ds->add_all_targets(kept_of(ids, seq_len), first_line);
    para.clear();
    lines = 0;
    open = false;
  };
  for_each_line(text, [&](std::string_view line, int64_t number) {
    if (is_blank(line)) return flush();
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);  // CRLF files
    if (!open) first_line = number, first = line;
    if (++lines == 2) para.assign(first);
    if (lines >= 2) para.append("\n").append(line);
    open = true;
  });
  flush();
  if (ds->size() == 0)
    throw Error("dataset file " + path + " (" + key +
                    "): holds no text (it is empty or holds only blank lines); give a file with "
                    "at least one paragraph",
                Error::kUsage);
  return ds;
}

// A line keel cannot use is bad input (exit 2), as a token file's bad header is.
std::unique_ptr<Dataset> jsonl_dataset_of(const std::string& text, const std::string& path,
                                          const std::string& key, const Tokenizer& tok,
                                          int64_t seq_len, const JsonlOptions& jsonl) {
  using json = nlohmann::json;
  static const char* kExpected =
      "expected {\"prompt\": ..., \"completion\": ...}, {\"messages\": [...]} or {\"text\": ...}";
  auto ds = std::make_unique<ExampleDataset>(path);
  ds->reserve(token_reserve(text, [&](const std::string& t) {
    return jsonl_dataset_of(t, path, key, tok, seq_len, jsonl);
  }));
  for_each_line(text, [&](std::string_view line, int64_t number) {
    if (is_blank(line)) return;
    auto bad = [&](const std::string& what) {
      return Error(path + ": line " + std::to_string(number) + ": " + what, Error::kUsage);
    };
    json obj;
    std::string duplicate;
    try {
      obj = parse_json_noting_duplicates(line, duplicate);
    } catch (const json::parse_error& e) {
      // e.what() is "[json.exception...] parse error at line 1, column C: DETAIL"; the "line 1"
      // is the line's own, so report the column and the detail only.
      std::string detail = json_error_detail(e.what());
      const size_t colon = detail.find(": ");
      if (colon != std::string::npos) detail = detail.substr(colon + 2);
      throw bad("invalid JSON at column " + std::to_string(e.byte) + ": " + detail + "; " +
                kExpected);
    } catch (const json::exception& e) {  // out_of_range: a number beyond a double
      throw bad("invalid JSON: " + json_error_detail(e.what()) + "; " + kExpected);
    }
    if (!obj.is_object())
      throw bad(std::string("a JSON ") + obj.type_name() + " instead of an object; " + kExpected);
    // {"text": "a", "text": "b"} trained on "b" without a word.
    if (!duplicate.empty())
      throw bad("the key \"" + visible(duplicate) +
                "\" is given more than once (JSON would keep the last); give each key once");
    auto get_string = [&](const char* key) {
      const json& v = obj.at(key);
      if (!v.is_string())
        throw bad(std::string("\"") + key + "\" must be a string, got " + v.type_name() + "; " +
                  kExpected);
      return v.get<std::string>();
    };
    // Which key holds the data: "text", a "prompt" and "completion" of text, or a conversation
    // in one of TRL's formats (chat.h).
    const bool has_text = obj.contains("text"), is_chat = is_conversation(obj),
               has_prompt = !is_chat && obj.contains("prompt"),
               has_completion = !is_chat && obj.contains("completion");
    Example e;
    if (int(has_text) + int(is_chat || has_prompt || has_completion) > 1) {
      throw bad(
          "has more than one of \"text\", \"prompt\"/\"completion\" and \"messages\" "
          "(which one is the data?); " +
          std::string(kExpected));
    } else if (!is_chat && (obj.contains("tools") || obj.contains("chat_template_kwargs"))) {
      throw bad(std::string("\"") + (obj.contains("tools") ? "tools" : "chat_template_kwargs") +
                "\" goes with a conversation (the chat template renders it), and this line "
                "holds text; give the conversation as {\"messages\": [...]}, or remove the key");
    } else if (is_chat) {
      // A conversation in the model's chat template; the targets are the assistant's replies or
      // the completion (chat.h).
      if (!tok.chat_format()) throw bad(no_chat_template("the run's tokenizer"));
      std::vector<ConversationExample> examples;
      try {
        // Read again keeping each object's key order (the parse above sorts them): a tool
        // call's arguments go through the template's tojson as the data wrote them.
        examples = conversation_examples(tok, conversation_of(nlohmann::ordered_json::parse(line)),
                                         jsonl.chat_date);
      } catch (const Error& err) {
        throw bad(err.what());
      }
      // A reply of its own example (chat.h) that starts past seq_len is left out, as the replies
      // past seq_len of a conversation in one example are cut off.
      int64_t kept = 0;
      for (const ConversationExample& c : examples)
        if (trainable_tokens(c.example, seq_len) > 0) {
          ds->add(kept_of(c.example.tokens, seq_len), kept_of(c.example.target, seq_len), number);
          ++kept;
        }
      ds->add_left_out(static_cast<int64_t>(examples.size()) - kept);
      if (kept == 0) {
        const Example& first_example = examples.front().example;
        const auto first = std::find(first_example.target.begin(), first_example.target.end(), 1) -
                           first_example.target.begin();
        throw bad(
            std::string(obj.contains("prompt") ? "the completion" : "the first assistant reply") +
            " starts at token " + std::to_string(first) + ", so with seq_len " +
            std::to_string(seq_len) + " no token of it is left to train on; " +
            jsonl.long_prompt_fix);
      }
      return;
    } else if (has_text) {
      e = all_targets(encode_with_prefix(tok, get_string("text")));
      e.tokens.push_back(static_cast<int32_t>(tok.eos_id()));
      e.target.push_back(1);
    } else if (has_prompt || has_completion) {
      if (!has_completion) throw bad(std::string("missing \"completion\"; ") + kExpected);
      if (!has_prompt) throw bad(std::string("missing \"prompt\"; ") + kExpected);
      e.tokens = encode_with_prefix(tok, get_string("prompt"));
      e.target.assign(e.tokens.size(), 0);  // context: no loss on the prompt
      // The completion continues the prompt: tokenized as in the two joined (no SentencePiece
      // "▁" of its own), as TRL tokenizes prompt + completion.
      const std::vector<int32_t> completion = tok.encode_continuation(get_string("completion"));
      e.tokens.insert(e.tokens.end(), completion.begin(), completion.end());
      e.tokens.push_back(static_cast<int32_t>(tok.eos_id()));
      e.target.resize(e.tokens.size(), 1);
      // The loader keeps the first seq_len tokens and labels positions 0..seq_len-2, i.e. it can
      // train on tokens 1..seq_len-1; the first completion token sits at prompt_len.
      const int64_t prompt_len = static_cast<int64_t>(e.tokens.size() - completion.size() - 1);
      if (prompt_len > seq_len - 1)
        throw bad("the prompt is " + std::to_string(prompt_len) + " tokens, so with seq_len " +
                  std::to_string(seq_len) + " no completion token is left to train on; " +
                  jsonl.long_prompt_fix);
    } else {
      throw bad(std::string("missing \"text\" (or \"prompt\" and \"completion\"); ") + kExpected);
    }
    if (trainable_tokens(e, seq_len) == 0)
      throw bad(
          "nothing to train on (an empty \"text\" or \"completion\" with no preceding "
          "token); remove the line or give it content");
    ds->add(kept_of(e.tokens, seq_len), kept_of(e.target, seq_len), number);
  });
  if (ds->size() == 0)
    throw Error("dataset file " + path + " (" + key +
                    "): holds no examples (it is empty or holds only blank lines); " + kExpected,
                Error::kUsage);
  return ds;
}

}  // namespace

std::unique_ptr<Dataset> load_text_dataset(const std::string& path, const Tokenizer& tok,
                                           int64_t seq_len, bool pack, const std::string& key) {
  check_seq_len(seq_len, path);
  if (!pack) check_eos(tok, path);
  if (!pack) return text_dataset_of(read_whole_file(path, key), path, key, tok, seq_len, pack);
  check_input_file(path, "dataset file", key);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw Error(
        "cannot read dataset file " + path + ": " + std::strerror(errno) + " (check " + key + ")",
        Error::kUsage);
  struct stat st {};
  const size_t size = ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)
                          ? static_cast<size_t>(st.st_size)
                          : 0;  // a pipe: no size
  return packed_dataset_of(in, size, path, key, tok, seq_len);
}

std::unique_ptr<Dataset> load_jsonl_dataset(const std::string& path, const Tokenizer& tok,
                                            int64_t seq_len, const std::string& key,
                                            const JsonlOptions& jsonl) {
  check_seq_len(seq_len, path);
  check_eos(tok, path);
  return jsonl_dataset_of(read_whole_file(path, key), path, key, tok, seq_len, jsonl);
}

std::unique_ptr<Dataset> load_dataset(const std::string& task, const std::string& path,
                                      const std::string& key, const Tokenizer& tok, int64_t seq_len,
                                      bool pack, const JsonlOptions& jsonl) {
  if (task == "text") return load_text_dataset(path, tok, seq_len, pack, key);
  if (task == "jsonl") {
    auto examples = load_jsonl_dataset(path, tok, seq_len, key, jsonl);
    return pack ? pack_dataset(std::move(examples), seq_len) : std::move(examples);
  }
  if (task == "tokens") return load_token_file(path, key, tok, seq_len);
  throw Error(key + " " + path + ": no dataset of task \"" + task +
                  "\" (text, jsonl and tokens are read from files)",
              Error::kUsage);
}

namespace {

// Examples [begin, begin + n) of a dataset shared with the other part of its split: no copies,
// and each example still names its file and line.
class RangeDataset : public Dataset {
 public:
  RangeDataset(std::shared_ptr<const Dataset> all, int64_t begin, int64_t n, std::string source)
      : all_(std::move(all)), begin_(begin), n_(n), source_(std::move(source)) {}
  int64_t size() const override { return n_; }
  ExampleView get(int64_t i) const override {
    check_example_index(i, n_, source_);
    return all_->get(begin_ + i);
  }
  std::string where(int64_t i) const override { return all_->where(begin_ + i); }
  int64_t left_out() const override { return all_->left_out(); }

 private:
  std::shared_ptr<const Dataset> all_;
  int64_t begin_, n_;
  std::string source_;
};

}  // namespace

int64_t truncated_examples(const Dataset& set, const std::string& task, bool pack,
                           int64_t seq_len) {
  if (task == "tokens" || (task == "text" && pack)) return 0;
  int64_t n = 0;
  for (int64_t i = 0; i < set.size(); ++i) n += static_cast<int64_t>(set.get(i).size()) > seq_len;
  return n;
}

std::pair<std::unique_ptr<Dataset>, std::unique_ptr<Dataset>> split_dataset(
    std::unique_ptr<Dataset> all, int64_t n_eval, const std::string& what, bool to_pack) {
  const int64_t n = all->size();
  if (n_eval < 1 || n_eval >= n)
    throw Error(what + ": holding out " + std::to_string(n_eval) + " of " + std::to_string(n) +
                    " examples leaves " + (n_eval < 1 ? "no validation" : "no training") +
                    " example; give a file with more examples or another data.eval_fraction",
                Error::kUsage);
  // Parts to pack: two datasets of their own (the validation part moved out of the file's).
  if (auto* examples = dynamic_cast<ExampleDataset*>(all.get());
      to_pack && examples && !examples->packed()) {
    std::unique_ptr<Dataset> eval = examples->split_off(n_eval, what);
    return {std::move(all), std::move(eval)};
  }
  std::shared_ptr<const Dataset> shared = std::move(all);
  return {std::make_unique<RangeDataset>(shared, 0, n - n_eval, what + " (training part)"),
          std::make_unique<RangeDataset>(shared, n - n_eval, n_eval, what + " (validation part)")};
}

std::unique_ptr<Dataset> pack_dataset(std::unique_ptr<Dataset> examples, int64_t seq_len) {
  auto* held = dynamic_cast<ExampleDataset*>(examples.get());
  KEEL_CHECK(held && !held->packed(), "pack_dataset: the dataset must be unpacked examples");
  held->pack_rows(seq_len);
  return examples;
}

DatasetFootprint dataset_footprint(const std::string& path, const std::string& task,
                                   const Tokenizer& tok, int64_t seq_len, bool pack,
                                   const JsonlOptions& jsonl) {
  DatasetFootprint f;
  check_seq_len(seq_len, path);  // the loader's checks first: a stride of 0 would never end
  if (task == "tokens") {
    // Counted from the header; the ids stay in the file's mapping (page cache the kernel may
    // drop), so only the rows' target flags are held.
    const TokenFileHeader h = read_token_file_header(path, "data.path");
    f.estimated = true;
    f.file_bytes = kTokenFileHeaderBytes + h.tokens * h.width;
    f.tokens = h.tokens;
    f.examples = packed_rows(static_cast<size_t>(h.tokens), static_cast<size_t>(seq_len));
    f.held = f.load_peak = seq_len;
    f.longest = seq_len, f.whole = true;
    return f;
  }
  if (task == "jsonl" || !pack) check_eos(tok, path);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) return f;
  f.file_bytes = static_cast<int64_t>(st.st_size);
  constexpr int64_t kSample = 1 << 20;
  std::string sample(static_cast<size_t>(std::min(f.file_bytes, kSample)), '\0');
  {
    std::ifstream in(path, std::ios::binary);
    in.read(sample.data(), static_cast<std::streamsize>(sample.size()));
    if (in.gcount() != static_cast<std::streamsize>(sample.size())) return f;
  }
  if (f.file_bytes > kSample) {
    sample.resize(whole_lines(sample));
    if (sample.empty()) return f;
  }
  std::unique_ptr<Dataset> ds =
      task == "jsonl" ? jsonl_dataset_of(sample, path, "data.path", tok, seq_len, jsonl)
                      : text_dataset_of(sample, path, "data.path", tok, seq_len, pack);
  const bool packed_jsonl = task == "jsonl" && pack;
  if (packed_jsonl) ds = pack_dataset(std::move(ds), seq_len);
  const auto tokens = static_cast<double>(ds->held_tokens());
  const double scale = static_cast<double>(f.file_bytes) / static_cast<double>(sample.size());
  f.estimated = true;
  f.tokens = std::llround(tokens * scale);
  f.examples = std::llround(static_cast<double>(ds->size()) * scale);
  f.held = std::llround(static_cast<double>(ds->held_bytes()) * scale);
  for (int64_t i = 0; i < ds->size(); ++i)
    f.longest =
        std::max(f.longest, std::min<int64_t>(static_cast<int64_t>(ds->get(i).size()), seq_len));
  f.whole = f.file_bytes <= kSample;
  // Rows of seq_len (packed text), or filled up to it (packed JSONL: a sample's rows are fewer).
  if (pack && !f.whole) f.longest = seq_len, f.whole = true;
  // Packed text is read and encoded a piece at a time into the stream it keeps (packed_dataset_of):
  // beside it, the read buffer and the piece's text (about 3 pieces) and the piece's ids in 32
  // bits. Paragraphs and JSONL are read whole first; packed JSONL is then copied row by row
  // (ExampleDataset::pack_rows), the file's text freed.
  const double piece = static_cast<double>(std::min<int64_t>(f.file_bytes, kTextPieceBytes));
  f.load_peak =
      task == "text" && pack
          ? f.held + std::llround(piece * (3 + 4 * tokens / static_cast<double>(sample.size())))
          : f.file_bytes + f.held;
  if (packed_jsonl) f.load_peak = std::max(f.load_peak, 2 * f.held);
  return f;
}

}  // namespace keel::data
