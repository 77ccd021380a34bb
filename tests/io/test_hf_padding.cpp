// Padding (issue 5, item 4): models::resize_token_embeddings grows the vocabulary for a dedicated
// pad token as HF's resize_token_embeddings does (new rows = the mean of the old rows), and a pad
// position never contributes: the masked loss is bit-identical whatever id fills the padding and
// whatever its embedding row holds.
#include <gtest/gtest.h>

#include "keel/autograd/node.h"
#include "keel/models/gpt2.h"
#include "keel/models/llama.h"
#include "keel/models/resize.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/shape.h"
#include "tests/support/check.h"

namespace keel::models {
namespace {

ModelSpec spec_of(const std::string& family, bool tied) {
  ModelSpec s;
  s.family = family;
  s.n_layer = 2;
  s.n_embd = 32;
  s.n_head = 4;
  s.n_kv_head = family == "llama" ? 2 : 0;
  s.vocab_size = 30;
  s.max_seq_len = 16;
  s.tie_embeddings = tied;
  return s;
}

Tensor embedding_of(CausalLM& m) {
  return m.find_parameter(m.spec().family == "gpt2" ? "transformer.wte.weight"
                                                    : "model.embed_tokens.weight");
}

struct Resize : ::testing::TestWithParam<std::tuple<std::string, bool, std::string>> {};

TEST_P(Resize, NewRowsAreTheMeanAndOldTokensAreUntouched) {
  const auto& [family, tied, dtn] = GetParam();
  ModelSpec spec = spec_of(family, tied);
  spec.param_dtype = *dtype_from_name(dtn);
  auto m = make_causal_lm(spec, 11);
  Tensor emb = embedding_of(*m);
  const Tensor old_emb = emb.clone();
  const Tensor old_head = tied ? Tensor() : m->find_parameter("lm_head.weight").clone();
  Tensor ids = Tensor::from_ints({1, 4, 9, 29, 0, 3}, {1, 6});
  Tensor before;
  {
    NoGradGuard no_grad;
    before = m->forward(ids, Tensor());  // [1, 6, 30]
  }
  resize_token_embeddings(*m, 32);
  EXPECT_EQ(m->spec().vocab_size, 32);
  // The handle the module and the registry share now holds 32 rows.
  EXPECT_EQ(emb.shape(), (Shape{32, 32}));
  EXPECT_EQ(embedding_of(*m).shape(), (Shape{32, 32}));
  EXPECT_EQ(emb.dtype(), spec.param_dtype);
  test::expect_bitwise_equal(emb.slice_rows(0, 30), old_emb, "kept rows");
  auto check_mean = [&](const Tensor& now, const Tensor& old, const std::string& what) {
    const std::vector<float> o = old.to_floats();
    std::vector<float> mean(32);
    for (int64_t d = 0; d < 32; ++d) {
      double acc = 0;  // f64 reference
      for (int64_t r = 0; r < 30; ++r) acc += o[r * 32 + d];
      mean[d] = static_cast<float>(acc / 30);
    }
    Tensor want = Tensor::from_floats(mean, {1, 32}, now.dtype());
    test::expect_bitwise_equal(now.slice_rows(30, 31), want, what + " row 30");
    test::expect_bitwise_equal(now.slice_rows(31, 32), want, what + " row 31");
  };
  check_mean(emb, old_emb, "embedding");
  if (!tied) {
    Tensor head = m->find_parameter("lm_head.weight");
    EXPECT_EQ(head.shape(), (Shape{32, 32}));
    test::expect_bitwise_equal(head.slice_rows(0, 30), old_head, "kept lm_head rows");
    check_mean(head, old_head, "lm_head");
  }
  // The logits of the old tokens do not move; the model now scores 32 tokens.
  NoGradGuard no_grad;
  Tensor after = m->forward(ids, Tensor());  // [1, 6, 32]
  ASSERT_EQ(after.shape(), (Shape{1, 6, 32}));
  const std::vector<float> a = after.to_floats(), b = before.to_floats();
  for (int64_t t = 0; t < 6; ++t)
    for (int64_t v = 0; v < 30; ++v) ASSERT_EQ(a[t * 32 + v], b[t * 30 + v]) << t << "," << v;
  // Shrinking drops the last rows.
  resize_token_embeddings(*m, 20);
  EXPECT_EQ(embedding_of(*m).shape(), (Shape{20, 32}));
  test::expect_bitwise_equal(embedding_of(*m), old_emb.slice_rows(0, 20), "shrunk");
  EXPECT_THROW(resize_token_embeddings(*m, 0), Error);
}

INSTANTIATE_TEST_SUITE_P(Models, Resize,
                         ::testing::Values(std::make_tuple("llama", true, "f32"),
                                           std::make_tuple("llama", false, "f32"),
                                           std::make_tuple("llama", false, "bf16"),
                                           std::make_tuple("gpt2", true, "f32")));

// Loss summed over labelled positions of a right-padded batch (as data::collate builds them).
double padded_loss(CausalLM& m, int64_t pad_id, int64_t T) {
  const std::vector<std::vector<int64_t>> rows = {{3, 7, 1, 8, 2}, {5, 5, 9}};
  std::vector<int64_t> ids, labels;
  std::vector<int64_t> mask;
  for (auto& r : rows)
    for (int64_t t = 0; t < T; ++t) {
      const bool real = t < static_cast<int64_t>(r.size());
      ids.push_back(real ? r[t] : pad_id);
      mask.push_back(real ? 1 : 0);
      labels.push_back(t + 1 < static_cast<int64_t>(r.size()) ? r[t + 1] : -100);
    }
  Tensor in = Tensor::from_ints(ids, {2, T});
  Tensor am = Tensor::from_ints(mask, {2, T}, DType::U8);
  Tensor logits = m.forward(in, am);
  Tensor flat = ops::reshape(logits, {-1, logits.size(-1)});
  return ops::cross_entropy(flat, Tensor::from_ints(labels, {2 * T}), -100, ops::Reduction::kSum)
      .item();
}

TEST(Padding, PadNeverContributes) {
  for (auto [family, tied] :
       {std::pair<std::string, bool>{"llama", true}, {"llama", false}, {"gpt2", true}}) {
    auto m = make_causal_lm(spec_of(family, tied), 13);
    resize_token_embeddings(*m, 31);  // a dedicated pad token, id 30
    NoGradGuard no_grad;
    const double ref = padded_loss(*m, 30, 8);
    // Whatever fills the padding — a real token (Llama-3.1's id 0 is "!") or the pad — the loss is
    // the same, bit for bit: pad positions carry no label and are masked out of attention.
    EXPECT_EQ(padded_loss(*m, 0, 8), ref) << family;
    EXPECT_EQ(padded_loss(*m, 17, 8), ref) << family;
    // Extra padding: the same examples in longer rows (other shapes, same sums up to rounding).
    EXPECT_NEAR(padded_loss(*m, 30, 12), ref, 1e-5 * std::abs(ref)) << family;
    if (!tied) {
      // The pad row's input embedding never reaches a labelled position, even a wild one. (Tied,
      // the row is also the pad token's output row, which every softmax includes, as in HF.)
      Tensor emb = embedding_of(*m);
      emb.slice_rows(30, 31).fill(1e4f);
      emb.bump_version();
      EXPECT_EQ(padded_loss(*m, 30, 8), ref) << family << ": the pad row leaks into the loss";
    }
  }
}

}  // namespace
}  // namespace keel::models
