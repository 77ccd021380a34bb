#include "keel/ops/rope.h"

#include <cmath>

#include "keel/backend/rope.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {

// cos and sin of pos * theta^(-2i/D) for pos = t + offset, t < T, i < D/2, computed in f64 and
// rounded to f32: an f32 angle loses ~pos * 2^-24 rad, visible at long positions.
struct RopeTable {
  Tensor cos, sin;  // [T, D/2] f32
};
RopeTable rope_table(float theta, int64_t offset, int64_t t, int64_t d) {
  const int64_t h = d / 2;
  RopeTable tab{Tensor::empty({t, h}), Tensor::empty({t, h})};
  float* c = tab.cos.data_as<float>();
  float* s = tab.sin.data_as<float>();
  for (int64_t i = 0; i < h; ++i) {
    // HF: inv_freq = 1 / theta^(arange(0, D, 2) / D)
    const double inv_freq =
        1.0 / std::pow(static_cast<double>(theta), static_cast<double>(2 * i) / d);
    for (int64_t p = 0; p < t; ++p) {
      const double angle = static_cast<double>(p + offset) * inv_freq;
      c[p * h + i] = static_cast<float>(std::cos(angle));
      s[p * h + i] = static_cast<float>(std::sin(angle));
    }
  }
  return tab;
}

}  // namespace

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

Tensor rope(const Tensor& x, float theta, int64_t pos_offset) {
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
  RopeTable tab = rope_table(theta, pos_offset, t, d);
  Tensor out = Tensor::empty_like(x);  // [B, H, T, D]
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
