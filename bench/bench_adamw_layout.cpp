// AdamW over GPT-2 124M's 148 parameter tensors (f32 masters writing the bf16 weight copy, as in
// bf16-mixed), with the same kernel and the same bytes in three memory layouts:
//   separate   every p, g, m, v and copy its own tensor, as keel's Optimizer::step sees them;
//   state-flat m and v (the optimizer's own state) views into flat buffers, the rest separate;
//   grads-sep  p, m, v and copy views into flat buffers, gradients their own tensors;
//   flat       every array a view into one flat buffer per kind (148 calls: the call count is
//              measured not to matter, one call over the whole buffer runs as fast).
// Medians over rounds that interleave the layouts, so the host's drift hits each alike.
//
//   OMP_NUM_THREADS=2 OMP_WAIT_POLICY=active ./build/bench/bench_adamw_layout [rounds]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "keel/backend/optim.h"
#include "keel/tensor/tensor.h"

using namespace keel;

namespace {

std::vector<int64_t> gpt2_124m_sizes() {
  std::vector<int64_t> s = {50257 * 768, 1024 * 768};  // wte, wpe
  for (int layer = 0; layer < 12; ++layer)
    for (int64_t n :
         {768, 768, 2304 * 768, 2304, 768 * 768, 768, 768, 768, 3072 * 768, 3072, 768 * 3072, 768})
      s.push_back(n);
  s.push_back(768);  // ln_f
  s.push_back(768);
  return s;
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
};

double step_ms(const Layout& l, const std::vector<int64_t>& sizes, int64_t step) {
  const auto& k = optim_kernels(Device::cpu());
  AdamWStep s;
  s.lr = 1e-4;
  s.weight_decay = 0.01;
  s.step = step;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < sizes.size(); ++i) {
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
  std::vector<std::vector<double>> ms(layouts.size());
  for (int r = 0; r < rounds + 2; ++r)  // the first two rounds warm up
    for (size_t i = 0; i < layouts.size(); ++i) {
      const double t = step_ms(layouts[i], sizes, r + 1);
      if (r >= 2) ms[i].push_back(t);
    }
  std::printf("AdamW over %zu tensors, %lld parameters (30 B each), %d rounds:\n", sizes.size(),
              static_cast<long long>(total), rounds);
  double flat_med = 0;
  for (size_t i = layouts.size(); i-- > 0;) {
    std::sort(ms[i].begin(), ms[i].end());
    const double med = ms[i][ms[i].size() / 2];
    if (i + 1 == layouts.size()) flat_med = med;
    std::printf("  %-10s median %7.1f ms  [%.1f..%.1f]  %.2fx flat  %.1f GB/s\n", layouts[i].name,
                med, ms[i].front(), ms[i].back(), med / flat_med, 30.0 * total / med / 1e6);
  }
  return 0;
}
