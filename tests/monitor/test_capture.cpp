// NaN capture (DESIGN §4) through the Trainer in process: the capture holds the step exactly as it
// was before the (skipped) update — parameters, optimizer state, micro-batches, the loss bits and
// the gradients' fingerprint, the RNG and scaler state — and the trainer stops with one message;
// nan_capture = false writes nothing but still stops; a 16-mixed overflow that the scaler handles
// never reaches the capture.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "keel/autograd/node.h"
#include "keel/io/safetensors.h"
#include "keel/monitor/nan_capture.h"
#include "keel/train/trainer.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel::monitor {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

Config small_config(const std::string& tag) {
  Config c;
  c.run.out_dir = test::temp_dir(tag);
  c.run.seed = 5;
  c.run.threads = 1;
  c.model.n_layer = 1;
  c.model.n_embd = 32;
  c.model.n_head = 2;
  c.data.num_examples = 128;
  c.data.eval_examples = 0;
  c.data.seq_len = 16;
  c.train.batch_size = 8;
  c.train.max_steps = 8;
  c.log.tensorboard = false;
  c.log.metrics = false;
  c.log.console = false;
  return c;
}

using test::slurp;

// Poisons one weight element with NaN (a corrupt value the next step trips on).
void poison(Trainer& t, const std::string& name) {
  NoGradGuard g;
  Tensor w = t.model().find_parameter(name);
  ASSERT_TRUE(w.defined()) << name;
  w.data_as<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  w.bump_version();
}

void expect_same_tensors(const io::Safetensors& file,
                         const std::vector<std::pair<std::string, Tensor>>& live,
                         const std::string& what) {
  ASSERT_EQ(file.tensors.size(), live.size()) << what;
  for (auto& [name, t] : live) {
    const Tensor* f = file.find(name);
    ASSERT_NE(f, nullptr) << what << ": " << name;
    test::expect_bitwise_equal(*f, t, what + ": " + name);
  }
}

// Three healthy steps, then a NaN weight: the capture at step 4 is the state after step 3's update.
TEST(NanCapture, HoldsTheStepAsItWasBeforeTheUpdate) {
  Config c = small_config("capture-state");
  c.data.shuffle = false;
  std::string captured;
  int captures = 0;
  Trainer* tp = nullptr;
  std::vector<data::Batch> seen_window;
  TrainerHooks h;
  h.on_capture = [&](const NonfiniteEvent& ev) {
    ++captures;
    seen_window = *ev.window;
    captured = write_nan_capture(*tp, ev);
    return captured;
  };
  Trainer t(c, h);
  tp = &t;
  const auto init = t.model().named_parameters();
  std::vector<Tensor> init_copy;
  for (auto& [n, p] : init) init_copy.push_back(p.clone());
  for (int64_t i = 0; i < 3; ++i) {
    StepResult r = t.train_step({t.loader().batch(0, i)}, 0);
    ASSERT_TRUE(r.stepped);
  }
  poison(t, "transformer.h.0.mlp.c_fc.weight");
  const StepResult r = t.train_step({t.loader().batch(0, 3)}, 0);
  EXPECT_FALSE(r.stepped);
  ASSERT_EQ(captures, 1);
  EXPECT_EQ(captured, c.run.out_dir + "/debug/nan_capture/rank0");

  // The parameters are the pre-step ones (no update was applied), which are not the initial ones.
  expect_same_tensors(io::read_safetensors(captured + "/model.safetensors"),
                      t.model().named_parameters(), "model");
  bool moved = false;
  for (size_t i = 0; i < init.size(); ++i)
    moved |= init_copy[i].to_floats() != init[i].second.to_floats();
  EXPECT_TRUE(moved) << "three updates were applied before the capture";
  expect_same_tensors(io::read_safetensors(captured + "/optimizer.safetensors"),
                      t.optimizer().state(), "optimizer");
  const io::Safetensors mb = io::read_safetensors(captured + "/microbatches.safetensors");
  ASSERT_EQ(seen_window.size(), 1u);
  test::expect_bitwise_equal(mb.at("mb0.input_ids"), seen_window[0].input_ids, "input_ids");
  test::expect_bitwise_equal(mb.at("mb0.labels"), seen_window[0].labels, "labels");
  test::expect_bitwise_equal(mb.at("mb0.attention_mask"), seen_window[0].attention_mask, "mask");

  const json meta = json::parse(slurp(captured + "/capture.json"));
  EXPECT_EQ(meta.at("format"), "keel-nan-capture");
  EXPECT_EQ(meta.at("step"), 4);
  EXPECT_EQ(meta.at("rank"), 0);
  EXPECT_EQ(meta.at("precision"), "32-true");
  EXPECT_EQ(meta.at("param_dtype"), "f32");
  EXPECT_EQ(meta.at("attention"), "eager");
  EXPECT_EQ(meta.at("threads"), omp_get_max_threads());
  EXPECT_EQ(meta.at("loss_bits"), double_bits_hex(r.loss));
  EXPECT_EQ(meta.at("grads_fingerprint"), gradient_fingerprint(t.trainable()));
  EXPECT_EQ(meta.at("rng").at("step_seed").get<uint64_t>(), t.step_seed(4));
  EXPECT_EQ(meta.at("rng").at("seed").get<uint64_t>(), 5u);
  EXPECT_EQ(meta.at("loss_scale"), 1.0);
  EXPECT_TRUE(meta.at("scaler").is_null());
  EXPECT_EQ(meta.at("nonfinite_param_values"), json::array({"transformer.h.0.mlp.c_fc.weight"}));
  EXPECT_FALSE(meta.at("nonfinite_params").empty());
  EXPECT_EQ(meta.at("micro_batches").size(), 1u);
  EXPECT_EQ(meta.at("micro_batches")[0].at("example_ids").get<std::vector<int64_t>>(),
            seen_window[0].example_ids);
  EXPECT_EQ(meta.at("micro_batches")[0].at("n_targets"), seen_window[0].n_targets);
  // The embedded config reads back to the run's config.
  const std::string toml_path = c.run.out_dir + "/readback.toml";
  std::ofstream(toml_path) << meta.at("config_toml").get<std::string>();
  auto body = [](const std::string& toml) {  // without the "# ..." header comments
    std::string out, line;
    std::istringstream in(toml);
    while (std::getline(in, line))
      if (line.rfind("#", 0) != 0) out += line + "\n";
    return out;
  };
  EXPECT_EQ(body(config_to_toml(load_config(toml_path))), body(config_to_toml(t.config())));
  // The capture is a complete directory (written atomically): no temporary siblings remain.
  for (auto& e : fs::directory_iterator(c.run.out_dir + "/debug/nan_capture"))
    EXPECT_EQ(e.path().filename(), "rank0");
}

TEST(NanCapture, StopsWithOneMessageNamingStepParameterPathAndReplay) {
  Config c = small_config("capture-message");
  Trainer* tp = nullptr;
  TrainerHooks h;
  h.on_capture = [&](const NonfiniteEvent& ev) { return write_nan_capture(*tp, ev); };
  Trainer t(c, h);
  tp = &t;
  poison(t, "transformer.h.0.attn.c_proj.weight");
  EXPECT_EQ(t.fit(), 3);
  const std::string m = t.stop_message();
  const std::string path = c.run.out_dir + "/debug/nan_capture/rank0";
  EXPECT_EQ(m.rfind("step 1: non-finite loss", 0), 0u) << m;
  // The NaN is in the forward: every gradient is non-finite, and what names the cause is the
  // poisoned value itself. No gradient is named as backward's producer: each one only carries
  // the loss's NaN (it named transformer.ln_f.weight, the first backward reaches).
  EXPECT_CONTAINS(m, "(the loss's own nan, carried back: the forward produced it, not backward)");
  EXPECT_NOT_CONTAINS(m, "first produced by backward");
  EXPECT_CONTAINS(m,
                  "; parameter values already non-finite in 1 (first: "
                  "transformer.h.0.attn.c_proj.weight)");
  EXPECT_NE(m.find("capture written to " + path + "; replay with: keel replay " + path),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << "one message, one line";
  EXPECT_TRUE(fs::exists(path + "/capture.json"));
}

// A NaN produced in backward in the last block, naturally: its MLP weight is so large (1e21) that
// the GELU's input squares beyond f32 (x^3 overflows: the forward still holds, x sigmoid(inf) = x,
// but its derivative is inf * 0 = nan), while the final LayerNorm's variance overflows to inf and
// its output and backward stay finite (x * 1/sqrt(inf) = 0). Every gradient backward produces
// after that GELU is NaN, down to the embedding, which comes first in model order: the stop line
// names the gradient backward produced first, in the last block's MLP.
TEST(NanCapture, StopLineNamesTheGradientBackwardProducedFirstNotTheEmbedding) {
  Config c = small_config("capture-order");
  c.model.n_layer = 2;
  Trainer* tp = nullptr;
  NonfiniteEvent seen;
  std::string path;
  TrainerHooks h;
  h.on_capture = [&](const NonfiniteEvent& ev) {
    seen = ev;
    return path = write_nan_capture(*tp, ev);
  };
  Trainer t(c, h);
  tp = &t;
  {
    NoGradGuard g;
    Tensor w = t.model().find_parameter("transformer.h.1.mlp.c_fc.weight");
    ASSERT_TRUE(w.defined());
    float* v = w.data_as<float>();
    for (int64_t i = 0; i < w.numel(); ++i) v[i] *= 1e21f;
    w.bump_version();
  }
  EXPECT_EQ(t.fit(), 3);
  const std::string m = t.stop_message();
  EXPECT_EQ(m.rfind("step 1: non-finite gradients in ", 0), 0u) << "the loss is finite: " << m;
  EXPECT_CONTAINS(m, "(first produced by backward: transformer.h.1.mlp.c_fc.");
  EXPECT_NOT_CONTAINS(m, "parameter values already non-finite");  // they are large, not broken
  ASSERT_FALSE(seen.nonfinite_params.empty());
  EXPECT_EQ(seen.nonfinite_params.front(), "transformer.wte.weight") << "model order";
  EXPECT_EQ(seen.first_nonfinite_param.rfind("transformer.h.1.mlp.c_fc.", 0), 0u)
      << seen.first_nonfinite_param;
  // Nothing of block 1 after the MLP's input in the forward (its c_proj, the final norm) is
  // non-finite: the NaN starts at the GELU.
  for (const std::string& n : seen.nonfinite_params) {
    EXPECT_EQ(n.find("h.1.mlp.c_proj"), std::string::npos) << n;
    EXPECT_EQ(n.find("ln_f"), std::string::npos) << n;
  }
  const json meta = json::parse(slurp(path + "/capture.json"));
  EXPECT_EQ(meta.at("first_nonfinite_param"), seen.first_nonfinite_param);
  EXPECT_EQ(meta.at("world_size"), 1);
}

TEST(NanCapture, DisabledWritesNothingButStillStops) {
  Config c = small_config("capture-off");
  c.debug.nan_capture = false;
  TrainerHooks h;
  h.on_capture = [](const NonfiniteEvent&) -> std::string {
    ADD_FAILURE() << "nan_capture = false must not capture";
    return "";
  };
  Trainer t(c, h);
  poison(t, "transformer.h.0.mlp.c_proj.weight");
  EXPECT_EQ(t.fit(), 3);
  EXPECT_NE(t.stop_message().find("no capture written ([debug] nan_capture = false)"),
            std::string::npos)
      << t.stop_message();
  EXPECT_FALSE(fs::exists(c.run.out_dir + "/debug"));
}

TEST(NanCapture, AFailingWriteStillStopsAndSaysWhy) {
  Config c = small_config("capture-fail");
  TrainerHooks h;
  h.on_capture = [](const NonfiniteEvent&) -> std::string { throw Error("disk full"); };
  Trainer t(c, h);
  poison(t, "transformer.h.0.mlp.c_proj.weight");
  EXPECT_EQ(t.fit(), 3);
  EXPECT_NE(t.stop_message().find("no capture written (writing it failed: disk full)"),
            std::string::npos)
      << t.stop_message();
}

// Under 16-mixed a NaN weight makes the loss itself non-finite: the scaler cannot handle it, so it
// is captured, with the scale the backward ran with and the scaler's state.
TEST(NanCapture, Under16MixedRecordsTheScaler) {
  Config c = small_config("capture-16mixed");
  c.train.precision = "16-mixed";
  Trainer* tp = nullptr;
  std::string path;
  TrainerHooks h;
  h.on_capture = [&](const NonfiniteEvent& ev) { return path = write_nan_capture(*tp, ev); };
  Trainer t(c, h);
  tp = &t;
  poison(t, "transformer.h.0.mlp.c_proj.weight");
  EXPECT_EQ(t.fit(), 3);
  ASSERT_FALSE(path.empty());
  const json meta = json::parse(slurp(path + "/capture.json"));
  EXPECT_EQ(meta.at("precision"), "16-mixed");
  EXPECT_EQ(meta.at("param_dtype"), "f32");
  EXPECT_EQ(meta.at("compute_dtype"), "f16");
  EXPECT_TRUE(meta.at("masters").get<bool>());
  EXPECT_EQ(meta.at("loss_scale"), 65536.0);
  ASSERT_TRUE(meta.at("scaler").is_object());
  EXPECT_TRUE(meta.at("scaler").contains("scale"));
  EXPECT_TRUE(meta.at("scaler").contains("_growth_tracker"));
  EXPECT_FALSE(meta.at("loss_finite").get<bool>());
}

// An ordinary overflow under 16-mixed: a finite loss whose scaled f16 gradients overflow. The
// scaler skips and backs off; the capture is never called.
TEST(NanCapture, ScalerHandledOverflowIsNeverCaptured) {
  Config c = small_config("capture-scaler");
  c.train.precision = "16-mixed";
  c.scaler.init_scale = 16777216.0;  // 2^24: the scaled gradients overflow f16
  c.train.max_steps = 16;
  std::vector<StepResult> steps;
  TrainerHooks h;
  h.on_capture = [](const NonfiniteEvent&) -> std::string {
    ADD_FAILURE() << "an overflow the scaler handles must not be captured";
    return "";
  };
  h.on_step = [&](const StepResult& r) { steps.push_back(r); };
  Trainer t(c, h);
  EXPECT_EQ(t.fit(), 0) << t.stop_message();
  ASSERT_FALSE(steps.empty());
  EXPECT_TRUE(steps.front().found_inf) << "the first scale must overflow f16";
  EXPECT_FALSE(steps.front().stepped);
  EXPECT_GT(steps.back().skipped_steps, 0);
  EXPECT_EQ(steps.back().nan_steps, 0);
  EXPECT_TRUE(steps.back().stepped);
  EXPECT_FALSE(fs::exists(c.run.out_dir + "/debug"));
}

TEST(NanCapture, FingerprintCoversEveryGradientBit) {
  Tensor a = Tensor::from_floats({1.f, 2.f, 3.f}, {3});
  Tensor b = Tensor::from_floats({4.f, 5.f}, {2});
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  a.impl()->grad = Tensor::from_floats({0.5f, -0.0f, 1.f}, {3});
  b.impl()->grad = Tensor::from_floats({2.f, 3.f}, {2});
  const std::vector<std::pair<std::string, Tensor>> ps = {{"a", a}, {"b", b}};
  const std::string h0 = gradient_fingerprint(ps);
  EXPECT_EQ(h0.size(), 16u);
  EXPECT_EQ(gradient_fingerprint(ps), h0);
  a.impl()->grad = Tensor::from_floats({0.5f, 0.0f, 1.f}, {3});  // -0 vs +0: other bits
  EXPECT_NE(gradient_fingerprint(ps), h0);
  EXPECT_EQ(double_bits_hex(1.0), "0x3ff0000000000000");
  EXPECT_EQ(double_bits_hex(-std::numeric_limits<double>::infinity()), "0xfff0000000000000");
}

}  // namespace
}  // namespace keel::monitor
