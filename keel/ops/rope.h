// Rotary position embedding, HF Llama / GPT-NeoX "rotate half" layout: for head dim D and
// i < D/2, (x[i], x[i + D/2]) rotates by angle pos * inv_freq[i], inv_freq[i] = theta^(-2i/D)
// (optionally rescaled, see RopeScaling). Angles in f64, rotation in f32, output in x's dtype.
// x: [B, H, T, D] (split-heads layout); pos = t + pos_offset.
// A partial rotary (`rotary_dim` R < D, HF's int(D * partial_rotary_factor): Phi-4-mini's 96 of
// 128) turns the first R channels as a head of R would, inv_freq[i] = theta^(-2i/R), pairs
// (x[i], x[i + R/2]), and passes the other D - R as they are (HF's Phi3 apply_rotary_pos_emb).
// 0: R = D.
#pragma once
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::ops {

// HF's `rope_scaling` for long contexts: which frequencies a model trained at a short context
// stretches, and by how much. The angles of a position change, so a checkpoint must be run with
// the scaling it was trained with (Llama 3.1/3.2 ship "llama3").
struct RopeScaling {
  enum class Kind { kNone, kLinear, kLlama3, kLongRope, kYarn, kDynamic };
  Kind kind = Kind::kNone;
  double factor = 1.0;  // linear: every inv_freq / factor; llama3: the low frequencies / factor
  // llama3 only: wavelengths above original_max_position / low_freq_factor are divided by
  // `factor`, those below original_max_position / high_freq_factor are kept, the band between is
  // interpolated smoothly.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
  // longrope (Phi-3-*-128k, Phi-3.5-mini): inv_freq[i] / short_factor[i] while a forward's
  // positions stay within original_max_position (the longest + 1 at most that), / long_factor[i]
  // past it (HF's dynamic update; a decode that crosses it runs its whole sequence again, as HF's
  // Phi-3 generate does: models::generate); cos and sin scaled by attention_factor.
  std::vector<double> short_factor, long_factor;
  // yarn (YaRN: Qwen2.5-Coder's config.json, Qwen3's and SmolLM3's long-context setting): each
  // frequency a blend of inv_freq / factor and inv_freq, by a ramp over the pairs whose
  // wavelengths fit between beta_fast and beta_slow turns within original_max_position
  // (floored / ceiled when `truncate`); cos and sin scaled by attention_factor, as longrope's.
  double beta_fast = 32, beta_slow = 1;
  bool truncate = true;
  double attention_factor = 1.0;  // longrope, yarn
  // dynamic (HF's dynamic NTK): unscaled while a forward's positions stay within
  // original_max_position (the model's max_position_embeddings); past it, for a forward reaching
  // seq_len, the base theta * (factor * seq_len / original - (factor - 1))^(D / (D - 2)). Per
  // forward, where HF's rotary module keeps the longest length it has seen until a forward within
  // the original context resets it: the same for every forward within it or at a new longest.
  bool operator==(const RopeScaling&) const = default;
};

// inv_freq[i], i < D/2, in f64 (what the angle of position p multiplies: p * inv_freq[i]), of a
// forward whose positions reach `seq_len` - 1 (longrope's choice of factors; the others ignore it).
std::vector<double> rope_inv_freq(double theta, int64_t head_dim, const RopeScaling& scaling = {},
                                  int64_t seq_len = 0);

Tensor rope(const Tensor& x, float theta = 10000.f, int64_t pos_offset = 0,
            const RopeScaling& scaling = {}, int64_t rotary_dim = 0);

// The same rotation at given positions: I64 [B, T] on the CPU, batch row b's tokens at
// positions[b, :] (a packed row's positions restart at each example's first token).
Tensor rope(const Tensor& x, float theta, const Tensor& positions, const RopeScaling& scaling = {},
            int64_t rotary_dim = 0);

}  // namespace keel::ops
