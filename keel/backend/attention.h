// Kernel interface: causal attention (see ops/attention.h for the semantics of the backends).
//
// Layouts: q, o, dq [B, Hq, T, D]; k, v, dk, dv [B, Hkv, T, D]; query head h reads key/value head
// h / (Hq / Hkv) (grouped-query attention, HF's repeat_kv order, without copies). Scores and
// probabilities [B, Hq, T, T] f32; lse [B, Hq, T] f32. key_padding_mask U8 [B, T] (1 = real key)
// or null. Query i sees key j when first_key(b, i) <= j <= i and the key is real; a row that sees
// no key is "fully masked": its output, probabilities and gradients are 0 (never NaN).
//
// The eager and math backends compute Q·Kᵀ, P·V and their gradients with the matmul kernels; the
// two softmax kernels below do the masking and the softmax between them. The flash kernels are
// self-contained: tiles of keys, online softmax, nothing [T, T] materialized.
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct AttentionDims {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seq = 0, head_dim = 0;
  float scale = 1.f;                          // applied to q·k (1/sqrt(D))
  const uint8_t* key_padding_mask = nullptr;  // [B, T] or null (every key real)
  // A packed row's positions, [B, T], restarting at 0 on each example's first token and counting
  // up by one (ops/attention.h), or null. CPU kernels only.
  const int64_t* positions = nullptr;
  // A sliding window (Mistral's sliding_window): query i sees the last `window` keys, i - window
  // + 1 .. i; 0: every earlier key.
  int64_t window = 0;
  // Gemma-2's attn_logit_softcapping: each scaled score s becomes softcap * tanh(s / softcap)
  // before the softmax (eager: rounded to the compute dtype again); 0: none. CPU kernels only.
  float softcap = 0;
  // With a soft cap, the eager and math softmax writes each row's logsumexp here ([B, Hq, T]) and
  // its backward reads it back: the capped score is log p + lse, whose tanh the cap's derivative
  // 1 - tanh² needs (no [B, Hq, T, T] copy of the scores is kept).
  float* softmax_lse = nullptr;
  // Dropout on the probabilities (ops::AttentionDropout): probability (b, h, i, j) survives when
  // the top 32 bits of splitmix64_at(splitmix64_at(drop_seed, 0), ((b·Hq + h)·T + i)·T + j) are
  // >= drop_threshold (backend/dropout.h's mask of seed drop_seed); survivors are times
  // drop_scale.
  // Read by the flash kernels only (the eager and math backends drop between their products with
  // the dropout kernels). CPU kernels only.
  bool dropout = false;
  uint32_t drop_threshold = 0;
  float drop_scale = 1.f;
  uint64_t drop_seed = 0;
  // The first key query i of batch b sees: its example's first token (0 when not packed), or its
  // window's, whichever is later. Never decreases along a row.
  int64_t first_key(int64_t b, int64_t i) const {
    const int64_t example = positions ? i - positions[b * seq + i] : 0;
    return window > 0 && i - window + 1 > example ? i - window + 1 : example;
  }
  // Whether some query's first key is past 0 (packed rows, or a window shorter than the row).
  bool bounded() const { return positions || (window > 0 && window < seq); }
};

struct AttentionKernels {
  // p32[b, h, i, :] = softmax over the visible keys of round_to(score_dt, scale * s[b, h, i, :]),
  // 0 at masked keys and on fully masked rows. Every element of p32 is written. p_lp, when not
  // null, receives p32 rounded to p_dt. s [B, Hq, T, T]: raw f32 scores when s_dt is F32 (p32 may
  // alias them), or, when s_dt is score_dt and 16-bit, round_to(score_dt, scale * s) already (the
  // product scaled and rounded them: half the bytes; CPU only; p_lp may alias them).
  void (*softmax_forward)(float* p32, void* p_lp, DType p_dt, const void* s, DType s_dt,
                          DType score_dt, const AttentionDims& dims);
  // ds = p32 ⊙ (dp − Σ_visible dp ⊙ p32) per row, rounded to ds_dt; exactly 0 at masked keys and
  // on fully masked rows whatever dp holds there. dp [B, Hq, T, T] of dtype dp_dt; ds may alias dp
  // when ds_dt == dp_dt. p_lp, when not null, receives p32 rounded to ds_dt (dV's operand P), from
  // the rows this pass reads anyway.
  void (*softmax_backward)(void* ds, DType ds_dt, const float* p32, const void* dp, DType dp_dt,
                           void* p_lp, const AttentionDims& dims);
  // o = attention(q, k, v) with an online softmax over key tiles; lse = m + log(l) per row (-inf on
  // fully masked rows). Tensors of dtype dt; the P tile is rounded to dt before P·V (and, with
  // dims.dropout, times its keep mask; the normalized output then times drop_scale).
  void (*flash_forward)(void* o, float* lse, const void* q, const void* k, const void* v, DType dt,
                        const AttentionDims& dims);
  // FlashAttention-2 backward: P recomputed tile by tile from lse; P and dS rounded to dt before
  // their products (with dims.dropout: dO·Vᵀ times keep·drop_scale, and dV's P the dropped
  // one). Any of dq, dk, dv may be null (not needed). Deterministic: dK/dV are reduced
  // per key tile, dQ per query tile, each in a fixed order (no atomics).
  void (*flash_backward)(void* dq, void* dk, void* dv, const void* q, const void* k, const void* v,
                         const void* o, const void* dout, const float* lse, DType dt,
                         const AttentionDims& dims);
};

const AttentionKernels& attention_kernels(Device dev);

}  // namespace keel
