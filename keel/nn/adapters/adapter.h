// Adapters on nn::Linear with PEFT's semantics and names: LoRA (lora.h), DoRA (dora.h), LoKr
// (lokr.h). An adapter is attached to a Linear through its hook (Linear::adapter) so that model
// code is unchanged; its parameters are registered on that Linear and are always f32, whatever the
// base dtype (DESIGN §2; PEFT's autocast_adapter_dtype).
//
// Dtype rule of PEFT's forward (tuners/lora/layer.py): result = base(x); the adapter path casts x
// to the adapter's dtype (f32), computes its update (its products still follow the autocast rule
// of linear), adds it to result in the wider dtype and casts the sum back to the output dtype.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "keel/nn/layers.h"

namespace keel::nn {

// The largest rank keel builds: the bound of the config key model.adapter.r and of a PEFT
// directory's r (a rank beyond any layer's width only multiplies memory).
inline constexpr int64_t kMaxAdapterRank = 65536;

struct AdapterOptions {
  std::string kind = "none";  // none | lora | dora | lokr
  int64_t r = 8;
  double alpha = 16;   // scaling = alpha / r
  double dropout = 0;  // LoRA/DoRA input dropout (PEFT's lora_dropout); LoKr: must be 0
  // Module names: a Linear is adapted when its path equals an entry or ends with "." + entry
  // (PEFT's rule for a list of names), e.g. "q_proj" or "self_attn.q_proj".
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};
  uint64_t seed = 0;  // initialization (per module: mixed with a hash of its path)
};

// What an adapted Linear runs. forward() returns the whole output (base + update).
class LinearAdapter {
 public:
  virtual ~LinearAdapter() = default;
  virtual const char* kind() const = 0;  // "lora", "dora", "lokr"
  virtual Tensor forward(Linear& base, const Tensor& x) = 0;
  // The weight the merged Linear holds, [out, in] f32 (LoRA: W + s·B·A; DoRA: m / ||W + s·B·A||_row
  // * (W + s·B·A); LoKr: W + s·kron(w1, w2)), from the current parameters.
  virtual Tensor merged_weight(const Linear& base) const = 0;
  // The adapter's parameters under PEFT's names relative to the Linear ("lora_A.weight").
  virtual std::vector<std::pair<std::string, Tensor>> peft_tensors() const = 0;
  double scaling = 1;   // alpha / r
  bool merged = false;  // merge_adapters() ran: forward is the base product only
};

// The parameters an adapter of `kind` (lora | dora | lokr) with rank r attaches to a Linear of
// in -> out features, without building it: PEFT's local names and shapes, in registration order
// (lora_A [r, in], lora_B [out, r]; DoRA adds lora_magnitude_vector [out]; LoKr lokr_w1 and
// lokr_w2 or lokr_w2_a/lokr_w2_b as the factorization gives). The adapters' constructors register
// exactly these (tests/nn checks them against built adapters); the memory estimate counts with it.
struct AdapterParamShape {
  std::string name;  // relative to the Linear, e.g. "lora_A.weight"
  Shape shape;
  int64_t numel() const;
};
std::vector<AdapterParamShape> adapter_parameter_shapes(const std::string& kind, int64_t r,
                                                        int64_t in, int64_t out);

// PEFT's target rule (apply_adapters uses it): the module path equals a target or ends with
// "." + target.
bool adapter_targets(const std::string& module_path, const std::vector<std::string>& targets);

// The options apply_adapters refuses before it looks at a model (kUsage, naming `source`'s keys):
// an unknown kind, r outside [1, kMaxAdapterRank], alpha <= 0, dropout outside [0, 1) or above 0
// for LoKr, no target modules. keel train's memory check runs it first: the estimate of a run that
// cannot start was noted as "no memory estimate" just before the run's own refusal.
void check_adapter_options(const AdapterOptions& opt, const std::string& source = "model.adapter");

// Attaches an adapter of opt.kind to every Linear under `root` that a target names, freezes every
// other parameter of the tree (requires_grad = false) and renames the tree (assign_paths). Returns
// the adapted module paths, in tree order. Errors (kUsage) name the problem and the fix: an
// unknown kind, r < 1, alpha <= 0, dropout outside [0, 1), a target that names no Linear (the
// message lists the Linear names the model has), a Linear that already has an adapter.
// `source` names where `opt` came from in messages: the config's model.adapter, or a PEFT
// directory's adapter_config.json (a GPT-2 model given a Llama adapter was told to fix
// model.adapter.target_modules, a key of no file the user gave).
std::vector<std::string> apply_adapters(Module& root, const AdapterOptions& opt,
                                        const std::string& source = "model.adapter");

// PEFT's merge: W <- merged_weight(), rounded to W's dtype, for every attached adapter not merged
// yet; forward then runs the merged base product only. Returns the number of merged modules.
int64_t merge_adapters(Module& root);

// Every adapted Linear under root, in tree order.
std::vector<Linear*> adapted_linears(Module& root);

// (name, tensor) of every adapter parameter under PEFT's adapter-file names:
// "base_model.model." + module path + "." + local name, e.g.
// "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".
std::vector<std::pair<std::string, Tensor>> peft_state_dict(Module& root);

// True when `t` (a parameter handle of the tree) belongs to an adapter.
bool is_adapter_parameter(Module& root, const Tensor& t);

// Stores every frozen floating parameter (requires_grad false) in `dt` (model.base_dtype),
// rewriting the shared TensorImpl in place so that every holder of the handle sees it. Adapter
// parameters are trainable and stay f32.
void cast_frozen_parameters(Module& root, DType dt);

// nn.init.kaiming_uniform_(w, a=sqrt(5)), nn.Linear's default and PEFT's lora_A init:
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = w.size(1).
void init_kaiming_uniform(Tensor& w, uint64_t seed);

// PEFT/LyCORIS factorization(dimension, factor=-1): the divisor pair (m, n), m <= n, m*n =
// dimension, found by walking divisors up to the square root.
std::pair<int64_t, int64_t> lokr_factorization(int64_t dimension, int64_t factor = -1);

}  // namespace keel::nn
