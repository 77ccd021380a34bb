#include "keel/ops/rope.h"

#include <cmath>

#include "keel/backend/rope.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {

// cos and sin of pos * inv_freq[i] for pos = t + offset, t < T, i < D/2, computed in f64 and
// rounded to f32: an f32 angle loses ~pos * 2^-24 rad, visible at long positions.
struct RopeTable {
  Tensor cos, sin;  // [T, D/2] f32
};
RopeTable rope_table(const std::vector<double>& inv_freq, int64_t offset, int64_t t) {
  const int64_t h = static_cast<int64_t>(inv_freq.size());
  RopeTable tab{Tensor::empty({t, h}), Tensor::empty({t, h})};
  float* c = tab.cos.data_as<float>();
  float* s = tab.sin.data_as<float>();
  for (int64_t i = 0; i < h; ++i)
    for (int64_t p = 0; p < t; ++p) {
      const double angle = static_cast<double>(p + offset) * inv_freq[i];
      c[p * h + i] = static_cast<float>(std::cos(angle));
      s[p * h + i] = static_cast<float>(std::sin(angle));
    }
  return tab;
}

}  // namespace

std::vector<double> rope_inv_freq(double theta, int64_t head_dim, const RopeScaling& sc) {
  using Kind = RopeScaling::Kind;
  KEEL_CHECK(sc.kind == Kind::kNone || (sc.factor > 0 && std::isfinite(sc.factor)),
             "rope: rope_scaling factor = " + std::to_string(sc.factor) + " must be positive");
  if (sc.kind == Kind::kLlama3)
    KEEL_CHECK(sc.high_freq_factor > sc.low_freq_factor && sc.low_freq_factor > 0 &&
                   sc.original_max_position > 0,
               "rope: llama3 rope_scaling needs high_freq_factor > low_freq_factor > 0 and "
               "original_max_position_embeddings > 0");
  const double pi = 3.14159265358979323846;
  std::vector<double> inv(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    // HF: inv_freq = 1 / theta^(arange(0, D, 2) / D)
    double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    if (sc.kind == Kind::kLinear) {
      f /= sc.factor;
    } else if (sc.kind == Kind::kLlama3) {
      // HF's _compute_llama3_parameters: long wavelengths (low frequencies) are stretched by
      // `factor`, short ones kept, the band between blended linearly in old_context / wavelen.
      const double old_ctx = static_cast<double>(sc.original_max_position);
      const double wavelen = 2 * pi / f;
      const double low_freq_wavelen = old_ctx / sc.low_freq_factor;
      const double high_freq_wavelen = old_ctx / sc.high_freq_factor;
      if (wavelen > low_freq_wavelen) {
        f /= sc.factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth =
            (old_ctx / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor);
        f = (1 - smooth) * f / sc.factor + smooth * f;
      }
    }
    inv[i] = f;
  }
  return inv;
}

struct RopeNode final : Node {
  RopeTable tab;
  int64_t rows = 0, t = 0, d = 0;
  std::vector<Tensor> backward(const Tensor& g) override {  // g [B, H, T, D]
    // The rotation is orthogonal: its gradient is the inverse rotation of g.
    Tensor gx = Tensor::empty_like(g);
    rope_kernels(g.device())
        .rotate(gx.data(), g.data(), tab.cos.data_as<float>(), tab.sin.data_as<float>(), g.dtype(),
                rows, t, d, /*inverse=*/true);
    return {gx};
  }
  const char* name() const override { return "rope"; }
};

Tensor rope(const Tensor& x, float theta, int64_t pos_offset, const RopeScaling& scaling) {
  check_floating("rope", x);
  KEEL_CHECK(x.dim() == 4,
             "rope: x must be [B, H, T, D] (split-heads layout), got " + shape_str(x.shape()));
  const int64_t t = x.size(2), d = x.size(3);
  KEEL_CHECK(d % 2 == 0, "rope: head dim D = " + std::to_string(d) +
                             " must be even (pairs (i, i + D/2) rotate together)");
  KEEL_CHECK(theta > 0.f && std::isfinite(theta),
             "rope: theta = " + std::to_string(theta) + " must be positive and finite");
  KEEL_CHECK(pos_offset >= 0, "rope: pos_offset = " + std::to_string(pos_offset) + " must be >= 0");
  const int64_t rows = x.size(0) * x.size(1);
  RopeTable tab = rope_table(rope_inv_freq(theta, d, scaling), pos_offset, t);
  if (!x.device().is_cpu()) tab = {tab.cos.to(x.device()), tab.sin.to(x.device())};  // [T, D/2]
  Tensor out = Tensor::empty_like(x);                                                // [B, H, T, D]
  rope_kernels(x.device())
      .rotate(out.data(), x.data(), tab.cos.data_as<float>(), tab.sin.data_as<float>(), x.dtype(),
              rows, t, d, /*inverse=*/false);
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<RopeNode>();
    node->tab = std::move(tab);
    node->rows = rows;
    node->t = t;
    node->d = d;
    record_node(out, node, {&x});
  }
  return out;
}

}  // namespace keel::ops
