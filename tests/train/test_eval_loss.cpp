// train/eval_loss.h: a dataset's loss as training weighs it, and where a non-finite one comes
// from. Batched, the loss is the token-weighted sum of the examples' own; a NaN in one token's
// embedding makes the batches holding that token non-finite, and nonfinite_examples finds the one
// example that is non-finite alone.
#include "keel/train/eval_loss.h"

#include <gtest/gtest.h>

#include <limits>

#include "keel/autograd/node.h"
#include "tests/support/tiny_models.h"

namespace keel {
namespace {

// Four examples of the tiny Llama's 37-token vocabulary; only example 2 holds token 7.
data::ExampleDataset four_examples() {
  return data::ExampleDataset({{{1, 2, 3, 4}, {0, 1, 1, 1}},
                               {{5, 6, 5, 6, 5}, {1, 1, 1, 1, 1}},
                               {{8, 7, 9}, {1, 1, 1}},
                               {{3, 3, 4, 4, 5, 5}, {0, 0, 1, 1, 1, 1}}},
                              "four.jsonl", {1, 2, 3, 4});
}

TEST(EvalLoss, BatchedIsTheTokenWeightedSumOfTheExamples) {
  auto model = models::make_causal_lm(test::tiny_model_spec("llama"), 5);
  const data::ExampleDataset set = four_examples();
  const PrecisionPolicy f32 = resolve_precision("32-true", Device::cpu());
  const LossTotal all = dataset_loss(*model, set, 3, 8, 0, f32, Device::cpu());
  double sum = 0;
  int64_t tokens = 0;
  for (int64_t i = 0; i < set.size(); ++i) {
    data::ExampleDataset one({set.get(i).copy()}, "one");
    const LossTotal r = dataset_loss(*model, one, 1, 8, 0, f32, Device::cpu());
    sum += r.loss_sum;
    tokens += r.tokens;
  }
  EXPECT_EQ(all.tokens, tokens);
  EXPECT_EQ(all.tokens, 3 + 4 + 2 + 4);  // targets after the first position
  EXPECT_NEAR(all.loss_sum, sum, 1e-4 * sum);
  EXPECT_EQ(all.batches, 2);
  EXPECT_EQ(all.nonfinite_batches, 0);
}

TEST(EvalLoss, TheExampleThatIsNonFiniteAloneIsNamed) {
  auto model = models::make_causal_lm(test::tiny_model_spec("llama"), 5);
  {
    NoGradGuard g;
    Tensor emb = model->find_parameter("model.embed_tokens.weight");
    ASSERT_TRUE(emb.defined());
    emb.data_as<float>()[7 * emb.size(1)] = std::numeric_limits<float>::quiet_NaN();
  }
  const data::ExampleDataset set = four_examples();
  const PrecisionPolicy f32 = resolve_precision("32-true", Device::cpu());
  const LossTotal r = dataset_loss(*model, set, 2, 8, 0, f32, Device::cpu());
  EXPECT_TRUE(std::isnan(r.loss_sum));
  EXPECT_EQ(r.batches, 2);
  EXPECT_EQ(r.nonfinite_batches, 1);  // examples {2, 3}; {0, 1} stay finite
  EXPECT_EQ(r.first_nonfinite_batch, (std::vector<int64_t>{2, 3}));
  const std::vector<int64_t> alone =
      nonfinite_examples(*model, set, r.first_nonfinite_batch, 8, 0, f32, Device::cpu());
  EXPECT_EQ(alone, std::vector<int64_t>{2});
  EXPECT_EQ(set.where(alone[0]), "four.jsonl:3");
}

}  // namespace
}  // namespace keel
