// encode_in_pieces (keel tokenize --output): the ids of encoding a text whole, whatever the piece
// size, for every kind of tokenizer keel reads.
#include "keel/data/text_pieces.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "keel/data/tokenizer.h"

namespace keel::data {
namespace {

const std::string kPiecesTokenizers =
    std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";

// A corpus of every kind of line end: punctuation before newlines (Llama-3's pattern takes
// "x.\n" as one pre-token), blank lines, lines that start with spaces or tabs, CRLF, digits,
// non-ASCII text, a line without an end.
std::string varied_corpus() {
  std::string t;
  const char* lines[] = {"the quick brown fox.",
                         "  indented line, two spaces",
                         "\ttabbed",
                         "",
                         "numbers 12345 and 3.14!",
                         "naïve café — done?",
                         "x",
                         "CRLF line\r",
                         "end of paragraph:",
                         "",
                         "",
                         "a'll we've they're",
                         "<|endoftext|>"};
  for (int i = 0; i < 60; ++i) t += std::string(lines[i % 13]) + (i % 7 == 3 ? " \n" : "\n");
  return t + "last line without an end";
}

std::vector<int32_t> encode_piecewise(const Tokenizer& tok, const std::string& text, size_t piece,
                                      int* pieces) {
  std::istringstream in(text);
  std::vector<int32_t> all;
  *pieces = 0;
  encode_in_pieces(tok, in, piece, [&](std::span<const int32_t> ids) {
    all.insert(all.end(), ids.begin(), ids.end());
    ++*pieces;
  });
  return all;
}

// Every piece size gives the ids of encoding the text whole, and the text is cut into many
// pieces: those after the first are encoded as continuations, so a tokenizer that puts something
// before every text (HF ByteLevel add_prefix_space, the gpt2_style file; SentencePiece's "▁", the
// sp_ files) reads a cut after a newline as the whole text does.
TEST(TextPieces, EncodingInPiecesIsEncodingWhole) {
  const std::string text = varied_corpus();
  for (const std::string& spec :
       {std::string("byte"), "gpt2:" + kPiecesTokenizers,
        "hf:" + kPiecesTokenizers + "/llama_style", "hf:" + kPiecesTokenizers + "/gpt2_style",
        "hf:" + kPiecesTokenizers + "/sp_legacy", "hf:" + kPiecesTokenizers + "/sp_metaspace"}) {
    const auto tok = load_tokenizer(spec);
    const std::vector<int32_t> whole = tok->encode(text);
    for (size_t piece : {size_t{1}, size_t{13}, size_t{100}, size_t{1} << 20}) {
      int pieces = 0;
      EXPECT_EQ(encode_piecewise(*tok, text, piece, &pieces), whole) << spec << " piece " << piece;
      if (piece == 100) {
        EXPECT_GT(pieces, 3) << spec;
      }
    }
  }
}

}  // namespace
}  // namespace keel::data
