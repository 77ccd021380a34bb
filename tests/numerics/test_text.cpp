// numerics/text.h: edit distance on known pairs and its metric properties.
#include "keel/numerics/text.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace keel {
namespace {

TEST(Text, EditDistanceOfKnownPairs) {
  EXPECT_EQ(edit_distance("", ""), 0u);
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  EXPECT_EQ(edit_distance("abc", ""), 3u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("flaw", "lawn"), 2u);
  EXPECT_EQ(edit_distance("adaptor", "adapter"), 1u);
  EXPECT_EQ(edit_distance("lr", "optim.lr"), 6u);
  EXPECT_EQ(edit_distance("h.0.mlp", "h.0.mlp"), 0u);
  EXPECT_EQ(edit_distance("h.0.attn", "h.1.attn"), 1u);
}

TEST(Text, EditDistanceIsASymmetricMetric) {
  const std::vector<std::string> words = {
      "",     "a", "ab", "ba", "rank", "r", "optim", "option", "model.adapter", "model.adaptor",
      "model"};
  for (const auto& a : words)
    for (const auto& b : words) {
      EXPECT_EQ(edit_distance(a, b), edit_distance(b, a)) << a << " / " << b;
      EXPECT_EQ(edit_distance(a, b) == 0, a == b) << a << " / " << b;
      for (const auto& c : words)
        EXPECT_LE(edit_distance(a, c), edit_distance(a, b) + edit_distance(b, c));
    }
}

TEST(Text, ShellWordQuotesOnlyWhatAShellWouldSplitOrExpand) {
  EXPECT_EQ(shell_word("out/run-1/debug/nan_capture/rank0"), "out/run-1/debug/nan_capture/rank0");
  EXPECT_EQ(shell_word("out/run 1"), "'out/run 1'");
  EXPECT_EQ(shell_word("it's"), "'it'\\''s'");
  EXPECT_EQ(shell_word("$HOME;*"), "'$HOME;*'");
  EXPECT_EQ(shell_word(""), "''");
}

TEST(Text, CountOfUsesTheSingularForOne) {
  EXPECT_EQ(count_of(1, "step"), "1 step");
  EXPECT_EQ(count_of(0, "step"), "0 steps");
  EXPECT_EQ(count_of(2, "micro-batch", "micro-batches"), "2 micro-batches");
  EXPECT_EQ(count_of(1, "micro-batch", "micro-batches"), "1 micro-batch");
}

}  // namespace
}  // namespace keel
