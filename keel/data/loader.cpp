#include "keel/data/loader.h"

#include <algorithm>
#include <bit>
#include <numeric>

#include "keel/data/rng.h"
#include "keel/numerics/error.h"

namespace keel::data {

int64_t padded_length(int64_t longest, int64_t seq_len) {
  const int64_t n = std::clamp<int64_t>(longest, 1, seq_len);
  const int64_t step =
      std::max<int64_t>(1, static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(n)) / 8));
  return std::min(seq_len, (n + step - 1) / step * step);
}

Batch collate(const Dataset& ds, const std::vector<int64_t>& ids, int64_t seq_len, int64_t pad_id,
              bool to_longest) {
  KEEL_CHECK(seq_len >= 2 && !ids.empty(), "collate needs seq_len >= 2 and at least one example");
  const int64_t B = static_cast<int64_t>(ids.size());
  std::vector<ExampleView> rows;
  rows.reserve(ids.size());
  int64_t longest = to_longest ? 0 : seq_len;
  for (int64_t id : ids) {
    rows.push_back(ds.get(id));
    longest = std::max<int64_t>(longest, static_cast<int64_t>(rows.back().size()));
  }
  const int64_t T = padded_length(longest, seq_len);
  const bool packed = !rows.front().example_starts.empty();
  Batch b;
  if (packed) b.position_ids = Tensor::empty({B, T}, DType::I64);  // [B, T]
  b.input_ids = Tensor::empty({B, T}, DType::I64);                 // [B, T]
  b.labels = Tensor::empty({B, T}, DType::I64);                    // [B, T]
  b.attention_mask = Tensor::empty({B, T}, DType::U8);             // [B, T]
  int64_t* in = b.input_ids.data_as<int64_t>();
  int64_t* lab = b.labels.data_as<int64_t>();
  uint8_t* mask = b.attention_mask.data_as<uint8_t>();
  int64_t* position = packed ? b.position_ids.data_as<int64_t>() : nullptr;
  for (int64_t r = 0; r < B; ++r) {
    const ExampleView& e = rows[static_cast<size_t>(r)];
    KEEL_CHECK(e.consistent(), "example tokens and target differ in length");
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(e.size()), T);
    int64_t* in_r = in + r * T;
    int64_t* lab_r = lab + r * T;
    uint8_t* mask_r = mask + r * T;
    // A packed row's examples start at these offsets (the first at 0).
    std::vector<int64_t> example_start(1, 0);
    for (size_t k = 1; k + 1 < e.example_starts.size(); ++k)
      example_start.push_back(static_cast<int64_t>(e.example_starts[k] - e.example_starts[0]));
    size_t next = 1;  // the next example's index in example_start
    int64_t pos = 0;
    for (int64_t t = 0; t < T; ++t) {
      const bool real = t < len;
      in_r[t] = real ? e.id(static_cast<size_t>(t)) : pad_id;
      mask_r[t] = real ? 1 : 0;
      while (next < example_start.size() && t == example_start[next]) ++next, pos = 0;
      if (packed) position[r * T + t] = pos++;
      // Position t predicts token t+1, which must exist within the kept row, be a target and
      // belong to the same example.
      const bool same_example = next >= example_start.size() || t + 1 != example_start[next];
      const bool labeled = t + 1 < len && same_example && e.target[static_cast<size_t>(t + 1)] != 0;
      lab_r[t] = labeled ? e.id(static_cast<size_t>(t + 1)) : kIgnoreLabel;
      b.n_targets += labeled;
    }
  }
  b.example_ids = ids;
  return b;
}

DataLoader::DataLoader(const Dataset& ds, int64_t batch_size, int64_t seq_len, int64_t pad_id,
                       bool shuffle, uint64_t seed, bool to_longest)
    : ds_(ds),
      batch_size_(batch_size),
      seq_len_(seq_len),
      pad_id_(pad_id),
      shuffle_(shuffle),
      to_longest_(to_longest),
      seed_(seed) {
  if (ds.size() <= 0)
    throw Error("DataLoader: the dataset is empty; check data.path (or data.num_examples)",
                Error::kUsage);
  if (batch_size < 1)
    throw Error("DataLoader: batch_size is " + std::to_string(batch_size) + "; it must be >= 1",
                Error::kUsage);
  if (seq_len < 2)
    throw Error("DataLoader: seq_len is " + std::to_string(seq_len) +
                    "; next-token prediction needs at least 2 positions (set data.seq_len >= 2)",
                Error::kUsage);
  batches_per_epoch_ = (ds.size() + batch_size - 1) / batch_size;
}

std::vector<int64_t> DataLoader::epoch_order(int64_t epoch) const {
  if (epoch < 0) throw Error("DataLoader: epoch " + std::to_string(epoch) + " is negative");
  std::vector<int64_t> order(static_cast<size_t>(ds_.size()));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (shuffle_) {
    // One stream per (seed, epoch): mixing both through the bijective mix64 keeps nearby seeds
    // and epochs from producing related streams.
    SplitMix64 rng(mix64(seed_) ^ mix64(static_cast<uint64_t>(epoch) + 0x632be59bd9b4e019ULL));
    shuffle_in_place(order, rng);
  }
  return order;
}

Batch DataLoader::batch(int64_t epoch, int64_t index) const {
  // Checked here, not only in epoch_order: the cache's "no epoch yet" sentinel is -1.
  if (epoch < 0) throw Error("DataLoader: epoch " + std::to_string(epoch) + " is negative");
  if (index < 0 || index >= batches_per_epoch_)
    throw Error("DataLoader: batch index " + std::to_string(index) + " is outside [0, " +
                std::to_string(batches_per_epoch_) + ") for an epoch of " +
                std::to_string(ds_.size()) + " examples in batches of " +
                std::to_string(batch_size_));
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_epoch_ != epoch) {
      cached_order_ = epoch_order(epoch);
      cached_epoch_ = epoch;
    }
    const int64_t begin = index * batch_size_, end = std::min(begin + batch_size_, ds_.size());
    ids.assign(cached_order_.begin() + begin, cached_order_.begin() + end);
  }
  return collate(ds_, ids, seq_len_, pad_id_, to_longest_);
}

}  // namespace keel::data
