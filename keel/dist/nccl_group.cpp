// The NCCL process group: one CUDA GPU per rank (local rank modulo the visible GPUs). Compiled
// only with KEEL_NCCL (CMake finds the CUDA toolkit and NCCL). Tensors still live on the host
// until the CUDA backend lands, so each collective stages its host buffer through one device
// buffer: copy in, NCCL collective on a private stream, copy out, synchronize. The unique id is
// broadcast over MPI when there is more than one rank; a 1-rank group still runs every
// collective through NCCL (that is how it is tested on a single GPU). A collective that a rank
// never joins leaves the others' NCCL kernels spinning on their GPUs: each rank waits for its
// stream by polling, to dist.timeout_s (ProcessGroup::wait_until_done, as MPI's requests), and a
// fault NCCL reports meanwhile (ncclCommGetAsyncError: a peer's process gone) ends the wait too.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "keel/dist/mpi_group.h"
#include "keel/numerics/error.h"

namespace keel::dist {

namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(std::string("NCCL group: ") + what + " failed: " + cudaGetErrorString(e) + " (" +
                std::to_string(static_cast<int>(e)) + ")");
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw Error(std::string("NCCL group: ") + what + " failed: " + ncclGetErrorString(r) +
                (ncclGetLastError(nullptr) ? std::string(" (") + ncclGetLastError(nullptr) + ")"
                                           : std::string()));
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

class NcclGroup final : public ProcessGroup {
 public:
  explicit NcclGroup(int64_t bucket_bytes) : ProcessGroup(bucket_bytes) {
    // A usable GPU first: anything but success (35 = driver too old or absent, 100 = no device)
    // means this machine cannot run the NCCL group, and that is one clear error.
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
      throw Error(std::string("dist.backend = \"nccl\" needs a CUDA GPU, and this machine has none "
                              "usable (cudaGetDeviceCount: ") +
                      (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") +
                      "); use dist.backend = \"mpi\" (CPU) or \"auto\"",
                  Error::kUsage);
    if (launched_by_mpirun()) mpi_.emplace();
    rank_ = mpi_ ? mpi_->rank : 0;
    world_ = mpi_ ? mpi_->world : 1;
    const int local = env_int("OMPI_COMM_WORLD_LOCAL_RANK", env_int("LOCAL_RANK", rank_));
    device_ = local % n;
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id;
    if (rank_ == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    if (mpi_) mpi_->broadcast(&id, sizeof id);
    nccl_check(ncclCommInitRank(&comm_, world_, id, rank_), "ncclCommInitRank");
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~NcclGroup() override {
    // A collective left pending by a deadline keeps its kernel spinning, and cudaFree would wait
    // for it: abort the communicator's work first.
    if (stuck_ && comm_) ncclCommAbort(comm_), comm_ = nullptr;
    if (buf_) cudaFree(buf_);
    if (stream_) cudaStreamDestroy(stream_);
    if (comm_) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return "nccl"; }

  void all_reduce_sum_f32(float* v, size_t n) override {
    const std::string purpose = take_purpose();
    stall_if_asked(rank_, purpose, true);
    // Pieces of at most one bucket: the device buffer never grows past it.
    const size_t cap = std::max<size_t>(1, static_cast<size_t>(bucket_bytes_) / sizeof(float));
    for (size_t off = 0; off < n; off += cap) {
      const size_t c = std::min(cap, n - off);
      collective(
          v + off, c * sizeof(float),
          [&](void* d) { return ncclAllReduce(d, d, c, ncclFloat32, ncclSum, comm_, stream_); },
          "ncclAllReduce(sum of gradients)", purpose);
    }
  }
  void all_reduce_sum(double* v, size_t n) override { reduce(v, n, ncclSum, "ncclAllReduce(sum)"); }
  void all_reduce_max(double* v, size_t n) override { reduce(v, n, ncclMax, "ncclAllReduce(max)"); }
  void all_gather(const double* in, size_t n, double* out) override {
    const std::string purpose = take_purpose();
    stall_if_asked(rank_, purpose, false);
    const size_t bytes = n * sizeof(double), total = bytes * static_cast<size_t>(world_);
    reserve(total);
    auto* d = static_cast<char*>(buf_);
    cuda_check(cudaMemcpyAsync(d + bytes * static_cast<size_t>(rank_), in, bytes,
                               cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync (host to device)");
    nccl_check(
        ncclAllGather(d + bytes * static_cast<size_t>(rank_), d, n, ncclFloat64, comm_, stream_),
        "ncclAllGather");
    cuda_check(cudaMemcpyAsync(out, d, total, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (device to host)");
    wait(std::string("ncclAllGather"), purpose);
  }
  std::vector<RankError> gather_errors(double hash, double time, double wait_s) override {
    if (!mpi_) return {{hash, time, stuck_}};
    return mpi_->gather_errors({hash, time, stuck_}, wait_s);
  }
  [[noreturn]] void abort(int code) override {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    if (mpi_) mpi_->abort(code);
    std::_Exit(code);
  }

 private:
  void reserve(size_t bytes) {
    if (bytes <= buf_bytes_) return;
    if (buf_) cuda_check(cudaFree(buf_), "cudaFree");
    buf_ = nullptr;
    cuda_check(cudaMalloc(&buf_, bytes), "cudaMalloc (staging buffer)");
    buf_bytes_ = bytes;
  }
  // In place: the element-wise `op` of n doubles across the ranks.
  void reduce(double* v, size_t n, ncclRedOp_t op, const char* what) {
    const std::string purpose = take_purpose();
    stall_if_asked(rank_, purpose, false);
    collective(
        v, n * sizeof(double),
        [&](void* d) { return ncclAllReduce(d, d, n, ncclFloat64, op, comm_, stream_); }, what,
        purpose);
  }
  template <class F>
  void collective(void* host, size_t bytes, F&& op, const std::string& what,
                  const std::string& purpose) {
    if (bytes == 0) return;
    reserve(bytes);
    cuda_check(cudaMemcpyAsync(buf_, host, bytes, cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync (host to device)");
    nccl_check(op(buf_), "ncclAllReduce");
    cuda_check(cudaMemcpyAsync(host, buf_, bytes, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (device to host)");
    wait(what, purpose);
  }
  // The stream's work done (the copy out of the collective's result), to dist.timeout_s.
  void wait(const std::string& what, const std::string& purpose) {
    wait_until_done(
        [&] {
          const cudaError_t e = cudaStreamQuery(stream_);
          if (e == cudaSuccess) return true;
          if (e != cudaErrorNotReady) cuda_check(e, "cudaStreamQuery");
          ncclResult_t async = ncclSuccess;
          nccl_check(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError");
          nccl_check(async, what.c_str());
          return false;
        },
        what, purpose);
  }

  std::optional<MpiRuntime> mpi_;
  int rank_ = 0, world_ = 1, device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* buf_ = nullptr;
  size_t buf_bytes_ = 0;
};

}  // namespace

int usable_gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::unique_ptr<ProcessGroup> make_nccl_group(int64_t bucket_bytes) {
  return std::make_unique<NcclGroup>(bucket_bytes);
}

}  // namespace keel::dist
