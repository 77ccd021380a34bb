// The underflow/overflow tracer: HF's frame layout with keel's extra columns, the producing module
// (never a module that only propagates), backward findings, masked attention, the ring buffer,
// trace_batch_nums and abort_after_batch_num.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/models/causal_lm.h"
#include "keel/monitor/tracer.h"
#include "keel/nn/layers.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/shape.h"
#include "tests/support/check.h"

namespace keel {
namespace {

using monitor::TracerFinding;
using monitor::TracerOptions;
using monitor::TracerStop;
using monitor::UnderflowOverflowTracer;

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) out.push_back(line);
  return out;
}

// A weight matrix k * identity ([n, n]) in dt.
Tensor scaled_identity(int64_t n, float k, DType dt) {
  std::vector<float> v(n * n, 0.f);
  for (int64_t i = 0; i < n; ++i) v[i * n + i] = k;
  return Tensor::from_floats(v, {n, n}, dt);
}

// pre -> big -> after, all Linear(8, 8) without bias. pre = I, big = 2I, after = I: an input
// holding 40000 overflows f16 in `big` (80000 > 65504); `after` only propagates.
class Chain : public nn::Module {
 public:
  explicit Chain(DType dt) : nn::Module("Chain") {
    pre = register_module("pre", std::make_unique<nn::Linear>(8, 8, false, dt));
    big = register_module("big", std::make_unique<nn::Linear>(8, 8, false, dt));
    after = register_module("after", std::make_unique<nn::Linear>(8, 8, false, dt));
    pre->weight.copy_from(scaled_identity(8, 1.f, dt));
    big->weight.copy_from(scaled_identity(8, 2.f, dt));
    after->weight.copy_from(scaled_identity(8, 1.f, dt));
    assign_paths();
  }
  Tensor forward(const Tensor& x) {
    return call({x}, [&] { return after->forward(big->forward(pre->forward(x))); });
  }
  nn::Linear *pre, *big, *after;
};

// [2, 8]: per row 4 zeros, 2 subnormals of f16 (1e-6 < 6.1e-5), 2 values near f16's max.
Tensor chain_input(DType dt) {
  std::vector<float> v;
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < 4; ++i) v.push_back(0.f);
    v.push_back(1e-6f);
    v.push_back(-1e-6f);
    v.push_back(40000.f);
    v.push_back(-40000.f);
  }
  return Tensor::from_floats(v, {2, 8}, dt);
}

// Runs f, expecting a TracerStop; returns its finding.
template <class F>
TracerFinding expect_stop(F&& f) {
  try {
    f();
  } catch (const TracerStop& s) {
    return s.finding;
  }
  ADD_FAILURE() << "expected a TracerStop";
  return {};
}

TEST(Tracer, NamesTheLinearThatOverflowsF16NotTheOnesDownstream) {
  const std::string dir = test::temp_dir("tracer-f16");
  const std::string log = dir + "/debug/underflow_overflow_rank0.log";
  Chain net(DType::F16);
  TracerOptions opt;
  opt.format = DType::F16;
  UnderflowOverflowTracer tracer(net, opt, log);
  tracer.begin_batch(1);
  tracer.begin_batch(2);  // nothing happened in batch 1
  TracerFinding f = expect_stop([&] { net.forward(chain_input(DType::F16)); });
  ASSERT_TRUE(f.found);
  EXPECT_EQ(f.module, "big");
  EXPECT_EQ(f.module_type, "Linear");
  EXPECT_EQ(f.phase, "forward");
  EXPECT_EQ(f.tensor, "output");
  EXPECT_EQ(f.batch, 2);
  EXPECT_EQ(f.log_path, log);
  EXPECT_NE(f.message.find("'big' (Linear)"), std::string::npos) << f.message;
  EXPECT_EQ(tracer.finding().module, "big");

  // HF's layout: the header lines, then frames "<17 spaces> path Type" and
  // "%8.2e %8.2e metadata", keel's three columns after them.
  ASSERT_TRUE(std::filesystem::exists(log));
  const std::string text = read_file(log);
  auto lines = lines_of(text);
  auto find_line = [&](const std::string& l) {
    return std::find(lines.begin(), lines.end(), l) - lines.begin();
  };
  EXPECT_LT(find_line("output has infs"), find_line("Detected inf/nan during batch_number=2"));
  const auto detected = find_line("Detected inf/nan during batch_number=2");
  ASSERT_LT(detected + 3, static_cast<long>(lines.size())) << text;
  EXPECT_EQ(lines[detected + 1], "Last 2 forward frames:");
  EXPECT_EQ(lines[detected + 2].rfind("abs min  abs max  metadata", 0), 0u) << lines[detected + 2];
  EXPECT_NE(lines[detected + 2].find("zeros%"), std::string::npos);
  EXPECT_NE(lines[detected + 2].find("subnorm%"), std::string::npos);
  EXPECT_NE(lines[detected + 2].find("nearmax%"), std::string::npos);
  // The first frame of the batch carries HF's "Starting batch" lines, then pre's frame.
  const auto pre_hdr = find_line("                  pre Linear");
  const auto big_hdr = find_line("                  big Linear");
  ASSERT_LT(pre_hdr, static_cast<long>(lines.size())) << text;
  ASSERT_LT(big_hdr, static_cast<long>(lines.size())) << text;
  EXPECT_LT(pre_hdr, big_hdr);
  EXPECT_NE(text.find("*** Starting batch number=2 ***"), std::string::npos);
  EXPECT_EQ(find_line("                  after Linear"), static_cast<long>(lines.size()))
      << "a module downstream of the producer has no frame: the tracer stopped at the producer";

  const std::regex row(
      R"(^(\d\.\d\de[+-]\d\d|     inf|     nan) (\d\.\d\de[+-]\d\d|     inf|     nan) (\S+) +(\d+\.\d\d) +(\d+\.\d\d) +(\d+\.\d\d)$)");
  auto parse = [&](long at) {
    std::smatch m;
    EXPECT_TRUE(std::regex_match(lines[at], m, row)) << lines[at];
    return std::vector<std::string>(m.begin() + 1, m.end());
  };
  // pre: weight I (56 zeros of 64), input = output = the crafted values.
  auto w = parse(pre_hdr + 1);
  EXPECT_EQ(w[0], "0.00e+00");
  EXPECT_EQ(w[1], "1.00e+00");
  EXPECT_EQ(w[2], "weight");
  EXPECT_EQ(w[3], "87.50");
  auto in = parse(pre_hdr + 2);
  EXPECT_EQ(in[0], "0.00e+00");
  EXPECT_EQ(in[1], "4.00e+04");
  EXPECT_EQ(in[2], "input[0]");
  EXPECT_EQ(in[3], "50.00");  // zeros
  EXPECT_EQ(in[4], "25.00");  // subnormals of f16 (1e-6 is stored as a subnormal)
  EXPECT_EQ(in[5], "25.00");  // within 2x of 65504
  auto out = parse(pre_hdr + 3);
  EXPECT_EQ(out[2], "output");
  EXPECT_EQ(out[1], "4.00e+04");
  // big: 2I, output 80000 -> inf for the two near-max values per row.
  auto bw = parse(big_hdr + 1);
  EXPECT_EQ(bw[1], "2.00e+00");
  auto bo = parse(big_hdr + 3);
  EXPECT_EQ(bo[1], "     inf");
  EXPECT_EQ(bo[2], "output");
  EXPECT_EQ(bo[3], "50.00");
  EXPECT_NE(text.find("keel: the first non-finite value was produced by 'big' (Linear)"),
            std::string::npos)
      << text;
}

TEST(Tracer, ProducerUnderF16AutocastWithF32Weights) {
  // 16-mixed: f32 masters, the product rounds to f16. The f32 input is finite; big's f16 output
  // is not.
  Chain net(DType::F32);
  TracerOptions opt;
  opt.format = DType::F16;
  UnderflowOverflowTracer tracer(net, opt, test::temp_dir("tracer-mixed") + "/t.log");
  tracer.begin_batch(1);
  amp::AutocastGuard ac(true, DType::F16);
  TracerFinding f = expect_stop([&] { net.forward(chain_input(DType::F32)); });
  EXPECT_EQ(f.module, "big");
  EXPECT_EQ(f.tensor, "output");
  // f32 tensors are judged against f16: pre's f32 input has subnormals/near-max "of f16".
  auto frames = tracer.frames();
  ASSERT_EQ(frames.size(), 2u);
  EXPECT_NE(frames[0].find("input[0]"), std::string::npos);
  EXPECT_NE(frames[0].find(" 50.00    25.00    25.00"), std::string::npos) << frames[0];
}

// A parent whose own code (an add between children) overflows: the parent is the producer, not
// the child that receives the inf.
class Block : public nn::Module {
 public:
  Block() : nn::Module("Block") {
    a = register_module("a", std::make_unique<nn::Linear>(4, 4, false, DType::F16));
    b = register_module("b", std::make_unique<nn::Linear>(4, 4, false, DType::F16));
    c = register_module("c", std::make_unique<nn::Linear>(4, 4, false, DType::F16));
    a->weight.copy_from(scaled_identity(4, 1.f, DType::F16));
    b->weight.copy_from(scaled_identity(4, 1.f, DType::F16));
    c->weight.copy_from(scaled_identity(4, 1.f, DType::F16));
  }
  Tensor forward(const Tensor& x) {
    return call({x}, [&] { return c->forward(ops::add(a->forward(x), b->forward(x))); });
  }
  nn::Linear *a, *b, *c;
};
class Root : public nn::Module {
 public:
  Root() : nn::Module("Root") {
    blk = register_module("blk", std::make_unique<Block>());
    assign_paths();
  }
  Tensor forward(const Tensor& x) {
    return call({x}, [&] { return blk->forward(x); });
  }
  Block* blk;
};

TEST(Tracer, ParentWhoseOwnArithmeticOverflowsIsTheProducer) {
  Root net;
  UnderflowOverflowTracer tracer(net, {}, test::temp_dir("tracer-parent") + "/t.log");
  tracer.begin_batch(1);
  Tensor x = Tensor::from_floats({40000.f, 1.f, 2.f, 3.f}, {1, 4}, DType::F16);
  TracerFinding f = expect_stop([&] { net.forward(x); });
  EXPECT_EQ(f.module, "blk");
  EXPECT_EQ(f.module_type, "Block");
  EXPECT_EQ(f.tensor, "input[0] of blk.c");
  EXPECT_EQ(f.phase, "forward");
}

TEST(Tracer, NonFiniteModelInputAndNonFiniteWeight) {
  {
    Chain net(DType::F32);
    UnderflowOverflowTracer tracer(net, {}, test::temp_dir("tracer-input") + "/t.log");
    tracer.begin_batch(1);
    Tensor x = Tensor::full({2, 8}, 1.f);
    x.data_as<float>()[3] = std::numeric_limits<float>::quiet_NaN();
    TracerFinding f = expect_stop([&] { net.forward(x); });
    EXPECT_EQ(f.module, "");  // the root: the value came from outside the model
    EXPECT_EQ(f.module_type, "Chain");
    EXPECT_EQ(f.tensor, "input[0]");
    EXPECT_NE(f.message.find("input data"), std::string::npos) << f.message;
  }
  {
    Chain net(DType::F32);
    net.after->weight.data_as<float>()[5] = std::numeric_limits<float>::infinity();
    UnderflowOverflowTracer tracer(net, {}, test::temp_dir("tracer-weight") + "/t.log");
    tracer.begin_batch(1);
    TracerFinding f = expect_stop([&] { net.forward(Tensor::full({2, 8}, 1.f)); });
    EXPECT_EQ(f.module, "after");
    EXPECT_EQ(f.tensor, "weight");
  }
}

// lin: Linear(8, 8) with weights 1000 on f16; forward of x = 1e-3 is finite (about 8), backward
// of a grad of 1000 per output gives 1000 * 1000 * 8 = 8e6 > 65504 in grad_input.
class One : public nn::Module {
 public:
  explicit One(float w, int64_t n = 8) : nn::Module("One") {
    lin = register_module("lin", std::make_unique<nn::Linear>(n, n, false, DType::F16));
    lin->weight.fill(w);
    assign_paths();
  }
  Tensor forward(const Tensor& x) {
    return call({x}, [&] { return lin->forward(x); });
  }
  nn::Linear* lin;
};

TEST(Tracer, BackwardFindingNamesTheNodesModule) {
  One net(1000.f);
  TracerOptions opt;
  opt.format = DType::F16;
  UnderflowOverflowTracer tracer(net, opt, test::temp_dir("tracer-bwd") + "/t.log");
  tracer.begin_batch(4);
  Tensor x = Tensor::full({2, 8}, 1e-3f, DType::F16).set_requires_grad(true);
  Tensor y = net.forward(x);
  EXPECT_FALSE(tracer.finding().found);
  TracerFinding f = expect_stop([&] { backward(y, Tensor::full(y.shape(), 1000.f, DType::F16)); });
  EXPECT_EQ(f.module, "lin");
  EXPECT_EQ(f.module_type, "Linear");
  EXPECT_EQ(f.phase, "backward");
  EXPECT_EQ(f.tensor, "grad_input[0]");
  EXPECT_EQ(f.batch, 4);
  const std::string text = read_file(f.log_path);
  EXPECT_NE(text.find("Last 3 forward and backward frames:"), std::string::npos) << text;
  EXPECT_NE(text.find("                  lin Linear (backward: "), std::string::npos) << text;
  EXPECT_NE(text.find("grad_input[0] has infs"), std::string::npos) << text;
}

TEST(Tracer, ScalerHandledBackwardOverflowIsNoFinding) {
  One net(1000.f);
  TracerOptions opt;
  opt.format = DType::F16;
  opt.scaler_handles_backward = true;
  UnderflowOverflowTracer tracer(net, opt, test::temp_dir("tracer-scaler") + "/t.log");
  tracer.begin_batch(1);
  Tensor x = Tensor::full({2, 8}, 1e-3f, DType::F16).set_requires_grad(true);
  Tensor y = net.forward(x);
  backward(y, Tensor::full(y.shape(), 1000.f, DType::F16));
  EXPECT_FALSE(tracer.finding().found);
  EXPECT_FALSE(std::isfinite(x.grad().to_floats()[0]));  // the overflow did happen
}

TEST(Tracer, GradAccumulationOverflowInAParametersGrad) {
  // Each micro-batch's weight grad is 200 * 200 = 40000 (finite in f16); their sum is not.
  One net(1.f, 1);
  UnderflowOverflowTracer tracer(net, {}, test::temp_dir("tracer-acc") + "/t.log");
  tracer.begin_batch(1);
  Tensor x = Tensor::full({1, 1}, 200.f, DType::F16);
  Tensor y1 = net.forward(x);
  backward(y1, Tensor::full({1, 1}, 200.f, DType::F16));
  EXPECT_FALSE(tracer.finding().found);
  Tensor y2 = net.forward(x);
  TracerFinding f = expect_stop([&] { backward(y2, Tensor::full({1, 1}, 200.f, DType::F16)); });
  EXPECT_EQ(f.module, "lin");
  EXPECT_EQ(f.phase, "backward");
  EXPECT_EQ(f.tensor, "weight.grad");
}

TEST(Tracer, StopOnFindingFalseCollectsTheFirstFindingAndContinues) {
  Chain net(DType::F16);
  UnderflowOverflowTracer tracer(net, {}, test::temp_dir("tracer-nostop") + "/t.log");
  tracer.set_stop_on_finding(false);
  tracer.begin_batch(7);
  Tensor y = net.forward(chain_input(DType::F16));  // no throw
  EXPECT_FALSE(std::isfinite(y.to_floats()[6]));
  ASSERT_TRUE(tracer.finding().found);
  EXPECT_EQ(tracer.finding().module, "big");
  EXPECT_EQ(tracer.finding().batch, 7);
  // Later batches do not replace the first finding.
  tracer.begin_batch(8);
  net.forward(chain_input(DType::F16));
  EXPECT_EQ(tracer.finding().batch, 7);
  EXPECT_EQ(tracer.frames().size(), 2u);
}

TEST(Tracer, RingBufferKeepsTheLastFrames) {
  // Three finite forwards (4 frames each), then the overflow: only max_frames_to_save survive.
  Chain net(DType::F16);
  TracerOptions opt;
  opt.max_frames_to_save = 3;
  UnderflowOverflowTracer tracer(net, opt, test::temp_dir("tracer-ring") + "/t.log");
  tracer.begin_batch(1);
  for (int i = 0; i < 3; ++i) net.forward(Tensor::full({2, 8}, 1.f, DType::F16));
  EXPECT_EQ(tracer.frames().size(), 3u);
  TracerFinding f = expect_stop([&] { net.forward(chain_input(DType::F16)); });
  auto frames = tracer.frames();
  ASSERT_EQ(frames.size(), 3u);
  // Oldest first: the root of the previous forward, then pre and big of this one.
  EXPECT_NE(frames[0].find("                   Chain"), std::string::npos) << frames[0];
  EXPECT_NE(frames[1].find("                  pre Linear"), std::string::npos) << frames[1];
  EXPECT_NE(frames[2].find("                  big Linear"), std::string::npos) << frames[2];
  const std::string text = read_file(f.log_path);
  EXPECT_NE(text.find("Last 3 forward frames:"), std::string::npos);
  size_t headers = 0;
  for (auto& l : lines_of(text))
    if (std::regex_match(l, std::regex("^ {18}\\S* ?\\S+$"))) ++headers;
  EXPECT_EQ(headers, 3u) << text;

  TracerOptions bad;
  bad.max_frames_to_save = 0;
  EXPECT_THROW(UnderflowOverflowTracer(net, bad, "x.log"), Error);
}

TEST(Tracer, TraceBatchNumsDumpsThoseBatchesInFull) {
  Chain net(DType::F32);
  TracerOptions opt;
  opt.trace_batch_nums = {2};
  const std::string log = test::temp_dir("tracer-trace") + "/t.log";
  UnderflowOverflowTracer tracer(net, opt, log);
  for (int64_t b = 1; b <= 3; ++b) {
    tracer.begin_batch(b);
    net.forward(Tensor::full({2, 8}, static_cast<float>(b)));
  }
  tracer.begin_batch(4);  // flushes
  EXPECT_FALSE(tracer.finding().found);
  const std::string text = read_file(log);
  EXPECT_EQ(text.find("batch number=1"), std::string::npos);
  EXPECT_EQ(text.find("batch number=3"), std::string::npos);
  EXPECT_NE(text.find("*** Starting batch number=2 (traced) ***"), std::string::npos) << text;
  // Every module call of batch 2 (pre, big, after, root), input = 2 everywhere it enters.
  for (const char* hdr : {"                  pre Linear", "                  big Linear",
                          "                  after Linear", "                   Chain"})
    EXPECT_NE(text.find(hdr), std::string::npos) << hdr << "\n" << text;
  EXPECT_NE(text.find("2.00e+00 2.00e+00 input[0]"), std::string::npos) << text;
  EXPECT_EQ(text.find("Detected"), std::string::npos);
}

// A share is printed with two decimals, but never rounded into a claim the counts deny: one zero
// among 40000 values (0.0025%) printed "0.00" (none), 39999 of them "100.00" (all).
TEST(Tracer, SharesNeverRoundToNoneOrAll) {
  Chain net(DType::F32);
  TracerOptions opt;
  opt.trace_batch_nums = {1, 2};
  const std::string log = test::temp_dir("tracer-shares") + "/t.log";
  UnderflowOverflowTracer tracer(net, opt, log);
  const int64_t rows = 5000, n = rows * 8;  // 40000 elements
  std::vector<float> one_zero(n, 1.f), one_nonzero(n, 0.f);
  one_zero[123] = 0.f;
  one_nonzero[123] = 1.f;
  tracer.begin_batch(1);
  net.forward(Tensor::from_floats(one_zero, {rows, 8}, DType::F32));
  tracer.begin_batch(2);
  net.forward(Tensor::from_floats(one_nonzero, {rows, 8}, DType::F32));
  tracer.begin_batch(3);  // flushes
  const auto lines = lines_of(read_file(log));
  // pre's input line of each batch: zeros% is 1/40000 of 100, then 39999/40000 of 100.
  std::vector<std::string> zeros;
  for (const std::string& l : lines) {
    std::smatch m;
    if (l.find(" input[0] ") != std::string::npos &&
        std::regex_search(l, m, std::regex(R"(input\[0\] +(\S+) +(\S+) +(\S+)$)")))
      zeros.push_back(m[1]);
  }
  ASSERT_GE(zeros.size(), 2u) << read_file(log);
  EXPECT_EQ(zeros.front(), "<0.01");  // 100 * 1 / 40000 = 0.0025
  EXPECT_EQ(zeros.back(), ">99.99");  // 100 * 39999 / 40000 = 99.9975
  // A share that two decimals hold stays a number: the identity weights' 56 zeros of 64.
  EXPECT_TRUE(std::regex_search(read_file(log), std::regex(R"( weight +87\.50 )")))
      << read_file(log);
}

TEST(Tracer, AbortAfterBatchNum) {
  Chain net(DType::F32);
  TracerOptions opt;
  opt.abort_after_batch_num = 2;
  UnderflowOverflowTracer tracer(net, opt, test::temp_dir("tracer-abort") + "/t.log");
  tracer.begin_batch(1);
  tracer.begin_batch(2);
  net.forward(Tensor::full({2, 8}, 1.f));
  TracerFinding f = expect_stop([&] { tracer.begin_batch(3); });
  EXPECT_FALSE(f.found);
  EXPECT_EQ(f.batch, 3);
  EXPECT_NE(f.message.find("abort_after_batch_num"), std::string::npos) << f.message;
}

TEST(Tracer, DetachesOnDestruction) {
  Chain net(DType::F16);
  {
    UnderflowOverflowTracer tracer(net, {}, test::temp_dir("tracer-detach") + "/t.log");
    EXPECT_TRUE(net.has_hooks());
    EXPECT_TRUE(net.big->has_hooks());
  }
  EXPECT_FALSE(net.has_hooks());
  EXPECT_FALSE(net.big->has_hooks());
  Tensor y = net.forward(chain_input(DType::F16));  // no tracer, no throw
  EXPECT_FALSE(std::isfinite(y.to_floats()[6]));
}

// Masked attention: a causal GPT-2 with key padding (one sample fully padded, so its rows see no
// key at all) runs forward and backward without a finding, in every backend and precision.
TEST(Tracer, MaskedAttentionIsNeverAFinding) {
  for (auto backend :
       {ops::AttentionBackend::kEager, ops::AttentionBackend::kMath, ops::AttentionBackend::kFlash})
    for (DType compute : {DType::F32, DType::BF16, DType::F16}) {
      models::ModelSpec spec;
      spec.family = "gpt2";
      spec.n_layer = 1;
      spec.n_embd = 16;
      spec.n_head = 2;
      spec.vocab_size = 32;
      spec.max_seq_len = 8;
      spec.attention = backend;
      auto model = models::make_causal_lm(spec, 3);
      TracerOptions opt;
      opt.format = compute;
      UnderflowOverflowTracer tracer(*model, opt, test::temp_dir("tracer-attn") + "/t.log");
      tracer.begin_batch(1);
      const int64_t B = 3, T = 6;
      std::vector<int64_t> ids(B * T), mask(B * T), labels(B * T);
      for (int64_t i = 0; i < B * T; ++i) {
        ids[i] = (i * 7) % 32;
        const int64_t b = i / T, t = i % T;
        mask[i] = b == 0 ? 1 : b == 1 ? (t < 3) : 0;  // full, half padded, fully padded
        labels[i] = mask[i] ? (i * 5) % 32 : -100;
      }
      amp::AutocastGuard ac(compute != DType::F32, compute);
      Tensor logits = model->forward(Tensor::from_ints(ids, {B, T}),
                                     Tensor::from_ints(mask, {B, T}, DType::U8));
      Tensor flat = amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, 32}));
      Tensor loss = ops::cross_entropy(flat, Tensor::from_ints(labels, {B * T}));
      backward(loss);
      EXPECT_FALSE(tracer.finding().found)
          << ops::attention_backend_name(backend) << " " << dtype_name(compute) << ": "
          << tracer.finding().message;
      // Frames were recorded (forward and backward): the tracer did look.
      auto frames = tracer.frames();
      EXPECT_EQ(frames.size(), 21u);
      bool attn_frame = false;
      for (auto& fr : frames) attn_frame |= fr.find("transformer.h.0.attn") != std::string::npos;
      EXPECT_TRUE(attn_frame);
    }
}

}  // namespace
}  // namespace keel
