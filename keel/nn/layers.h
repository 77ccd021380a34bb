// The layers models are built from. Each forward asks autocast (amp/) for its inputs' dtypes and
// runs one op from ops/; none of them casts by itself.
#pragma once
#include <cstdint>
#include <vector>

#include "keel/nn/module.h"
#include "keel/ops/activation.h"

namespace keel::nn {

class LinearAdapter;  // nn/adapters/adapter.h

// y = x·Wᵀ + b, W [out, in] (nn.Linear / HF layout).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, DType dt = DType::F32);
  // The product below, or adapter->forward(*this, x) when an unmerged adapter is attached.
  Tensor forward(const Tensor& x);
  // x·Wᵀ + b under the linear autocast rule, never through the adapter (adapters call it).
  Tensor base_forward(const Tensor& x);
  Tensor weight, bias;  // [out, in], [out] (bias may be undefined)
  int64_t in_features, out_features;

  // Adapter hook (nn/adapters/, set by apply_adapters): model code keeps calling forward(). The
  // adapter's modules and parameters are registered on this Linear, so they carry PEFT's names
  // ("<path>.lora_A.weight", "<path>.lora_magnitude_vector") while the base keeps HF's.
  std::shared_ptr<LinearAdapter> adapter;
  template <class M>
  M* add_adapter_module(const std::string& name, std::unique_ptr<M> m) {
    return register_module(name, std::move(m));
  }
  Tensor add_adapter_parameter(const std::string& name, Tensor t) {
    return register_parameter(name, std::move(t));
  }
};

class LayerNorm : public Module {
 public:
  LayerNorm(int64_t dim, double eps, DType dt = DType::F32);
  Tensor forward(const Tensor& x);
  Tensor weight, bias;  // [dim]
  double eps;
};

class RMSNorm : public Module {
 public:
  // `unit_offset`: Gemma's norm, which scales by 1 + weight (the weight stored as that offset,
  // 0 at construction); else by weight (1 at construction). `centered`: a LayerNorm (the mean
  // subtracted before the root mean square), in f32 and cast back to x's dtype, whose `affine`
  // parameters are a weight (Cohere's CohereLayerNorm), a weight and a bias (Phi's, GPT-NeoX's,
  // StableLM's: torch's nn.LayerNorm, which computes a 16-bit input in f32 too), or none (OLMo's
  // OlmoLayerNorm).
  enum class Affine { kWeight, kWeightAndBias, kNone };
  RMSNorm(int64_t dim, double eps, DType dt = DType::F32, bool unit_offset = false,
          bool centered = false, Affine affine = Affine::kWeight);
  Tensor forward(const Tensor& x);
  Tensor weight, bias;  // [dim] or undefined (as `affine` says)
  double eps;
  bool unit_offset, centered;
};

// A LayerNorm without bias over each head's channels of x [..., heads, dim], each head scaled by a
// weight of its own, in f32 (the product cast to x's dtype under autocast's norm rule): Cohere's
// q_norm / k_norm (HF's CohereLayerNorm over (heads, head_dim): one parameter `weight` [heads,
// dim]) and, with `module_per_head`, StableLM's q_layernorm / k_layernorm (an nn.LayerNorm per
// head: `norms.<h>.weight` [dim] each).
class HeadLayerNorm : public Module {
 public:
  HeadLayerNorm(int64_t heads, int64_t dim, double eps, DType dt, bool module_per_head);
  Tensor forward(const Tensor& x);
  Tensor weight;                // [heads, dim]; undefined with module_per_head
  std::vector<RMSNorm*> norms;  // module_per_head: head h's (its weight [dim])
  int64_t heads, dim;
  double eps;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num, int64_t dim, DType dt = DType::F32);
  Tensor forward(const Tensor& ids);
  Tensor weight;  // [num, dim]
};

// Inverted dropout whose mask seed is mix(step seed, hash of this module's path): a replayed step
// with the same step seed regenerates every mask. Identity in eval mode or with p == 0.
class Dropout : public Module {
 public:
  explicit Dropout(double p);
  Tensor forward(const Tensor& x);
  // The seed of this call's mask: the step's seed mixed with the module's path (so the mask does
  // not depend on how many models were built). LoRA's fused input path draws the same mask.
  uint64_t mask_seed() const;
  double p;
  static void set_step_seed(uint64_t seed);  // the trainer sets it per micro-batch
  static uint64_t step_seed();               // a checkpointed segment's recompute reuses it
};

// The mask seed of a dropout at module path `path` in this micro-batch: the step's seed mixed with
// a hash of the path (Dropout::mask_seed's). An op that drops inside itself (the attention's
// probabilities, ops::AttentionDropout) draws it for a path of its own.
uint64_t dropout_mask_seed(const std::string& path);

// x + y with type promotion (a residual add of an f32 stream and a bf16 branch stays f32).
Tensor residual_add(const Tensor& x, const Tensor& y);

}  // namespace keel::nn
