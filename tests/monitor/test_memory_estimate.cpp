// The memory estimate behind `keel memory` and the doctor: the issue's reference numbers, the
// parameter count against the real models and a published one (from models/param_shapes.h), the
// per-policy byte widths, host_memory's block rounding, and the activation model's scaling (its
// absolute accuracy is checked against a real run's peak RSS in tests/cli).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "keel/backend/matmul.h"
#include "keel/models/causal_lm.h"
#include "keel/monitor/memory_estimate.h"
#include "keel/numerics/error.h"
#include "keel/tensor/host_memory.h"
#include "keel/train/config.h"
#include "tests/support/check.h"

namespace keel::monitor {
namespace {

// A GPT-2 query with its sizes: L layers, C wide, H heads, batch B of T tokens.
MemoryQuery gpt2_query(int64_t L, int64_t C, int64_t H, int64_t B, int64_t T) {
  MemoryQuery q;
  q.family = "gpt2";
  q.layers = L;
  q.hidden = C;
  q.heads = H;
  q.batch = B;
  q.seq = T;
  return q;
}

TEST(MemoryEstimate, HundredMillionAdamWUnder16Mixed) {
  // Issue 4 item 7: 400 MB weights (f32 masters), 400 MB grads, 800 MB optimizer state.
  MemoryQuery q;
  q.params = 100'000'000;
  q.precision = "16-mixed";
  q.optimizer = "adamw";
  const MemoryEstimate e = estimate_memory(q);
  EXPECT_EQ(e.weights, 400'000'000);
  EXPECT_EQ(e.grads, 400'000'000);
  EXPECT_EQ(e.optimizer_state, 800'000'000);
  EXPECT_EQ(e.lowp_copies, 200'000'000);  // f16 copies of every weight, cached for the step
  EXPECT_FALSE(e.has_activations);
  EXPECT_EQ(e.activations, 0);
  EXPECT_EQ(e.total, 1'800'000'000);
  const std::string text = format_memory(e);
  EXPECT_NE(text.find("400.0 MB"), std::string::npos) << text;
  EXPECT_NE(text.find("800.0 MB"), std::string::npos) << text;
}

// A row that holds bytes never reads "0.0 MB": the doctor's table printed the LayerNorm
// statistics of a small run (5 LayerNorms x mean and rstd x B*T f32 = 10 kB here) as 0.0 MB.
TEST(MemoryEstimate, ASmallNonzeroRowIsNotPrintedAsZero) {
  MemoryQuery q = gpt2_query(1, 32, 4, 8, 32);
  q.precision = "32-true";
  q.optimizer = "adamw";
  const MemoryEstimate e = estimate_memory(q);
  const std::string text = format_memory(e);
  int small = 0;
  for (const MemoryItem& it : e.activation_items) {
    const size_t at = text.find("    " + it.name + " ");
    ASSERT_NE(at, std::string::npos) << it.name << "\n" << text;
    const std::string line = text.substr(at, text.find('\n', at) - at);
    // What one decimal of 10^6 bytes shows: 0.0 only for a row under 0.05 MB.
    if (it.bytes > 0 && it.bytes < 50'000) {
      ++small;
      EXPECT_NOT_CONTAINS(line, " 0.0 MB");
      EXPECT_CONTAINS(line, "<0.1 MB");
    }
  }
  EXPECT_GT(small, 0) << "no row under 0.05 MB: the case tests nothing\n" << text;
}

TEST(MemoryEstimate, BytesPerPolicyAndOptimizer) {
  MemoryQuery q;
  q.params = 1'000'000;
  struct Case {
    const char* precision;
    int64_t weights, lowp;
  } cases[] = {{"32-true", 4'000'000, 0},          {"bf16-mixed", 4'000'000, 2'000'000},
               {"16-mixed", 4'000'000, 2'000'000}, {"bf16-true", 2'000'000, 0},
               {"16-true", 2'000'000, 0},          {"bf16", 4'000'000, 2'000'000}};
  for (const Case& c : cases) {
    q.precision = c.precision;
    q.optimizer = "adamw";
    MemoryEstimate e = estimate_memory(q);
    EXPECT_EQ(e.weights, c.weights) << c.precision;
    EXPECT_EQ(e.grads, c.weights) << c.precision;  // grads keep the parameters' dtype
    EXPECT_EQ(e.optimizer_state, 2 * c.weights) << c.precision;
    EXPECT_EQ(e.lowp_copies, c.lowp) << c.precision;
    q.optimizer = "sgd";
    q.momentum = 0.9;
    EXPECT_EQ(estimate_memory(q).optimizer_state, c.weights) << c.precision;
    q.momentum = 0;
    EXPECT_EQ(estimate_memory(q).optimizer_state, 0) << c.precision;
    q.momentum = 0.9;
  }
}

// The count from sizes must be the real models' count, parameter for parameter.
TEST(MemoryEstimate, ParameterCountMatchesTheModels) {
  struct Case {
    const char* family;
    int64_t layers, hidden, heads, kv_heads, vocab;
    bool tie;
  } cases[] = {{"gpt2", 2, 64, 4, 0, 259, true},
               {"gpt2", 3, 96, 6, 0, 300, true},
               {"llama", 2, 64, 4, 2, 259, true},
               {"llama", 2, 64, 4, 0, 259, false}};
  for (const Case& c : cases) {
    models::ModelSpec s;
    s.family = c.family;
    s.n_layer = c.layers;
    s.n_embd = c.hidden;
    s.n_head = c.heads;
    s.n_kv_head = c.kv_heads;
    s.vocab_size = c.vocab;
    s.max_seq_len = 48;
    s.tie_embeddings = c.tie;
    auto model = models::make_causal_lm(s, 1);
    MemoryQuery q;
    q.family = c.family;
    q.layers = c.layers;
    q.hidden = c.hidden;
    q.heads = c.heads;
    q.kv_heads = c.kv_heads;
    q.vocab = c.vocab;
    q.seq = 48;
    q.max_seq_len = 48;
    q.tie_embeddings = c.tie;
    EXPECT_EQ(count_parameters(q), model->num_parameters()) << c.family << " " << c.hidden;
    // The low-precision copies are exactly the cast weights: everything but norms and position
    // table (gpt2), projections + lm_head (llama).
    q.precision = "bf16-mixed";
    const MemoryEstimate e = estimate_memory(q);
    int64_t cast = 0;
    for (auto& [name, p] : model->named_parameters()) {
      const bool norm =
          name.find("ln_") != std::string::npos || name.find("norm") != std::string::npos;
      const bool pos = name.find("wpe") != std::string::npos;
      const bool embed_only = name.find("embed_tokens") != std::string::npos && !c.tie;
      if (!norm && !pos && !embed_only) cast += p.numel();
    }
    EXPECT_EQ(e.lowp_copies, 2 * cast) << c.family << " tie=" << c.tie;
  }
}

// Llama-3.1-8B's sizes: grouped-query attention (8 kv heads of 128) and an untied head make it
// 8.03B parameters; counted from the layout, nothing built.
TEST(MemoryEstimate, Llama31_8bHasItsPublishedParameterCount) {
  MemoryQuery q;
  q.family = "llama";
  q.layers = 32;
  q.hidden = 4096;
  q.heads = 32;
  q.kv_heads = 8;
  q.ffn = 14336;
  q.vocab = 128256;
  q.tie_embeddings = false;
  q.precision = "bf16-true";
  EXPECT_EQ(count_parameters(q), 8'030'261'248);
  const MemoryEstimate e = estimate_memory(q);
  EXPECT_EQ(e.params, 8'030'261'248);
  // Every matrix is a multiple of 2 MiB, every norm (8 KiB) of 64 bytes: no rounding.
  EXPECT_EQ(e.weights, 2 * e.params);
  EXPECT_EQ(e.optimizer_state, 2 * e.weights);
  q.kv_heads = 0;  // full-width k/v projections
  EXPECT_EQ(count_parameters(q), 8'030'261'248 + 32 * 2 * 4096 * (4096 - 1024));
  q.tie_embeddings = true;
  EXPECT_EQ(count_parameters(q), 8'030'261'248 + 32 * 2 * 4096 * (4096 - 1024) - 128256 * 4096);
}

TEST(MemoryEstimate, ActivationsScaleAsTheSavedTensors) {
  MemoryQuery q = gpt2_query(2, 64, 4, 4, 32);
  const MemoryEstimate a = estimate_memory(q);
  ASSERT_TRUE(a.has_activations);
  EXPECT_GT(a.activations, 0);
  // Everything saved is per row: doubling the batch doubles activations exactly.
  q.batch = 8;
  const MemoryEstimate b = estimate_memory(q);
  EXPECT_EQ(b.activations, 2 * a.activations);
  // Eager keeps f32 probabilities [B, H, T, T] per layer; flash keeps output + lse instead.
  q.batch = 4;
  q.attention = "flash";
  const MemoryEstimate f = estimate_memory(q);
  const int64_t probs = 2 * 4 * 4 * 32 * 32 * 4;  // L * B * H * T * T * 4 bytes
  const int64_t flash = 2 * (4 * 32 * 64 * 4 + 4 * 4 * 32 * 4);
  EXPECT_EQ(a.activations - f.activations, probs - flash);
  // 16-bit compute halves the compute-dtype tensors but not the f32 residual stream, norm
  // statistics or probabilities; bf16-mixed adds cross_entropy's f32 copy of the logits.
  q.attention = "eager";
  q.precision = "bf16-mixed";
  const MemoryEstimate m = estimate_memory(q);
  EXPECT_LT(m.activations, a.activations);
  EXPECT_GT(m.activations, a.activations / 2);
  // Layers add linearly.
  q.precision = "32-true";
  q.layers = 4;
  const MemoryEstimate l4 = estimate_memory(q);
  q.layers = 3;
  const MemoryEstimate l3 = estimate_memory(q);
  EXPECT_EQ(l4.activations - l3.activations, l3.activations - a.activations);
}

// GPT-BigCode's multi_query keeps one key head and one value head per block ([B,1,T,D]), not a
// head's copy per query head: counting three [B,T,C] copies over-counted its peak RSS by 5%.
TEST(MemoryEstimate, MultiQueryKeysAndValuesAreOneHeadWide) {
  MemoryQuery q = gpt2_query(2, 64, 4, 4, 32);  // D = 16, B * T = 128
  q.hf_model_type = "gpt_bigcode";
  auto qkv_bytes = [&](int64_t kv_heads) {
    q.kv_heads = kv_heads;
    for (const MemoryItem& it : estimate_memory(q).activation_items)
      if (it.name == "q, k, v") return it.bytes;
    ADD_FAILURE() << "no \"q, k, v\" row";
    return int64_t{0};
  };
  const auto block = [](int64_t n) {
    return static_cast<int64_t>(host_memory::block_size(static_cast<size_t>(n)));
  };
  EXPECT_EQ(qkv_bytes(4), 2 * 3 * block(128 * 64 * 4));
  EXPECT_EQ(qkv_bytes(1), 2 * (block(128 * 64 * 4) + 2 * block(128 * 16 * 4)));
}

TEST(MemoryEstimate, QueryFromConfig) {
  Config c;
  c.model.n_layer = 3;
  c.model.n_embd = 96;
  c.model.n_head = 6;
  c.train.batch_size = 5;
  c.data.seq_len = 40;
  c.train.precision = "16-mixed";
  c.model.attention = "math";
  const MemoryQuery q = memory_query_from_config(c);
  EXPECT_EQ(q.layers, 3);
  EXPECT_EQ(q.hidden, 96);
  EXPECT_EQ(q.heads, 6);
  EXPECT_EQ(q.batch, 5);
  EXPECT_EQ(q.seq, 40);
  EXPECT_EQ(q.precision, "16-mixed");
  EXPECT_EQ(q.attention, "math");
  EXPECT_TRUE(estimate_memory(q).has_activations);
}

// The usage error estimate_memory throws for `q` ("no error" when it accepts it).
std::string usage_error_of(const MemoryQuery& q) {
  try {
    estimate_memory(q);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind, Error::kUsage);
    return e.what();
  }
  return "no error";
}

TEST(MemoryEstimate, BadQueriesNameTheFix) {
  MemoryQuery q;
  EXPECT_NE(usage_error_of(q).find("--params"), std::string::npos);
  q.params = 10;
  q.precision = "fp8";
  EXPECT_NE(usage_error_of(q).find("fp8"), std::string::npos);
  q.precision = "32-true";
  q.optimizer = "lion";
  EXPECT_NE(usage_error_of(q).find("adamw or sgd"), std::string::npos);
  q.optimizer = "adamw";
  q.hidden = 100;
  q.layers = 2;
  q.heads = 3;
  EXPECT_NE(usage_error_of(q).find("divisible"), std::string::npos);
  q.family = "llama";
  q.hidden = 96;
  q.kv_heads = 2;  // 3 heads in 2 groups
  EXPECT_NE(usage_error_of(q).find("pick --kv-heads dividing --heads"), std::string::npos)
      << usage_error_of(q);
  q.kv_heads = -1;
  EXPECT_NE(usage_error_of(q).find("--kv-heads"), std::string::npos) << usage_error_of(q);
}

// Sizes beyond the config keys' bounds are refused before anything is counted: --layers 99999999
// (or a config.json saying so) ran for minutes listing parameter shapes, --batch 1e14 wrapped the
// activations to a negative count and printed a total of 22.5 MB, --batch -3 dropped them.
TEST(MemoryEstimate, SizesBeyondTheConfigKeysBoundsAreRefused) {
  auto sized = [] {
    MemoryQuery q;
    q.layers = 2;
    q.hidden = 64;
    q.batch = 4;
    q.seq = 64;
    return q;
  };
  MemoryQuery q = sized();
  EXPECT_EQ(usage_error_of(q), "no error");
  q.layers = 99999999;
  EXPECT_CONTAINS(usage_error_of(q),
                  "memory: layers = 99999999 (--layers): model.n_layer must be in [1, 1024]");
  q = sized();
  q.batch = 100000000000000;
  EXPECT_CONTAINS(usage_error_of(q),
                  "memory: batch = 100000000000000 (--batch): train.batch_size must be");
  q.batch = -3;
  EXPECT_CONTAINS(usage_error_of(q), "train.batch_size must be in [1, 65536], got -3");
  q = sized();
  q.ffn = -1;
  EXPECT_CONTAINS(usage_error_of(q), "(--ffn): model.intermediate_size");
  q = sized();
  q.source = "/models/x/config.json";
  q.vocab = 99999999999;
  EXPECT_CONTAINS(usage_error_of(q), "vocab = 99999999999 (--vocab or /models/x/config.json)");
  q = sized();
  q.adapter.kind = "lora";
  q.adapter.r = 100000;
  EXPECT_CONTAINS(usage_error_of(q), "(--r): model.adapter.r must be in [1, 65536]");
  // Within every bound, a product beyond any machine is refused before it could wrap.
  q = sized();
  q.layers = 1024;
  q.hidden = 65536;
  q.batch = 65536;
  q.seq = 1048576;
  EXPECT_CONTAINS(usage_error_of(q), "need more than 2^60 bytes (1.15 EB) of activations");
}

}  // namespace
}  // namespace keel::monitor

namespace keel::monitor {
namespace {

// A LoRA run: 99M frozen base parameters, 1M f32 adapter parameters. A bf16 frozen base
// (model.base_dtype = bf16) is 2 bytes a weight and, under bf16-mixed, used as stored (no autocast
// copy), and drawn directly in bf16 (no f32 model first), so the step sets the peak. An f32 base
// under bf16-mixed is 4 bytes plus a bf16 copy per use.
TEST(MemoryEstimate, LoraWithABf16FrozenBase) {
  MemoryQuery q;
  q.params = 100'000'000;
  q.trainable = 1'000'000;
  q.trainable_f32 = true;
  q.precision = "bf16-mixed";
  q.base_dtype = "bf16";
  const MemoryEstimate b = estimate_memory(q);
  EXPECT_EQ(b.weights, 99'000'000 * 2 + 1'000'000 * 4);
  EXPECT_EQ(b.grads, 4'000'000);
  EXPECT_EQ(b.optimizer_state, 8'000'000);
  EXPECT_EQ(b.lowp_copies, 2'000'000);  // the adapters' bf16 casts only
  EXPECT_EQ(b.live_peak, 216'000'000);
  EXPECT_EQ(b.init_peak, 202'000'000);  // the base as drawn, in bf16, and the f32 adapters
  EXPECT_EQ(b.total, 216'000'000);
  EXPECT_NE(format_memory(b).find("frozen base in 16-bit, adapters in f32"), std::string::npos);

  q.base_dtype = "f32";
  const MemoryEstimate f = estimate_memory(q);
  EXPECT_EQ(f.weights, 100'000'000 * 4);
  EXPECT_EQ(f.lowp_copies, 99'000'000 * 2 + 1'000'000 * 2);  // the base's and the adapters' casts
  EXPECT_EQ(f.init_peak, 0);
  EXPECT_EQ(f.total, 400'000'000 + 4'000'000 + 8'000'000 + 200'000'000);
  // The step itself: the bf16 base saves the f32 weights and their bf16 copies.
  EXPECT_EQ(f.live_peak - b.live_peak, 99'000'000 * 2 + 99'000'000 * 2);

  // bf16-true builds the base in bf16 already: no cast, no build-time peak.
  q.precision = "bf16-true";
  q.base_dtype = "f32";  // the config default: the policy's parameter dtype
  const MemoryEstimate t = estimate_memory(q);
  EXPECT_EQ(t.weights, 99'000'000 * 2 + 1'000'000 * 4);
  EXPECT_EQ(t.init_peak, 0);
  q.base_dtype = "bf17";
  EXPECT_THROW(estimate_memory(q), Error);
}

}  // namespace
}  // namespace keel::monitor

namespace keel::monitor {
namespace {

// With the model's sizes, state is counted in host_memory's blocks: GPT-2 with C = 768 has 9 MiB
// MLP weights that take 10 MiB blocks (2 MiB multiples from 8 MiB up). No packed matmul copies:
// matmul scratch is 0 but for a 16-bit compute dtype oneDNN has no kernel for on this CPU (f16;
// bf16 without AVX-512), which it multiplies through f32 copies.
TEST(MemoryEstimate, SizedStateIsCountedInHostMemoryBlocks) {
  MemoryQuery q = gpt2_query(1, 768, 12, 4, 64);
  const MemoryEstimate e = estimate_memory(q);
  const int64_t N = count_parameters(q);
  const int64_t mib = int64_t{1} << 20;
  // c_fc and mlp.c_proj: 9 MiB each in 10 MiB blocks; wte's 796 kB in a 32 KiB multiple.
  EXPECT_EQ(e.weights - 4 * N, 2 * mib + (25 * 32768 - 259 * 768 * 4));
  EXPECT_EQ(e.grads, e.weights);
  EXPECT_EQ(e.optimizer_state, 2 * e.weights);
  EXPECT_EQ(e.matmul_scratch, 0);
  // 0 MB of scratch does not say "no kernel for the dtype here" (doctor printed it under its
  // own "the CPU has native bf16 dot products").
  EXPECT_CONTAINS(format_memory(e), "none: the matmuls take their operands as they are");
  EXPECT_EQ(format_memory(e).find("no kernel"), std::string::npos);
  EXPECT_EQ(e.cache_slack, e.live_peak / 16);
  EXPECT_GT(e.runtime, 0);  // the process without the model
  EXPECT_EQ(e.total, e.runtime + e.live_peak + e.cache_slack);
  q.precision = "bf16-mixed";  // scratch only where this CPU has no bf16 matmul (no AVX-512)
  EXPECT_EQ(estimate_memory(q).matmul_scratch > 0, !cpu_matmul_native(DType::BF16));
  q.precision = "16-mixed";
  EXPECT_GT(estimate_memory(q).matmul_scratch, 0);
  EXPECT_CONTAINS(format_memory(estimate_memory(q)), "f32 operand copies: no kernel");
  // A bare parameter count stays bytes (no blocks, no slack).
  MemoryQuery p;
  p.params = N;
  EXPECT_EQ(estimate_memory(p).weights, 4 * N);
  EXPECT_EQ(estimate_memory(p).cache_slack, 0);
}

}  // namespace
}  // namespace keel::monitor

namespace keel::monitor {
namespace {

// A Llama query with gpt2_query's sizes.
MemoryQuery llama_query(int64_t L, int64_t C, int64_t H, int64_t B, int64_t T) {
  MemoryQuery q = gpt2_query(L, C, H, B, T);
  q.family = "llama";
  return q;
}

// An adapter's parameters come from its own shapes: trainable count, f32 grads and AdamW state
// for them only, the frozen base in model.base_dtype; an adapter without sizes is an error, not
// a silent full fine-tune.
TEST(MemoryEstimate, AdaptersAreCountedFromTheirShapes) {
  MemoryQuery q = llama_query(2, 64, 4, 2, 16);
  const MemoryEstimate full = estimate_memory(q);
  q.adapter.kind = "lora";
  q.adapter.r = 4;
  q.adapter.target_modules = {"q_proj", "v_proj"};
  const MemoryEstimate lora = estimate_memory(q);
  EXPECT_EQ(lora.adapter_params, 2 * (4 * (64 + 64) + 4 * (64 + 64)));  // q and v, 2 layers
  EXPECT_EQ(lora.trainable, lora.adapter_params);
  EXPECT_EQ(lora.params, full.params + lora.adapter_params);
  EXPECT_EQ(lora.optimizer_state, 2 * lora.grads);
  EXPECT_LT(lora.grads, full.grads / 10);
  // The adapters keep activations of their own: DoRA more than LoRA (its f32 base and LoRA
  // results), rank for rank.
  q.adapter.kind = "dora";
  EXPECT_GT(estimate_memory(q).activations, lora.activations);
  q.adapter.kind = "lora";
  q.adapter.target_modules = {"qkv"};
  EXPECT_THROW(estimate_memory(q), Error);
  MemoryQuery bare;
  bare.params = 1'000'000;
  bare.adapter.kind = "lora";
  try {
    estimate_memory(bare);
    ADD_FAILURE() << "an adapter without sizes must not fall back to a full fine-tune";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--model DIR"), std::string::npos) << e.what();
  }
  bare.adapter.kind = "ia3";
  EXPECT_THROW(estimate_memory(bare), Error);
}

// Checkpointing keeps each segment's input instead of every block's activations, and holds one
// segment's recompute during backward: the more blocks a segment holds, the more it keeps then.
TEST(MemoryEstimate, CheckpointingKeepsSegmentInputs) {
  MemoryQuery q = llama_query(8, 128, 4, 4, 128);
  const MemoryEstimate none = estimate_memory(q);
  EXPECT_TRUE(none.checkpoint.empty());
  q.checkpoint_every = 1;
  const MemoryEstimate blocks = estimate_memory(q);
  q.checkpoint_every = 4;
  const MemoryEstimate four = estimate_memory(q);
  EXPECT_LT(blocks.activations, none.activations / 4);
  EXPECT_GT(blocks.activations, four.activations);  // 8 segment inputs vs 2, but ...
  EXPECT_GT(four.transient, blocks.transient);      // ... a 4-block recompute vs a 1-block one
  EXPECT_LT(blocks.total, none.total);
  EXPECT_NE(blocks.checkpoint.find("8 segment inputs"), std::string::npos) << blocks.checkpoint;
  q.checkpoint_every = -1;
  EXPECT_THROW(estimate_memory(q), Error);
  EXPECT_EQ(parse_checkpointing("none", "k"), 0);
  EXPECT_EQ(parse_checkpointing("blocks", "k"), 1);
  EXPECT_EQ(parse_checkpointing("3", "k"), 3);
  for (const char* bad : {"0", "-2", "block", "2x", ""}) {
    try {
      parse_checkpointing(bad, "train.activation_checkpointing");
      ADD_FAILURE() << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("train.activation_checkpointing"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("none, blocks"), std::string::npos);
    }
  }
}

// What does not fit gets the options that would lower it, each with its own estimate (computed
// by the same function), those that fit marked.
TEST(MemoryEstimate, FitAdviceNamesTheOptionsWithTheirEstimates) {
  MemoryQuery q = llama_query(16, 2048, 16, 8, 1024);
  q.precision = "bf16-mixed";
  const MemoryEstimate e = estimate_memory(q);
  EXPECT_EQ(memory_fit_advice(q, e.total), "");
  const std::string m = memory_fit_advice(q, e.total / 2);
  EXPECT_NE(m.find("needs an estimated"), std::string::npos) << m;
  EXPECT_NE(m.find("available"), std::string::npos) << m;
  MemoryQuery ck = q;
  ck.checkpoint_every = 1;
  const std::string ck_line = "train.activation_checkpointing = blocks: ";
  ASSERT_NE(m.find(ck_line), std::string::npos) << m;
  EXPECT_NE(m.find(ck_line + format_bytes(estimate_memory(ck).total)), std::string::npos) << m;
  EXPECT_EQ(format_bytes(12'345'678), "12.3 MB");
  EXPECT_EQ(format_bytes(37'830'000'000), "37.83 GB");
  EXPECT_NE(m.find("model.adapter.kind = lora"), std::string::npos) << m;
  EXPECT_NE(m.find("train.batch_size = 1"), std::string::npos) << m;
  EXPECT_NE(m.find("(fits)"), std::string::npos) << m;
}

// A text or JSONL run's data is counted: held for the run beside the model, and its loading peak
// (before the model) on its own. memory_query_from_config reads data.path's first MiB; an 8 MB
// packed byte-tokenized file holds 2 bytes a token (16-bit ids), and loads a 1 MiB piece at a time
// (its text, read buffer and 32-bit ids: 7 MiB beside the stream). Data that dominates is named
// in the advice, and step options that lower nothing (under 1%) are not listed.
TEST(MemoryEstimate, TheDataOfATextRunIsCounted) {
  const std::string dir = ::testing::TempDir() + "/keel-mem-data";
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/corpus.txt");
    for (int i = 0; i < 200000; ++i) f << "line " << i << " of a corpus for the estimate\n";
  }
  const int64_t bytes = static_cast<int64_t>(std::filesystem::file_size(dir + "/corpus.txt"));
  Config c = load_config("", {"data.task=text", "data.path=" + dir + "/corpus.txt",
                              "data.pack=true", "data.seq_len=64", "model.n_layer=1",
                              "model.n_embd=32", "model.n_head=2", "train.batch_size=2"});
  const MemoryQuery q = memory_query_from_config(c);
  EXPECT_NEAR(static_cast<double>(q.dataset_bytes) / static_cast<double>(bytes), 2.0, 0.2);
  EXPECT_EQ(q.dataset_load_bytes, q.dataset_bytes + 7 * (int64_t{1} << 20));
  EXPECT_CONTAINS(q.dataset_detail, dir + "/corpus.txt: ");
  MemoryQuery none = q;
  none.dataset_bytes = none.dataset_load_bytes = 0;
  const MemoryEstimate e = estimate_memory(q), without = estimate_memory(none);
  // The loading peak is the process's here: the data and its text, before a model of 0.1 MB.
  EXPECT_EQ(e.total - without.total,
            q.dataset_load_bytes - std::max(without.live_peak, without.init_peak));
  EXPECT_CONTAINS(format_memory(e), "loading the data");
  const std::string m = memory_fit_advice(q, e.total / 2);
  EXPECT_CONTAINS(m, "The data holds " + format_bytes(q.dataset_bytes) + " for the run");
  EXPECT_CONTAINS(m, "a tokenizer of fewer tokens a byte");
  // A packed text can be converted once into a token file the run maps.
  EXPECT_CONTAINS(m, "keel tokenize --tokenizer byte --file " + dir + "/corpus.txt --output " +
                         dir + "/corpus.txt.bin; then data.task = \"tokens\"");
  // Each would lower the estimate by a fraction of a MB of its 40.
  EXPECT_NOT_CONTAINS(m, "train.batch_size = 1");
  EXPECT_NOT_CONTAINS(m, "train.precision = bf16-mixed");
  // Arith has no file; a missing file is left to the run's own error.
  EXPECT_EQ(memory_query_from_config(load_config("", {})).dataset_bytes, 0);
  EXPECT_EQ(memory_query_from_config(load_config("", {"data.task=text", "data.path=/no/file"}))
                .dataset_bytes,
            0);
}

// model.path: the sizes of its config.json (Llama-3.1-8B's: 8.03B parameters), the adapter from
// the config; no weights read.
TEST(MemoryEstimate, QueryFromAModelDirectory) {
  const std::string dir = ::testing::TempDir() + "/keel-mem-llama31-8b";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json")
      << R"({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
             "vocab_size": 128256, "tie_word_embeddings": false, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 131072, "rope_theta": 500000.0,
             "torch_dtype": "bfloat16"})";
  Config c;
  c.model.path = dir;
  c.train.batch_size = 2;
  c.data.seq_len = 512;
  MemoryQuery q = memory_query_from_config(c);
  EXPECT_EQ(q.source, dir + "/config.json");
  EXPECT_EQ(estimate_memory(q).params, 8'030'261'248);
  c.model.adapter.kind = "lora";
  c.model.adapter.r = 32;
  c.model.adapter.target_modules = {"q_proj", "k_proj", "v_proj", "up_proj", "down_proj"};
  c.model.base_dtype = "bf16";
  c.train.precision = "bf16-mixed";
  q = memory_query_from_config(c);
  const MemoryEstimate e = estimate_memory(q);
  EXPECT_EQ(e.trainable, 56'623'104);
  EXPECT_EQ(e.params, 8'030'261'248 + 56'623'104);
  EXPECT_EQ(e.optimizer_state, 2 * 4 * 56'623'104);  // f32 moments of the adapters only
  EXPECT_NE(format_memory(e).find("sizes from " + dir + "/config.json"), std::string::npos);
}

}  // namespace
}  // namespace keel::monitor
