// Encoding a text in pieces (keel/data/token_file: encode_in_pieces, what `keel tokenize --output`
// does) gives the ids of encoding it whole, for the GPT-2 and the Llama-3-style tiny tokenizers
// and pieces of a few bytes: a mismatch is a finding (it would change a token file's rows).
#include <cstdlib>
#include <sstream>

#include "keel/data/text_pieces.h"
#include "keel/data/token_file.h"
#include "keel/data/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";
  static const auto gpt2 = keel::data::load_tokenizer("gpt2:" + dir);
  static const auto llama = keel::data::load_tokenizer("hf:" + dir + "/llama_style");
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const auto* tok : {gpt2.get(), llama.get()}) {
    const std::vector<int32_t> whole = tok->encode(text);
    for (size_t piece : {size_t{3}, size_t{17}}) {
      std::istringstream in(text);
      std::vector<int32_t> pieces;
      keel::data::encode_in_pieces(*tok, in, piece, [&](std::span<const int32_t> ids) {
        pieces.insert(pieces.end(), ids.begin(), ids.end());
      });
      if (pieces != whole) std::abort();
    }
  }
  return 0;
}
