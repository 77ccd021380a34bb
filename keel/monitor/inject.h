// Fault injection (`[debug.inject]`): corrupts one module's output at one step, to exercise the
// instability toolkit (tracer, NaN capture, replay) on purpose in tests and demos.
//
// A forward post hook on the named module, active only in training mode (evaluation is never
// corrupted) and only during the configured step: every call of the module in that step (each
// micro-batch) has its output replaced by
//   nan:   output + d, d = NaN at element 0 and 0 elsewhere (one element becomes NaN),
//   inf:   the same with +inf,
//   scale: output * factor.
// The replacement is built from differentiable ops inside the module's scope, so backward still
// flows through it and its nodes are attributed to the module (the tracer names it).
//
// Attach the injector BEFORE the tracer: post hooks run in the order they were added, and the
// tracer must see the corrupted output to name the module as the producer.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "keel/nn/module.h"
#include "keel/train/config.h"

namespace keel::monitor {

// [debug.inject]: module (a path, e.g. "transformer.h.0.attn"), step (1-based, as the console
// line counts), kind (nan | inf | scale), factor (kind = scale); only_rank is the caller's.
using InjectOptions = InjectConfig;

class FaultInjector {
 public:
  // Throws Error (kUsage) naming the module path and listing the most similar existing paths when
  // the module does not exist, or when kind/factor are invalid.
  FaultInjector(nn::Module& root, InjectOptions opt);
  ~FaultInjector();
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  void begin_step(int64_t step);  // the trainer/app calls this before each step's forward
  int64_t injections() const { return injections_; }  // outputs corrupted so far
  const InjectOptions& options() const { return opt_; }

 private:
  void corrupt(nn::Module& m, Tensor& output);

  nn::Module* target_ = nullptr;
  InjectOptions opt_;
  int hook_ = 0;
  int64_t step_ = -1;
  int64_t injections_ = 0;
};

// Up to `max` module paths under `root` closest to `path` (edit distance), closest first.
std::vector<std::string> similar_module_paths(nn::Module& root, const std::string& path,
                                              size_t max = 5);

}  // namespace keel::monitor
