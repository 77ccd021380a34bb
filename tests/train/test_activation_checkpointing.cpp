// train.activation_checkpointing (nn/checkpoint.h): losses and every gradient bit-identical to a
// run without it in each precision policy, adapter kind and family, with dropout and gradient
// accumulation; module hooks see one forward per step; the peak of live tensor memory is lower;
// evaluation and generation ignore it. The tracer, fault injection and NaN capture:
// tests/monitor/test_checkpoint_instrumentation.cpp.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "keel/io/hf_model.h"
#include "keel/tensor/host_memory.h"
#include "keel/train/trainer.h"
#include "tests/support/check.h"
#include "tests/support/tiny_models.h"

namespace keel {
namespace {

struct CkptCase {
  std::string family, precision, adapter;
};

void PrintTo(const CkptCase& c, std::ostream* os) {
  *os << c.family << " " << c.precision << " " << c.adapter;
}

std::string ckpt_case_name(const CkptCase& c) {
  std::string s = c.family + "_" + c.precision + "_" + c.adapter;
  for (char& ch : s)
    if (ch == '-') ch = '_';
  return s;
}

// Three blocks (so segments of 2 leave a shorter last one), dropout in the model (GPT-2), on the
// attention probabilities and in the adapters, two micro-batches a step, an evaluation at the end
// (generation: not checkpointed).
Config ckpt_config(const CkptCase& k, const std::string& checkpointing, const std::string& tag) {
  Config c;
  c.run.out_dir = test::temp_dir("ckpt_" + tag);
  c.run.seed = 7;
  c.model.family = k.family;
  c.model.n_layer = 3;
  c.model.n_embd = 32;
  c.model.n_head = 2;
  if (k.family == "llama") {
    c.model.n_kv_head = 1;
    c.model.tie_embeddings = false;
  }
  if (k.family == "gpt2") c.model.dropout = 0.1;  // (a Llama has no model dropout)
  c.model.attention_dropout = 0.1;                // the probabilities' (HF's attn_pdrop)
  c.model.adapter.kind = k.adapter;
  if (k.adapter != "none") {
    c.model.adapter.r = 4;
    c.model.adapter.alpha = 8;
    c.model.adapter.dropout = k.adapter == "lokr" ? 0.0 : 0.1;  // LoKr has no input dropout
    c.model.adapter.target_modules =
        k.family == "gpt2" ? std::vector<std::string>{"c_attn", "c_proj", "c_fc"}
                           : std::vector<std::string>{"q_proj", "v_proj", "up_proj", "down_proj"};
  }
  c.data.digits = 2;
  c.data.num_examples = 64;
  c.data.eval_examples = 4;
  c.data.seq_len = 16;
  c.train.precision = k.precision;
  c.train.batch_size = 4;
  c.train.grad_accum = 2;
  c.train.max_steps = 3;
  c.train.activation_checkpointing = checkpointing;
  c.log.tensorboard = false;
  c.log.metrics = false;
  c.log.console = false;
  return c;
}

// What a run computed, step by step: the loss and grad norm bits and a copy of every trainable
// gradient as the step left it (after unscaling), and how often the blocks' forward hooks ran.
struct CkptTrace {
  std::vector<double> loss, grad_norm;
  std::vector<std::vector<std::pair<std::string, Tensor>>> grads;
  int64_t block_calls = 0, block_recomputes = 0;
  double eval_loss = 0;
};

bool ckpt_is_block(const nn::Module& m) {
  return m.type() == "GPT2Block" || m.type() == "LlamaDecoderLayer";
}

CkptTrace ckpt_trace(const Config& c) {
  CkptTrace tr;
  TrainerHooks h;
  Trainer* self = nullptr;
  h.on_step = [&](const StepResult& r) {
    tr.loss.push_back(r.loss);
    tr.grad_norm.push_back(r.grad_norm);
    tr.grads.emplace_back();
    for (auto& [name, p] : self->trainable())
      tr.grads.back().emplace_back(name, p.grad().defined() ? p.grad().clone() : Tensor());
  };
  h.on_eval = [&](const EvalResult& e) { tr.eval_loss = e.loss; };
  Trainer t(c, h);
  self = &t;
  for (nn::Module* m : t.model().modules())
    if (ckpt_is_block(*m))
      m->add_forward_post_hook([&](nn::Module&, const std::vector<Tensor>&, Tensor&) {
        ++(nn::Module::recomputing() ? tr.block_recomputes : tr.block_calls);
      });
  EXPECT_EQ(t.fit(), 0);
  return tr;
}

void ckpt_expect_same_bits(double a, double b, const std::string& what) {
  EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << what << ": " << a << " vs " << b;
}

void ckpt_expect_same_run(const CkptTrace& plain, const CkptTrace& ckpt) {
  ASSERT_EQ(plain.loss.size(), ckpt.loss.size());
  ASSERT_EQ(plain.grads.size(), ckpt.grads.size());
  for (size_t s = 0; s < plain.loss.size(); ++s) {
    const std::string step = "step " + std::to_string(s + 1);
    ckpt_expect_same_bits(plain.loss[s], ckpt.loss[s], step + " loss");
    ckpt_expect_same_bits(plain.grad_norm[s], ckpt.grad_norm[s], step + " grad_norm");
    ASSERT_EQ(plain.grads[s].size(), ckpt.grads[s].size());
    for (size_t i = 0; i < plain.grads[s].size(); ++i) {
      const auto& [name, g] = plain.grads[s][i];
      ASSERT_EQ(name, ckpt.grads[s][i].first);
      ASSERT_EQ(g.defined(), ckpt.grads[s][i].second.defined()) << step << " " << name;
      if (g.defined()) test::expect_bitwise_equal(ckpt.grads[s][i].second, g, step + " " + name);
    }
  }
  ckpt_expect_same_bits(plain.eval_loss, ckpt.eval_loss, "eval loss");
}

class CheckpointBits : public ::testing::TestWithParam<CkptCase> {};

TEST_P(CheckpointBits, LossesAndEveryGradientMatchTheRunWithout) {
  const CkptCase k = GetParam();
  const std::string tag = ckpt_case_name(k);
  const CkptTrace plain = ckpt_trace(ckpt_config(k, "none", tag + "_none"));
  const CkptTrace ckpt = ckpt_trace(ckpt_config(k, "blocks", tag + "_blocks"));
  ckpt_expect_same_run(plain, ckpt);
  // Checkpointing really ran: each block's forward was recomputed once per micro-batch, and the
  // hooks saw as many first forwards as without it.
  EXPECT_EQ(plain.block_recomputes, 0);
  EXPECT_EQ(ckpt.block_calls, plain.block_calls);
  EXPECT_EQ(ckpt.block_recomputes, 3 * 2 * 3);  // blocks x micro-batches x steps
  for (double l : plain.loss) EXPECT_TRUE(std::isfinite(l));
}

std::vector<CkptCase> ckpt_cases() {
  std::vector<CkptCase> out;
  for (const char* f : {"gpt2", "llama"})
    for (const char* p : {"32-true", "bf16-mixed", "16-mixed", "bf16-true"})
      for (const char* a : {"none", "lora", "dora", "lokr"}) out.push_back({f, p, a});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Policies, CheckpointBits, ::testing::ValuesIn(ckpt_cases()),
                         [](const auto& info) { return ckpt_case_name(info.param); });

TEST(Checkpoint, SegmentsOfSeveralBlocksMatchTooAndRecomputeEveryBlock) {
  // Segments of 2 over 3 blocks: [0, 1] and [2].
  for (const CkptCase& k :
       {CkptCase{"gpt2", "32-true", "none"}, CkptCase{"llama", "bf16-mixed", "lora"}}) {
    const std::string tag = ckpt_case_name(k) + "_seg";
    const CkptTrace plain = ckpt_trace(ckpt_config(k, "none", tag + "_none"));
    const CkptTrace seg = ckpt_trace(ckpt_config(k, "2", tag + "_2"));
    ckpt_expect_same_run(plain, seg);
    EXPECT_EQ(seg.block_recomputes, 3 * 2 * 3) << tag;
  }
}

// A mixture of experts (a Qwen3-MoE from its HF directory, 6 experts 2 a token): the recomputed
// forward routes every token as the first did, and the losses and gradients keep their bits, whole
// in f32 and with LoRA on the experts in bf16-mixed.
TEST(Checkpoint, MixturesOfExpertsMatchToo) {
  models::ModelSpec s = test::tiny_model_spec("qwen3_moe");
  s.n_layer = 3;
  s.vocab_size = 259;
  s.max_seq_len = 32;
  s.moe.experts = 6;
  s.moe.dense_layers = {};
  const std::string base = test::temp_dir("ckpt-moe-base");
  io::save_hf_model(*models::make_causal_lm(s, 5), base);
  std::vector<double> first_losses;
  // The load-balancing loss's gradient enters at the routers inside the recomputed blocks, from
  // the sums their first forward counted (the recompute counts nothing again).
  for (const auto& [k, aux_coef] : {std::pair{CkptCase{"llama", "32-true", "none"}, 0.0},
                                    std::pair{CkptCase{"llama", "bf16-mixed", "lora"}, 0.0},
                                    std::pair{CkptCase{"llama", "32-true", "none"}, 0.05},
                                    std::pair{CkptCase{"llama", "bf16-mixed", "lora"}, 0.05}}) {
    const std::string tag = ckpt_case_name(k) + (aux_coef > 0 ? "_moe_aux" : "_moe");
    auto config = [&](const std::string& checkpointing) {
      Config c = ckpt_config(k, checkpointing, tag + "_" + checkpointing);
      c.model = ModelConfig{};
      c.model.path = base;
      c.model.attention_dropout = 0.1;
      c.model.router_aux_loss_coef = aux_coef;
      if (k.adapter != "none") {
        c.model.adapter.kind = k.adapter;
        c.model.adapter.r = 4;
        c.model.adapter.dropout = 0.1;
        c.model.adapter.target_modules = {"q_proj", "gate_proj", "up_proj", "down_proj"};
      }
      return c;
    };
    const CkptTrace plain = ckpt_trace(config("none"));
    const CkptTrace ckpt = ckpt_trace(config("blocks"));
    ckpt_expect_same_run(plain, ckpt);
    EXPECT_EQ(ckpt.block_recomputes, 3 * 2 * 3) << tag;
    first_losses.push_back(plain.loss.at(0));
  }
  // (The loss took the load-balancing term: the same forwards, another loss.)
  ASSERT_EQ(first_losses.size(), 4u);
  EXPECT_GT(first_losses[2], first_losses[0]);
  EXPECT_GT(first_losses[3], first_losses[1]);
}

// Phi's, GPT-NeoX's, StableLM's, Falcon's and GPT-J's dropout of their sublayers' outputs
// (model.dropout; a parallel Falcon's on the branches' sum) draws the same masks when a
// checkpointed block recomputes: the same bits with and without checkpointing, and another loss
// than without the dropout.
TEST(Checkpoint, SublayerDropoutsOfPhiGptNeoxStableLmAndFalconMatchToo) {
  for (const char* family : {"phi", "gpt_neox", "stablelm_par", "falcon", "falcon_seq", "gptj"}) {
    models::ModelSpec s = test::tiny_model_spec(family);
    s.n_layer = 3;
    s.vocab_size = 259;
    s.max_seq_len = 32;
    const std::string base = test::temp_dir(std::string("ckpt-") + family + "-base");
    io::save_hf_model(*models::make_causal_lm(s, 5), base);
    std::vector<double> first_losses;
    for (const double dropout : {0.0, 0.1}) {
      const CkptCase k{"llama", "bf16-mixed", "lora"};
      const std::string tag = std::string(family) + (dropout > 0 ? "_dropout" : "_plain");
      auto config = [&](const std::string& checkpointing) {
        Config c = ckpt_config(k, checkpointing, tag + "_" + checkpointing);
        c.model = ModelConfig{};
        c.model.path = base;
        c.model.dropout = dropout;
        c.model.adapter.kind = k.adapter;
        c.model.adapter.r = 4;
        c.model.adapter.target_modules = {s.grouped_qkv() ? "query_key_value" : "q_proj"};
        return c;
      };
      const CkptTrace plain = ckpt_trace(config("none"));
      const CkptTrace ckpt = ckpt_trace(config("blocks"));
      SCOPED_TRACE(tag);
      ckpt_expect_same_run(plain, ckpt);
      EXPECT_EQ(ckpt.block_recomputes, 3 * 2 * 3);
      first_losses.push_back(plain.loss.at(0));
    }
    ASSERT_EQ(first_losses.size(), 2u);
    EXPECT_NE(first_losses[0], first_losses[1]) << family << ": the dropout dropped nothing";
  }
}

TEST(Checkpoint, AGradAccumOfOneMatchesToo) {
  CkptCase k{"llama", "16-mixed", "dora"};
  Config a = ckpt_config(k, "none", "acc1_none"), b = ckpt_config(k, "blocks", "acc1_blocks");
  a.train.grad_accum = b.train.grad_accum = 1;
  ckpt_expect_same_run(ckpt_trace(a), ckpt_trace(b));
}

TEST(Checkpoint, OffOutsideTrainingAndWithoutGradMode) {
  // Evaluation (eval mode, no grad) and a no-grad forward run the blocks once, plainly.
  Config c = ckpt_config({"llama", "32-true", "lora"}, "blocks", "eval_off");
  Trainer t(c);
  EXPECT_EQ(t.model().activation_checkpointing(), 1);
  int64_t recomputes = 0, calls = 0;
  for (nn::Module* m : t.model().modules())
    if (ckpt_is_block(*m))
      m->add_forward_post_hook([&](nn::Module&, const std::vector<Tensor>&, Tensor& out) {
        ++calls;
        if (nn::Module::recomputing()) ++recomputes;
        EXPECT_EQ(out.requires_grad(), grad_mode_enabled() && !nn::Module::recomputing());
      });
  const data::Batch b = t.loader().batch(0, 0);
  {
    NoGradGuard no_grad;
    Tensor logits = t.model().forward(b.input_ids, b.attention_mask);
    EXPECT_FALSE(logits.requires_grad());
  }
  EXPECT_EQ(calls, 3);
  const EvalResult e = t.evaluate();
  EXPECT_TRUE(std::isfinite(e.loss));
  EXPECT_EQ(recomputes, 0);
}

TEST(Checkpoint, TheKeyTakesNoneBlocksOrABlockCountAndNamesTheValidValues) {
  auto blocks = [](const std::string& set) {
    return activation_checkpointing_blocks(
        load_config("", {"train.activation_checkpointing=" + set}).train);
  };
  EXPECT_EQ(activation_checkpointing_blocks(Config{}.train), 0);  // default: none
  EXPECT_EQ(blocks("none"), 0);
  EXPECT_EQ(blocks("blocks"), 1);
  EXPECT_EQ(blocks("2"), 2);       // a TOML integer
  EXPECT_EQ(blocks("\"07\""), 7);  // a string holding one, stored as "7"
  EXPECT_EQ(
      load_config("", {"train.activation_checkpointing=\"07\""}).train.activation_checkpointing,
      "7");
  EXPECT_EQ(activation_checkpointing_blocks(
                load_config_text("[train]\nactivation_checkpointing = 4\n", "c.toml").train),
            4);
  for (const char* bad : {"sometimes", "0", "-1", "1025", "2x", "\"\""}) {
    const std::string e = test::error_of(
        [&] { load_config("", {std::string("train.activation_checkpointing=") + bad}); });
    EXPECT_CONTAINS(e, "train.activation_checkpointing must be none, blocks, or an integer N");
    EXPECT_CONTAINS(e, "--set train.activation_checkpointing=");
  }
  const std::string in_file = test::error_of(
      [] { load_config_text("[train]\nactivation_checkpointing = \"all\"\n", "c.toml"); });
  EXPECT_CONTAINS(in_file, "c.toml:2");
  EXPECT_CONTAINS(in_file, "got \"all\"");
  const std::string a_float = test::error_of(
      [] { load_config_text("[train]\nactivation_checkpointing = 1.5\n", "c.toml"); });
  EXPECT_CONTAINS(a_float, "train.activation_checkpointing must be a string");
}

// ---- memory ------------------------------------------------------------------------------------

// A small Llama LoRA run in a fresh process (the peak is a process-wide high-water mark): prints
// the peak of live tensor bytes. Run by PeakLiveBytesDropWithCheckpointing, not on its own.
TEST(CheckpointChild, DISABLED_TrainAndPrintPeak) {
  const char* mode = std::getenv("KEEL_CKPT_CHILD");
  ASSERT_NE(mode, nullptr);
  Config c = ckpt_config({"llama", "32-true", "lora"}, mode, std::string("peak_") + mode);
  c.model.n_layer = 8;
  c.model.n_embd = 128;
  c.model.n_head = 4;
  c.model.n_kv_head = 4;
  c.model.max_seq_len = 128;
  c.data.task = "text";
  c.data.path = c.run.out_dir + "/corpus.txt";
  {
    std::ofstream f(c.data.path);
    for (int i = 0; i < 400; ++i) f << "line " << i << " of a corpus for the checkpointing test.\n";
  }
  c.data.pack = true;
  c.data.seq_len = 128;
  c.data.eval_examples = 0;
  c.train.batch_size = 8;
  c.train.grad_accum = 1;
  c.train.max_steps = 2;
  Trainer t(c);
  ASSERT_EQ(t.fit(), 0);
  std::printf("KEEL_PEAK_LIVE_BYTES=%zu\n", host_memory::stats().peak_live_bytes);
}

size_t ckpt_child_peak(const std::string& mode) {
  // This test binary itself (popen's /proc/self/exe would be the shell).
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string cmd = "KEEL_CKPT_CHILD=" + mode + " '" + self +
                          "' --gtest_also_run_disabled_tests "
                          "--gtest_filter=CheckpointChild.DISABLED_TrainAndPrintPeak 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return 0;
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  const size_t at = out.find("KEEL_PEAK_LIVE_BYTES=");
  EXPECT_NE(at, std::string::npos) << out;
  return at == std::string::npos ? 0 : std::stoull(out.substr(at + 21));
}

TEST(Checkpoint, PeakLiveBytesDropWithCheckpointing) {
  if (!host_memory::cache_enabled()) GTEST_SKIP() << "the host cache (its statistics) is off";
  const size_t plain = ckpt_child_peak("none"), blocks = ckpt_child_peak("blocks"),
               seg = ckpt_child_peak("2");
  ASSERT_GT(plain, 0u);
  std::printf("peak live bytes: none %.1f MB, blocks %.1f MB (%.2fx), segments of 2 %.1f MB\n",
              plain / 1e6, blocks / 1e6, static_cast<double>(blocks) / plain, seg / 1e6);
  EXPECT_LT(blocks, plain * 6 / 10);  // activations are most of this run's memory
  EXPECT_LT(seg, plain * 8 / 10);
}

}  // namespace
}  // namespace keel
