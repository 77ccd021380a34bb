// Process groups (DESIGN §1 dist/): the Collective interface of train/ implemented by
//   single  one process (no MPI);
//   mpi     Open MPI over shared memory or the network, CPU buffers (mpirun -np N keel train ...);
//   nccl    NCCL on CUDA GPUs, one GPU per rank; host buffers are staged through a device buffer
//           until the tensors live on the GPU. Built only with KEEL_NCCL (CUDA toolkit + NCCL).
// Gradients are summed in buckets of at most bucket_bytes (dist/bucket.h).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "keel/train/collective.h"

namespace keel::dist {

class ProcessGroup : public Collective {
 public:
  explicit ProcessGroup(int64_t bucket_bytes) : bucket_bytes_(bucket_bytes) {}
  // Buckets over all_reduce_sum_f32.
  void all_reduce_grads(std::vector<Tensor>& grads) override;
  void wait_for_rank_zero(const std::string& work) override;  // train/collective.h
  // In place: element-wise sum across ranks of n floats.
  virtual void all_reduce_sum_f32(float* v, size_t n) = 0;
  // Ends every rank of the job now with `code` (a rank that hit an error another rank did not
  // would otherwise leave it waiting in a collective forever). Does not return.
  [[noreturn]] virtual void abort(int code) = 0;
  // After an error on this rank: each rank that failed gives a hash of its message (error_hash)
  // and the time it failed (seconds since the epoch). Returns every rank's (rank r's at [r]) when
  // every rank arrived within wait_s seconds, nothing when one did not (it did not fail, or not
  // yet: this rank's error is its own). `stuck`: the rank's error was a deadline that left a
  // collective unfinished (the job must then be aborted, not finalized). Never meets a collective
  // of the training (a communicator of its own).
  struct RankError {
    double hash = 0, time = 0;
    bool stuck = false;
  };
  virtual std::vector<RankError> gather_errors(double hash, double time, double wait_s) {
    (void)hash, (void)time, (void)wait_s;
    return {};
  }
  int64_t bucket_bytes() const { return bucket_bytes_; }
  // dist.timeout_s: a collective that every rank has not joined within this many seconds is an
  // Error naming the collective and the ranks that may be missing (MPI), instead of a hang.
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  double timeout() const { return timeout_s_; }
  // Buckets reduced, f32 bytes summed and wall seconds spent in all_reduce_grads so far (waiting
  // for slower ranks included): what overlapping it with backward could save at most.
  int64_t buckets_reduced() const { return buckets_; }
  int64_t bytes_reduced() const { return bytes_; }
  double grad_reduce_seconds() const { return seconds_; }

 protected:
  // Polls `done` until it says the collective `what` (issued for `purpose`) completed, or
  // dist.timeout_s passes: then the group is stuck (the collective stays pending: the job can only
  // be aborted) and this is an Error naming the collective, this rank and the ranks that may not
  // have arrived. A waiting rank spins briefly (a collective of ranks in step finishes within
  // microseconds), then sleeps with a doubling backoff up to 5 ms, so that a rank left waiting
  // does not burn a core. Every group's collectives wait here (MPI's requests, NCCL's streams).
  void wait_until_done(const std::function<bool()>& done, const std::string& what,
                       const std::string& purpose);

  int64_t bucket_bytes_;
  double timeout_s_ = 600;
  bool stuck_ = false;  // a deadline left a collective pending (gather_errors' `stuck`)
  int64_t buckets_ = 0, bytes_ = 0;
  double seconds_ = 0;
  std::vector<float> staging_;
};

// `backend`: "auto" (mpi when launched by mpirun: OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK is
// set; else single), "single", "mpi" or "nccl". Errors (Error) name the backend and the fix: nccl
// in a build without NCCL or without a usable GPU, mpi when MPI cannot start.
std::unique_ptr<ProcessGroup> make_process_group(const std::string& backend, double bucket_mb);

// Testing only: KEEL_TEST_STALL_RANK=R makes rank R stop answering (sleep) before its first
// gradient all-reduce (`gradients`), as a hung or stopped rank would, so that tests see the others'
// deadline; with KEEL_TEST_STALL_AT=TEXT, before its first collective whose purpose contains TEXT
// instead. Every group calls it before each collective.
void stall_if_asked(int rank, const std::string& purpose, bool gradients);

// True when this process was started by mpirun (or another PMI launcher).
bool launched_by_mpirun();
// The launcher's rank and rank count for this process, from its environment, without starting
// MPI (for commands that run on one rank, such as keel doctor); 0 and 1 when not launched by it.
int launcher_rank();
int launcher_world_size();

// Whether this build has the NCCL group.
bool nccl_available();
// CUDA GPUs the NCCL group could use: cudaGetDeviceCount's count, 0 when it fails (35: no
// driver) or when this build has no NCCL.
int usable_gpus();

class SingleGroup final : public ProcessGroup {
 public:
  explicit SingleGroup(int64_t bucket_bytes = 25000000) : ProcessGroup(bucket_bytes) {}
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string backend() const override { return "single"; }
  void all_reduce_grads(std::vector<Tensor>&) override {}
  void all_reduce_sum_f32(float*, size_t) override {}
  void all_reduce_sum(double*, size_t) override {}
  void all_reduce_max(double*, size_t) override {}
  void all_gather(const double* in, size_t n, double* out) override;
  [[noreturn]] void abort(int code) override;
  std::vector<RankError> gather_errors(double hash, double time, double) override {
    return {{hash, time, false}};
  }
};

// A 52-bit hash of an error message (exact in a double), for gather_errors.
double error_hash(const std::string& message);

}  // namespace keel::dist
