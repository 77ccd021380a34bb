// TextStream (keel/data/text_stream.h): streamed pieces concatenate to the decoded text, a tail
// that may become a stop string is held back until it cannot, the stop string itself is never
// emitted, and a UTF-8 character split over byte tokens comes out whole.
#include <gtest/gtest.h>

#include "keel/data/text_stream.h"
#include "keel/data/tokenizer.h"

namespace keel::data {
namespace {

std::vector<std::string> stream(const std::string& text, std::vector<std::string> stops,
                                bool* stopped = nullptr, const std::string& prompt = "") {
  ByteTokenizer tok;
  TextStream s(tok, std::move(stops), prompt);
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

// Only the new text was searched: "\n\n" never stopped after a prompt ending in "\n" at the
// model's first "\n", and the text ran on past a stop string visible in prompt + output. Now a
// stop string may begin in the prompt (as HF's StopStringCriteria), but must end in the new text.
TEST(TextStream, AStopStringMayBeginInThePrompt) {
  bool stopped = false;
  auto p = stream("\nQ: next", {"\n\n"}, &stopped, "Q: 1+1\nA: 2\n");
  EXPECT_TRUE(stopped);
  EXPECT_EQ(join(p), "");
  // Its new part is held back while it may still complete one ...
  p = stream("ENDx", {"xEND"}, &stopped, "say x");
  EXPECT_TRUE(stopped);
  EXPECT_EQ(join(p), "");
  EXPECT_EQ(p[0], "");
  p = stream("ENy", {"xEND"}, &stopped, "say x");
  EXPECT_FALSE(stopped);
  EXPECT_EQ(p[1], "");
  EXPECT_EQ(p[2], "ENy");  // ... and released when it cannot
  EXPECT_EQ(join(p), "ENy");
  // One wholly in the prompt does not stop; the earliest occurrence wins across stops.
  EXPECT_EQ(join(stream("ab##cd", {"Q:", "##"}, &stopped, "Q: x")), "ab");
  EXPECT_EQ(join(stream("b then a", {"ab", " a"}, &stopped, "xa")), "");
}

}  // namespace
}  // namespace keel::data
