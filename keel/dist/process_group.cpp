#include "keel/dist/process_group.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <thread>

#include "keel/dist/bucket.h"
#include "keel/dist/mpi_group.h"
#include "keel/numerics/error.h"

namespace keel::dist {

void ProcessGroup::all_reduce_grads(std::vector<Tensor>& grads) {
  const auto t0 = std::chrono::steady_clock::now();
  // Gradients on a GPU (run.device = cuda) go through host copies: correct with every group,
  // not fast (a device-side bucket path for NCCL is future work).
  std::vector<Tensor> host = grads;
  bool on_device = false;
  for (Tensor& g : host)
    if (g.defined() && !g.device().is_cpu()) g = g.to(Device::cpu()), on_device = true;
  // Each bucket's call names its place ("summing gradient bucket 2 of 5 at step 3"): the count
  // is the plan all_reduce_in_buckets follows.
  const std::string what = take_purpose();
  std::vector<int64_t> numels;
  for (const Tensor& g : host) numels.push_back(g.defined() ? g.numel() : 0);
  const size_t buckets =
      plan_buckets(numels,
                   std::max<int64_t>(1, bucket_bytes_ / static_cast<int64_t>(sizeof(float))))
          .size();
  size_t bucket = 0;
  all_reduce_in_buckets(
      host, bucket_bytes_,
      [&](float* v, size_t n) {
        set_purpose("summing gradient bucket " + std::to_string(++bucket) + " of " +
                    std::to_string(buckets) + (what.empty() ? "" : " " + what));
        all_reduce_sum_f32(v, n);
        ++buckets_;
        bytes_ += static_cast<int64_t>(n * sizeof(float));
      },
      staging_);
  if (on_device)
    for (size_t i = 0; i < grads.size(); ++i)
      if (grads[i].defined() && !grads[i].device().is_cpu()) grads[i].copy_from(host[i]);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void ProcessGroup::wait_for_rank_zero(const std::string& work) {
  try {
    set_purpose(rank() == 0 ? "meeting the other ranks after rank 0's " + work
                            : "waiting for rank 0's " + work);
    Collective::wait_for_rank_zero(work);
  } catch (const Error& e) {
    if (rank() == 0) throw;
    char limit[32];
    std::snprintf(limit, sizeof limit, "%g", timeout_s_);
    throw Error("rank 0's " + work + " (done by rank 0 alone) did not finish within " +
                    "dist.timeout_s = " + limit + " s; raise dist.timeout_s if it needs longer, " +
                    "or check rank 0's output if it hung",
                e.kind);
  }
}

void ProcessGroup::wait_until_done(const std::function<bool()>& done, const std::string& what,
                                   const std::string& purpose) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto nap = std::chrono::microseconds(20);
  for (int polls = 0;; ++polls) {
    if (done()) return;
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    if (waited > timeout_s_) {
      stuck_ = true;
      std::string others;
      for (int r = 0; r < world_size(); ++r)
        if (r != rank()) others += (others.empty() ? "" : ", ") + std::to_string(r);
      char limit[32];  // as set: 0.5 s was said as "0 s"
      std::snprintf(limit, sizeof limit, "%g", timeout_s_);
      throw Error(what + (purpose.empty() ? "" : " while " + purpose) +
                  " did not complete within dist.timeout_s = " + limit + " s on rank " +
                  std::to_string(rank()) + ": " +
                  (world_size() == 2 ? "rank " : "one or more of ranks ") + others +
                  " did not arrive (stopped, hung, or running a different config); check "
                  "that rank's output, or raise dist.timeout_s for slow steps");
    }
    if (polls > 200) {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(5000));
    }
  }
}

void stall_if_asked(int rank, const std::string& purpose, bool gradients) {
  static const int stalled = [] {
    const char* v = std::getenv("KEEL_TEST_STALL_RANK");
    return v && *v ? std::atoi(v) : -1;
  }();
  if (stalled != rank) return;
  const char* at = std::getenv("KEEL_TEST_STALL_AT");
  if (at && *at ? purpose.find(at) != std::string::npos : gradients)
    std::this_thread::sleep_for(std::chrono::hours(1));
}

void SingleGroup::all_gather(const double* in, size_t n, double* out) {
  if (n) std::memcpy(out, in, n * sizeof(double));
}

void SingleGroup::abort(int code) { std::exit(code); }

double error_hash(const std::string& message) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : message) h = (h ^ c) * 1099511628211ull;
  return static_cast<double>(h & ((uint64_t{1} << 52) - 1));
}

bool launched_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

namespace {
int env_int(std::initializer_list<const char*> names, int fallback) {
  for (const char* n : names)
    if (const char* v = std::getenv(n); v && *v) return std::atoi(v);
  return fallback;
}
}  // namespace

int launcher_rank() { return env_int({"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}, 0); }
int launcher_world_size() { return std::max(1, env_int({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1)); }

#ifndef KEEL_HAS_NCCL
bool nccl_available() { return false; }
int usable_gpus() { return 0; }
std::unique_ptr<ProcessGroup> make_nccl_group(int64_t) {
  throw Error(
      "dist.backend = \"nccl\": this keel was built without NCCL (configure with the CUDA "
      "toolkit and NCCL present and -DKEEL_NCCL=ON); use dist.backend = \"mpi\" on CPUs",
      Error::kUsage);
}
#else
bool nccl_available() { return true; }
#endif

std::unique_ptr<ProcessGroup> make_process_group(const std::string& backend, double bucket_mb) {
  if (!(bucket_mb > 0) || !std::isfinite(bucket_mb))
    throw Error("dist.bucket_mb = " + std::to_string(bucket_mb) + ": must be > 0", Error::kUsage);
  const auto bytes = static_cast<int64_t>(bucket_mb * 1e6);  // MB, as reference/ §5 measured
  if (backend == "single") return std::make_unique<SingleGroup>(bytes);
  if (backend == "mpi") return make_mpi_group(bytes);
  if (backend == "nccl") return make_nccl_group(bytes);
  if (backend == "auto")
    return launched_by_mpirun() ? make_mpi_group(bytes) : std::make_unique<SingleGroup>(bytes);
  throw Error("dist.backend = \"" + backend + "\": use auto, single, mpi or nccl", Error::kUsage);
}

}  // namespace keel::dist
