#include "keel/data/tokenizer_base.h"

#include <filesystem>

#include "keel/data/gpt2_tokenizer.h"
#include "keel/data/hf_tokenizer.h"
#include "keel/data/tokenizer.h"
#include "keel/numerics/error.h"

namespace keel::data {

Tokenizer::~Tokenizer() = default;

bool pad_collides(const Tokenizer& tok, int64_t pad_id) {
  if (pad_id < 0 || pad_id >= tok.vocab_size()) return false;
  if (pad_id == tok.bos_id() || pad_id == tok.eos_id()) return true;
  if (tok.is_special(pad_id)) return false;  // a dedicated pad, or a reserved special
  return !tok.id_to_token(pad_id).empty();   // a hole in the vocabulary is no token
}

namespace {

std::unique_ptr<Tokenizer> load_tokenizer_of(const std::string& spec, const std::string& key) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  const auto has_prefix = [&](const char* p) { return spec.rfind(p, 0) == 0; };
  if (has_prefix("gpt2:")) return load_gpt2_tokenizer(spec.substr(5), key);
  if (has_prefix("hf:")) return load_hf_tokenizer(spec.substr(3), key);
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p = spec;
  if (fs::is_regular_file(p, ec) && p.extension() == ".json") return load_hf_tokenizer(spec, key);
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "tokenizer.json", ec)) return load_hf_tokenizer(spec, key);
    if (fs::exists(p / "vocab.bpe", ec) || fs::exists(p / "merges.txt", ec))
      return load_gpt2_tokenizer(spec, key);
  }
  throw Error(key + " = \"" + spec +
                  "\": not a tokenizer; use \"byte\", \"gpt2:DIR\" (encoder.json + vocab.bpe), "
                  "\"hf:PATH\" (a tokenizer.json or its directory), or such a path",
              Error::kUsage);
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec, const std::string& key) {
  // A tokenizer file keel cannot use (malformed JSON, an unsupported model, a merge of unknown
  // tokens) is bad input, as a missing one is: exit 2, not 1.
  try {
    return load_tokenizer_of(spec, key);
  } catch (const Error& e) {
    throw Error(e.what(), Error::kUsage);
  }
}

std::vector<int32_t> encode_with_prefix(const Tokenizer& tok, std::string_view text) {
  std::vector<int32_t> ids = tok.encode(text);
  // In place where the encoding left room (it grew by doubling): no second copy of a long text.
  if (tok.prefix_id() >= 0) ids.insert(ids.begin(), static_cast<int32_t>(tok.prefix_id()));
  return ids;
}

}  // namespace keel::data
