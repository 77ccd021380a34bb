// llm.c's token files (`data.task = "tokens"`): a text tokenized once, ahead of training, as
// llm.c's dev/data scripts write it (fineweb.py, tinyshakespeare.py): a header of 256
// little-endian int32 — the magic 20240520 (GPT-2: 16-bit ids, version 1) or 20240801 (Llama 3:
// 32-bit ids, version 7), the version, the token count — then the ids. keel maps the file and
// trains on it as on a packed text file (rows of seq_len tokens every seq_len - 1, every token a
// target): the ids are read from the mapping in place, so a corpus of any size costs its pages in
// the page cache (which the kernel drops under pressure), not 4 bytes a token of the process's own
// memory. `keel tokenize --output FILE` writes one from text.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "keel/data/dataset.h"
#include "keel/data/tokenizer_base.h"

namespace keel::data {

constexpr int64_t kTokenFileHeaderBytes = 256 * 4;
// The fewest ids a token file trains or evaluates on: one to predict the other. load_token_file
// refuses fewer, so `keel tokenize --output` does not write such a file.
constexpr int64_t kTokenFileMinTokens = 2;

struct TokenFileHeader {
  int64_t tokens = 0;  // ids after the header
  int width = 2;       // bytes an id: 2 (GPT-2's magic) or 4 (Llama 3's)
};

// The header of `path` (named by config key or flag `key`), checked against the file's size: an
// Error (kUsage) naming the file, what is wrong and the fix for a missing file, a pipe (a token
// file is mapped), a foreign or unknown magic, a version other than its magic's, a negative count,
// and a size that is not the header's count of ids (truncated, or bytes after them).
TokenFileHeader read_token_file_header(const std::string& path, const std::string& key);

// The packed rows of the token file `path` (seq_len tokens a row, overlapping by one; every token
// a target), its ids read from the file's mapping. Every id is checked against `tok`'s vocabulary
// first (a file written with another tokenizer names the first id beyond it and where it is);
// fewer than 2 tokens, and seq_len < 2, are errors.
std::unique_ptr<Dataset> load_token_file(const std::string& path, const std::string& key,
                                         const Tokenizer& tok, int64_t seq_len);

// The bytes of a token file holding `ids`: GPT-2's 16-bit layout when `vocab_size` <= 65536,
// else Llama 3's 32-bit one (llm.c reads both). Errors for more than 2^31 - 1 ids (the header
// counts them in an int32) and for an id outside [0, vocab_size).
std::string token_file_bytes(std::span<const int32_t> ids, int64_t vocab_size);

// A token file written as its ids come (token_file_bytes's layout): into `path`.tmp-PID, the
// header's count written by commit(), which syncs and renames it over `path`; a writer destroyed
// without commit() removes its file, so a failed conversion leaves nothing half-written. Write
// errors (a full disk) are Errors naming `path`.
class TokenFileWriter {
 public:
  TokenFileWriter(const std::string& path, int64_t vocab_size);
  ~TokenFileWriter();
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;
  void append(std::span<const int32_t> ids);  // each id checked against the vocabulary
  void commit();
  int64_t tokens() const { return tokens_; }
  int64_t bytes() const;  // of the file, header included

 private:
  void write_all(const void* data, size_t n, int64_t offset);
  std::string path_, tmp_;
  int64_t vocab_size_ = 0, tokens_ = 0;
  int width_ = 2, fd_ = -1;
};

}  // namespace keel::data
