// Loading through file mappings (io/safetensors.h MappedSafetensors, io/hf_weights.h
// attach_hf_weights): tensors are views of the mapping where aligned and copies where not, writes
// never reach the file, and a frozen base attached from the files then cast holds exactly the bits
// of the copying loader's f32 model cast afterwards (bf16, f32 and GPT-2 Conv1D files; LoRA and
// DoRA on top). A bf16 base stored as bf16 stays a view of the file.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "keel/io/atomic_file.h"
#include "keel/io/hf_model.h"
#include "keel/io/safetensors.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/nn/adapters/dora.h"
#include "tests/io/tiny_specs.h"
#include "tests/support/check.h"

namespace keel::io {
namespace {

namespace fs = std::filesystem;

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

TEST(MappedSafetensors, ViewsShareTheMappingAndMisalignedTensorsAreCopied) {
  const std::string dir = test::temp_dir("mapped-views");
  // An odd number of bf16 elements first: the f32 tensor after it starts 2 bytes off its
  // 4-byte alignment (the data section itself starts at a multiple of 8).
  const Tensor odd = Tensor::from_floats({1.5f, -2.0f, 3.25f}, {3}, DType::BF16);
  const Tensor f = Tensor::from_floats({0.1f, 0.2f, 0.3f, 0.4f}, {2, 2});
  const Tensor wide = Tensor::from_floats(std::vector<float>(4096, 0.5f), {64, 64}, DType::BF16);
  write_safetensors(dir + "/t.safetensors", {{"a_odd", odd}, {"b_f32", f}, {"c_wide", wide}});
  MappedSafetensors m(dir + "/t.safetensors");
  ASSERT_EQ(m.header().tensors.size(), 3u);
  const TensorInfo& ia = *m.find("a_odd");
  const TensorInfo& ib = *m.find("b_f32");
  const TensorInfo& ic = *m.find("c_wide");
  EXPECT_TRUE(m.aligned(ia));
  EXPECT_FALSE(m.aligned(ib));
  Tensor ta = m.tensor(ia), tb = m.tensor(ib), tc = m.tensor(ic);
  EXPECT_TRUE(ta.is_external());
  EXPECT_FALSE(tb.is_external()) << "a misaligned f32 tensor must be copied";
  EXPECT_EQ(ta.data(), m.raw(ia));
  EXPECT_TRUE(same_bits(ta, odd));
  EXPECT_TRUE(same_bits(tb, f));
  EXPECT_TRUE(same_bits(tc, wide));
  // read_safetensors goes through the mapping too, and keeps its errors (tests/io/
  // test_safetensors.cpp); a tensor outlives the reader that made it.
  Tensor kept;
  {
    const Safetensors st = read_safetensors(dir + "/t.safetensors");
    EXPECT_TRUE(st.at("c_wide").is_external());
    kept = st.at("c_wide");
  }
  EXPECT_TRUE(same_bits(kept, wide));
  fs::remove_all(dir);
}

// A damaged file is an Error and leaves no descriptor open: a bad header length threw with the
// file still open, and the fuzzer's loop over damaged files ran out of descriptors.
TEST(MappedSafetensors, ADamagedFileLeavesNoDescriptorOpen) {
  const std::string path = test::temp_dir("mapped-fd") + "/bad.safetensors";
  std::ofstream(path, std::ios::binary) << std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{}", 10);
  auto open_fds = [] {
    return std::distance(fs::directory_iterator("/proc/self/fd"), fs::directory_iterator{});
  };
  const auto before = open_fds();
  for (int k = 0; k < 20; ++k)
    EXPECT_CONTAINS(test::error_of([&] { MappedSafetensors m(path); }), path);
  EXPECT_EQ(open_fds(), before);
}

TEST(MappedSafetensors, WritesToAViewNeverReachTheFile) {
  const std::string dir = test::temp_dir("mapped-private");
  const Tensor w = Tensor::from_floats(std::vector<float>(2048, 1.0f), {2048});
  write_safetensors(dir + "/w.safetensors", {{"w", w}});
  const std::string before = read_file(dir + "/w.safetensors");
  {
    MappedSafetensors m(dir + "/w.safetensors");
    Tensor v = m.tensor(*m.find("w"));
    ASSERT_TRUE(v.is_external());
    v.fill(7.0f);  // e.g. an adapter merged into a mapped base
    EXPECT_EQ(v.to_floats()[100], 7.0f);
  }
  EXPECT_EQ(read_file(dir + "/w.safetensors"), before);
  fs::remove_all(dir);
}

TEST(MappedSafetensors, ErrorsNameTheFile) {
  const std::string dir = test::temp_dir("mapped-errors");
  EXPECT_CONTAINS(test::error_of([&] { MappedSafetensors m(dir + "/none.safetensors"); }),
                  dir + "/none.safetensors");
  EXPECT_CONTAINS(test::error_of([&] { MappedSafetensors m(dir); }), "is a directory");
  std::ofstream(dir + "/short.safetensors") << "abc";
  EXPECT_CONTAINS(test::error_of([&] { MappedSafetensors m(dir + "/short.safetensors"); }),
                  "shorter than the 8-byte header length");
  fs::remove_all(dir);
}

using test_specs::gpt2_spec;
using test_specs::llama_spec;

// An HF directory of `spec` written by save_hf_model in `stored` (sharded when shard_bytes > 0).
std::string write_model(const models::ModelSpec& spec, DType stored, int64_t shard_bytes,
                        const std::string& tag) {
  const std::string dir = test::temp_dir(tag);
  auto m = models::make_causal_lm(spec, 11);
  HfSaveOptions o;
  o.dtype = stored;
  o.max_shard_bytes = shard_bytes;
  save_hf_model(*m, dir, o);
  return dir;
}

nn::AdapterOptions adapter(const std::string& kind) {
  nn::AdapterOptions a;
  a.kind = kind;
  a.r = 4;
  a.target_modules = {"q_proj", "v_proj", "up_proj", "down_proj", "c_attn", "c_fc"};
  a.seed = 3;
  return a;
}

// Keeps the targets that name a Linear of the family.
nn::AdapterOptions for_family(nn::AdapterOptions a, const std::string& family) {
  if (family == "gpt2")
    a.target_modules = {"c_attn", "c_fc"};
  else
    a.target_modules = {"q_proj", "v_proj", "up_proj", "down_proj"};
  return a;
}

// The loader before mapping: an f32 model, the weights copied in, adapters, the base cast.
std::unique_ptr<models::CausalLM> copied(const std::string& dir, const nn::AdapterOptions& a,
                                         DType base) {
  HfConfig hf = read_hf_config(dir);
  auto m = models::make_causal_lm(hf.spec, 0);
  load_hf_weights(*m, dir);
  nn::apply_adapters(*m, for_family(a, hf.spec.family));
  nn::cast_frozen_parameters(*m, base);
  return m;
}

// The mapped loader: a deferred model, the files' tensors attached, adapters, the base cast.
std::unique_ptr<models::CausalLM> mapped(const std::string& dir, const nn::AdapterOptions& a,
                                         DType base, LoadedWeights* stats = nullptr) {
  HfConfig hf = read_hf_config(dir);
  auto m = models::make_causal_lm_for_loading(hf.spec);
  const LoadedWeights w = attach_hf_weights(*m, dir);
  if (stats) *stats = w;
  nn::apply_adapters(*m, for_family(a, hf.spec.family));
  nn::cast_frozen_parameters(*m, base);
  return m;
}

void expect_same_model(models::CausalLM& a, models::CausalLM& b) {
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].first, pb[i].first);
    EXPECT_TRUE(same_bits(pa[i].second, pb[i].second)) << pa[i].first;
  }
}

TEST(AttachHfWeights, ABf16BaseStoredAsBf16StaysAViewOfTheFiles) {
  const std::string dir = write_model(llama_spec(false), DType::BF16, 20000, "attach-bf16");
  ASSERT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  for (const char* kind : {"lora", "dora", "lokr"}) {
    LoadedWeights w;
    auto m = mapped(dir, adapter(kind), DType::BF16, &w);
    auto ref = copied(dir, adapter(kind), DType::BF16);
    expect_same_model(*m, *ref);
    EXPECT_EQ(w.tensors, static_cast<int64_t>(m->named_parameters().size() -
                                              m->named_parameters(true).size()));
    EXPECT_EQ(w.mapped, w.tensors) << kind;
    EXPECT_EQ(w.copied_bytes, 0u);
    for (auto& [name, p] : m->named_parameters())
      EXPECT_EQ(p.is_external(), !p.requires_grad()) << kind << " " << name;
  }
  fs::remove_all(dir);
}

TEST(AttachHfWeights, F32AndGpt2Conv1DFilesConvertToTheCopyingLoadersBits) {
  for (const models::ModelSpec& spec : {llama_spec(false), gpt2_spec()}) {
    const std::string dir = write_model(spec, DType::F32, 0, "attach-f32-" + spec.family);
    for (const char* kind : {"lora", "dora"}) {
      LoadedWeights w;
      auto m = mapped(dir, adapter(kind), DType::BF16, &w);
      auto ref = copied(dir, adapter(kind), DType::BF16);
      expect_same_model(*m, *ref);  // base bits and DoRA's magnitudes from the f32 values
      for (auto& [name, p] : m->named_parameters()) {
        EXPECT_FALSE(p.is_external()) << name << ": converted, not mapped";
        if (!p.requires_grad()) {
          EXPECT_EQ(p.dtype(), DType::BF16) << name;
        }
      }
      if (spec.family == "gpt2") {  // Conv1D weights: transposed copies even before the cast
        EXPECT_EQ(w.mapped, w.tensors - 4 * spec.n_layer);
      }
    }
    // A base kept in f32 (model.base_dtype = f32) from the same files: the copying loader's f32.
    auto m = mapped(dir, adapter("lora"), DType::F32);
    auto ref = copied(dir, adapter("lora"), DType::F32);
    expect_same_model(*m, *ref);
    fs::remove_all(dir);
  }
  // A bf16 file under an f32 base: widened exactly, tensor by tensor.
  const std::string dir = write_model(gpt2_spec(), DType::BF16, 0, "attach-bf16-gpt2");
  auto m = mapped(dir, adapter("lora"), DType::F32);
  auto ref = copied(dir, adapter("lora"), DType::F32);
  expect_same_model(*m, *ref);
  fs::remove_all(dir);
}

TEST(AttachHfWeights, KeepsTheCopyingLoadersErrors) {
  const std::string dir = write_model(llama_spec(false), DType::BF16, 0, "attach-errors");
  models::ModelSpec wrong = llama_spec(false);
  wrong.intermediate_size = 128;
  auto m = models::make_causal_lm_for_loading(wrong);
  EXPECT_CONTAINS(test::error_of([&] { attach_hf_weights(*m, dir); }),
                  dir +
                      "/model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has "
                      "shape [48, 32] but " +
                      dir + "/config.json implies [128, 32]");
  fs::remove_all(dir);
}

TEST(DeferredModel, HasNoMemoryUntilAttachedAndReplayGivesItsDraws) {
  auto m = models::make_causal_lm_for_loading(llama_spec(false));
  const Tensor w = m->find_parameter("model.layers.0.self_attn.q_proj.weight");
  ASSERT_TRUE(w.defined());
  EXPECT_TRUE(w.is_deferred());
  EXPECT_CONTAINS(test::error_of([&] { (void)w.data(); }),
                  "'model.layers.0.self_attn.q_proj.weight' has no memory yet");
  // replay_init reproduces make_causal_lm's f32 draws, also when the model is built in bf16.
  for (DType dt : {DType::F32, DType::BF16}) {
    models::ModelSpec s = llama_spec(false);
    s.param_dtype = dt;
    auto built = models::make_causal_lm(s, 42);
    int64_t replayed = 0;
    models::replay_init(
        s, 42, [](const std::string& n) { return n.find("proj") != std::string::npos; },
        [&](const std::string& name, const Tensor& f32) {
          ++replayed;
          EXPECT_EQ(f32.dtype(), DType::F32);
          EXPECT_TRUE(same_bits(f32.to_dtype(dt), built->find_parameter(name))) << name;
        });
    EXPECT_EQ(replayed, 2 * 7);  // 7 projections a layer
  }
}

}  // namespace
}  // namespace keel::io
