// Encoding a text too large to hold: `keel tokenize --output` reads a corpus and encodes it a
// piece at a time, cut only where encoding the pieces apart gives the ids of encoding it whole.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <istream>
#include <span>

#include "keel/data/tokenizer_base.h"

namespace keel::data {

// The piece `keel tokenize --output` and the packed text loader read at a time: what they hold
// beside the ids is about 3 pieces of text and one piece's ids in 32 bits (dataset_footprint).
constexpr size_t kTextPieceBytes = size_t{1} << 20;

// tok.encode(text) for a text read from `in`, a piece of about `piece_bytes` at a time, without
// holding the whole text: each piece ends after a newline where the lines on both sides encode
// to the same ids together and apart (checked at each cut, so a tokenizer whose pre-tokenizer
// would read the cut differently is never cut there; a text without such a newline is read
// whole). The pieces after the first are encoded as continuations (Tokenizer::
// encode_continuation: no SentencePiece "▁" before them). `emit` receives each piece's ids in
// order.
void encode_in_pieces(const Tokenizer& tok, std::istream& in, size_t piece_bytes,
                      const std::function<void(std::span<const int32_t>)>& emit);

}  // namespace keel::data
