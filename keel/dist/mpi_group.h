// The MPI process group (Open MPI from Debian): launched with
//   mpirun -np N keel train CONFIG
// (as root add --allow-run-as-root, or export OMPI_ALLOW_RUN_AS_ROOT=1 and
// OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1). Started without mpirun it is a 1-rank group (MPI singleton).
#pragma once
#include <memory>
#include <vector>

#include "keel/dist/process_group.h"

namespace keel::dist {

std::unique_ptr<ProcessGroup> make_mpi_group(int64_t bucket_bytes);
std::unique_ptr<ProcessGroup> make_nccl_group(int64_t bucket_bytes);

// For the NCCL group's bootstrap: MPI_Init once per process (thread level FUNNELED: only the main
// thread calls MPI; OpenMP workers never do), and MPI_Finalize when the last user lets go.
struct MpiRuntime {
  MpiRuntime();
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;
  int rank = 0, world = 1;
  // MPI_Bcast of `bytes` bytes from rank 0 over MPI_COMM_WORLD.
  void broadcast(void* data, int bytes);
  [[noreturn]] void abort(int code);
  // ProcessGroup::gather_errors over a duplicate of MPI_COMM_WORLD made at MPI_Init (so that it
  // never meets a collective of the training, which may be pending on the failed rank).
  std::vector<ProcessGroup::RankError> gather_errors(ProcessGroup::RankError mine, double wait_s);
};

}  // namespace keel::dist
