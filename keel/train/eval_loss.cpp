#include "keel/train/eval_loss.h"

#include <cmath>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/data/loader.h"
#include "keel/train/trainer.h"

namespace keel {

LossTotal dataset_loss(models::CausalLM& model, const data::Dataset& set, int64_t batch_size,
                       int64_t seq_len, int64_t pad_id, const PrecisionPolicy& policy,
                       Device device) {
  LossTotal t;
  t.examples = set.size();
  if (set.size() == 0) return t;
  NoGradGuard no_grad;
  model.train(false);
  amp::AutocastGuard autocast(policy.autocast, policy.compute_dtype);
  data::DataLoader loader(set, batch_size, seq_len, pad_id, /*shuffle=*/false, /*seed=*/0);
  for (int64_t i = 0; i < loader.batches_per_epoch(); ++i) {
    data::Batch b = loader.batch(0, i).to(device);
    if (b.n_targets == 0) continue;
    const double sum = batch_loss_sum(model, b).item();
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
