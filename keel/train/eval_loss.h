// The loss of a model on a dataset as training weighs it: every batch the loader makes of it (in
// order, no shuffling), the summed cross-entropy of the target tokens (the training masks: labels
// of context tokens and padding are -100) divided by their count. `keel eval` and the trainer's
// evaluation both use it.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "keel/amp/precision.h"
#include "keel/data/dataset.h"
#include "keel/models/causal_lm.h"

namespace keel {

// One example's part of a LossTotal: its dataset index, its targets' summed loss and their count.
struct ExampleLoss {
  int64_t id = 0;
  double loss_sum = 0;
  int64_t tokens = 0;
};

struct LossTotal {
  double loss_sum = 0;  // summed over target tokens (nats)
  int64_t tokens = 0;   // target tokens
  int64_t examples = 0;
  // Batches whose summed loss is NaN or inf, and the dataset indices of the first one's rows.
  int64_t batches = 0, nonfinite_batches = 0;
  std::vector<int64_t> first_nonfinite_batch;
  // With per_example: each example's own part, in the order evaluated (the sums add up to
  // loss_sum and tokens).
  std::vector<ExampleLoss> per_example;
  double loss() const { return tokens ? loss_sum / static_cast<double>(tokens) : 0; }
  double perplexity() const { return std::exp(loss()); }
};

// Gradients off, the model in eval mode (left so), under the policy's autocast, batches moved to
// `device`. `per_example`: also each example's part (LossTotal::per_example).
LossTotal dataset_loss(models::CausalLM& model, const data::Dataset& set, int64_t batch_size,
                       int64_t seq_len, int64_t pad_id, const PrecisionPolicy& policy,
                       Device device, bool per_example = false);

// The same over examples `ids` of `set` (in batches of batch_size, in the order given): the loss
// of one step's batch under the current weights (the trend advisor's spike comparison).
LossTotal examples_loss(models::CausalLM& model, const data::Dataset& set,
                        const std::vector<int64_t>& ids, int64_t batch_size, int64_t seq_len,
                        int64_t pad_id, const PrecisionPolicy& policy, Device device,
                        bool per_example = false);

// Of examples `ids`, those whose loss alone (a batch of one) is not finite: which rows of a
// non-finite batch produce it, for an error that names their file and line.
std::vector<int64_t> nonfinite_examples(models::CausalLM& model, const data::Dataset& set,
                                        const std::vector<int64_t>& ids, int64_t seq_len,
                                        int64_t pad_id, const PrecisionPolicy& policy,
                                        Device device);

}  // namespace keel
