// Datasets: a list of tokenized examples, each with a per-token loss mask. Built-in tasks live in
// arith.h; this file has the container and the two file formats (plain text, JSONL).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "keel/data/tokenizer.h"

namespace keel::data {

// One training example: the token sequence and, per token, whether it is a prediction target
// (1) or context only (0). The loader turns it into next-token labels: the label at position t is
// tokens[t + 1] when target[t + 1] is set, else -100.
struct Example {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> target;  // same length as tokens
};

// An example as a dataset hands it out: views of its tokens and target flags (same length), valid
// while the dataset lives. A packed text file's rows are views of one token stream, not copies;
// a GPT-2 token file's rows are views of its 16-bit ids where the file is mapped (tokens16, and
// `tokens` is empty): read ids through id(t).
struct ExampleView {
  std::span<const int32_t> tokens;
  std::span<const uint16_t> tokens16;
  std::span<const uint8_t> target;
  // A packed row (ExampleDataset::pack_rows): where each of its examples starts in the dataset's
  // storage, then where the last ends (the row is tokens[0, back() - front())); empty when the
  // view is one example.
  std::span<const size_t> example_starts;
  ExampleView() = default;
  ExampleView(std::span<const int32_t> t, std::span<const uint8_t> f) : tokens(t), target(f) {}
  ExampleView(std::span<const uint16_t> t, std::span<const uint8_t> f) : tokens16(t), target(f) {}
  size_t size() const { return target.size(); }
  int32_t id(size_t t) const { return tokens16.empty() ? tokens[t] : tokens16[t]; }
  // Ids and flags agree in length (what a dataset must hand out).
  bool consistent() const { return tokens.size() + tokens16.size() == target.size(); }
  Example copy() const {
    Example e{{tokens.begin(), tokens.end()}, {target.begin(), target.end()}};
    if (!tokens16.empty()) e.tokens.assign(tokens16.begin(), tokens16.end());
    return e;
  }
};

class Dataset {
 public:
  virtual ~Dataset();
  virtual int64_t size() const = 0;
  virtual ExampleView get(int64_t i) const = 0;  // 0 <= i < size()
  // The examples its rows hold: size(), or more where rows are packed (ExampleDataset::pack_rows).
  virtual int64_t examples() const { return size(); }
  // Where example i comes from, for findings that name a batch's examples: "data.jsonl:17" (the
  // file and the 1-based line it starts on) when the dataset knows, else "example 17".
  virtual std::string where(int64_t i) const;
  // The bytes its storage holds in memory (the token arrays and line numbers; 0 for a view of
  // another dataset): what dataset_footprint scales.
  virtual int64_t held_bytes() const { return 0; }
  // The tokens its storage holds (a packed file's stream once, not its overlapping rows).
  virtual int64_t held_tokens() const { return 0; }
  // Examples of its source left out whole: replies of conversations that are rows of their own
  // (chat.h: a template that rewrites earlier turns) and would start past seq_len. A split's parts
  // give their file's.
  virtual int64_t left_out() const { return 0; }
};

// A dataset held in memory: every example's tokens and target flags one after another in two
// flat arrays (5 bytes a token, 16 an example: its start and line), not a pair of vectors each.
// `source` names it in error messages ("data.jsonl", "arith train").
class ExampleDataset : public Dataset {
 public:
  explicit ExampleDataset(std::string source);  // empty; filled by add()
  // Every example must have tokens.size() == target.size() (checked).
  // `lines`: the 1-based line of `source` each example starts on (empty: not from a file).
  ExampleDataset(const std::vector<Example>& examples, std::string source,
                 std::vector<int64_t> lines = {});
  // Room for `tokens` tokens in all, so that the arrays do not grow by copies: address space, not
  // memory (pages that no example reaches are never touched).
  void reserve(size_t tokens);
  // Appends an example (`line`: where it starts in `source`, or 0 when not from a file).
  void add(std::span<const int32_t> tokens, std::span<const uint8_t> target, int64_t line = 0);
  void add_all_targets(std::span<const int32_t> tokens, int64_t line = 0);

  // Packs the examples into rows of at most seq_len tokens (data.pack with JSONL), best fit
  // decreasing as TRL's packing_strategy="bfd": longest first, each into the row it fills most
  // (the first such row on a tie), or a new row; an example longer than seq_len has a row of its
  // own (cut by the loader as ever). The storage is reordered row by row, so that a row is one
  // view of its examples one after another, and from then on size(), get() and where() are the
  // rows'. Deterministic: the order of the file and the lengths decide.
  void pack_rows(int64_t seq_len);
  bool packed() const { return !rows_.empty(); }
  int64_t examples() const override { return static_cast<int64_t>(starts_.size()) - 1; }
  // The last n examples, moved into a dataset of their own (a validation split; not packed).
  std::unique_ptr<ExampleDataset> split_off(int64_t n, std::string source);

  int64_t size() const override {
    return static_cast<int64_t>(packed() ? rows_.size() : starts_.size()) - 1;
  }
  ExampleView get(int64_t i) const override;
  const std::string& source() const { return source_; }
  std::string where(int64_t i) const override;
  int64_t held_bytes() const override;
  int64_t held_tokens() const override;
  size_t token_capacity() const { return tokens_.capacity(); }  // what reserve() asked for
  int64_t left_out() const override { return left_out_; }
  void add_left_out(int64_t n) { left_out_ += n; }

 private:
  std::vector<int32_t> tokens_;    // [all tokens]
  std::vector<uint8_t> target_;    // [all tokens]
  std::vector<size_t> starts_{0};  // [examples + 1] where each example starts; then the end
  std::vector<size_t> rows_;       // packed: [rows + 1] each row's first example; then the count
  std::string source_;
  std::vector<int64_t> lines_;
  int64_t left_out_ = 0;
};

// Rows of a packed token stream of `n` tokens, `len` tokens a row starting every len - 1 (rows
// overlap by one token; load_text_dataset's comment): how many hold at least 2 tokens, and row
// k's {start, length}.
int64_t packed_rows(size_t n, size_t len);
std::pair<size_t, size_t> packed_row(int64_t k, size_t n, size_t len);

// An Error naming `source` when i is outside [0, size): what every get(i) checks.
void check_example_index(int64_t i, int64_t size, const std::string& source);

// The examples of `set` (of data.task `task`, packed or not) longer than `seq_len` tokens, which
// the loader cuts to it: one text paragraph or JSONL line each (packed text and a token file's
// rows are seq_len long already: 0 without a look).
int64_t truncated_examples(const Dataset& set, const std::string& task, bool pack, int64_t seq_len);

// The last `n_eval` examples of `all` (in order) and the others: a validation split of one file.
// Both parts are views of `all`, which they share (examples keep their file and line); with
// `to_pack` (a JSONL file's examples, to be packed by pack_dataset), datasets of their own, the
// validation part moved out of `all`. Errors (kUsage, naming `what`) when either part would be
// empty.
std::pair<std::unique_ptr<Dataset>, std::unique_ptr<Dataset>> split_dataset(
    std::unique_ptr<Dataset> all, int64_t n_eval, const std::string& what, bool to_pack = false);

// Plain text file; every token is a target.
//  pack = false: one example per paragraph (paragraphs are separated by blank lines, i.e. lines
//    holding only spaces, tabs or '\r'); an example is the paragraph's bytes (its lines joined by
//    '\n', a line's trailing '\r' dropped) followed by eos. Longer paragraphs are truncated by the
//    loader to seq_len.
//  pack = true: the file's bytes as one stream (no eos inserted: blank lines are part of the text),
//    cut into rows of seq_len tokens that overlap by one token (row k starts at k*(seq_len-1)), so
//    that every token after the first is predicted exactly once although each row's last position
//    has no label. The last row may be shorter. The dataset holds the stream once (2 bytes a token
//    when the vocabulary has at most 65,536 ids, else 4) and hands out its rows as views; the file
//    is read and encoded a piece at a time (text_pieces.h), never whole.
// Errors (kUsage: bad input) name the path and `key`, the config key or flag that gave it: a
// missing/unreadable file, seq_len < 2, no text in the file (packed: fewer than 2 tokens).
std::unique_ptr<Dataset> load_text_dataset(const std::string& path, const Tokenizer& tok,
                                           int64_t seq_len, bool pack,
                                           const std::string& key = "data.path");

// JSONL: one JSON object per line (blank lines are skipped), either
//   {"text": "..."}                         -> text + eos, all targets, or
//   {"prompt": "...", "completion": "..."}  -> prompt (context) + completion + eos (targets).
// Other keys are ignored. A malformed line is an Error naming the file, the line number and the
// problem ("data.jsonl: line 17: missing \"completion\"; expected {\"prompt\": ..., \"completion\":
// ...} or {\"text\": ...}"), kUsage (bad input) as every error here; so is a prompt so long that no
// completion token fits in seq_len (such an example would train on nothing), seq_len < 2, and a
// file without examples.
inline constexpr const char* kLongPromptFix = "raise data.seq_len or shorten the prompt";
struct JsonlOptions {
  // Ends the error of a prompt that leaves no completion token: the fix in the words of the command
  // that read the file (keel eval has --seq-len, and none past the model's).
  std::string long_prompt_fix = kLongPromptFix;
  // The day a chat template's strftime_now writes ("YYYY-MM-DD", data.chat_date); empty leaves it
  // undefined, so that a conversation renders the same on every day (chat_template.h).
  std::string chat_date;
};
std::unique_ptr<Dataset> load_jsonl_dataset(const std::string& path, const Tokenizer& tok,
                                            int64_t seq_len, const std::string& key = "data.path",
                                            const JsonlOptions& jsonl = {});

// The dataset of a run's data.task from `path`: "text" (load_text_dataset, `pack` as data.pack),
// "jsonl" (load_jsonl_dataset; packed into rows by pack_dataset when `pack`) or "tokens" (an
// llm.c token file, load_token_file in
// token_file.h). `key` names where the path came from ("data.path", "data.eval_path", "--data")
// in the errors about the file.
std::unique_ptr<Dataset> load_dataset(const std::string& task, const std::string& path,
                                      const std::string& key, const Tokenizer& tok, int64_t seq_len,
                                      bool pack, const JsonlOptions& jsonl = {});

// Best fit decreasing (ExampleDataset::pack_rows): the rows that examples of these lengths
// (each at most `capacity` counted) fill, as lists of example indices.
std::vector<std::vector<size_t>> best_fit_decreasing(const std::vector<size_t>& lengths,
                                                     size_t capacity);

// A JSONL dataset packed into rows (ExampleDataset::pack_rows): `examples` must be one that
// load_jsonl_dataset or split_dataset returned.
std::unique_ptr<Dataset> pack_dataset(std::unique_ptr<Dataset> examples, int64_t seq_len);

// What loading a text or JSONL file will hold, before it is loaded (a token file: its header's
// count; the ids stay in the file's mapping, not counted): the examples of its first MiB
// (cut at a line's end) built as the loader builds them, scaled by the file's size. `held`: the
// dataset's storage for the run (2 or 4 bytes a token packed, 5 with the target flags, plus 8 to
// 16 an example); `load_peak`: the most at once while loading (paragraphs and JSONL: the file's
// text beside it; packed text: one piece's text and ids). A file of at
// most 1 MiB is counted whole; a pipe (no size) and a first line beyond 1 MiB are not estimated
// (`estimated` false). A malformed line in the sample is the loader's Error.
struct DatasetFootprint {
  bool estimated = false;
  int64_t file_bytes = 0, tokens = 0, examples = 0, held = 0, load_peak = 0;
  // The tokens of the longest row counted (at most seq_len), and whether that was every row: the
  // file was counted whole (a packed file's rows are all seq_len long).
  int64_t longest = 0;
  bool whole = false;
};
DatasetFootprint dataset_footprint(const std::string& path, const std::string& task,
                                   const Tokenizer& tok, int64_t seq_len, bool pack,
                                   const JsonlOptions& jsonl = {});

}  // namespace keel::data
