#include "keel/ops/rope.h"

#include <algorithm>
#include <cmath>

#include "keel/backend/rope.h"
#include "keel/ops/op_util.h"

namespace keel::ops {

namespace {

// cos and sin of pos * inv_freq[i] for each position pos, i < D/2, computed in f64 and rounded to
// f32: an f32 angle loses ~pos * 2^-24 rad, visible at long positions.
// longrope's attention_factor scales both (HF multiplies its cos and sin by attention_scaling):
// the rotation stays a rotation times that factor, whose transpose the backward applies.
struct RopeTable {
  Tensor cos, sin;  // [positions, D/2] f32
};
RopeTable rope_table(double theta, int64_t head_dim, const RopeScaling& scaling,
                     const std::vector<int64_t>& positions) {
  int64_t longest = 0;
  for (int64_t p : positions) longest = std::max(longest, p + 1);
  const std::vector<double> inv_freq = rope_inv_freq(theta, head_dim, scaling, longest);
  const bool scaled =
      scaling.kind == RopeScaling::Kind::kLongRope || scaling.kind == RopeScaling::Kind::kYarn;
  const double scale = scaled ? scaling.attention_factor : 1;
  const int64_t h = static_cast<int64_t>(inv_freq.size()), n = std::ssize(positions);
  RopeTable tab{Tensor::empty({n, h}), Tensor::empty({n, h})};
  float* c = tab.cos.data_as<float>();
  float* s = tab.sin.data_as<float>();
  for (int64_t i = 0; i < h; ++i)
    for (int64_t p = 0; p < n; ++p) {
      const double angle = static_cast<double>(positions[p]) * inv_freq[i];
      c[p * h + i] = static_cast<float>(scale * std::cos(angle));
      s[p * h + i] = static_cast<float>(scale * std::sin(angle));
    }
  return tab;
}

}  // namespace

std::vector<double> rope_inv_freq(double theta, int64_t head_dim, const RopeScaling& sc,
                                  int64_t seq_len) {
  using Kind = RopeScaling::Kind;
  KEEL_CHECK(sc.kind == Kind::kNone || (sc.factor > 0 && std::isfinite(sc.factor)),
             "rope: rope_scaling factor = " + std::to_string(sc.factor) + " must be positive");
  if (sc.kind == Kind::kLlama3)
    KEEL_CHECK(sc.high_freq_factor > sc.low_freq_factor && sc.low_freq_factor > 0 &&
                   sc.original_max_position > 0,
               "rope: llama3 rope_scaling needs high_freq_factor > low_freq_factor > 0 and "
               "original_max_position_embeddings > 0");
  const bool long_rope = sc.kind == Kind::kLongRope;
  if (long_rope)
    KEEL_CHECK(std::ssize(sc.short_factor) == head_dim / 2 &&
                   std::ssize(sc.long_factor) == head_dim / 2 && sc.attention_factor > 0 &&
                   sc.original_max_position > 0,
               "rope: longrope rope_scaling needs short_factor and long_factor of head_dim / 2 = " +
                   std::to_string(head_dim / 2) +
                   " values, a positive attention_factor and original_max_position_embeddings");
  if (sc.kind == Kind::kYarn)
    KEEL_CHECK(sc.original_max_position > 0 && sc.attention_factor > 0 && sc.beta_fast > 0 &&
                   sc.beta_slow > 0 && std::isfinite(sc.beta_fast + sc.beta_slow),
               "rope: yarn rope_scaling needs original_max_position_embeddings, a positive "
               "attention_factor and positive beta_fast and beta_slow");
  if (sc.kind == Kind::kDynamic)
    KEEL_CHECK(sc.original_max_position > 0 && head_dim > 2,
               "rope: dynamic rope_scaling needs max_position_embeddings and heads wider than 2");
  const double pi = 3.14159265358979323846;
  // HF's _compute_dynamic_ntk_parameters: the base grows with the forward's length past the
  // original context (an unchanged base within it).
  const double base =
      sc.kind == Kind::kDynamic && seq_len > sc.original_max_position
          ? theta * std::pow(sc.factor * static_cast<double>(seq_len) /
                                     static_cast<double>(sc.original_max_position) -
                                 (sc.factor - 1),
                             static_cast<double>(head_dim) / static_cast<double>(head_dim - 2))
          : theta;
  if (sc.kind == Kind::kYarn) {
    // HF's _compute_yarn_parameters: the pairs turning more than beta_fast times within the
    // original context keep their frequency, those turning fewer than beta_slow times are
    // interpolated (/ factor), a linear ramp between.
    const double dim = static_cast<double>(head_dim);
    auto correction_dim = [&](double turns) {
      return dim * std::log(static_cast<double>(sc.original_max_position) / (turns * 2 * pi)) /
             (2 * std::log(base));
    };
    double low = correction_dim(sc.beta_fast), high = correction_dim(sc.beta_slow);
    if (sc.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, dim - 1);
    if (low == high) high += 0.001;  // (HF's guard against a zero-width ramp)
    std::vector<double> inv(head_dim / 2);
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      const double pos_freq = std::pow(base, static_cast<double>(2 * i) / dim);
      const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      const double extrapolate = 1 - ramp;  // the share kept at its trained frequency
      inv[i] = (1 / (sc.factor * pos_freq)) * (1 - extrapolate) + (1 / pos_freq) * extrapolate;
    }
    return inv;
  }
  // HF's _longrope_frequency_update: the long factors once the positions pass the original
  // context.
  const std::vector<double>& ext =
      seq_len > sc.original_max_position ? sc.long_factor : sc.short_factor;
  std::vector<double> inv(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    // HF: inv_freq = 1 / theta^(arange(0, D, 2) / D) (dynamic: the grown base)
    double f = 1.0 / std::pow(base, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    if (long_rope) {
      f /= ext[i];  // HF's _compute_longrope_parameters: 1 / (ext_factors * base^(2i / D))
    } else if (sc.kind == Kind::kLinear) {
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

namespace {

// x [B, H, T, D] rotated into out by the table's angles: one table [T, D/2] for every batch row
// (`per_row` false), or one for each ([B * T, D/2], a packed batch's own positions).
// Channels rot..D-1 pass unchanged (a partial rotary).
void rotate(Tensor& out, const Tensor& x, const RopeTable& tab, bool per_row, int64_t rot,
            bool inverse) {
  const int64_t t = x.size(2), d = x.size(3);
  const float* c = tab.cos.data_as<float>();
  const float* s = tab.sin.data_as<float>();
  const RopeKernels& k = rope_kernels(x.device());
  if (!per_row)
    return k.rotate(out.data(), x.data(), c, s, x.dtype(), x.size(0) * x.size(1), t, d, rot,
                    inverse);
  const int64_t row_elems = x.size(1) * t * d, h = rot / 2;
  const size_t bytes = dtype_size(x.dtype());
  for (int64_t b = 0; b < x.size(0); ++b)
    k.rotate(static_cast<char*>(out.data()) + b * row_elems * bytes,
             static_cast<const char*>(x.data()) + b * row_elems * bytes, c + b * t * h,
             s + b * t * h, x.dtype(), x.size(1), t, d, rot, inverse);
}

struct RopeNode final : Node {
  RopeTable tab;
  bool per_row = false;
  int64_t rot = 0;
  std::vector<Tensor> backward(const Tensor& g) override {  // g [B, H, T, D]
    // The rotation is orthogonal: its gradient is the inverse rotation of g.
    Tensor gx = Tensor::empty_like(g);
    rotate(gx, g, tab, per_row, rot, /*inverse=*/true);
    return {gx};
  }
  const char* name() const override { return "rope"; }
};

Tensor rope_with_table(const Tensor& x, RopeTable tab, bool per_row, int64_t rot) {
  if (!x.device().is_cpu()) tab = {tab.cos.to(x.device()), tab.sin.to(x.device())};
  Tensor out = Tensor::empty_like(x);  // [B, H, T, D]
  rotate(out, x, tab, per_row, rot, /*inverse=*/false);
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<RopeNode>();
    node->tab = std::move(tab);
    node->per_row = per_row;
    node->rot = rot;
    record_node(out, node, {&x});
  }
  return out;
}

// The channels that turn (rotary_dim, 0: all of them), checked.
int64_t check_rope_input(const Tensor& x, float theta, int64_t rotary_dim) {
  check_floating("rope", x);
  KEEL_CHECK(x.dim() == 4,
             "rope: x must be [B, H, T, D] (split-heads layout), got " + shape_str(x.shape()));
  const int64_t rot = rotary_dim > 0 ? rotary_dim : x.size(3);
  KEEL_CHECK(rot % 2 == 0 && rot <= x.size(3),
             "rope: the rotated channels R = " + std::to_string(rot) + " of a head of " +
                 std::to_string(x.size(3)) +
                 " must be even and at most the head (pairs (i, i + R/2) rotate together)");
  KEEL_CHECK(theta > 0.f && std::isfinite(theta),
             "rope: theta = " + std::to_string(theta) + " must be positive and finite");
  return rot;
}

}  // namespace

Tensor rope(const Tensor& x, float theta, int64_t pos_offset, const RopeScaling& scaling,
            int64_t rotary_dim) {
  const int64_t rot = check_rope_input(x, theta, rotary_dim);
  KEEL_CHECK(pos_offset >= 0, "rope: pos_offset = " + std::to_string(pos_offset) + " must be >= 0");
  std::vector<int64_t> pos(static_cast<size_t>(x.size(2)));
  for (size_t p = 0; p < pos.size(); ++p) pos[p] = pos_offset + static_cast<int64_t>(p);
  return rope_with_table(x, rope_table(theta, rot, scaling, pos), false, rot);
}

Tensor rope(const Tensor& x, float theta, const Tensor& positions, const RopeScaling& scaling,
            int64_t rotary_dim) {
  const int64_t rot = check_rope_input(x, theta, rotary_dim);
  const Shape bt{x.size(0), x.size(2)};
  KEEL_CHECK(
      positions.dtype() == DType::I64 && positions.device().is_cpu() && positions.shape() == bt,
      "rope: positions must be cpu i64 [B, T] = " + shape_str(bt) + ", got " +
          positions.device().str() + " " + dtype_name(positions.dtype()) + " " +
          shape_str(positions.shape()));
  const std::vector<int64_t> pos = positions.to_ints();
  for (int64_t p : pos) KEEL_CHECK(p >= 0, "rope: position " + std::to_string(p) + " is negative");
  return rope_with_table(x, rope_table(theta, rot, scaling, pos), true, rot);
}

}  // namespace keel::ops
