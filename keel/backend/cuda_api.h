// The CUDA runtime as the rest of keel sees it: whether a usable GPU is present (and why not),
// synchronization, memory statistics. Declared without CUDA headers; implemented by
// backend/cuda/runtime.cu in a CUDA build and by backend/cuda_off.cpp otherwise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace keel::cuda {

struct Status {
  bool built = false;   // this build has the CUDA backend
  bool usable = false;  // built, the driver answers and at least one device is present
  int devices = 0;
  // Why not usable, in the runtime's words, e.g. "cudaGetDeviceCount: error 35
  // (cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version)".
  std::string reason;
};
// Probed once (cudaGetDeviceCount; any error means "use the CPU", not only cudaErrorNoDevice).
const Status& status();

std::string device_name(int device);  // "NVIDIA H200 (sm_90, 139 GiB)"
void synchronize(int device = 0);     // waits for all work queued on the device's stream

// The caching allocator's counters for one device (bytes).
struct MemStats {
  size_t allocated = 0;  // held by live tensors
  size_t peak = 0;       // high-water mark of `allocated` since the last reset
  size_t reserved = 0;   // obtained from cudaMalloc (allocated + cached)
  int64_t cuda_mallocs = 0;
};
MemStats mem_stats(int device = 0);
// cuBLASLt's version (e.g. 130100), loading the library (it is opened on first use, never at
// process start); 0 in a build without CUDA. Throws keel::Error when it cannot be loaded.
size_t cublaslt_version();
void reset_peak(int device = 0);
void empty_cache(int device = 0);  // returns cached blocks to the driver

// Launch profile, for finding where a step's time goes without a profiler: between
// profile_begin() and profile_end(), every kernel, copy, fill and matmul keel queues records a CUDA
// event after it. A site's device time is the time between its event and the one before: its own
// run time while the GPU is behind the host, that plus the GPU's idle wait when the host is behind.
// Host time is the host's time between the two launches. Rows are per launch site, largest first.
struct ProfileRow {
  std::string site;  // "norm_layer_norm (norm.cu:106)", "matmul bf16 16384x2304x768 NT"
  int64_t calls = 0;
  double device_ms = 0, host_ms = 0;
};
void profile_begin();
std::vector<ProfileRow> profile_end();  // synchronizes

}  // namespace keel::cuda
