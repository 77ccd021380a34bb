// A mixture-of-experts layer's differentiable pieces (HF's Qwen3MoeSparseMoeBlock,
// OlmoeSparseMoeBlock, MixtralSparseMoeBlock): route each token to its k experts, gather each
// expert's tokens, and sum the experts' outputs weighted by the routing. The experts themselves
// are the caller's modules (each an MLP of its own, with its own adapters).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::ops {

struct MoeRouting {
  int64_t tokens = 0, top_k = 0;
  // [tokens, top_k] f32: each token's k weights, largest first (the softmax of the router's
  // logits over every expert, its k largest, divided by their sum when normalized); differentiable
  // with respect to the logits.
  Tensor weights;
  std::vector<int32_t> experts;  // [tokens * top_k]: the expert of each weight
  // Per expert: the tokens routed to it, ascending, and which of their k choices it was. An
  // expert no token chose has none (its MLP does not run: HF's loop skips it too).
  std::vector<std::vector<int64_t>> rows_of;
  std::vector<std::vector<int32_t>> slots_of;
};

// The load-balancing loss of a mixture's routers over one forward's sparse layers (the Switch
// Transformer's auxiliary loss; HF's load_balancing_loss_func, which Qwen3-MoE, OLMoE and Mixtral
// add to the loss times router_aux_loss_coef when output_router_logits is set). With the counted
// tokens of every layer taken together (N of them; HF's attention mask: padding is not counted),
// f_x = the share of their top-k choices that went to expert x (each token's k choices count, so
// the shares sum to k) and P_x = their mean router probability for x:
//   loss = experts * sum_x f_x P_x
// top_k when the router spreads tokens evenly (all P_x = 1/experts), experts when it sends every
// token to one expert with certainty. Its gradient reaches the router's logits through P alone (the
// choices are counted, not differentiated: torch's one_hot of topk).
struct MoeBalance {
  struct Sums {
    std::vector<double> chosen, probs;  // [experts]: each expert's choices and summed probability
    int64_t tokens = 0;                 // counted tokens, over the layers
    double loss() const;                // the formula above; 0 without tokens
    void clear();
  };
  // Per token of a layer's input: 1 counted, 0 padding (the forward's attention mask); empty:
  // every token.
  std::vector<uint8_t> counted;
  Sums forward;  // this forward's, what the loss and its gradient are of
  Sums step;     // every counted forward's since clear_step(): a step's tokens together
  // d(objective)/d(forward.loss()), read by the routings' backward; 0: no gradient is added.
  double grad = 0;

  // A forward's start: its sums cleared, `key_padding` (U8 [B, T] or undefined: no padding) the
  // tokens it counts of each layer's `tokens_per_layer`.
  void begin(const Tensor& key_padding, int64_t tokens_per_layer);
  void clear_step() { step.clear(); }
};

// Routes each row of `router_logits` [tokens, experts] (any floating dtype: under autocast the
// router's bf16 product) to its `top_k` most probable experts: the softmax in f32, ties to the
// lower expert, `normalize` as Qwen3-MoE's norm_topk_prob (Mixtral: always; OLMoE: never).
// `balance`: the layer's routing is added to its sums (when `count`: not a checkpointed block's
// recompute, whose tokens its first forward counted), and the backward adds the balance loss's
// gradient (balance->grad times it) to the logits'.
MoeRouting moe_route(const Tensor& router_logits, int64_t top_k, bool normalize,
                     const std::shared_ptr<MoeBalance>& balance = nullptr, bool count = true);

// x [tokens, d]'s rows `rows` (an expert's input, each token once), then zero rows up to
// `padded` (0: none): [max(m, padded), d]. The backward adds each row's gradient back to its
// token's (straight into x's pending gradient when there is one).
Tensor gather_rows(const Tensor& x, const std::vector<int64_t>& rows, int64_t padded = 0);

// The rows an expert's batch of m tokens is padded to: m rounded up to a multiple of 8 (to 64
// rows), 32 (to 512), 128 (to 4096), then 512. Each expert sees another count of tokens every
// step, and oneDNN builds (JITs, ~8 ms) and keeps a kernel per distinct shape: unpadded, a tiny
// Qwen3-MoE's eval held 107 MB of kernels after 160 batches, and a real one would build tens of
// thousands a step. A padded row is zero and its output unused; it changes no real row's value
// (each output row is its own dot products), only the weight gradients' summation blocking.
int64_t moe_padded_rows(int64_t m);

// [tokens, d] in `dtype` (the layer input's): token t's sum over the experts it chose, in
// ascending expert order, of expert_outputs[e]'s row for t times t's weight for e, rounded as
// HF's index_add_ of `output * weight` into zeros (backend/moe.h). expert_outputs[e] is
// [at least rows_of[e].size(), d]: its first rows are the tokens' (padding after them is not
// read, and gets a zero gradient); undefined for an expert with no rows.
Tensor moe_combine(const std::vector<Tensor>& expert_outputs, const MoeRouting& routing,
                   DType dtype);

// A shared expert's gated output (Qwen2-MoE's): sigmoid(logit) * x, x [tokens, d] and logit
// [tokens, 1] of one floating dtype, the sigmoid rounded to it first (backend/moe.h).
Tensor gate_rows(const Tensor& x, const Tensor& logit);

}  // namespace keel::ops
