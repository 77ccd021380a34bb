// Per-layer gradient norms and underflow shares: the global grad norm of DESIGN §3 broken down by
// top-level block, so a user sees WHICH layer's gradients explode or vanish. Always computed (from
// the step's own pass: no extra read of the gradients); the trend advisor reads them, and
// `log.per_layer_grad_norm` writes them to metrics.jsonl.
//
// A block is the module path of a parameter up to and including its first numeric component
// ("transformer.h.3.attn.c_attn.weight" -> "transformer.h.3", "model.layers.0.mlp.up_proj.weight"
// -> "model.layers.0"); a parameter outside the numbered stack is its own module
// ("transformer.wte.weight" -> "transformer.wte", "model.norm.weight" -> "model.norm",
// "lm_head.weight" -> "lm_head"). Adapter parameters belong to the block of the layer they adapt.
//
// Call it where the global norm is computed: after unscale, before clipping (the trainer's
// on_grads hook, with the step's amp::GradPass), so the norms are pre-clip and unscaled. Each
// tensor's sum of squares is the one the step's global norm adds up (f32 within fixed blocks, f64
// across), so the squares of the block norms add up to the global norm squared (up to f64
// rounding), and the bits do not depend on the thread count.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "keel/amp/grad_pass.h"
#include "keel/tensor/tensor.h"

namespace keel::monitor {

std::string grad_norm_block(const std::string& param_name);

struct BlockGradNorm {
  std::string block;
  double norm = 0;  // inf/nan when a gradient of the block is non-finite
  // Gradient elements of the block, and how many were exactly 0 or (non-zero) below the compute
  // format's smallest normal, as the pass counted them (amp::GradPass::zero_of); without the rows
  // of a lookup table that no input selected (exactly 0 in any precision, not underflow).
  int64_t count = 0, zero = 0, below_normal = 0;
  // No element of the block's gradient is a normal number of the compute format: it vanished.
  bool vanished() const { return count > 0 && zero + below_normal == count; }
  double underflow_share() const {
    return count > 0 ? static_cast<double>(zero + below_normal) / static_cast<double>(count) : 0;
  }
};
// One entry per block, in the order the blocks first appear in `params` (registration order:
// embeddings, layers 0..L-1, final norm, head). Parameters without a gradient are skipped; a block
// none of whose parameters has a gradient is absent. `pass`: the step's pass over exactly these
// parameters' gradients, in this order, whose per-gradient sums and counts are reused (null: one
// pass here, counts judged against f32). `unselected` (aligned with params, or null): per
// gradient, elements known to be exactly 0 because no input selected their row of a lookup table
// (Trainer::last_unselected); they are left out of count and zero, so an embedding's underflow
// share is over the rows the step used (259 rows, 13 of them used, read 95% "underflow").
std::vector<BlockGradNorm> per_layer_grad_norms(
    const std::vector<std::pair<std::string, Tensor>>& params, const amp::GradPass* pass = nullptr,
    const std::vector<int64_t>* unselected = nullptr);

// The largest finite |value| among the values of `params` and the parameter holding it (one pass
// of the backend's statistics kernel per tensor, where it lives; value 0 and no name when empty).
// Replay reports it; the trend advisor tells a diverged model (kDivergedWeight) by it.
struct LargestWeight {
  std::string param;
  double value = 0;
};
LargestWeight largest_weight(const std::vector<std::pair<std::string, Tensor>>& params);

}  // namespace keel::monitor
