// Causal scaled-dot-product attention with an optional key-padding mask, three backends:
//
//  eager: S = round(scale * Q·Kᵀ) in the compute dtype, masked, P = softmax in f32 rounded to the
//         compute dtype, O = P·V (f32 accumulation, rounded). What HF's eager attention does.
//  math:  every intermediate in f32; O rounded once.
//  flash: tiles over keys with an online softmax whose running max and sum are f32; each tile's P
//         is rounded to the compute dtype before P·V; O accumulates in f32, rounded once.
//
// q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] with Hq % Hkv == 0 (grouped-query attention without
// copying k/v). key_padding_mask: U8 [B, T], 1 = real token, 0 = padding; undefined = none.
// scale = 1/sqrt(D). A query row with no visible key (fully masked) outputs 0, not NaN.
//
// Packed rows (data.pack with JSONL: several examples one after another in a row) give
// positions: I64 [B, T] that restart at 0 on each example's first token and count up by one (HF's
// position_ids of a flattened batch). Query i then sees only keys of its own example, from
// i - positions[b, i] on: an example's outputs are what it computes alone in a row of its own.
// Masked scores are -inf by intent and are never reported as non-finite findings.
#pragma once
#include <cmath>
#include <cstdint>
#include <string_view>
#include <utility>

#include "keel/tensor/tensor.h"

namespace keel::ops {

enum class AttentionBackend { kEager, kMath, kFlash };
AttentionBackend attention_backend_from_name(std::string_view name);  // Error on unknown names
const char* attention_backend_name(AttentionBackend b);

// What each query sees beyond causality: keys that are padding (key_padding, U8 [B, T], 1 = real)
// and, in a packed row, keys of other examples (positions, I64 [B, T]). Either may be undefined.
struct AttentionMask {
  Tensor key_padding;
  Tensor positions;
  // A sliding window (Mistral's sliding_window, HF's kv_idx > q_idx - sliding_window): a query
  // sees the last `window` keys, itself included; 0: every earlier key.
  int64_t window = 0;
  AttentionMask() = default;
  AttentionMask(Tensor key_padding, Tensor positions = Tensor())  // NOLINT: a mask is a mask
      : key_padding(std::move(key_padding)), positions(std::move(positions)) {}
};

// The flat index of the first of `positions` (I64 [B, T] on the CPU) that neither starts an
// example (0) nor follows the position before it in its row by one; -1 when every one does. What
// attention checks, and what a NaN capture's stored positions must pass.
int64_t first_bad_position(const Tensor& positions);

// How scores are formed from q·kᵀ: its scale (0: 1/sqrt(D); Gemma-2's query_pre_attn_scalar^-1/2
// otherwise) and a soft cap (Gemma-2's attn_logit_softcapping: each scaled score s becomes
// softcap * tanh(s / softcap) before the softmax, the eager backend rounding it to the compute
// dtype again; 0: none).
struct AttentionScores {
  float scale = 0;
  float softcap = 0;
  // The scale of heads of `head_dim` channels: `scale`, or 1/sqrt(head_dim).
  float scale_for(int64_t head_dim) const {
    return scale > 0 ? scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  }
};

// Dropout on the probabilities (HF's attn_pdrop for GPT-2, attention_dropout for the Llama
// family; a model applies it while training): probability (b, h, i, j) survives by the mask
// ops::dropout(·, p, seed) draws for a [B, Hq, T, T] tensor, at flat index ((b·Hq + h)·T + i)·T +
// j, and survivors are scaled by 1/(1-p). Each backend drops where it holds P:
//   eager: P rounded to the compute dtype, then round(P · keep · scale) (HF's eager attention:
//          softmax(...).to(dtype), then F.dropout); the backward drops dP the same way.
//   math:  in f32.
//   flash: each tile's P, rounded to the compute dtype, times keep (0 or 1) before P·V; the row's
//          sum stays the undropped one, and the normalized output is times scale. Its backward
//          drops dP (times keep·scale) and uses round(P · keep · scale) for dV.
// p == 0 computes exactly what no dropout does.
struct AttentionDropout {
  float p = 0;
  uint64_t seed = 0;
};

// Positions, a window shorter than the row, a soft cap and dropout on the CPU only: the CUDA
// kernels read none of them yet (an Error says so).
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                 AttentionBackend backend = AttentionBackend::kEager,
                 const AttentionScores& scores = {}, const AttentionDropout& dropout = {});

}  // namespace keel::ops
