#include "keel/dist/mpi_group.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "keel/numerics/error.h"

namespace keel::dist {

namespace {

int g_users = 0;                    // live MpiRuntime objects
bool g_we_init = false;             // this process called MPI_Init (and so must finalize)
MPI_Comm g_errors = MPI_COMM_NULL;  // ranks compare their errors here (gather_errors)

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
  // Collective: every rank's first MpiRuntime (a group's, or a failed rank's that only compares
  // its error) makes it, first thing, so that the duplicates match.
  if (g_errors == MPI_COMM_NULL) check(MPI_Comm_dup(MPI_COMM_WORLD, &g_errors), "MPI_Comm_dup");
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
}

MpiRuntime::~MpiRuntime() {
  if (--g_users == 0 && g_we_init) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();  // frees g_errors (not freed before: a rank may still use it)
  }
}

void MpiRuntime::broadcast(void* data, int bytes) {
  check(MPI_Bcast(data, bytes, MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast");
}

std::vector<ProcessGroup::RankError> MpiRuntime::gather_errors(ProcessGroup::RankError mine,
                                                               double wait_s) {
  const double in[3] = {mine.hash, mine.time, mine.stuck ? 1.0 : 0.0};
  std::vector<double> all(3 * static_cast<size_t>(world));
  MPI_Request req;
  if (MPI_Iallgather(in, 3, MPI_DOUBLE, all.data(), 3, MPI_DOUBLE, g_errors, &req) != MPI_SUCCESS)
    return {};
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return {};
    if (done) {
      std::vector<ProcessGroup::RankError> r;
      for (size_t q = 0; q < static_cast<size_t>(world); ++q)
        r.push_back({all[3 * q], all[3 * q + 1], all[3 * q + 2] != 0});
      return r;
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > wait_s)
      return {};  // left pending: the caller ends the job
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
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
    const std::string purpose = take_purpose();
    stall_if_asked(mpi_.rank, purpose, true);
    // MPI counts are ints: reduce in pieces below INT_MAX elements.
    for (size_t off = 0; off < n;) {
      const int c = static_cast<int>(std::min<size_t>(n - off, INT_MAX / 2));
      MPI_Request req;
      check(MPI_Iallreduce(MPI_IN_PLACE, v + off, c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req),
            "MPI_Allreduce(sum of gradients)");
      wait(req, "MPI_Allreduce(sum of gradients)", purpose);
      off += static_cast<size_t>(c);
    }
  }
  void all_reduce_sum(double* v, size_t n) override {
    const std::string purpose = take_purpose();
    stall_if_asked(mpi_.rank, purpose, false);
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, v, static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD,
                         &req),
          "MPI_Allreduce(sum)");
    wait(req, "MPI_Allreduce(sum)", purpose);
  }
  void all_reduce_max(double* v, size_t n) override {
    const std::string purpose = take_purpose();
    stall_if_asked(mpi_.rank, purpose, false);
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, v, static_cast<int>(n), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD,
                         &req),
          "MPI_Allreduce(max)");
    wait(req, "MPI_Allreduce(max)", purpose);
  }
  void all_gather(const double* in, size_t n, double* out) override {
    const std::string purpose = take_purpose();
    stall_if_asked(mpi_.rank, purpose, false);
    MPI_Request req;
    check(MPI_Iallgather(in, static_cast<int>(n), MPI_DOUBLE, out, static_cast<int>(n), MPI_DOUBLE,
                         MPI_COMM_WORLD, &req),
          "MPI_Allgather");
    wait(req, "MPI_Allgather", purpose);
  }
  [[noreturn]] void abort(int code) override { mpi_.abort(code); }
  std::vector<RankError> gather_errors(double hash, double time, double wait_s) override {
    return mpi_.gather_errors({hash, time, stuck_}, wait_s);
  }

 private:
  // Waits for `req` (ProcessGroup::wait_until_done: dist.timeout_s).
  void wait(MPI_Request& req, const char* what, const std::string& purpose) {
    wait_until_done(
        [&] {
          int done = 0;
          check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what);
          return done != 0;
        },
        what, purpose);
  }

  MpiRuntime mpi_;
};

}  // namespace

std::unique_ptr<ProcessGroup> make_mpi_group(int64_t bucket_bytes) {
  return std::make_unique<MpiGroup>(bucket_bytes);
}

}  // namespace keel::dist
