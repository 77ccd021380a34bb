// AdamW over GPT-2 124M's 148 parameter tensors (f32 masters writing the bf16 weight copy, as in
// bf16-mixed), with the same kernel and the same bytes in three memory layouts:
//   separate   every p, g, m, v and copy its own tensor, as keel's Optimizer::step sees them;
//   state-flat m and v (the optimizer's own state) views into flat buffers, the rest separate;
//   grads-sep  p, m, v and copy views into flat buffers, gradients their own tensors;
//   flat       every array a view into one flat buffer per kind, one call per tensor;
//   flat-1call the flat buffers in one call over all parameters (what the call count costs).
// Medians over rounds that interleave the layouts, so the host's drift hits each alike.
//
//   OMP_NUM_THREADS=2 OMP_WAIT_POLICY=active ./build/bench/bench_adamw_layout [rounds]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "keel/backend/optim.h"
#include "keel/models/gpt2.h"
#include "keel/tensor/tensor.h"

using namespace keel;

namespace {

// The sizes of GPT-2 124M's trainable tensors, in the order the optimizer sees them (the tied
// embedding once): from the model itself, so the list is keel's own.
std::vector<int64_t> gpt2_124m_sizes() {
  models::ModelSpec spec;
  spec.n_layer = 12;
  spec.n_embd = 768;
  spec.n_head = 12;
  spec.vocab_size = 50257;
  spec.max_seq_len = 1024;
  const models::GPT2LMHeadModel model(spec, 0);
  std::vector<int64_t> sizes;
  for (const auto& [name, t] : model.named_parameters(true)) sizes.push_back(t.numel());
  return sizes;
}

// One array kind: each tensor's own storage, or views into one flat tensor.
struct Arrays {
  std::vector<Tensor> own;
  Tensor flat;
  std::vector<int64_t> offset;
  void* at(size_t i) const {
    if (!own.empty()) return own[i].data();
    return static_cast<char*>(flat.data()) + offset[i] * dtype_size(flat.dtype());
  }
};

Arrays make(const std::vector<int64_t>& sizes, float value, DType dt, bool separate) {
  Arrays a;
  int64_t total = 0;
  for (int64_t n : sizes) {
    a.offset.push_back(total);
    total += n;
  }
  if (separate)
    for (int64_t n : sizes) a.own.push_back(Tensor::full({n}, value, dt));
  else
    a.flat = Tensor::full({total}, value, dt);
  return a;
}

struct Layout {
  const char* name;
  Arrays p, g, m, v, copy;
  bool one_call = false;
};

double step_ms(const Layout& l, const std::vector<int64_t>& sizes, int64_t step) {
  const auto& k = optim_kernels(Device::cpu());
  AdamWStep s;
  s.lr = 1e-4;
  s.weight_decay = 0.01;
  s.step = step;
  const auto t0 = std::chrono::steady_clock::now();
  if (l.one_call) {
    const int64_t total = l.p.offset.back() + sizes.back();
    s.p_copy = l.copy.at(0);
    k.adamw(l.p.at(0), l.g.at(0), l.m.at(0), l.v.at(0), DType::F32, total, s);
  }
  for (size_t i = 0; !l.one_call && i < sizes.size(); ++i) {
    s.p_copy = l.copy.at(i);
    k.adamw(l.p.at(i), l.g.at(i), l.m.at(i), l.v.at(i), DType::F32, sizes[i], s);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 10;
  if (rounds < 1) {
    std::fprintf(stderr, "bench_adamw_layout: rounds must be at least 1, got '%s'\n", argv[1]);
    return 2;
  }
  const std::vector<int64_t> sizes = gpt2_124m_sizes();
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  auto layout = [&](const char* name, bool sep_params, bool sep_grads, bool sep_state) {
    return Layout{name,
                  make(sizes, 0.1f, DType::F32, sep_params),
                  make(sizes, 0.01f, DType::F32, sep_grads),
                  make(sizes, 0.001f, DType::F32, sep_state),
                  make(sizes, 0.001f, DType::F32, sep_state),
                  make(sizes, 0.f, DType::BF16, sep_params)};
  };
  std::vector<Layout> layouts;
  layouts.push_back(layout("separate", true, true, true));
  layouts.push_back(layout("state-flat", true, true, false));
  layouts.push_back(layout("grads-sep", false, true, false));
  layouts.push_back(layout("flat", false, false, false));
  layouts.push_back(layout("flat-1call", false, false, false));
  layouts.back().one_call = true;
  std::vector<std::vector<double>> ms(layouts.size());
  for (int r = 0; r < rounds + 2; ++r)  // the first two rounds warm up
    for (size_t i = 0; i < layouts.size(); ++i) {
      const double t = step_ms(layouts[i], sizes, r + 1);
      if (r >= 2) ms[i].push_back(t);
    }
  std::printf("AdamW over %zu tensors, %lld parameters (30 B each), %d rounds:\n", sizes.size(),
              static_cast<long long>(total), rounds);
  std::vector<double> med(layouts.size());
  for (size_t i = 0; i < layouts.size(); ++i) {
    std::sort(ms[i].begin(), ms[i].end());
    med[i] = ms[i][ms[i].size() / 2];
  }
  const double flat = med[layouts.size() - 2];  // "flat", the last per-tensor layout
  for (size_t i = 0; i < layouts.size(); ++i)
    std::printf("  %-10s median %7.1f ms  [%.1f..%.1f]  %.2fx flat  %.1f GB/s\n", layouts[i].name,
                med[i], ms[i].front(), ms[i].back(), med[i] / flat, 30.0 * total / med[i] / 1e6);
  return 0;
}
