// A packed row (position_ids restarting at each example's first token): every example's logits
// and its loss's gradients are what the example computes alone in a row of its own, for GPT-2
// (learned positions) and the Llama family (RoPE, GQA, Qwen's biases and q/k norms), in f32 and
// under bf16-mixed autocast, with each attention backend.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "tests/support/check.h"
#include "tests/support/tiny_models.h"

namespace keel::packed_rows_test {

// ids[t0, t0 + n) of a [1, T] row as a row of its own.
Tensor slice_ids(const std::vector<int64_t>& ids, int64_t t0, int64_t n) {
  return Tensor::from_ints(std::vector<int64_t>(ids.begin() + t0, ids.begin() + t0 + n), {1, n});
}

// One row of examples of these lengths: token ids (a multiplier's walk over the vocabulary of 37)
// and each token's position in its example.
struct PackedRow {
  std::vector<int64_t> ids, pos;
};
PackedRow packed_row(const std::vector<int64_t>& lengths, int64_t step, int64_t offset) {
  PackedRow r;
  for (int64_t n : lengths)
    for (int64_t p = 0; p < n; ++p) {
      r.ids.push_back((step * static_cast<int64_t>(r.ids.size()) + offset) % 37);
      r.pos.push_back(p);
    }
  return r;
}

// logits[0, t0 : t0 + n, :] of [1, T, V].
Tensor slice_logits(const Tensor& logits, int64_t t0, int64_t n) {
  return logits.view({logits.size(1), logits.size(2)}).slice_rows(t0, t0 + n).clone();
}

TEST(PackedRows, EachExampleComputesWhatItComputesAlone) {
  const std::vector<int64_t> lengths = {5, 9, 2, 8};  // 24 tokens: one row
  const int64_t t = 24;
  const auto [ids, pos] = packed_row(lengths, 7, 3);
  const Tensor input = Tensor::from_ints(ids, {1, t}), positions = Tensor::from_ints(pos, {1, t});
  for (const char* family : {"gpt2", "llama", "qwen2", "qwen3_d8"})
    for (ops::AttentionBackend be : {ops::AttentionBackend::kEager, ops::AttentionBackend::kFlash})
      for (bool bf16 : {false, true}) {
        models::ModelSpec spec = test::tiny_model_spec(family);
        spec.max_seq_len = t;
        spec.attention = be;
        auto model = models::make_causal_lm(spec, 5);
        amp::AutocastGuard autocast(bf16, DType::BF16);
        const std::string what = std::string(family) + " " + ops::attention_backend_name(be) +
                                 (bf16 ? " bf16-mixed" : " f32");
        const Tensor packed = model->forward(input, Tensor(), positions).to_dtype(DType::F32);
        int64_t t0 = 0;
        for (int64_t n : lengths) {
          const Tensor alone = model->forward(slice_ids(ids, t0, n), Tensor()).to_dtype(DType::F32);
          // f32: the same sums in another order; bf16: that, rounded, now and then an ulp of a
          // logit's bf16 value.
          const double tol = bf16 ? 0.03 : 2e-5;
          test::expect_close(slice_logits(packed, t0, n), alone.view({n, alone.size(2)}), tol, tol,
                             what + " example at " + std::to_string(t0));
          t0 += n;
        }
      }
}

// The gradient of a packed row's summed logits is the sum of each example's alone: no example's
// loss reaches another's tokens (through attention, positions or anything else).
TEST(PackedRows, GradientsOfAPackedRowAreTheExamplesGradientsSummed) {
  const std::vector<int64_t> lengths = {6, 3, 7};
  const int64_t t = 16;
  const auto [ids, pos] = packed_row(lengths, 5, 1);
  for (const char* family : {"gpt2", "llama"}) {
    models::ModelSpec spec = test::tiny_model_spec(family);
    spec.max_seq_len = t;
    auto model = models::make_causal_lm(spec, 9);
    // A fixed weighting of every logit as the upstream gradient.
    const Tensor w = test::randn({1, t, spec.vocab_size}, 77);
    backward(
        model->forward(Tensor::from_ints(ids, {1, t}), Tensor(), Tensor::from_ints(pos, {1, t})),
        w);
    std::vector<std::vector<float>> packed;
    for (auto& [name, p] : model->named_parameters()) {
      packed.push_back(p.grad().to_floats());
      p.set_grad(Tensor());
    }
    // The same weights on each example's logits: slices of the packed weighting.
    int64_t t0 = 0;
    for (int64_t n : lengths) {
      const Tensor wn =
          w.view({t, spec.vocab_size}).slice_rows(t0, t0 + n).clone().view({1, n, spec.vocab_size});
      backward(model->forward(slice_ids(ids, t0, n), Tensor()), wn);  // gradients accumulate
      t0 += n;
    }
    size_t k = 0;
    for (auto& [name, p] : model->named_parameters()) {
      const Tensor summed = p.grad();
      test::expect_close(Tensor::from_floats(packed[k], summed.shape()), summed, 1e-5, 1e-4,
                         std::string(family) + " " + name);
      ++k;
    }
  }
}

}  // namespace keel::packed_rows_test
