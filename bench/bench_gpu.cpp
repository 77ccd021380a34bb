// GPU benchmark of issue 7: tokens/s of GPT-2 124M (12 layers, 768 wide, 12 heads, vocab 50,257)
// training at B=16, T=1024 in bf16-mixed on one CUDA device (AdamW, clipping at 1.0: the whole
// step of DESIGN §3) in four variants: attention flash (CUDA cores), eager, flash on tensor cores
// (KEEL_CUDA_FLASH_MMA=1), and that with the bias in cuBLASLt's epilogue
// (KEEL_CUDA_BIAS_EPILOGUE=1) and the embedding's backward grouped on the device
// (KEEL_CUDA_DEVICE_GROUPING=1), with MFU against the bf16 matmul rate measured in the same run
// (cuBLASLt through keel's matmul kernels, 8192³, bf16 in, f32 accumulation). The fastest variant
// is the headline.
//
//   ./build/bench/bench_gpu [--steps 8] [--batch 16] [--seq 1024] [--layers 12] [--dump DIR]
//                           [--profile ROWS]
//
// --dump DIR writes the initial parameters (DIR/model.safetensors, keel's names and layouts) and
// the step's tokens (DIR/batch.safetensors) so that bench/gpt2_torch.py can start PyTorch from the
// same point (loss parity at step 0). --profile ROWS then runs one more step with an event after
// every launch and prints the ROWS launch sites that took the most device time. The last line is
// machine-readable:
//   RESULT keel_tok_s=... step_ms=... mfu=... peak_tflops=... loss0=... attention=<fastest>
//          flash_tok_s=... eager_tok_s=... flash_mma_tok_s=... flash_mma_fused_tok_s=...
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/backend/cuda_api.h"
#include "keel/backend/matmul.h"
#include "keel/io/safetensors.h"
#include "keel/models/causal_lm.h"
#include "keel/ops/attention.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/shape.h"
#include "keel/optim/adamw.h"
#include "keel/optim/clip.h"

using namespace keel;
using clk = std::chrono::steady_clock;

namespace {

double seconds_since(clk::time_point t0) {
  return std::chrono::duration<double>(clk::now() - t0).count();
}

// bf16 (bf16 out, f32 accumulation) matmul rate in TFLOP/s: the best of 20 timed runs.
double bf16_matmul_tflops(Device dev) {
  const int64_t n = 8192;
  Tensor a = Tensor::empty({n, n}, DType::BF16, dev), b = Tensor::empty({n, n}, DType::BF16, dev);
  a.fill(0.5f), b.fill(0.25f);
  Tensor c = Tensor::empty({n, n}, DType::BF16, dev);
  MatmulArgs args;
  args.c = c.data(), args.a = a.data(), args.b = b.data();
  args.in_dt = args.out_dt = DType::BF16;
  args.m = args.n = args.k = n;
  args.trans_b = true;  // as linear's x·Wᵀ
  const auto& mm = matmul_kernels(dev);
  for (int r = 0; r < 3; ++r) mm.matmul(args);
  cuda::synchronize(dev.index);
  double best = 1e30;
  for (int r = 0; r < 20; ++r) {
    const auto t0 = clk::now();
    mm.matmul(args);
    cuda::synchronize(dev.index);
    best = std::min(best, seconds_since(t0));
  }
  return 2.0 * n * n * n / best / 1e12;
}

uint64_t xorshift(uint64_t& s) {
  s ^= s << 13, s ^= s >> 7, s ^= s << 17;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 8, batch = 16, seq = 1024, layers = 12;
  std::string dump;
  int64_t profile_rows = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--steps")
      steps = std::stoll(v);
    else if (k == "--batch")
      batch = std::stoll(v);
    else if (k == "--seq")
      seq = std::stoll(v);
    else if (k == "--layers")
      layers = std::stoll(v);
    else if (k == "--dump")
      dump = v;
    else if (k == "--profile")
      profile_rows = std::stoll(v);
    else {
      std::fprintf(stderr, "bench_gpu: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  const cuda::Status& st = cuda::status();
  if (!st.usable) {
    std::printf("bench_gpu: no usable CUDA device: %s\n", st.reason.c_str());
    return 2;
  }
  const Device dev = Device::cuda(0);
  std::printf("device: %s\nmatmul: %s\n", cuda::device_name(0).c_str(),
              matmul_kernels(dev).describe());
  const double peak = bf16_matmul_tflops(dev);
  std::printf("bf16 matmul 8192^3: %.1f TFLOP/s\n", peak);

  models::ModelSpec spec;
  spec.family = "gpt2";
  spec.n_layer = layers, spec.n_embd = 768, spec.n_head = 12;
  spec.vocab_size = 50257, spec.max_seq_len = 1024;
  spec.attention = ops::AttentionBackend::kFlash;
  auto model = models::make_causal_lm(spec, 1234);
  int64_t n_params = 0;
  for (auto& [name, p] : model->named_parameters()) n_params += p.numel();

  // The tokens: B rows of T + 1 (inputs and next-token labels).
  std::vector<int64_t> toks(batch * (seq + 1));
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (auto& t : toks) t = static_cast<int64_t>(xorshift(s) % 50257);
  std::vector<int64_t> in(batch * seq), lab(batch * seq);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t) {
      in[b * seq + t] = toks[b * (seq + 1) + t];
      lab[b * seq + t] = toks[b * (seq + 1) + t + 1];
    }
  Tensor ids = Tensor::from_ints(in, {batch, seq}), labels = Tensor::from_ints(lab, {batch * seq});
  if (!dump.empty()) {
    std::filesystem::create_directories(dump);
    io::write_safetensors(dump + "/model.safetensors", model->named_parameters());
    io::write_safetensors(dump + "/batch.safetensors", {{"input_ids", ids}, {"labels", labels}});
  }
  nn::move_to_device(*model, dev);
  ids = ids.to(dev), labels = labels.to(dev);
  auto params = model->named_parameters(true);
  optim::AdamW opt(optim::make_param_groups(params, 0.1));

  struct Run {
    double step_s, tok_s, loss0;
  };
  // One training step; returns (loss, grad norm).
  auto train_step = [&]() {
    opt.zero_grad();
    double loss_v = 0;
    {
      amp::AutocastGuard autocast(true, DType::BF16);
      Tensor logits = model->forward(ids, Tensor());  // [B, T, V]
      Tensor flat = amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, 50257}));
      logits = Tensor();
      Tensor loss = ops::cross_entropy(flat, labels);  // mean over tokens, f32
      flat = Tensor();
      loss_v = loss.item();
      backward(loss);
    }
    std::vector<Tensor> grads;
    for (auto& [name, p] : params)
      if (p.grad().defined()) grads.push_back(p.grad());
    const double norm = optim::global_grad_norm(grads);  // one readback
    if (std::isfinite(norm)) {
      optim::clip_grads(grads, 1.0, norm);
      opt.step(6e-4);
    }
    return std::pair<double, double>{loss_v, norm};
  };
  // Flash (tiled, f32 online softmax on CUDA cores), eager (scores through cuBLASLt, softmax
  // kernel between), flash on tensor cores: all keel's; the table reports the fastest.
  // The variants, each a backend and the switches of the kernels not yet checked on a GPU
  // (backend/cuda/attention_mma.cu, matmul.cu's bias epilogue, embedding.cu's grouping), set only
  // for its own steps.
  struct Variant {
    const char* name;  // also its RESULT key, <name>_tok_s
    ops::AttentionBackend backend;
    std::vector<const char*> switches;
  };
  const std::vector<Variant> variants = {
      {"flash", ops::AttentionBackend::kFlash, {}},  // first: its step 0 is the initial model
      {"eager", ops::AttentionBackend::kEager, {}},
      {"flash_mma", ops::AttentionBackend::kFlash, {"KEEL_CUDA_FLASH_MMA"}},
      {"flash_mma_fused",
       ops::AttentionBackend::kFlash,
       {"KEEL_CUDA_FLASH_MMA", "KEEL_CUDA_BIAS_EPILOGUE", "KEEL_CUDA_DEVICE_GROUPING"}},
  };
  auto switched = [](const Variant& v, bool on) {
    for (const char* e : v.switches) on ? setenv(e, "1", 1) : unsetenv(e);
  };
  auto run = [&](const Variant& variant) {
    model->set_attention_backend(variant.backend);
    switched(variant, true);
    std::vector<double> times, losses;
    for (int64_t step = 0; step < steps; ++step) {
      cuda::synchronize(0);
      const auto t0 = clk::now();
      const auto [loss_v, norm] = train_step();
      cuda::synchronize(0);
      times.push_back(seconds_since(t0));
      losses.push_back(loss_v);
      std::printf("%s step %lld: loss %.4f  grad_norm %.3f  %.1f ms\n", variant.name,
                  static_cast<long long>(step), loss_v, norm, times.back() * 1e3);
    }
    switched(variant, false);
    // Median over the steps after the first two (plans, caches and allocator warm-up).
    std::vector<double> timed(times.begin() + std::min<int64_t>(2, steps - 1), times.end());
    std::sort(timed.begin(), timed.end());
    const double step_s = timed[timed.size() / 2];
    return Run{step_s, static_cast<double>(batch * seq) / step_s, losses.front()};
  };
  std::vector<Run> runs;
  for (const Variant& v : variants) runs.push_back(run(v));
  size_t best_i = 0;
  for (size_t i = 1; i < runs.size(); ++i)
    if (runs[i].tok_s > runs[best_i].tok_s) best_i = i;
  const Run& best = runs[best_i];
  const double step_s = best.step_s, tok_s = best.tok_s;
  // Model FLOPs per token: 6N for the parameter matmuls plus 12·L·C·T for attention (llm.c's
  // estimate; the embedding lookup is no matmul but wte is also the lm_head, so N counts it once).
  const double flops_tok = 6.0 * n_params + 12.0 * layers * 768 * seq;
  const double mfu = flops_tok * tok_s / (peak * 1e12);
  const cuda::MemStats ms = cuda::mem_stats(0);
  for (size_t i = 0; i < runs.size(); ++i)
    std::printf(
        "GPT-2 %lldL (%.1fM params) B=%lld T=%lld bf16-mixed, %s: %.1f ms/step, %.0f tok/s, MFU "
        "%.1f%% of the measured bf16 matmul rate\n",
        static_cast<long long>(layers), n_params / 1e6, static_cast<long long>(batch),
        static_cast<long long>(seq), variants[i].name, runs[i].step_s * 1e3, runs[i].tok_s,
        100 * flops_tok * runs[i].tok_s / (peak * 1e12));
  std::printf("peak memory %.2f GiB (caching allocator, live tensors)\n",
              ms.peak / double(1u << 30));
  if (profile_rows > 0) {
    // One more step of the faster backend with an event after every launch (cuda::profile_*).
    model->set_attention_backend(variants[best_i].backend);
    switched(variants[best_i], true);
    cuda::profile_begin();
    const auto t0 = clk::now();
    train_step();
    const std::vector<cuda::ProfileRow> rows = cuda::profile_end();
    double dev_ms = 0, host_ms = 0;
    int64_t calls = 0;
    for (const auto& r : rows) dev_ms += r.device_ms, host_ms += r.host_ms, calls += r.calls;
    std::printf(
        "profile of one step (%.1f ms with the events): device %.1f ms, host %.1f ms, %lld "
        "launches\n",
        seconds_since(t0) * 1e3, dev_ms, host_ms, static_cast<long long>(calls));
    std::printf("%10s %10s %7s  %s\n", "device ms", "host ms", "calls", "site");
    for (size_t i = 0; i < rows.size() && static_cast<int64_t>(i) < profile_rows; ++i)
      std::printf("%10.3f %10.3f %7lld  %s\n", rows[i].device_ms, rows[i].host_ms,
                  static_cast<long long>(rows[i].calls), rows[i].site.c_str());
  }
  std::printf(
      "RESULT keel_tok_s=%.1f step_ms=%.2f mfu=%.4f peak_tflops=%.1f loss0=%.6f attention=%s",
      tok_s, step_s * 1e3, mfu, peak, runs[0].loss0, variants[best_i].name);
  for (size_t i = 0; i < runs.size(); ++i)
    std::printf(" %s_tok_s=%.1f", variants[i].name, runs[i].tok_s);
  std::printf("\n");
  return 0;
}
