// ByteTokenizer: the dependency-free tokenizer of the built-in tasks. Ids 0..255 are the bytes of
// the text (any bytes, so UTF-8 and binary round-trip exactly); then three specials:
// pad = 256, bos = 257, eos = 258; vocab 259.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "keel/data/tokenizer_base.h"

namespace keel::data {

struct ByteTokenizer : Tokenizer {
  static constexpr int32_t kPad = 256, kBos = 257, kEos = 258, kVocab = 259;

  int64_t vocab_size() const override { return kVocab; }
  int64_t pad_id() const override { return kPad; }
  int64_t bos_id() const override { return kBos; }
  int64_t eos_id() const override { return kEos; }
  bool is_special(int64_t id) const override { return id >= 256 && id < kVocab; }

  // One id per byte; no bos/eos is added (callers add the specials they want).
  std::vector<int32_t> encode(std::string_view text) const override;
  // Bytes for ids 0..255; specials are skipped (as HF's skip_special_tokens=True), so that
  // decode(encode(s)) == s and a generated "...<eos>" decodes to its text. An id outside
  // [0, 259) is an Error naming the id and its position.
  std::string decode(const std::vector<int32_t>& ids) const override;

  // Tokens: the single byte for ids 0..255, "<pad>", "<bos>", "<eos>" for the specials.
  int64_t token_to_id(std::string_view token) const override;
  std::string id_to_token(int64_t id) const override;
};

}  // namespace keel::data
