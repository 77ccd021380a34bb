#include "keel/train/eval_loss.h"

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
    t.loss_sum += batch_loss_sum(model, b).item();
    t.tokens += b.n_targets;
  }
  return t;
}

}  // namespace keel
