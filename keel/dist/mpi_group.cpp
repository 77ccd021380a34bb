#include "keel/dist/mpi_group.h"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>

#include "keel/numerics/error.h"

namespace keel::dist {

namespace {

int g_users = 0;         // live MpiRuntime objects
bool g_we_init = false;  // this process called MPI_Init (and so must finalize)

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw Error(std::string("MPI: ") + what + " failed: " + std::string(msg, len));
}

}  // namespace

MpiRuntime::MpiRuntime() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (finalized)
    throw Error(
        "dist.backend = \"mpi\": MPI was already finalized in this process; it can be "
        "started once per process");
  if (!inited) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
      throw Error(
          "dist.backend = \"mpi\": MPI_Init_thread failed; launch with mpirun -np N keel "
          "train CONFIG (as root: mpirun --allow-run-as-root ...)");
    g_we_init = true;
  }
  ++g_users;
  // Errors come back as codes (turned into keel::Error), not as an abort deep inside MPI.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
}

MpiRuntime::~MpiRuntime() {
  if (--g_users == 0 && g_we_init) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
}

void MpiRuntime::broadcast(void* data, int bytes) {
  check(MPI_Bcast(data, bytes, MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast");
}

void MpiRuntime::abort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

namespace {

class MpiGroup final : public ProcessGroup {
 public:
  explicit MpiGroup(int64_t bucket_bytes) : ProcessGroup(bucket_bytes) {}
  int rank() const override { return mpi_.rank; }
  int world_size() const override { return mpi_.world; }
  std::string backend() const override { return "mpi"; }

  void all_reduce_sum_f32(float* v, size_t n) override {
    // MPI counts are ints: reduce in pieces below INT_MAX elements.
    for (size_t off = 0; off < n;) {
      const int c = static_cast<int>(std::min<size_t>(n - off, INT_MAX / 2));
      check(MPI_Allreduce(MPI_IN_PLACE, v + off, c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
            "MPI_Allreduce(sum of gradients)");
      off += static_cast<size_t>(c);
    }
  }
  void all_reduce_sum(double* v, size_t n) override {
    check(MPI_Allreduce(MPI_IN_PLACE, v, static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD),
          "MPI_Allreduce(sum)");
  }
  void all_reduce_max(double* v, size_t n) override {
    check(MPI_Allreduce(MPI_IN_PLACE, v, static_cast<int>(n), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
          "MPI_Allreduce(max)");
  }
  void all_gather(const double* in, size_t n, double* out) override {
    check(MPI_Allgather(in, static_cast<int>(n), MPI_DOUBLE, out, static_cast<int>(n), MPI_DOUBLE,
                        MPI_COMM_WORLD),
          "MPI_Allgather");
  }
  [[noreturn]] void abort(int code) override { mpi_.abort(code); }

 private:
  MpiRuntime mpi_;
};

}  // namespace

std::unique_ptr<ProcessGroup> make_mpi_group(int64_t bucket_bytes) {
  return std::make_unique<MpiGroup>(bucket_bytes);
}

}  // namespace keel::dist
