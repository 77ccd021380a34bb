// Optimizer base, parameter groups and the HF weight-decay grouping rule.
//
// An optimizer owns its state tensors (one set per parameter, in the parameter's dtype, created at
// construction) and updates every parameter that has a gradient with one fused kernel pass
// (backend/optim.h), then bumps the parameter's version so autocast's cached low-precision copies
// are refreshed. Parameters without a gradient are skipped and keep their per-parameter step, as
// in PyTorch.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::optim {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

struct ParamGroup {
  std::vector<Tensor> params;
  std::vector<std::string> names;  // one per param (state keys); empty: the tensors' own names
  double weight_decay = 0.0;
  double lr_scale = 1;  // this group's lr = step(lr) * lr_scale
};

// HF Trainer's rule: parameters whose name contains "bias", "norm" or "ln_" (GPT-2's ln_1, ln_2,
// ln_f), or with fewer than 2 dims, get no weight decay. Returns {decay group (weight_decay),
// no-decay group (0)}, both always present (possibly empty), in the order of `named_params`.
// Parameters that do not require grad (a frozen base under adapters) are left out.
std::vector<ParamGroup> make_param_groups(const NamedTensors& named_params, double weight_decay);

// What the last step() did to the stored weights, counted by the update kernels in their pass.
struct UpdateCounts {
  int64_t elements = 0;      // elements of the parameters updated (those with a gradient)
  int64_t rounded_away = 0;  // ... whose update was non-zero but left the stored bits unchanged
  double rounded_away_share() const {
    return elements > 0 ? static_cast<double>(rounded_away) / static_cast<double>(elements) : 0;
  }
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // One update of every parameter that has a gradient, with learning rate lr * group.lr_scale.
  // grad_scale (from clip_coefficient) multiplies every gradient first, as clip_grads would in
  // place; an optimizer that fuses it into its kernel (AdamW) leaves .grad unchanged.
  void step(double lr, float grad_scale = 1.f);
  // Drops every gradient (PyTorch's set_to_none): the next backward creates them afresh.
  void zero_grad();
  // Gives every parameter a home for its gradient in one flat buffer per dtype and device (the
  // layout of the state's): backward then writes a parameter's first gradient of a step there
  // (Node::grad_buffer: the weight-gradient kernels write it in place; anything else is copied)
  // and adds later ones in place, instead of adopting backward's own tensors. The same bits
  // either way. build_run turns it on (bench/README "Flat gradients": GPT-2 124M peak RSS and
  // step time unchanged); false drops the buffers (call zero_grad first).
  void use_flat_grads(bool on = true);
  // The flat gradient buffers (empty until use_flat_grads()).
  const std::vector<Tensor>& flat_grad_buffers() const { return grad_buffers_; }
  // A data-parallel step's zero gradient for `param`, one of this optimizer's parameters without
  // a gradient on this rank: written into its flat home when it has one (zero_grad leaves the
  // previous step's values there), so that the buffers stay whole.
  void zero_grad_of(Tensor& param);
  // True when flat buffers exist and every gradient that is defined lives in its home: the
  // buffers then hold all of this step's gradients (an all-reduce may sum them as offset ranges).
  bool grads_in_flat_buffers() const;

  // The state, by name: "<param>.<kind>" for each state kind (exp_avg, exp_avg_sq for AdamW;
  // momentum_buffer for SGD with momentum), "<param>.step" (i64 scalar: this parameter's update
  // count), and "step" (i64 scalar: step() calls). The state kinds are live views of the flat
  // buffers, not copies; the counts are a snapshot, views of one i64 buffer (load_state reads
  // them, so a caller may fill them in place: Trainer::load_checkpoint reads a checkpoint
  // straight into a state() result, then hands it to load_state).
  NamedTensors state() const;
  // Restores a state() result. Every entry must be present with the right shape and no other
  // entry may appear; any problem is an Error naming the entry, and nothing is changed.
  void load_state(const NamedTensors& state);

  int64_t step_count() const { return steps_; }
  // The last step()'s counts: in bf16-true most small updates round away (bf16 keeps 8 bits).
  const UpdateCounts& last_update() const { return last_update_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // The gradients of every parameter, in group order (undefined where a parameter has none):
  // handles, so GradScaler::unscale and clip_grads modify them in place.
  std::vector<Tensor> grads() const;

 protected:
  // kinds: the names of the per-parameter state tensors, e.g. {"exp_avg", "exp_avg_sq"}.
  Optimizer(std::vector<ParamGroup> groups, std::vector<std::string> kinds, const char* what);

  struct Slot {
    Tensor param;
    std::string name;
    size_t group = 0;
    int64_t step = 0;           // updates applied to this parameter
    std::vector<Tensor> state;  // one per kind, same shape and dtype as param
  };
  struct Update {
    double lr = 0, weight_decay = 0;
    size_t slot_index = 0;
    float grad_scale = 1.f;  // see step(); != 1 only when fuses_grad_scale()
    Tensor weight_copy;      // defined only when writes_weight_copy(): write round(p) into it
    int64_t* rounded_away = nullptr;  // the kernel's counter (AdamWStep::rounded_away)
  };
  // Updates one parameter whose gradient `g` is defined; slot.step is already incremented.
  virtual void update(Slot& slot, const Tensor& g, const Update& u) = 0;
  virtual bool fuses_grad_scale() const { return false; }
  // Whether update() can also refresh autocast's 16-bit copy of an f32 weight (amp::weight_copy)
  // in its pass, sparing the next step's cast a read of the weight.
  virtual bool writes_weight_copy(const Tensor& /*param*/) const { return false; }
  // Gives every slot its state (zeros, one tensor per kind) as views of shared flat buffers.
  void allocate_flat_state();
  // The flat layout: one buffer per (dtype, device) in slot order, every slot 64-byte aligned.
  struct FlatLayout {
    std::vector<std::pair<DType, Device>> buffers;
    std::vector<int64_t> elems;                     // per buffer
    std::vector<std::pair<size_t, int64_t>> where;  // per slot: (buffer, element offset)
  };
  FlatLayout flat_layout() const;

  std::vector<ParamGroup> groups_;
  std::vector<Slot> slots_;
  std::vector<std::string> kinds_;
  std::vector<Tensor> grad_buffers_;  // use_flat_grads()
  int64_t steps_ = 0;
  UpdateCounts last_update_;
  const char* what_;  // "AdamW" / "SGD" for messages
};

}  // namespace keel::optim
