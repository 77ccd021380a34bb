// Collation and the deterministic sampler.
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

#include "keel/data/dataset.h"
#include "keel/tensor/tensor.h"

namespace keel::data {

// Labels that cross_entropy ignores (PyTorch's default ignore_index).
inline constexpr int64_t kIgnoreLabel = -100;

// A batch for next-token prediction, right-padded to T = padded_length(its longest row, seq_len).
struct Batch {
  Tensor input_ids;       // [B, T] I64; pad positions hold pad_id
  Tensor labels;          // [B, T] I64: tokens[t + 1] when that token is a target, else -100
                          //   (context tokens, padding, and the last real and last row position)
  Tensor attention_mask;  // [B, T] U8: 1 on real tokens, 0 on padding
  // [B, T] I64, packed rows only (data.pack with JSONL; else undefined): each token's position in
  // its example, restarting at 0 on an example's first token; padding goes on counting. The
  // model's RoPE angles or wpe rows, and which keys a query sees (its own example's).
  Tensor position_ids;
  int64_t n_targets = 0;             // labels != -100 (the token count a loss mean divides by)
  std::vector<int64_t> example_ids;  // dataset index of each row

  // The same batch with its tensors on `dev` (itself on the cpu). position_ids stay on the cpu:
  // the host builds RoPE's tables and attention's bounds from them.
  Batch to(Device dev) const {
    if (dev.is_cpu()) return *this;
    Batch d = *this;
    d.input_ids = input_ids.to(dev);
    d.labels = labels.to(dev);
    if (attention_mask.defined()) d.attention_mask = attention_mask.to(dev);
    return d;
  }
};

// The row length T of a batch whose longest example holds `longest` tokens: that length capped at
// seq_len and rounded up to an eighth of its power of two (16..31 exact, 100 -> 104, 600 -> 640),
// so that padding adds at most 12.5% and a run's batches take at most eight lengths an octave
// (each new matmul shape builds its oneDNN primitives once: ~8 ms each). Short rows were padded
// to seq_len: an arith batch of 10-token rows at the default seq_len 32 computed 3.2x its tokens.
// HF's collators pad to the longest row likewise (padding="longest").
int64_t padded_length(int64_t longest, int64_t seq_len);

// Collates the listed examples: each row keeps the first seq_len tokens (longer examples are
// truncated at the end) and is right-padded with pad_id to padded_length(the longest row,
// seq_len), or to seq_len itself when `to_longest` is false (data.padding = "max_length"). Rows of
// a packed dataset (ExampleView::example_starts) get position_ids, and the last token of each of
// their examples no label: an example never predicts the next one's first token.
// seq_len >= 2, ids non-empty.
Batch collate(const Dataset& ds, const std::vector<int64_t>& ids, int64_t seq_len, int64_t pad_id,
              bool to_longest = true);

// Deterministic loader: epoch e visits the dataset in the order of a permutation drawn from
// (seed, e) by Fisher-Yates with SplitMix64 (rng.h), or in index order when shuffle is false.
// batch(e, i) is a pure function of (e, i), so resuming needs only the epoch and the batch index.
// batches_per_epoch() = ceil(size / batch_size): the last batch of an epoch holds the remainder
// (drop_last = false) and is never empty. Thread-safe.
class DataLoader {
 public:
  // Errors (kind kUsage): an empty dataset, batch_size < 1, seq_len < 2.
  DataLoader(const Dataset& ds, int64_t batch_size, int64_t seq_len, int64_t pad_id, bool shuffle,
             uint64_t seed, bool to_longest = true);
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t size() const { return ds_.size(); }
  int64_t batch_size() const { return batch_size_; }
  int64_t seq_len() const { return seq_len_; }
  // 0 <= index < batches_per_epoch(), epoch >= 0 (else an Error).
  Batch batch(int64_t epoch, int64_t index) const;
  // The dataset indices of epoch e in visiting order (a permutation of 0..size-1).
  std::vector<int64_t> epoch_order(int64_t epoch) const;

 private:
  const Dataset& ds_;
  int64_t batch_size_, seq_len_, pad_id_;
  bool shuffle_, to_longest_;
  uint64_t seed_;
  int64_t batches_per_epoch_;
  // The last epoch's order, so that a run of batch(e, 0..n-1) draws the permutation once.
  mutable std::mutex mu_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;
};

}  // namespace keel::data
