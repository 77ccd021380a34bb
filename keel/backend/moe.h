// Kernel interface: a mixture-of-experts layer's routing and the weighted sum of its experts'
// outputs, as HF's sparse MoE blocks compute them (Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock,
// MixtralSparseMoeBlock).
//
// Routing: per token (a row of the router's logits [n, e], any floating dtype), the softmax over
// the experts in f32, its k largest probabilities in descending order (a tie: the lower expert
// first; NaN counts as the largest, as torch.topk's), divided by their sum when `normalize`
// (Qwen3-MoE's norm_topk_prob, Mixtral's always). The combine: out[t] = the sum over the experts
// that token t chose, in ascending expert order, of expert_output * weight, with HF's roundings:
// the weight rounded to out's dtype, the product in the wider of the expert output's dtype and
// out's, rounded to out's, then added (index_add_) and rounded to out's.
// The CPU runs them; a GPU has none yet (moe_kernels says so).
#pragma once
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

// One expert's rows: the tokens routed to it (ascending) and which of their k choices it was.
struct MoeExpertRows {
  const int64_t* tokens = nullptr;
  const int32_t* slots = nullptr;
  int64_t rows = 0;
};

struct MoeKernels {
  // probs [n, e] f32 (kept for the backward), weights [n, k] f32, experts [n, k].
  void (*route)(const void* logits, DType dt, int64_t n, int64_t e, int64_t k, bool normalize,
                float* probs, float* weights, int32_t* experts);
  // dlogits [n, e] (dt) from dweights [n, k] f32: through the renormalization (when `normalize`)
  // and the softmax; an expert no token chose gets p * (0 - <dp, p>). `dprobs` [e] (or null): a
  // gradient added to the probabilities of every counted token (`counted` [n], null: every one),
  // the balance loss's (ops::MoeBalance), before the softmax's backward.
  void (*route_backward)(void* dlogits, DType dt, const float* dweights, const float* probs,
                         const float* weights, const int32_t* experts, int64_t n, int64_t e,
                         int64_t k, bool normalize, const float* dprobs, const uint8_t* counted);
  // An expert's input: out [padded, d] = x's rows `rows` [m] (x [n, d]), then zeros to `padded`.
  void (*gather)(void* out, const void* x, DType dt, const int64_t* rows, int64_t m, int64_t padded,
                 int64_t d);
  // Its backward: dx[rows[r]] += g[r] for r < m (each row named once: no sums within a call).
  void (*scatter_add)(void* dx, const void* g, DType dt, const int64_t* rows, int64_t m, int64_t d);
  // out [n, d] (out_dt) = the combine above. ys[x] [rows_x, d] in y_dts[x] (the first rows_x
  // rows of an expert output padded beyond them); weights [n, k] f32.
  void (*combine)(void* out, DType out_dt, const void* const* ys, const DType* y_dts,
                  const MoeExpertRows* experts, int64_t n_experts, const float* weights, int64_t k,
                  int64_t n, int64_t d);
  // Its backward from g [n, d] (g_dt, out's dtype): dys[x] [rows_x, d] in y_dts[x] (each null
  // when not wanted) = g[token] * weight, and dweights [n, k] f32 (null when not wanted; entries
  // of no expert's rows are left as they are) = sum over d of g[token] * y.
  void (*combine_backward)(const void* g, DType g_dt, const void* const* ys, const DType* y_dts,
                           void* const* dys, const MoeExpertRows* experts, int64_t n_experts,
                           const float* weights, float* dweights, int64_t k, int64_t d);
  // A shared expert's gated output (Qwen2-MoE's): out [n, d] = sigmoid(logit[t]) * x[t, :], the
  // sigmoid rounded to dt, then the product (logit [n], x, out in dt), as HF's
  // F.sigmoid(shared_expert_gate(x)) * shared_expert(x) rounds them.
  void (*gate_rows)(void* out, const void* x, const void* logit, DType dt, int64_t n, int64_t d);
  // Its backward from g [n, d]: dx = g * s (rounded to dt), dlogit[t] = <g[t], x[t]> * s (1 - s)
  // (f32 sums, rounded to dt); either may be null when not wanted.
  void (*gate_rows_backward)(void* dx, void* dlogit, const void* g, const void* x,
                             const void* logit, DType dt, int64_t n, int64_t d);
};

// The kernels of `dev`; a GPU's is an Error naming the fix (the model's MoE layers run on the CPU).
const MoeKernels& moe_kernels(Device dev);

}  // namespace keel
