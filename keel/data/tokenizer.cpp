#include "keel/data/tokenizer.h"

#include "keel/numerics/error.h"

namespace keel::data {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  // Through unsigned char: bytes >= 0x80 (UTF-8 continuation bytes) must map to 128..255.
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= kVocab)
      throw Error("the byte tokenizer cannot decode id " + std::to_string(id) + " at position " +
                  std::to_string(i) + ": it is outside the vocabulary [0, " +
                  std::to_string(kVocab) +
                  "); was it produced by a model with another vocab_size?");
    if (id < 256) out.push_back(static_cast<char>(static_cast<unsigned char>(id)));
  }
  return out;
}

namespace {
constexpr const char* kSpecialNames[] = {"<pad>", "<bos>", "<eos>"};
}  // namespace

int64_t ByteTokenizer::token_to_id(std::string_view token) const {
  if (token.size() == 1) return static_cast<unsigned char>(token[0]);
  for (int32_t i = 0; i < 3; ++i)
    if (token == kSpecialNames[i]) return kPad + i;
  return -1;
}

std::string ByteTokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id >= kVocab)
    throw Error("the byte tokenizer has no token for id " + std::to_string(id) +
                ": it is outside the vocabulary [0, " + std::to_string(kVocab) + ")");
  if (id < 256) return std::string(1, static_cast<char>(static_cast<unsigned char>(id)));
  return kSpecialNames[id - kPad];
}

}  // namespace keel::data
