// build_model's frozen base in model.base_dtype (train/run.h): a random base under an adapter is
// drawn directly in bf16, never as a whole f32 model, and holds the bits of the f32 model built,
// grown for the pad id, adapted and cast afterwards -- DoRA's magnitudes (from the f32 draws) and
// the grown embedding rows (the mean of the f32 rows) included.
#include <gtest/gtest.h>

#include <cstring>

#include "keel/models/resize.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/train/run.h"
#include "tests/support/check.h"

namespace keel {
namespace {

TEST(BuildModel, ARandomBf16BaseHasTheBitsOfTheF32ModelCastAfterwards) {
  for (const char* kind : {"lora", "dora", "lokr"}) {
    for (const char* family : {"llama", "gpt2"}) {
      const bool llama = std::string(family) == "llama";
      const std::string targets = llama ? "[\"q_proj\",\"down_proj\",\"lm_head\"]" : "[\"c_attn\"]";
      std::vector<std::string> sets = {"run.out_dir=" + test::temp_dir("build-model"),
                                       "run.seed=9",
                                       std::string("model.family=") + family,
                                       "model.n_layer=2",
                                       "model.n_embd=32",
                                       "model.n_head=4",
                                       "model.base_dtype=bf16",
                                       std::string("model.adapter.kind=") + kind,
                                       "model.adapter.r=4",
                                       "model.adapter.target_modules=" + targets,
                                       "data.num_examples=8",
                                       "data.eval_examples=0",
                                       "data.seq_len=8",
                                       "log.console=false",
                                       "log.metrics=false",
                                       "log.tensorboard=false"};
      if (llama) sets.push_back("model.tie_embeddings=false");  // lm_head: grown and adapted
      const Config cfg = load_config("", sets);
      const RunData d = build_data(cfg);
      const models::ModelSpec spec = model_spec(cfg, d.tokenizer->vocab_size(), DType::F32);
      // The byte tokenizer's own pad, and a pad id one past the vocabulary (data.pad = "add" for a
      // tokenizer without one) that grows the embeddings.
      for (const int64_t pad_id : {d.pad_id, spec.vocab_size}) {
        auto m = build_model(cfg, *d.tokenizer, pad_id, DType::F32, [](const std::string&) {});

        // The sequence before: the f32 model, grown, adapted, then its frozen base cast.
        auto ref = models::make_causal_lm(spec, cfg.run.seed);
        if (pad_id >= spec.vocab_size) models::resize_token_embeddings(*ref, pad_id + 1);
        nn::AdapterOptions a = cfg.model.adapter;
        a.seed = cfg.run.seed;
        nn::apply_adapters(*ref, a);
        nn::cast_frozen_parameters(*ref, DType::BF16);

        const auto got = m->named_parameters(), want = ref->named_parameters();
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          const Tensor &g = got[i].second, &w = want[i].second;
          ASSERT_EQ(got[i].first, want[i].first);
          EXPECT_EQ(g.dtype(), w.dtype()) << kind << " " << got[i].first;
          EXPECT_EQ(g.shape(), w.shape()) << kind << " " << got[i].first;
          EXPECT_TRUE(g.dtype() == w.dtype() && g.shape() == w.shape() &&
                      std::memcmp(g.data(), w.data(), g.nbytes()) == 0)
              << kind << " " << family << " pad " << pad_id << ": " << got[i].first << " differs";
        }
      }
    }
  }
}

}  // namespace
}  // namespace keel
