// Non-finite weights at load time (keel/io/weight_check.h): the raw check in every dtype, and HF
// directories whose weights hold a NaN or an inf at a known place. The error names the file, the
// tensor, the count and the index in the FILE's layout (GPT-2's Conv1D weights are [in, out] in
// HF's files and [out, in] in keel), and the override loads them anyway with a warning. Keel
// checkpoints and resume, with weights that overflowed in training, are tests/cli/test_cli_weights.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "keel/io/hf_model.h"
#include "keel/io/safetensors.h"
#include "keel/io/weight_check.h"
#include "keel/numerics/convert.h"
#include "tests/support/check.h"

namespace keel::io {
namespace {

using test::error_of;
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(WeightCheck, CountsAndLocatesNonFiniteValuesInEveryFloatingDtype) {
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    std::vector<float> v(3 * 4 * 5, 0.25f);
    v[1 * 20 + 2 * 5 + 3] = kNan;  // [1, 2, 3]: the first
    v[2 * 20 + 0 * 5 + 1] = -kInf;
    v[2 * 20 + 3 * 5 + 4] = kNan;
    const Tensor t = Tensor::from_floats(v, {3, 4, 5}, dt);
    const NonfiniteWeights w = find_nonfinite_weights(t.data(), dt, t.shape());
    EXPECT_EQ(w.count, 3) << dtype_name(dt);
    EXPECT_EQ(w.nan, 2) << dtype_name(dt);
    EXPECT_EQ(w.inf, 1) << dtype_name(dt);
    EXPECT_EQ(w.first, 1 * 20 + 2 * 5 + 3) << dtype_name(dt);
    EXPECT_EQ(w.first_index, (Shape{1, 2, 3})) << dtype_name(dt);
    // The largest finite values are no finding.
    const Tensor big = Tensor::from_floats({65504.f, -65504.f}, {2}, dt);
    EXPECT_EQ(find_nonfinite_weights(big.data(), dt, big.shape()).count, 0) << dtype_name(dt);
  }
  const Tensor ids = Tensor::from_ints({1, 2, 3}, {3});
  EXPECT_EQ(find_nonfinite_weights(ids.data(), DType::I64, ids.shape()).count, 0);
  EXPECT_EQ(find_nonfinite_weights(nullptr, DType::F32, {0, 7}).count, 0);
}

TEST(WeightCheck, TheErrorNamesFileTensorCountIndexAndOverride) {
  std::vector<float> v(6, 1.f);
  v[4] = kInf;
  const Tensor t = Tensor::from_floats(v, {2, 3}, DType::BF16);
  const std::string m = error_of([&] { check_weights_finite({}, t, "w", "/d/model.safetensors"); });
  EXPECT_CONTAINS(m,
                  "/d/model.safetensors: tensor 'w' holds 1 non-finite value of 6 (0 nan, 1 inf)");
  EXPECT_CONTAINS(m, "the first at [1, 1] of its [2, 3] bf16 in the file");
  EXPECT_CONTAINS(m, "set model.allow_nonfinite_weights = true to load it anyway");
  try {
    check_weights_finite({}, t, "w", "f");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind, Error::kUsage);  // the user's file, not keel's failure
  }
  std::vector<std::string> warned;
  WeightCheck allow{true, [&](const std::string& w) { warned.push_back(w); }};
  check_weights_finite(allow, t, "w", "f");
  ASSERT_EQ(warned.size(), 1u);
  EXPECT_CONTAINS(warned[0], "warning: f: tensor 'w' holds 1 non-finite value");
  EXPECT_CONTAINS(warned[0], "loaded anyway (model.allow_nonfinite_weights = true)");
  check_weights_finite({}, Tensor::from_floats({1, 2}, {2}, DType::F32), "ok", "f");  // finite
}

models::ModelSpec tiny_spec(const std::string& family) {
  models::ModelSpec s;
  s.family = family;
  s.n_layer = 2;
  s.n_embd = 32;
  s.n_head = 4;
  s.n_kv_head = family == "llama" ? 2 : 0;
  s.vocab_size = 61;
  s.max_seq_len = 16;
  s.tie_embeddings = family == "gpt2";
  return s;
}

// An HF directory of a random model whose tensor `name` holds `value` at the FILE's flat index
// `at` (stored in `dt`).
std::string hf_dir_with(const std::string& family, const std::string& name, int64_t at, float value,
                        DType dt) {
  const std::string dir = test::temp_dir("weight-check-" + family);
  auto model = models::make_causal_lm(tiny_spec(family), 3);
  HfSaveOptions opt;
  opt.dtype = dt;
  save_hf_model(*model, dir, opt);
  const std::string file = dir + "/model.safetensors";
  Safetensors st = read_safetensors(file);
  bool found = false;
  for (auto& [n, t] : st.tensors)
    if (n == name) {
      std::vector<float> v = t.to_floats();
      v.at(static_cast<size_t>(at)) = value;
      t = Tensor::from_floats(v, t.shape(), t.dtype());
      found = true;
    }
  EXPECT_TRUE(found) << name << " is not in " << file;
  write_safetensors(file, st.tensors, st.metadata);
  return dir;
}

TEST(WeightCheck, Gpt2Conv1dIndexIsTheFilesInOutLayout) {
  // c_fc is [in = 32, out = 128] in HF's file, [128, 32] in keel: file index [2, 5] is keel's
  // [5, 2]; the message must name the file's.
  const std::string name = "transformer.h.1.mlp.c_fc.weight";
  const std::string dir = hf_dir_with("gpt2", name, 2 * 128 + 5, kNan, DType::F32);
  const std::string m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, dir + "/model.safetensors: tensor '" + name + "' holds 1 non-finite value");
  EXPECT_CONTAINS(m, "the first at [2, 5] of its [32, 128] f32 in the file");
  EXPECT_CONTAINS(m, "model.allow_nonfinite_weights = true");
  // The override loads it, warning once, and the NaN sits at keel's transposed place.
  std::vector<std::string> warned;
  auto model = load_hf_model(dir, DType::F32, ops::AttentionBackend::kEager,
                             {true, [&](const std::string& w) { warned.push_back(w); }});
  ASSERT_EQ(warned.size(), 1u);
  EXPECT_CONTAINS(warned[0], "tensor '" + name + "'");
  const std::vector<float> w = model->find_parameter(name).to_floats();
  EXPECT_TRUE(std::isnan(w[5 * 32 + 2]));
  int nonfinite = 0;
  for (float x : w) nonfinite += !std::isfinite(x);
  EXPECT_EQ(nonfinite, 1);
}

TEST(WeightCheck, LlamaBf16InfIsNamedWithItsIndex) {
  // down_proj is [hidden = 32, intermediate] in HF and in keel.
  auto probe = models::make_causal_lm(tiny_spec("llama"), 3);
  const int64_t ffn = probe->spec().ffn_dim();
  const std::string name = "model.layers.0.mlp.down_proj.weight";
  const std::string dir = hf_dir_with("llama", name, 3 * ffn + 1, -kInf, DType::BF16);
  const std::string m = error_of([&] { load_hf_model(dir); });
  EXPECT_CONTAINS(m, "tensor '" + name + "' holds 1 non-finite value of " +
                         std::to_string(32 * ffn) + " (0 nan, 1 inf)");
  EXPECT_CONTAINS(m,
                  "the first at [3, 1] of its [32, " + std::to_string(ffn) + "] bf16 in the file");
  auto model = load_hf_model(dir, DType::F32, ops::AttentionBackend::kEager,
                             {true, [](const std::string&) {}});
  EXPECT_TRUE(std::isinf(model->find_parameter(name).to_floats()[3 * ffn + 1]));
}

}  // namespace
}  // namespace keel::io
