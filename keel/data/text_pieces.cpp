#include "keel/data/text_pieces.h"

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "keel/numerics/error.h"

namespace keel::data {

void encode_in_pieces(const Tokenizer& tok, std::istream& in, size_t piece_bytes,
                      const std::function<void(std::span<const int32_t>)>& emit) {
  auto blank = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  };
  // A piece after the first continues the text: nothing of a text's start (SentencePiece's "▁")
  // goes before it.
  bool first_piece = true;
  auto encode = [&](std::string_view text, bool at_start) {
    return at_start ? tok.encode(text) : tok.encode_continuation(text);
  };
  // Where `text` may be cut (after text[cut - 1] == '\n'): a newline between two non-blank bytes
  // whose lines encode the same together and apart; 0 when none of the last few candidates is.
  auto find_cut = [&](std::string_view text) -> size_t {
    int tries = 0;
    for (size_t nl = text.rfind('\n'); nl != std::string::npos && nl > 0 && tries < 64;
         nl = text.rfind('\n', nl - 1)) {
      if (nl + 1 >= text.size() || blank(text[nl - 1]) || blank(text[nl + 1])) continue;
      ++tries;
      const size_t before = text.rfind('\n', nl - 1),
                   line_start = before == std::string::npos ? 0 : before + 1;
      const size_t after = text.find('\n', nl + 1);
      const size_t line_end = after == std::string::npos ? text.size() : after;
      const std::string_view left(text.data() + line_start, nl + 1 - line_start),
          right(text.data() + nl + 1, line_end - nl - 1);
      const bool at_start = first_piece && line_start == 0;
      std::vector<int32_t> apart = encode(left, at_start);
      const std::vector<int32_t> r = tok.encode_continuation(right);
      apart.insert(apart.end(), r.begin(), r.end());
      const std::string joined = std::string(left) + std::string(right);
      if (encode(joined, at_start) == apart) return nl + 1;
    }
    return 0;
  };
  std::string text;
  std::vector<char> buf(std::max<size_t>(piece_bytes, 1));
  bool end = false;
  while (!end) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    text.append(buf.data(), static_cast<size_t>(in.gcount()));
    if (in.bad()) throw Error("a read of the text failed part-way");
    end = in.eof() || in.gcount() == 0;
    if (end) break;
    // The line the cut ends on must be whole, so look for cuts before the last newline only.
    const size_t last_nl = text.rfind('\n');
    if (last_nl == std::string::npos) continue;
    const size_t cut = find_cut(std::string_view(text).substr(0, last_nl));
    if (cut == 0) continue;  // no cut yet: read on, the piece grows
    const std::vector<int32_t> ids = encode(std::string_view(text).substr(0, cut), first_piece);
    emit(ids);
    text.erase(0, cut);
    first_piece = false;
  }
  if (!text.empty()) {
    const std::vector<int32_t> ids = encode(text, first_piece);
    emit(ids);
  }
}

}  // namespace keel::data
