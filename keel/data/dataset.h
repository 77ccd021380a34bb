// Datasets: a list of tokenized examples, each with a per-token loss mask. Built-in tasks live in
// arith.h; this file has the container and the two file formats (plain text, JSONL).
#pragma once
#include <cstdint>
#include <memory>
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

class Dataset {
 public:
  virtual ~Dataset();
  virtual int64_t size() const = 0;
  virtual const Example& get(int64_t i) const = 0;  // 0 <= i < size()
  // Where example i comes from, for findings that name a batch's examples: "data.jsonl:17" (the
  // file and the 1-based line it starts on) when the dataset knows, else "example 17".
  virtual std::string where(int64_t i) const;
};

// A dataset held in memory. `source` names it in error messages ("data.jsonl", "arith train").
class ExampleDataset : public Dataset {
 public:
  // Every example must have tokens.size() == target.size() (checked).
  // `lines`: the 1-based line of `source` each example starts on (empty: not from a file).
  ExampleDataset(std::vector<Example> examples, std::string source,
                 std::vector<int64_t> lines = {});
  int64_t size() const override { return static_cast<int64_t>(examples_.size()); }
  const Example& get(int64_t i) const override;
  const std::string& source() const { return source_; }
  std::string where(int64_t i) const override;

 private:
  std::vector<Example> examples_;
  std::string source_;
  std::vector<int64_t> lines_;
};

// The last `n_eval` examples of `all` (in order) and the others: a validation split of one file.
// Errors (kUsage, naming `what`) when either part would be empty.
std::pair<std::unique_ptr<Dataset>, std::unique_ptr<Dataset>> split_dataset(
    const Dataset& all, int64_t n_eval, const std::string& what);

// Plain text file; every token is a target.
//  pack = false: one example per paragraph (paragraphs are separated by blank lines, i.e. lines
//    holding only spaces, tabs or '\r'); an example is the paragraph's bytes (its lines joined by
//    '\n', a line's trailing '\r' dropped) followed by eos. Longer paragraphs are truncated by the
//    loader to seq_len.
//  pack = true: the file's bytes as one stream (no eos inserted: blank lines are part of the text),
//    cut into rows of seq_len tokens that overlap by one token (row k starts at k*(seq_len-1)), so
//    that every token after the first is predicted exactly once although each row's last position
//    has no label. The last row may be shorter.
// Errors: missing/unreadable file (names the path), seq_len < 2, no text in the file.
std::unique_ptr<Dataset> load_text_dataset(const std::string& path, const Tokenizer& tok,
                                           int64_t seq_len, bool pack);

// JSONL: one JSON object per line (blank lines are skipped), either
//   {"text": "..."}                         -> text + eos, all targets, or
//   {"prompt": "...", "completion": "..."}  -> prompt (context) + completion + eos (targets).
// Other keys are ignored. A malformed line is an Error naming the file, the line number and the
// problem ("data.jsonl: line 17: missing \"completion\"; expected {\"prompt\": ..., \"completion\":
// ...} or {\"text\": ...}"); so is a prompt so long that no completion token fits in seq_len (such
// an example would train on nothing), seq_len < 2, and a file without examples.
std::unique_ptr<Dataset> load_jsonl_dataset(const std::string& path, const Tokenizer& tok,
                                            int64_t seq_len);

}  // namespace keel::data
