// train.activation_checkpointing under the instability toolkit (DESIGN §4, §8 "Hooks"): a
// checkpointed segment's forward runs twice (forward, then inside backward), yet the tracer's
// frames and log, the fault injector's count, the finding and the NaN capture are those of the run
// without checkpointing, byte for byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "keel/monitor/inject.h"
#include "keel/monitor/nan_capture.h"
#include "keel/monitor/tracer.h"
#include "keel/train/trainer.h"
#include "tests/support/check.h"

namespace keel {
namespace {

// Three blocks with dropout (GPT-2's model dropout, and the adapter's) and two micro-batches a
// step. (A Llama has no model dropout: model.dropout is refused there.)
Config ckpt_instr_config(const std::string& family, const std::string& precision,
                         const std::string& adapter, const std::string& checkpointing,
                         const std::string& tag) {
  std::vector<std::string> sets = {"run.out_dir=" + test::temp_dir("ckpt_instr_" + tag),
                                   "run.seed=7",
                                   "model.family=" + family,
                                   "model.n_layer=3",
                                   "model.n_embd=32",
                                   "model.n_head=2",
                                   "data.num_examples=64",
                                   "data.eval_examples=0",
                                   "data.seq_len=16",
                                   "train.batch_size=4",
                                   "train.grad_accum=2",
                                   "train.max_steps=3",
                                   "train.precision=" + precision,
                                   "train.activation_checkpointing=" + checkpointing,
                                   "log.tensorboard=false",
                                   "log.metrics=false",
                                   "log.console=false",
                                   "model.adapter.kind=" + adapter};
  if (family == "gpt2") sets.push_back("model.dropout=0.1");
  if (adapter != "none") {
    sets.push_back("model.adapter.dropout=0.1");
    sets.push_back(family == "gpt2" ? R"(model.adapter.target_modules=["c_attn","c_fc"])"
                                    : R"(model.adapter.target_modules=["q_proj","up_proj"])");
  }
  return load_config("", sets);
}

// Frames equal, or the first that differs (a whole run's frames are too long to print).
void ckpt_expect_same_frames(const std::vector<std::string>& ckpt,
                             const std::vector<std::string>& plain, const std::string& what) {
  for (size_t i = 0; i < std::min(ckpt.size(), plain.size()); ++i)
    if (ckpt[i] != plain[i]) {
      ADD_FAILURE() << what << ": frame " << i << " of " << plain.size() << " differs:\n"
                    << ckpt[i] << "\n--- without checkpointing:\n"
                    << plain[i];
      return;
    }
  EXPECT_EQ(ckpt.size(), plain.size()) << what;
}

struct CkptInstrCase {
  std::string family, precision, adapter;
};

std::string ckpt_read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct CkptTracedRun {
  int exit_code = -1;
  std::vector<std::string> frames;
  std::string log, capture_dir;
  int64_t injections = 0;
  monitor::TracerFinding finding;
};

// fit() with the tracer (trace_batch_nums) and, when `inject`, a NaN injected into block 1's MLP
// output at step 2 and the NaN capture written: what `keel train` wires up (apps/keel/train.cpp).
CkptTracedRun ckpt_traced_run(Config c, bool inject) {
  c.debug.underflow_overflow.enabled = true;
  c.debug.underflow_overflow.trace_batch_nums = {1, 2};
  c.debug.underflow_overflow.max_frames_to_save = 100000;
  c.debug.inject.module = c.model.family == "gpt2" ? "transformer.h.1.mlp" : "model.layers.1.mlp";
  c.debug.inject.step = inject ? 2 : -1;
  CkptTracedRun out;
  Trainer* self = nullptr;
  std::unique_ptr<monitor::FaultInjector> injector;
  std::unique_ptr<monitor::UnderflowOverflowTracer> tracer;
  TrainerHooks h;
  h.on_step_begin = [&](int64_t step) {
    injector->begin_step(step);
    tracer->begin_batch(step);
  };
  h.on_capture = [&](const NonfiniteEvent& ev) {
    return out.capture_dir = monitor::write_nan_capture(*self, ev, 0);
  };
  Trainer t(c, h);
  self = &t;
  injector = std::make_unique<monitor::FaultInjector>(t.model(), c.debug.inject);
  monitor::TracerOptions topt{c.debug.underflow_overflow};
  topt.format = t.policy().compute_dtype;
  const std::string log = c.run.out_dir + "/debug/underflow_overflow_rank0.log";
  tracer = std::make_unique<monitor::UnderflowOverflowTracer>(t.model(), topt, log);
  tracer->set_stop_on_finding(false);  // let the step finish and the capture be written
  out.exit_code = t.fit();
  out.frames = tracer->frames();
  out.finding = tracer->finding();
  out.injections = injector->injections();
  injector.reset();
  tracer.reset();  // flushes the log
  out.log = ckpt_read_file(log);
  return out;
}

// The run without checkpointing and the run with it (`blocks`), otherwise the same.
std::pair<CkptTracedRun, CkptTracedRun> ckpt_traced_pair(const CkptInstrCase& k, bool inject) {
  const std::string tag = std::string(inject ? "inject_" : "trace_") + k.family;
  return {ckpt_traced_run(ckpt_instr_config(k.family, k.precision, k.adapter, "none", tag), inject),
          ckpt_traced_run(ckpt_instr_config(k.family, k.precision, k.adapter, "blocks", tag + "_b"),
                          inject)};
}

TEST(Checkpoint, TracerFramesAndLogAreThoseOfTheRunWithout) {
  for (const CkptInstrCase& k :
       {CkptInstrCase{"gpt2", "bf16-mixed", "lora"}, CkptInstrCase{"llama", "32-true", "none"}}) {
    const auto [plain, ckpt] = ckpt_traced_pair(k, false);
    EXPECT_EQ(plain.exit_code, 0);
    EXPECT_EQ(ckpt.exit_code, 0);
    ASSERT_FALSE(plain.frames.empty());
    ckpt_expect_same_frames(ckpt.frames, plain.frames, k.family + " " + k.precision);
    ASSERT_FALSE(plain.log.empty());
    EXPECT_TRUE(ckpt.log == plain.log) << k.family << " " << k.precision << ": the logs differ";
  }
}

TEST(Checkpoint, AnInjectedNaNIsFoundCountedAndCapturedAsWithout) {
  const CkptInstrCase k{"llama", "bf16-mixed", "lora"};
  const auto [plain, ckpt] = ckpt_traced_pair(k, true);
  EXPECT_EQ(plain.exit_code, 3);
  EXPECT_EQ(ckpt.exit_code, 3);
  EXPECT_EQ(plain.injections, 2);  // one per micro-batch of step 2, not one more per recompute
  EXPECT_EQ(ckpt.injections, plain.injections);
  EXPECT_TRUE(plain.finding.found);
  EXPECT_EQ(ckpt.finding.module, plain.finding.module);
  EXPECT_EQ(ckpt.finding.phase, plain.finding.phase);
  EXPECT_EQ(ckpt.finding.tensor, plain.finding.tensor);
  EXPECT_EQ(ckpt.finding.batch, plain.finding.batch);
  ckpt_expect_same_frames(ckpt.frames, plain.frames, "injected");
  EXPECT_TRUE(ckpt.log == plain.log) << "the logs differ";
  // The capture: the same tensors, bit for bit, and the same record apart from when and where.
  ASSERT_FALSE(plain.capture_dir.empty());
  ASSERT_FALSE(ckpt.capture_dir.empty());
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "microbatches.safetensors"})
    EXPECT_EQ(ckpt_read_file(ckpt.capture_dir + "/" + f),
              ckpt_read_file(plain.capture_dir + "/" + f))
        << f;
  auto record = [](const std::string& dir) {
    nlohmann::json j = nlohmann::json::parse(ckpt_read_file(dir + "/capture.json"));
    for (const char* volatile_key : {"utc_time", "time", "config", "config_toml", "out_dir"})
      j.erase(volatile_key);
    return j;
  };
  EXPECT_EQ(record(ckpt.capture_dir), record(plain.capture_dir));
}

}  // namespace
}  // namespace keel
