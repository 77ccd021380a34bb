#include "keel/train/eval_loss.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/data/loader.h"
#include "keel/numerics/error.h"
#include "keel/ops/cross_entropy.h"
#include "keel/train/trainer.h"

namespace keel {

LossTotal dataset_loss(models::CausalLM& model, const data::Dataset& set, int64_t batch_size,
                       int64_t seq_len, int64_t pad_id, const PrecisionPolicy& policy,
                       Device device, bool per_example) {
  std::vector<int64_t> all(static_cast<size_t>(set.size()));
  std::iota(all.begin(), all.end(), int64_t{0});
  return examples_loss(model, set, all, batch_size, seq_len, pad_id, policy, device, per_example);
}

LossTotal examples_loss(models::CausalLM& model, const data::Dataset& set,
                        const std::vector<int64_t>& ids, int64_t batch_size, int64_t seq_len,
                        int64_t pad_id, const PrecisionPolicy& policy, Device device,
                        bool per_example) {
  LossTotal t;
  t.examples = static_cast<int64_t>(ids.size());
  if (ids.empty()) return t;
  KEEL_CHECK(batch_size >= 1, "examples_loss needs batch_size >= 1");
  NoGradGuard no_grad;
  model.train(false);
  amp::AutocastGuard autocast(policy.autocast, policy.compute_dtype);
  for (size_t begin = 0; begin < ids.size(); begin += static_cast<size_t>(batch_size)) {
    const size_t end = std::min(ids.size(), begin + static_cast<size_t>(batch_size));
    const std::vector<int64_t> chunk(ids.begin() + static_cast<std::ptrdiff_t>(begin),
                                     ids.begin() + static_cast<std::ptrdiff_t>(end));
    data::Batch b = data::collate(set, chunk, seq_len, pad_id).to(device);
    if (b.n_targets == 0) {
      if (per_example)
        for (int64_t id : chunk) t.per_example.push_back({id, 0.0, 0});
      continue;
    }
    std::vector<double> rows;
    const double sum = batch_loss_sum(model, b, per_example ? &rows : nullptr).item();
    if (per_example)
      for (size_t r = 0; r < chunk.size(); ++r) {
        const int64_t row = static_cast<int64_t>(r);
        t.per_example.push_back(
            {chunk[r], rows[r],
             ops::count_targets(b.labels.slice_rows(row, row + 1).view({-1}), data::kIgnoreLabel)});
      }
    if (!std::isfinite(sum) && t.nonfinite_batches++ == 0) t.first_nonfinite_batch = b.example_ids;
    t.loss_sum += sum;
    t.tokens += b.n_targets;
    ++t.batches;
  }
  return t;
}

std::vector<int64_t> nonfinite_examples(models::CausalLM& model, const data::Dataset& set,
                                        const std::vector<int64_t>& ids, int64_t seq_len,
                                        int64_t pad_id, const PrecisionPolicy& policy,
                                        Device device) {
  NoGradGuard no_grad;
  model.train(false);
  amp::AutocastGuard autocast(policy.autocast, policy.compute_dtype);
  std::vector<int64_t> bad;
  for (int64_t id : ids) {
    const data::Batch b = data::collate(set, {id}, seq_len, pad_id).to(device);
    if (b.n_targets > 0 && !std::isfinite(batch_loss_sum(model, b).item())) bad.push_back(id);
  }
  return bad;
}

}  // namespace keel
