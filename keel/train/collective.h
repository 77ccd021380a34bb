// The collectives the Trainer needs to run data-parallel, as an interface: train/ sits above
// dist/, so the process groups (dist/: MPI, NCCL) implement it and the caller hands one to the
// Trainer. Without one the Trainer runs a single process (SingleCollective: every call is the
// identity).
//
// Every call is collective: every rank must make the same calls in the same order with the same
// sizes, in every branch of a step, or the run hangs. The Trainer is written so that it does
// (a rank with no micro-batch in a remainder window still joins every call, with zero gradients).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;  // "single", "mpi", "nccl"

  // Sums the gradients of every rank in place (step 3 of DESIGN §3): `grads` lists the same
  // tensors, same shapes and dtypes, in the same order on every rank. After it every rank holds
  // the same bits.
  virtual void all_reduce_grads(std::vector<Tensor>& grads) = 0;
  // In place over n doubles: element-wise sum / max across ranks.
  virtual void all_reduce_sum(double* v, size_t n) = 0;
  virtual void all_reduce_max(double* v, size_t n) = 0;
  // Each rank contributes n doubles; out receives world_size * n, rank r's at out[r * n].
  virtual void all_gather(const double* in, size_t n, double* out) = 0;
  // Every rank, after `work` rank 0 does alone ("evaluation at step 40"): returns once rank 0 has
  // arrived. A process group keeps dist.timeout_s's deadline here (a rank 0 hung in its file
  // system would otherwise hang the job), and its error names rank 0's work and the key to raise,
  // not a rank that "did not arrive (stopped, hung, ...)".
  virtual void wait_for_rank_zero(const std::string& work) {
    (void)work;
    double none = 0;
    all_reduce_max(&none, 1);
  }
  // What the next call is for, as its deadline error says it ("MPI_Allreduce(max) while agreeing
  // on non-finite gradients and stop requests at step 3"): the operation alone did not tell a
  // user which of a step's five collectives a rank never reached. Set by the call site just
  // before the call; the call consumes it, so a later call never inherits a stale purpose.
  void set_purpose(std::string purpose) { purpose_ = std::move(purpose); }

 protected:
  std::string take_purpose() { return std::exchange(purpose_, std::string()); }

 private:
  std::string purpose_;
};

// One process: rank 0 of 1; every collective leaves its input as it is.
class SingleCollective final : public Collective {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string backend() const override { return "single"; }
  void all_reduce_grads(std::vector<Tensor>&) override {}
  void all_reduce_sum(double*, size_t) override {}
  void all_reduce_max(double*, size_t) override {}
  void all_gather(const double* in, size_t n, double* out) override;
};

// Data sharding (DESIGN §3, distributed). A step's global window is the next
// min(grad_accum * world, left) micro-batches of the epoch's global order, starting at `first`;
// rank r takes micro-batches first + r, first + r + W, first + r + 2W, ... of it. So the ranks
// never overlap, together they cover the window exactly, and a 1-rank run with
// grad_accum * world sees the same examples in the same steps. In a remainder window
// (count < W * grad_accum) some ranks may get fewer micro-batches, or none.
std::vector<int64_t> rank_micro_batches(int64_t first, int64_t count, int rank, int world);

// One value every rank must agree on, for check_rank_consistency. Compared bit for bit.
struct RankCheckValue {
  std::string name;  // "loss_scale"
  double value = 0;
  bool hex = false;  // print as the 16 hex digits of its bits (a checksum)
};

// All-gathers the values and throws Error naming every value that differs, with each rank's
// value ("step 100: ranks disagree: loss_scale is 65536 on rank 0 but 32768 on rank 1"). Every
// rank gets the same verdict, so every rank throws together (no hang).
void check_rank_consistency(Collective& c, int64_t step, const std::vector<RankCheckValue>& values);

// A 64-bit hash of the raw bytes of the tensors (in order), as a double holding its bits (for
// check_rank_consistency with hex = true). Word-wise, so it costs about one read of the memory.
double tensors_checksum(const std::vector<Tensor>& ts);

}  // namespace keel
