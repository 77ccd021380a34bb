// An f64 reference of causal attention (header-only, for the ops tests): query i of batch row b
// sees keys [first(b, i), i] (0 when `first` is empty); a score is scale·q·k (scale 0:
// 1/sqrt(D)), capped to cap·tanh(s / cap) when cap > 0 (Gemma-2's soft cap); the output is the
// softmax-weighted values. q [B, Hq, T, D]; k, v [B, Hkv, T, D]. `drop`, when not empty, holds
// [B, Hq, T, T] factors the probabilities are multiplied by (a dropout's keep · 1/(1-p)).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "keel/ops/attention.h"
#include "keel/tensor/tensor.h"

namespace keel::test {

inline std::vector<double> attention_ref(
    const Tensor& q, const Tensor& k, const Tensor& v,
    const std::function<int64_t(int64_t b, int64_t i)>& first = {}, double scale = 0,
    double cap = 0, const std::vector<float>& drop = {}) {
  const int64_t nb = q.size(0), hq = q.size(1), hkv = k.size(1), t = q.size(2), dd = q.size(3);
  const auto qv = q.to_floats(), kv = k.to_floats(), vv = v.to_floats();
  if (scale == 0) scale = 1 / std::sqrt(double(dd));
  std::vector<double> o(q.numel());
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < t; ++i) {
        const int64_t kh = h / (hq / hkv), lo = first ? first(b, i) : 0;
        std::vector<double> s;
        double mx = -INFINITY, sum = 0;
        for (int64_t j = lo; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < dd; ++d)
            dot +=
                double(qv[((b * hq + h) * t + i) * dd + d]) * kv[((b * hkv + kh) * t + j) * dd + d];
          s.push_back(cap > 0 ? cap * std::tanh(scale * dot / cap) : scale * dot);
          mx = std::max(mx, s.back());
        }
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (int64_t d = 0; d < dd; ++d) {
          double acc = 0;
          for (int64_t j = lo; j <= i; ++j)
            acc += s[j - lo] / sum * (drop.empty() ? 1.0 : drop[((b * hq + h) * t + i) * t + j]) *
                   vv[((b * hkv + kh) * t + j) * dd + d];
          o[((b * hq + h) * t + i) * dd + d] = acc;
        }
      }
  return o;
}

// What bounds a query's keys besides causality, for the gradient checks of attention over rows of
// 9 tokens: nothing, a padded first key, a window of 3 (each named for the failure message).
inline std::vector<std::pair<std::string, ops::AttentionMask>> attention_bounds_of_9() {
  ops::AttentionMask padded(Tensor::from_ints({0, 1, 1, 1, 1, 1, 1, 1, 1}, {1, 9}, DType::U8));
  ops::AttentionMask window;
  window.window = 3;
  return {{"", ops::AttentionMask()}, {" padded", padded}, {" window 3", window}};
}

}  // namespace keel::test
