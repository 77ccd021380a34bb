// Packing examples into rows (data.pack with JSONL): best-fit-decreasing rows, views of the
// storage, position_ids that restart at each example, no label across an example's end, the
// validation split taken before packing, and the file's lines named for a row.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include "keel/data/dataset.h"
#include "keel/data/loader.h"
#include "tests/support/check.h"

namespace keel::data::packing_test {

// Example e: `n` tokens 100 * (e + 1) + t, every one a target.
Example numbered(int32_t e, int32_t n) {
  Example x;
  for (int32_t t = 0; t < n; ++t) x.tokens.push_back(100 * (e + 1) + t), x.target.push_back(1);
  return x;
}

std::vector<int32_t> concat(const std::vector<Example>& ex, const std::vector<int>& which,
                            size_t cap = SIZE_MAX) {
  std::vector<int32_t> v;
  for (int e : which)
    for (size_t t = 0; t < ex[e].tokens.size() && t < cap; ++t) v.push_back(ex[e].tokens[t]);
  return v;
}

const std::vector<Example>& seven() {
  static const std::vector<Example> ex = {numbered(0, 4), numbered(1, 7), numbered(2, 3),
                                          numbered(3, 6), numbered(4, 2), numbered(5, 12),
                                          numbered(6, 1)};
  return ex;
}

TEST(Packing, RowsAreBestFitDecreasing) {
  ExampleDataset ds(seven(), "hand.jsonl", {1, 2, 3, 4, 5, 6, 7});
  ds.pack_rows(10);
  // Longest first: 5 (12, cut to 10) fills a row; 1 (7) and 3 (6) open rows; 0 (4) fits 3's row
  // exactly (its room 4 is the least that holds it); 2 (3) fills 1's; 4 (2) opens a row, 6 joins.
  ASSERT_EQ(ds.size(), 4);
  const std::vector<std::vector<int>> rows = {{5}, {1, 2}, {3, 0}, {4, 6}};
  for (int64_t r = 0; r < 4; ++r) {
    const ExampleView v = ds.get(r);
    EXPECT_EQ(v.copy().tokens, concat(seven(), rows[r])) << r;
    EXPECT_EQ(v.example_starts.size(), rows[r].size() + 1) << r;
    EXPECT_EQ(v.example_starts.back() - v.example_starts.front(), v.size()) << r;
  }
  // A row is one view of the storage: rows follow one another.
  EXPECT_EQ(ds.get(2).tokens.data(), ds.get(1).tokens.data() + ds.get(1).size());
  // A row names its first example's line, and how many more it holds.
  EXPECT_EQ(ds.where(0), "hand.jsonl:6");
  EXPECT_EQ(ds.where(1), "hand.jsonl:2 (packed with 1 more example)");
  EXPECT_EQ(ds.where(3), "hand.jsonl:5 (packed with 1 more example)");
  // The same file packs into the same rows every time.
  ExampleDataset again(seven(), "hand.jsonl");
  again.pack_rows(10);
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(again.get(r).copy().tokens, ds.get(r).copy().tokens);
}

TEST(Packing, CollatedRowsRestartPositionsAndLabelNoTokenOfTheNextExample) {
  std::vector<Example> ex = seven();
  ex[2].target = {0, 0, 1};  // example 2: a prompt of two tokens, then its completion
  ExampleDataset ds(ex, "hand.jsonl");
  ds.pack_rows(10);
  const Batch b = collate(ds, {1, 3, 0}, 10, /*pad_id=*/0);
  ASSERT_TRUE(b.position_ids.defined());
  const int64_t T = 10;
  ASSERT_EQ(b.input_ids.size(1), T);
  const std::vector<int64_t> pos = b.position_ids.to_ints(), lab = b.labels.to_ints();
  // Row 0: examples 1 (7 tokens) then 2 (3).
  EXPECT_EQ(std::vector<int64_t>(pos.begin(), pos.begin() + T),
            (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 0, 1, 2}));
  EXPECT_EQ(std::vector<int64_t>(lab.begin(), lab.begin() + T),
            (std::vector<int64_t>{201, 202, 203, 204, 205, 206, -100, -100, 302, -100}));
  // Row 1: examples 4 (2) and 6 (1), then padding, whose positions go on counting.
  EXPECT_EQ(std::vector<int64_t>(pos.begin() + T, pos.begin() + 2 * T),
            (std::vector<int64_t>{0, 1, 0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(std::vector<int64_t>(lab.begin() + T, lab.begin() + 2 * T),
            (std::vector<int64_t>{501, -100, -100, -100, -100, -100, -100, -100, -100, -100}));
  EXPECT_EQ(b.attention_mask.to_ints()[T + 2], 1);
  EXPECT_EQ(b.attention_mask.to_ints()[T + 3], 0);
  // Row 2: example 5 alone, longer than the row: cut to it as unpacked.
  EXPECT_EQ(std::vector<int64_t>(pos.begin() + 2 * T, pos.end()),
            (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(lab[3 * T - 2], 609);
  EXPECT_EQ(lab[3 * T - 1], -100);
  EXPECT_EQ(b.n_targets, 6 + 1 + 1 + 9);
  // Unpacked rows carry no position_ids (the model counts 0..T-1).
  ExampleDataset plain(ex, "hand.jsonl");
  EXPECT_FALSE(collate(plain, {0, 1}, 10, 0).position_ids.defined());
}

TEST(Packing, JsonlFilesPackAfterTheirValidationSplit) {
  const std::string path = test::temp_dir("packing") + "/d.jsonl";
  {
    std::ofstream f(path);
    for (int i = 0; i < 12; ++i)
      f << "{\"prompt\": \"q" << i << "\", \"completion\": \"" << std::string(1 + i % 4, 'a')
        << "\"}\n";
  }
  const ByteTokenizer tok;
  auto packed = load_dataset("jsonl", path, "data.path", tok, 16, /*pack=*/true);
  auto plain = load_dataset("jsonl", path, "data.path", tok, 16, /*pack=*/false);
  ASSERT_EQ(plain->size(), 12);
  EXPECT_LT(packed->size(), 12);
  int64_t tokens = 0, packed_tokens = 0;
  for (int64_t i = 0; i < plain->size(); ++i) tokens += static_cast<int64_t>(plain->get(i).size());
  for (int64_t i = 0; i < packed->size(); ++i) {
    packed_tokens += static_cast<int64_t>(packed->get(i).size());
    EXPECT_LE(packed->get(i).size(), 16u) << packed->where(i);
  }
  EXPECT_EQ(packed_tokens, tokens);
  // What the memory estimate reads: a file counted whole, its rows and their longest.
  const DatasetFootprint f = dataset_footprint(path, "jsonl", tok, 16, /*pack=*/true);
  ASSERT_TRUE(f.estimated && f.whole);
  EXPECT_EQ(f.examples, packed->size());
  EXPECT_EQ(f.tokens, tokens);
  int64_t longest = 0;
  for (int64_t i = 0; i < packed->size(); ++i)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(packed->get(i).size()));
  EXPECT_EQ(f.longest, longest);
  EXPECT_EQ(f.held, packed->held_bytes());
  EXPECT_GE(f.load_peak, 2 * f.held);  // the rows are copied out of the examples
  // The split holds out the file's last examples, then packs each part.
  auto [train, eval] = split_dataset(load_dataset("jsonl", path, "data.path", tok, 16, false), 3,
                                     path, /*to_pack=*/true);
  EXPECT_EQ(eval->where(0), path + ":10");
  EXPECT_EQ(eval->get(2).copy().tokens, plain->get(11).copy().tokens);
  auto train_rows = pack_dataset(std::move(train), 16);
  auto eval_rows = pack_dataset(std::move(eval), 16);
  // Lines 10, 11, 12: 5, 7 and 8 tokens ("q9" "aa" eos, ...): 12 and 11 share a row.
  ASSERT_EQ(eval_rows->size(), 2);
  EXPECT_EQ(eval_rows->where(0), path + ":12 (packed with 1 more example)");
  EXPECT_EQ(eval_rows->where(1), path + ":10");
  int64_t split_tokens = 0;
  for (int64_t i = 0; i < eval_rows->size(); ++i)
    split_tokens += static_cast<int64_t>(eval_rows->get(i).size());
  for (int64_t i = 0; i < train_rows->size(); ++i)
    split_tokens += static_cast<int64_t>(train_rows->get(i).size());
  EXPECT_EQ(split_tokens, tokens);
}

}  // namespace keel::data::packing_test
