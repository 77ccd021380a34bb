// The underflow/overflow tracer (DESIGN §4, `[debug.underflow_overflow]`): HF's
// DebugUnderflowOverflow extended to backward, with the share of zeros, subnormals and near-max
// values, and with the module that PRODUCED the first non-finite value named.
//
// Forward: a pre hook and a post hook on every module under the root. Per call, one frame with the
// abs-min / abs-max of each local weight, each input and the output (HF's frame layout), plus
// keel's extra columns. Backward: an autograd node post-hook; one frame per node with its
// grad_output and each grad_input, attributed to the module that created the node (Node::scope);
// accumulation into a parameter's .grad gets a frame with the accumulated gradient.
//
// The producer of the first non-finite value is the module whose inputs (and weights) are finite
// and whose result is not:
//   - a module's post hook sees finite inputs and a non-finite output: that module (the innermost
//     one, since children finish first);
//   - a module's pre hook sees a non-finite input: nothing hooked produced it, so the parent module
//     that is still running made it in its own code (a residual add, attention between two
//     Linears): the parent is named, with the tensor "input[i] of <child>"; with no parent running
//     the value came in through the model's inputs;
//   - a local weight is non-finite: that module, tensor = the weight's name;
//   - backward: the node whose grad_output is finite and one of whose grad_inputs is not (tensor
//     "grad_input[i]"); a grad_output that is already non-finite came from summing finite
//     contributions (tensor "grad_output"); a parameter .grad that overflows while accumulating
//     micro-batches (tensor "<weight>.grad").
// Modules downstream only propagate and are never named. Masked attention scores never leave the
// attention op (it returns 0 for fully masked rows), so they are never seen, never reported.
//
// Cost: one pass of the backend's statistics kernel (monitor_kernels(device).stats) over each
// distinct tensor (an output that is the next module's input is measured once: stats are cached
// per tensor and version for the batch), no copies; frames are stored as numbers in a ring buffer
// and formatted only when written.
//
// Batch numbers are the trainer's step numbers (1-based, as in the console line and metrics.jsonl);
// the caller calls begin_batch before each step's forward.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "keel/nn/module.h"
#include "keel/numerics/dtype.h"
#include "keel/numerics/error.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/train/config.h"

namespace keel::monitor {

// [debug.underflow_overflow] (max_frames_to_save, trace_batch_nums: batches whose full frames are
// dumped even without a finding — unlike HF, detection stays on in traced batches, keel never
// hides a non-finite value —, abort_after_batch_num; `enabled` is the caller's business), and
// what the run decides:
struct TracerOptions : UnderflowOverflowConfig {
  // The compute dtype: subnormal / near-max are judged against it for f32 tensors (an f32 value
  // that will be rounded to f16 by the next product); a bf16/f16 tensor is judged against its own
  // format.
  DType format = DType::F32;
  // A GradScaler is on (16-mixed): non-finite gradients are the scaler's business (it skips the
  // step and backs off), so backward frames are recorded but never make a finding.
  bool scaler_handles_backward = false;
};

struct TracerFinding {
  bool found = false;
  std::string module;       // path of the module that PRODUCED the first non-finite value (its
                            // inputs finite, its output not), "" for the root
  std::string module_type;  // e.g. "Linear"
  std::string phase;        // "forward" or "backward"
  std::string tensor;       // "output", "grad_input[0]", "weight", ...
  int64_t batch = -1;       // batch number (optimizer step) it happened in
  std::string log_path;     // the log written
  std::string message;      // one line for the user
};

// Thrown from inside a hook (or begin_batch, for abort_after_batch_num) right after the log is
// written. The CLI maps it to exit code 3.
struct TracerStop : Error {
  TracerFinding finding;  // found == false when stopping for abort_after_batch_num
  explicit TracerStop(TracerFinding f) : Error(f.message), finding(std::move(f)) {}
};

// Attaches forward pre/post hooks to every module under `root` and an autograd node post-hook (on
// the constructing thread); detaches on destruction. Keeps the last max_frames_to_save frames in
// memory (ring buffer). `log_path` (normally out_dir/debug/underflow_overflow_rank{R}.log) is
// opened for appending, with its directory created, when there is something to write.
class UnderflowOverflowTracer {
 public:
  UnderflowOverflowTracer(nn::Module& root, TracerOptions opt, std::string log_path);
  ~UnderflowOverflowTracer();
  UnderflowOverflowTracer(const UnderflowOverflowTracer&) = delete;
  UnderflowOverflowTracer& operator=(const UnderflowOverflowTracer&) = delete;

  // The trainer/app calls this before each step's forward. Throws TracerStop when batch_num is past
  // abort_after_batch_num.
  void begin_batch(int64_t batch_num);
  const TracerFinding& finding() const;
  // When `stop_on_finding` (default true) the tracer throws TracerStop from inside the hook right
  // after writing the log; replay sets it false to collect the finding and continue (after a
  // finding the hooks do nothing more).
  void set_stop_on_finding(bool stop);

  int64_t batch() const;
  // The frames in the ring buffer, oldest first, formatted as in the log.
  std::vector<std::string> frames() const;
  const std::string& log_path() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::monitor
