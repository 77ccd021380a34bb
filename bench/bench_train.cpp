// Tokens/s of `keel train` on GPT-2 124M (12 layers, 768 wide, 12 heads, vocab 50,257) at B=4,
// T=64 in 32-true and bf16-mixed, and model-FLOPs utilization against the matmul peak measured in
// the same run (1024³ through keel's matmul kernels, f32 and bf16).
//
//   ./build/bench/bench_train [steps=6] [layers=12] [grads=plain|flat] [precision=both]
//                             [model=gpt2|llama|lora]
//
// grads=flat gives the optimizer's parameters flat gradient buffers (Optimizer::use_flat_grads);
// the process's peak RSS is printed last (run one precision per process to compare it).
// model=llama: a Llama of the same width (12 heads, 4 key/value heads, SwiGLU 2048, untied, vocab
// 32,000); model=lora: the GPT-2 with a frozen base and LoRA r=16 on c_attn, c_proj and c_fc.
// Reports the median step time over the steps after the first (warm-up), and the spread, then the
// gradient pass alone (amp/grad_pass.h: the step's unscale + finite check + sums of squares) over
// the last step's gradients: its median of 9 runs without a scale (32-true, bf16-mixed) and with
// one (16-mixed's GradScaler: x 0.5 and x 2 in turn, exact for these values), beside the
// composition it replaced (per gradient: the unscale's pass, then the sum's), and their ratio.
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "bench/matmul_peak.h"
#include "keel/amp/grad_pass.h"
#include "keel/backend/monitor.h"
#include "keel/backend/optim.h"
#include "keel/train/trainer.h"

using namespace keel;
using clk = std::chrono::steady_clock;

using bench::MatmulPeak;

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 6;
  const int layers = argc > 2 ? std::atoi(argv[2]) : 12;
  const bool flat_grads = argc > 3 && std::string(argv[3]) == "flat";
  const std::string only = argc > 4 ? argv[4] : "";
  const std::string model = argc > 5 ? argv[5] : "gpt2";
  if (model != "gpt2" && model != "llama" && model != "lora") {
    std::fprintf(stderr, "model must be gpt2, llama or lora, got %s\n", model.c_str());
    return 2;
  }
  const std::string dir = std::filesystem::temp_directory_path() / "keel-bench-train";
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/corpus.txt");
    for (int i = 0; i < 4000; ++i) f << "the quick brown fox jumps over the lazy dog " << i << " ";
  }
  MatmulPeak probe32(DType::F32), probe16(DType::BF16);
  const double peak32 = probe32.probe(), peak16 = probe16.probe();
  std::printf("threads %d | matmul peak 1024^3: f32 %.0f GFLOP/s, bf16 %.0f GFLOP/s\n",
              omp_get_max_threads(), peak32, peak16);
  for (const char* precision : {"32-true", "bf16-mixed"}) {
    if (!only.empty() && only != precision) continue;
    Config c;
    c.run.out_dir = dir + "/out";
    c.model.n_layer = layers;
    c.model.n_embd = 768;
    c.model.n_head = 12;
    c.model.vocab_size = 50257;
    c.model.max_seq_len = 64;
    if (model == "llama") {
      c.model.family = "llama";
      c.model.n_kv_head = 4;
      c.model.intermediate_size = 2048;
      c.model.vocab_size = 32000;
      c.model.tie_embeddings = false;
    }
    if (model == "lora") {
      c.model.adapter.kind = "lora";
      c.model.adapter.r = 16;
      c.model.adapter.alpha = 32;
      c.model.adapter.target_modules = {"c_attn", "c_proj", "c_fc"};
    }
    c.data.task = "text";
    c.data.path = dir + "/corpus.txt";
    c.data.pack = true;
    c.data.seq_len = 64;
    c.train.batch_size = 4;
    c.train.max_steps = steps;
    c.train.precision = precision;
    c.log.console = c.log.metrics = c.log.tensorboard = false;
    std::vector<double> times;
    int64_t tokens = 0;
    TrainerHooks h;
    h.on_step = [&](const StepResult& r) {
      times.push_back(r.seconds);
      tokens = r.tokens;
    };
    Trainer t(c, h);
    t.optimizer().use_flat_grads(flat_grads);  // build_run's default is flat
    const double n_params = static_cast<double>(t.model().num_parameters());
    t.fit();
    const std::vector<Tensor> grads = t.optimizer().grads();
    // The peer, measured alongside: the composition the fused pass replaced, one gradient at a
    // time, the unscale as its own read and write before the sum's read.
    auto two_passes = [&](float inv) {
      for (const Tensor& g : grads) {
        if (!g.defined()) continue;
        void* d = g.data();
        DType dt = g.dtype();
        int64_t n = g.numel();
        if (inv != 1.f) optim_kernels(g.device()).unscale(d, dt, n, inv);
        GradBufStats b;
        monitor_kernels(g.device()).unscale_norm(&d, &dt, &n, 1, 1.f, 0.f, &b);
      }
    };
    std::vector<double> pass_s, unscale_s, two_pass_s, two_unscale_s;
    auto seconds_of = [](auto&& f) {
      const auto t0 = clk::now();
      f();
      return std::chrono::duration<double>(clk::now() - t0).count();
    };
    for (int rep = 0; rep < 9; ++rep) {
      pass_s.push_back(seconds_of([&] { amp::grad_pass(grads, 1.f); }));
      unscale_s.push_back(seconds_of([&] { amp::grad_pass(grads, rep % 2 ? 2.f : 0.5f); }));
      two_pass_s.push_back(seconds_of([&] { two_passes(1.f); }));
      two_unscale_s.push_back(seconds_of([&] { two_passes(rep % 2 ? 2.f : 0.5f); }));
    }
    for (auto* v : {&pass_s, &unscale_s, &two_pass_s, &two_unscale_s})
      std::sort(v->begin(), v->end());
    std::vector<double> warm(times.begin() + (times.size() > 1 ? 1 : 0), times.end());
    std::sort(warm.begin(), warm.end());
    const double med = warm[warm.size() / 2];
    // Model FLOPs per token (PaLM): 6N for the dense products + 12·L·T·C for attention.
    const double flops_tok = 6 * n_params + 12.0 * layers * 64 * 768;
    const double tps = tokens / med;
    // The higher of the probes before and after the steps (bench/matmul_peak.h).
    const bool f32 = std::string(precision) == "32-true";
    const double peak = std::max(f32 ? peak32 : peak16, (f32 ? probe32 : probe16).probe());
    std::printf(
        "%-10s | %.1fM params | median step %.3f s (min %.3f, max %.3f) | %.0f tok/s | "
        "MFU %.1f%% of the %s matmul peak\n",
        precision, n_params / 1e6, med, warm.front(), warm.back(), tps,
        100 * tps * flops_tok / (peak * 1e9), f32 ? "f32" : "bf16");
    std::printf(
        "%-10s | grad pass over %zu gradients: %.1f ms, unscaling %.1f ms | one gradient at a "
        "time, unscale then sum: %.1f ms, %.1f ms | ratio %.2fx, %.2fx (medians of 9)\n",
        precision, grads.size(), 1e3 * pass_s[4], 1e3 * unscale_s[4], 1e3 * two_pass_s[4],
        1e3 * two_unscale_s[4], two_pass_s[4] / pass_s[4], two_unscale_s[4] / unscale_s[4]);
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  std::printf("%s | grads %s | peak RSS %ld MB\n", model.c_str(), flat_grads ? "flat" : "plain",
              ru.ru_maxrss / 1024);
  return 0;
}
