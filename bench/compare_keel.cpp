// keel's side of bench/compare_pytorch: trains an HF model directory (written by `keel
// init-model`) on fixed token batches through Trainer::train_step, and prints one JSON object:
// the loss and wall time of every step, peak RSS, and the matmul peak measured in this process.
// The PyTorch side (bench/compare_pytorch/compare.py) reads the same two files, so both sides do
// the same work from the same start.
//
//   compare_keel --model DIR --ids FILE --batch B --seq T --steps N --precision P
//                [--threads N] [--lr 1e-4] [--weight-decay 0.1] [--max-grad-norm 1.0]
//                [--device cpu|cuda]
//                [--adapter lora|dora --r 32 --alpha 64 --adapter-dropout 0.05
//                 --targets q_proj,k_proj,... --base-dtype f32|bf16 --adapter-init DIR]
//
// With --adapter the base is frozen (stored in --base-dtype) and only the adapter trains; the
// adapter as initialized is written to --adapter-init (a PEFT directory) unless that directory
// exists, so that the PyTorch side starts from the same lora_A.
//
// --device cuda trains on the GPU (run.device): each step is timed to its end on the device, the
// matmul peak is an 8192³ product there, and the JSON adds the caching allocator's peak
// ("peak_gpu_mb").
//
// FILE holds int64 little-endian token ids [steps, B, T + 1]: row b of step s is the input
// ids[s, b, :T] with the next-token labels ids[s, b, 1:].
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/matmul_peak.h"
#include "keel/backend/cuda_api.h"
#include "keel/io/hf_model.h"
#include "keel/numerics/error.h"
#include "keel/tensor/host_memory.h"
#include "keel/train/trainer.h"

using namespace keel;
using clk = std::chrono::steady_clock;

namespace {

using bench::MatmulPeak;

// A line of /proc/self/status in MB ("VmRSS:", "VmHWM:" = peak RSS).
double status_mb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(std::strlen(key))) / 1024.0;
  return 0;
}

// VmRSS and VmHWM (peak) of this process in MB, from /proc/self/status.
std::string rss_now() {
  std::ifstream f("/proc/self/status");
  std::string line, out;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0 || line.rfind("VmHWM:", 0) == 0)
      out += line.substr(0, 6) + " " + std::to_string(std::stol(line.substr(6)) / 1024) + " MB ";
  return out;
}

std::string arg(int argc, char** argv, const std::string& key, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == key) return argv[i + 1];
  if (def.empty()) throw Error("compare_keel: missing " + key + " (see the usage at the top)");
  return def;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string model = arg(argc, argv, "--model", ""), ids_path = arg(argc, argv, "--ids", "");
  const int64_t B = std::stoll(arg(argc, argv, "--batch", "")),
                T = std::stoll(arg(argc, argv, "--seq", "")),
                steps = std::stoll(arg(argc, argv, "--steps", ""));
  const std::string precision = arg(argc, argv, "--precision", "32-true");
  const int threads = std::stoi(arg(argc, argv, "--threads", "0"));
  const std::string device = arg(argc, argv, "--device", "cpu");
  if (device != "cpu" && device != "cuda")
    throw Error("compare_keel: --device " + device + ": use cpu or cuda");
  const bool gpu = device == "cuda";
  if (gpu && !cuda::status().usable)
    throw Error("compare_keel: --device cuda, but no usable GPU: " + cuda::status().reason);
  if (threads > 0) omp_set_num_threads(threads);

  // Token batches: [steps, B, T + 1] int64.
  std::vector<int64_t> ids(static_cast<size_t>(steps * B * (T + 1)));
  {
    std::ifstream f(ids_path, std::ios::binary);
    if (!f) throw Error(ids_path + ": cannot open the token file");
    f.read(reinterpret_cast<char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 8));
    if (f.gcount() != static_cast<std::streamsize>(ids.size() * 8) || f.peek() != EOF)
      throw Error(ids_path + ": expected exactly steps*B*(T+1) = " + std::to_string(ids.size()) +
                  " int64 ids; regenerate it with compare.py");
  }

  // The Trainer needs a dataset; a one-line corpus satisfies it and is never read by the steps.
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("keel-compare-" + std::to_string(static_cast<long>(getpid())));
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/corpus.txt") << "unused corpus: the steps read --ids\n";
  Config c;
  c.run.out_dir = dir + "/out";
  c.run.threads = threads;
  c.run.device = device;
  c.model.path = model;
  c.data.task = "text";
  c.data.path = dir + "/corpus.txt";
  c.data.seq_len = T;
  c.train.batch_size = B;
  c.train.max_steps = steps;
  c.train.precision = precision;
  c.train.allow_cpu_bf16 = true;
  c.train.max_grad_norm = std::stod(arg(argc, argv, "--max-grad-norm", "1.0"));
  c.optim.lr = std::stod(arg(argc, argv, "--lr", "1e-4"));
  c.optim.weight_decay = std::stod(arg(argc, argv, "--weight-decay", "0.1"));
  c.sched.name = "constant";
  c.log.console = c.log.metrics = c.log.tensorboard = false;
  c.debug.nan_capture = false;
  c.model.adapter.kind = arg(argc, argv, "--adapter", "none");
  if (c.model.adapter.kind != "none") {
    c.model.adapter.r = std::stoll(arg(argc, argv, "--r", "8"));
    c.model.adapter.alpha = std::stod(arg(argc, argv, "--alpha", "16"));
    c.model.adapter.dropout = std::stod(arg(argc, argv, "--adapter-dropout", "0"));
    c.model.adapter.target_modules.clear();
    std::stringstream targets(arg(argc, argv, "--targets", "q_proj,v_proj"));
    for (std::string t; std::getline(targets, t, ',');) c.model.adapter.target_modules.push_back(t);
    c.model.base_dtype = arg(argc, argv, "--base-dtype", "f32");
  }

  // Probed before and after the steps (bench/matmul_peak.h); the buffers live throughout, so the
  // second probe adds nothing to the peak RSS.
  MatmulPeak peak_probe(precision == "32-true" ? DType::F32 : DType::BF16, gpu ? 8192 : 1024,
                        gpu ? Device::cuda(0) : Device::cpu());
  const double peak_before = peak_probe.probe();

  // What the process holds before the model exists: shared libraries (oneDNN; with a CUDA build
  // also cuBLASLt/cudart, ~150 MB) and the matmul peak's buffers.
  const double base_rss = status_mb("VmRSS:");
  std::fprintf(stderr, "before construction: %s\n", rss_now().c_str());
  Trainer t(c);
  const double n_params = static_cast<double>(t.model().num_parameters());
  double n_trainable = 0;
  for (const auto& [name, p] : t.model().named_parameters(/*trainable_only=*/true))
    n_trainable += static_cast<double>(p.numel());
  const std::string adapter_init = arg(argc, argv, "--adapter-init", "-");
  if (c.model.adapter.kind != "none" && adapter_init != "-" &&
      !std::filesystem::exists(adapter_init)) {
    nn::AdapterOptions opt = c.model.adapter;
    opt.seed = c.run.seed;
    io::save_peft_adapter(t.model(), opt, adapter_init, model);
  }
  const auto& spec = t.model().spec();
  std::fprintf(stderr, "after construction: %s\n", rss_now().c_str());
  std::vector<double> losses, seconds;
  std::vector<int64_t> in(B * T), lab(B * T);
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < T; ++j) {
        in[b * T + j] = ids[(s * B + b) * (T + 1) + j];
        lab[b * T + j] = ids[(s * B + b) * (T + 1) + j + 1];
      }
    data::Batch batch;
    batch.input_ids = Tensor::from_ints(in, {B, T});
    batch.labels = Tensor::from_ints(lab, {B, T});
    batch.attention_mask = Tensor::full({B, T}, 1.0f, DType::U8);
    batch.n_targets = B * T;
    const auto t0 = clk::now();
    const StepResult r = t.train_step({batch}, 0);
    if (gpu) cuda::synchronize(0);  // the optimizer's kernels may still be queued
    if (!r.stepped) throw Error("compare_keel: step " + std::to_string(s) + " did not update");
    losses.push_back(r.loss);
    seconds.push_back(gpu ? std::chrono::duration<double>(clk::now() - t0).count() : r.seconds);
    const auto hm = host_memory::stats();
    std::fprintf(stderr,
                 "step %lld: loss %.6f, %.3f s, %s block cache: %lld hits, %lld misses, %lld "
                 "evictions, %zu MB cached\n",
                 static_cast<long long>(s), r.loss, r.seconds, rss_now().c_str(),
                 static_cast<long long>(hm.hits), static_cast<long long>(hm.misses),
                 static_cast<long long>(hm.evictions), hm.cached_bytes >> 20);
  }
  const double peak_after = peak_probe.probe();
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  std::filesystem::remove_all(dir);

  std::printf(
      "{\"side\": \"keel\", \"precision\": \"%s\", \"threads\": %d, \"params\": %.0f, "
      "\"trainable\": %.0f, ",
      precision.c_str(), omp_get_max_threads(), n_params, n_trainable);
  std::printf(
      "\"n_layer\": %lld, \"n_embd\": %lld, \"peak_gflops_before\": %.2f, "
      "\"peak_gflops_after\": %.2f, \"peak_rss_mb\": %.1f, \"base_rss_mb\": %.1f, ",
      static_cast<long long>(spec.n_layer), static_cast<long long>(spec.n_embd), peak_before,
      peak_after, ru.ru_maxrss / 1024.0, base_rss);
  if (gpu) std::printf("\"peak_gpu_mb\": %.1f, ", cuda::mem_stats(0).peak / 1048576.0);
  std::printf("\"loss\": [");
  for (size_t i = 0; i < losses.size(); ++i) std::printf("%s%.9g", i ? ", " : "", losses[i]);
  std::printf("], \"seconds\": [");
  for (size_t i = 0; i < seconds.size(); ++i) std::printf("%s%.6f", i ? ", " : "", seconds[i]);
  std::printf("]}\n");
  return 0;
} catch (const std::exception& e) {
  const std::string m = e.what();  // (most messages name compare_keel already)
  std::fprintf(stderr, "%s%s\n",
               m.rfind("compare_keel:", 0) == 0 ? "" : "compare_keel: ", m.c_str());
  return 1;
}
