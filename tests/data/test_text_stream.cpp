// TextStream (keel/data/text_stream.h): streamed pieces concatenate to the decoded text, a tail
// that may become a stop string is held back until it cannot, the stop string itself is never
// emitted, and a UTF-8 character split over byte tokens comes out whole.
#include <gtest/gtest.h>

#include "keel/data/text_stream.h"
#include "keel/data/tokenizer.h"

namespace keel::data {
namespace {

std::vector<std::string> stream(const std::string& text, std::vector<std::string> stops,
                                bool* stopped = nullptr) {
  ByteTokenizer tok;
  TextStream s(tok, std::move(stops));
  std::vector<std::string> pieces;
  for (int32_t id : tok.encode(text)) pieces.push_back(s.push(id));
  pieces.push_back(s.finish());
  if (stopped) *stopped = s.stopped();
  return pieces;
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (auto& p : v) out += p;
  return out;
}

TEST(TextStream, PiecesConcatenateAndStopStringsCut) {
  bool stopped = false;
  auto p = stream("hello world", {}, &stopped);
  EXPECT_EQ(join(p), "hello world");
  EXPECT_FALSE(stopped);
  EXPECT_EQ(p[0], "h");  // nothing to hold back: each byte as it comes
  p = stream("say END now", {"END"}, &stopped);
  EXPECT_TRUE(stopped);
  EXPECT_EQ(join(p), "say ");
  // "E" and "EN" are held back (they may start "END") ...
  EXPECT_EQ(p[4], "");
  EXPECT_EQ(p[5], "");
  // ... and released when they cannot: "ENx" is text.
  p = stream("aENxb", {"END"});
  EXPECT_EQ(p[1], "");
  EXPECT_EQ(p[3], "ENx");
  EXPECT_EQ(join(p), "aENxb");
  // The earliest of several stops wins; an empty stop is ignored.
  EXPECT_EQ(join(stream("ab\ncd##", {"##", "\n", ""})), "ab");
}

TEST(TextStream, MultiByteCharactersAndPendingTailAtTheEnd) {
  // "é" is two byte tokens; the stream's text is the exact bytes.
  EXPECT_EQ(join(stream("café!", {"!!"})), "café!");
  auto p = stream("abE", {"END"});
  EXPECT_EQ(p.back(), "E");  // held back to the end, then released by finish()
}

}  // namespace
}  // namespace keel::data
