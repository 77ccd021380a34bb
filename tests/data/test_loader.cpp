// Collation (labels, mask, padding, truncation) against a plain reference, and the sampler:
// a permutation per epoch, pure batch(e, i), shuffle=false order, the last partial batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <thread>

#include "keel/data/loader.h"
#include "keel/data/rng.h"
#include "keel/numerics/error.h"
#include "tests/support/check.h"

namespace keel::data {
namespace {

constexpr int64_t kPad = 256;

// Examples of varied lengths (0 .. 2*T) with random target flags; token ids < 256.
std::unique_ptr<ExampleDataset> random_dataset(int64_t n, int64_t max_len, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<Example> ex(static_cast<size_t>(n));
  for (Example& e : ex) {
    const size_t len = rng.below(static_cast<uint64_t>(max_len) + 1);
    for (size_t t = 0; t < len; ++t) {
      e.tokens.push_back(static_cast<int32_t>(rng.below(256)));
      e.target.push_back(static_cast<uint8_t>(rng.below(2)));
    }
  }
  return std::make_unique<ExampleDataset>(std::move(ex), "random");
}

// Reference collation, written from the definition: row r, position t < T holds token t of the
// example when it exists (else pad, mask 0); its label is the next token of the (truncated)
// example when that token exists and is a target. T is padded_length of the batch's longest
// example (tested on its own below).
void expect_matches_reference(const Batch& b, const Dataset& ds, int64_t seq_len) {
  const int64_t B = static_cast<int64_t>(b.example_ids.size());
  int64_t longest = 0;
  for (int64_t id : b.example_ids) longest = std::max<int64_t>(longest, ds.get(id).size());
  const int64_t T = padded_length(longest, seq_len);
  ASSERT_EQ(b.input_ids.shape(), (Shape{B, T}));
  ASSERT_EQ(b.labels.shape(), (Shape{B, T}));
  ASSERT_EQ(b.attention_mask.shape(), (Shape{B, T}));
  EXPECT_EQ(b.input_ids.dtype(), DType::I64);
  EXPECT_EQ(b.labels.dtype(), DType::I64);
  EXPECT_EQ(b.attention_mask.dtype(), DType::U8);
  const std::vector<int64_t> in = b.input_ids.to_ints(), lab = b.labels.to_ints(),
                             mask = b.attention_mask.to_ints();
  int64_t targets = 0;
  for (int64_t r = 0; r < B; ++r) {
    const Example e = ds.get(b.example_ids[r]).copy();
    const int64_t len = static_cast<int64_t>(e.tokens.size());
    for (int64_t t = 0; t < T; ++t) {
      const int64_t k = r * T + t;
      const bool real = t < len;
      EXPECT_EQ(in[k], real ? e.tokens[t] : kPad) << "row " << r << " pos " << t;
      EXPECT_EQ(mask[k], real ? 1 : 0) << "row " << r << " pos " << t;
      int64_t want = -100;
      if (t + 1 < T && t + 1 < len && e.target[t + 1]) want = e.tokens[t + 1];
      EXPECT_EQ(lab[k], want) << "row " << r << " pos " << t;
      targets += want != -100;
    }
  }
  EXPECT_EQ(b.n_targets, targets);
}

TEST(Collate, HandWrittenCase) {
  std::vector<Example> ex = {
      {{10, 11, 12, 13}, {0, 0, 1, 1}},                      // context then targets; padded
      {{1, 2, 3, 4, 5, 6, 7, 8}, {1, 1, 1, 1, 1, 1, 1, 1}},  // truncated to its start
      {{}, {}},                                              // all padding
  };
  ExampleDataset ds(std::move(ex), "hand");
  const Batch b = collate(ds, {0, 1, 2}, 6, kPad);
  EXPECT_EQ(b.input_ids.to_ints(), (std::vector<int64_t>{10, 11, 12, 13, kPad, kPad,  //
                                                         1, 2, 3, 4, 5, 6,            //
                                                         kPad, kPad, kPad, kPad, kPad, kPad}));
  EXPECT_EQ(b.labels.to_ints(), (std::vector<int64_t>{-100, 12, 13, -100, -100, -100,  //
                                                      2, 3, 4, 5, 6, -100,             //
                                                      -100, -100, -100, -100, -100, -100}));
  EXPECT_EQ(b.attention_mask.to_ints(), (std::vector<int64_t>{1, 1, 1, 1, 0, 0,  //
                                                              1, 1, 1, 1, 1, 1,  //
                                                              0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(b.n_targets, 2 + 5);
  EXPECT_EQ(b.example_ids, (std::vector<int64_t>{0, 1, 2}));
}

// A batch is padded to its longest row, not to seq_len: rows of 10 tokens at seq_len 32 were
// computed 32 long. Lengths from 16 up are rounded to an eighth of their power of two, so a run
// meets few shapes.
TEST(Collate, RowsArePaddedToTheLongestRoundedToAnEighthOfItsPowerOfTwo) {
  EXPECT_EQ(padded_length(10, 32), 10);
  EXPECT_EQ(padded_length(15, 32), 15);
  EXPECT_EQ(padded_length(16, 32), 16);
  EXPECT_EQ(padded_length(17, 32), 18);
  EXPECT_EQ(padded_length(100, 512), 104);
  EXPECT_EQ(padded_length(600, 2048), 640);
  EXPECT_EQ(padded_length(2000, 2048), 2048);
  EXPECT_EQ(padded_length(3000, 2048), 2048);  // truncated rows: seq_len
  EXPECT_EQ(padded_length(700, 650), 650);     // rounding never passes seq_len
  EXPECT_EQ(padded_length(0, 32), 1);          // a batch of empty examples
  int64_t lengths = 0;
  for (int64_t n = 1; n <= 4096; ++n) {
    const int64_t T = padded_length(n, 4096);
    ASSERT_GE(T, n);
    ASSERT_LE(T, n + n / 8) << n;  // at most 12.5% padding
    lengths += T == n;
  }
  EXPECT_LE(lengths, 15 + 8 * 8 + 1);  // 1..15 exact, then 8 an octave up to 4096

  std::vector<Example> ex = {{{1, 2, 3}, {0, 1, 1}}, {{4, 5, 6, 7, 8}, {0, 0, 1, 1, 1}}};
  ExampleDataset ds(std::move(ex), "hand");
  EXPECT_EQ(collate(ds, {0}, 32, kPad).input_ids.shape(), (Shape{1, 3}));
  EXPECT_EQ(collate(ds, {0, 1}, 32, kPad).input_ids.shape(), (Shape{2, 5}));
  EXPECT_EQ(collate(ds, {0, 1}, 4, kPad).input_ids.shape(), (Shape{2, 4}));
  // data.padding = max_length: every row seq_len long, the same tokens and labels in front.
  const Batch full = collate(ds, {0, 1}, 32, kPad, /*to_longest=*/false);
  EXPECT_EQ(full.input_ids.shape(), (Shape{2, 32}));
  EXPECT_EQ(full.n_targets, collate(ds, {0, 1}, 32, kPad).n_targets);
  DataLoader fixed(ds, 2, 32, kPad, false, 0, /*to_longest=*/false);
  EXPECT_EQ(fixed.batch(0, 0).input_ids.shape(), (Shape{2, 32}));
}

TEST(Collate, MatchesReferenceOnRandomExamples) {
  auto ds = random_dataset(37, 24, 5);
  for (int64_t T : {2, 7, 12, 30}) {
    DataLoader loader(*ds, 5, T, kPad, true, 11);
    for (int64_t i = 0; i < loader.batches_per_epoch(); ++i)
      expect_matches_reference(loader.batch(1, i), *ds, T);
  }
}

TEST(DataLoader, EachEpochIsAPermutationWithAPartialLastBatch) {
  auto ds = random_dataset(10, 5, 1);
  DataLoader loader(*ds, 3, 8, kPad, true, 1234);
  ASSERT_EQ(loader.batches_per_epoch(), 4);  // 3 + 3 + 3 + 1
  for (int64_t epoch = 0; epoch < 5; ++epoch) {
    std::vector<int64_t> seen;
    for (int64_t i = 0; i < 4; ++i) {
      const Batch b = loader.batch(epoch, i);
      const int64_t rows = i < 3 ? 3 : 1;
      EXPECT_EQ(static_cast<int64_t>(b.example_ids.size()), rows);
      EXPECT_EQ(b.input_ids.shape()[0], rows);
      seen.insert(seen.end(), b.example_ids.begin(), b.example_ids.end());
    }
    EXPECT_EQ(seen, loader.epoch_order(epoch));
    std::sort(seen.begin(), seen.end());
    std::vector<int64_t> all(10);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(seen, all) << "epoch " << epoch << " does not visit every example exactly once";
  }
  // An exact multiple has no partial batch.
  auto ds9 = random_dataset(9, 5, 1);
  EXPECT_EQ(DataLoader(*ds9, 3, 8, kPad, true, 0).batches_per_epoch(), 3);
  EXPECT_EQ(DataLoader(*ds9, 100, 8, kPad, true, 0).batches_per_epoch(), 1);
  EXPECT_EQ(DataLoader(*ds9, 100, 8, kPad, true, 0).batch(0, 0).example_ids.size(), 9u);
}

TEST(DataLoader, EpochsDifferAndSeedsDiffer) {
  auto ds = random_dataset(50, 5, 2);
  DataLoader a(*ds, 8, 8, kPad, true, 7), b(*ds, 8, 8, kPad, true, 8);
  std::vector<int64_t> identity(50);
  std::iota(identity.begin(), identity.end(), 0);
  std::set<std::vector<int64_t>> orders;
  for (int64_t e = 0; e < 6; ++e) {
    orders.insert(a.epoch_order(e));
    EXPECT_NE(a.epoch_order(e), identity);
    EXPECT_NE(a.epoch_order(e), b.epoch_order(e)) << "seed does not matter in epoch " << e;
  }
  EXPECT_EQ(orders.size(), 6u) << "two epochs share an order";
}

TEST(DataLoader, NoShuffleKeepsOrder) {
  auto ds = random_dataset(11, 5, 3);
  DataLoader loader(*ds, 4, 8, kPad, false, 99);
  for (int64_t e : {0, 3}) {
    std::vector<int64_t> seen;
    for (int64_t i = 0; i < loader.batches_per_epoch(); ++i) {
      const Batch b = loader.batch(e, i);
      seen.insert(seen.end(), b.example_ids.begin(), b.example_ids.end());
    }
    std::vector<int64_t> want(11);
    std::iota(want.begin(), want.end(), 0);
    EXPECT_EQ(seen, want);
  }
}

void expect_same_batch(const Batch& x, const Batch& y, const std::string& what) {
  test::expect_bitwise_equal(x.input_ids, y.input_ids, what + " input_ids");
  test::expect_bitwise_equal(x.labels, y.labels, what + " labels");
  test::expect_bitwise_equal(x.attention_mask, y.attention_mask, what + " attention_mask");
  EXPECT_EQ(x.n_targets, y.n_targets) << what;
  EXPECT_EQ(x.example_ids, y.example_ids) << what;
}

// batch(e, i) is a pure function: a fresh loader (a resumed run), any call order, and concurrent
// callers all see the same batches.
TEST(DataLoader, BatchesArePureFunctionsOfEpochAndIndex) {
  auto ds = random_dataset(40, 12, 4);
  DataLoader run(*ds, 6, 10, kPad, true, 2024);
  std::vector<std::vector<Batch>> in_order(3);
  for (int64_t e = 0; e < 3; ++e)
    for (int64_t i = 0; i < run.batches_per_epoch(); ++i) in_order[e].push_back(run.batch(e, i));

  DataLoader resumed(*ds, 6, 10, kPad, true, 2024);
  for (int64_t e = 2; e >= 0; --e)  // reverse order, interleaving epochs
    for (int64_t i = resumed.batches_per_epoch() - 1; i >= 0; --i) {
      expect_same_batch(resumed.batch(e, i), in_order[e][i],
                        "epoch " + std::to_string(e) + " batch " + std::to_string(i));
      expect_same_batch(resumed.batch((e + 1) % 3, 0), in_order[(e + 1) % 3][0], "interleaved");
    }

  std::vector<std::vector<Batch>> threaded(2);
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < 2; ++w)
    threads.emplace_back([&, w] {
      for (int64_t k = 0; k < 30; ++k) threaded[w].push_back(run.batch((k + w) % 3, k % 7));
    });
  for (auto& t : threads) t.join();
  for (int64_t w = 0; w < 2; ++w)
    for (int64_t k = 0; k < 30; ++k)
      expect_same_batch(threaded[w][k], in_order[(k + w) % 3][k % 7], "threaded");
}

// Fisher-Yates must give every permutation the same chance; a classic bug (swapping with any j in
// [0, n)) skews 3-element permutations by up to 40% and fails this chi-square test.
TEST(DataLoader, PermutationsAreUniform) {
  auto ds = random_dataset(3, 1, 6);
  DataLoader loader(*ds, 1, 2, kPad, true, 77);
  std::map<std::vector<int64_t>, int64_t> counts;
  const int64_t n = 6000;
  for (int64_t e = 0; e < n; ++e) ++counts[loader.epoch_order(e)];
  ASSERT_EQ(counts.size(), 6u);
  double chi2 = 0;  // 5 degrees of freedom: p(chi2 > 25) ~ 1.4e-4
  for (auto& [order, c] : counts) chi2 += double(c - n / 6) * double(c - n / 6) / double(n / 6);
  EXPECT_LT(chi2, 25.0);
}

TEST(DataLoader, Errors) {
  ExampleDataset empty({}, "empty");
  auto ds = random_dataset(5, 4, 1);
  auto usage = [](auto&& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind, Error::kUsage);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  usage([&] { DataLoader(empty, 4, 8, kPad, true, 0); }, "dataset is empty");
  usage([&] { DataLoader(*ds, 0, 8, kPad, true, 0); }, "batch_size is 0");
  usage([&] { DataLoader(*ds, 4, 1, kPad, true, 0); }, "seq_len is 1");
  DataLoader loader(*ds, 4, 8, kPad, true, 0);
  EXPECT_THROW(loader.batch(0, 2), Error);  // 2 batches: 4 + 1
  EXPECT_THROW(loader.batch(0, -1), Error);
  EXPECT_THROW(loader.batch(-1, 0), Error);
  EXPECT_THROW(ds->get(5), Error);
  // Examples whose flags do not match their tokens are a programming error caught early.
  std::vector<Example> bad = {{{1, 2, 3}, {1, 1}}};
  EXPECT_THROW(ExampleDataset(std::move(bad), "bad"), Error);
}

}  // namespace
}  // namespace keel::data
