// CUDA runtime: device probe, one stream per device, the caching allocator and the copies,
// conversions and fills that tensor/ reaches through DeviceRuntime.
//
// Allocator: plain cudaMalloc (never managed memory). Sizes are rounded (512 B below 1 MiB, 2 MiB
// above) and freed blocks wait in per-size free lists for the next request of the same rounded
// size: a training step asks for the same sizes every step, so after the first step nothing
// reaches the driver. Every kernel and copy runs on the device's one stream, so a block freed by
// the host can be handed out again at once: later work is queued after the work that used it.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "keel/backend/cuda/common.cuh"
#include "keel/backend/cuda_api.h"
#include "keel/tensor/device_runtime.h"

// Referenced by the link options of keel_backend (-Wl,--undefined): pulls this object, and with
// it the registration below, out of the static library into every executable.
extern "C" {
int keel_cuda_backend_anchor = 0;
}

namespace keel::cuda {

void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  throw Error(std::string(file) + ":" + std::to_string(line) + ": " + what + " failed: error " +
              std::to_string(static_cast<int>(e)) + " (" + cudaGetErrorName(e) + ": " +
              cudaGetErrorString(e) + ")");
}

const Status& status() {
  static const Status s = [] {
    Status st;
    st.built = true;
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      // Error 35 (insufficient driver) on a machine without a driver, 100 without a device: any
      // error means "use the CPU".
      st.reason = std::string("cudaGetDeviceCount: error ") + std::to_string(static_cast<int>(e)) +
                  " (" + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")";
      cudaGetLastError();  // clear the sticky-free error so later calls start clean
      return st;
    }
    if (n == 0) {
      st.reason = "cudaGetDeviceCount: no CUDA device";
      return st;
    }
    st.devices = n;
    st.usable = true;
    return st;
  }();
  return s;
}

namespace {

constexpr int kMaxDevices = 16;

void require_device(int device) {
  const Status& s = status();
  if (!s.usable)
    throw Error("cuda:" + std::to_string(device) + " is not usable: " + s.reason +
                    "; use run.device = \"cpu\"",
                Error::kUsage);
  if (device < 0 || device >= s.devices)
    throw Error("cuda:" + std::to_string(device) + " does not exist: this machine has " +
                    std::to_string(s.devices) +
                    " CUDA device(s) (cuda:0 .. cuda:" + std::to_string(s.devices - 1) + ")",
                Error::kUsage);
}

struct DeviceState {
  std::mutex mu;
  cudaStream_t stream = nullptr;
  std::map<size_t, std::vector<void*>> free_blocks;  // rounded size -> cached blocks
  MemStats stats;
};
DeviceState& state(int device) {
  // Never destroyed: tensors released during static destruction still find their cache.
  static DeviceState* states = new DeviceState[kMaxDevices];
  KEEL_CHECK(device >= 0 && device < kMaxDevices, "cuda: device index out of range");
  return states[device];
}

// Makes `device` current (cheap when it already is).
void use_device(int device) {
  require_device(device);
  int cur = -1;
  KEEL_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != device) KEEL_CUDA_CHECK(cudaSetDevice(device));
}

size_t round_size(size_t n) {
  constexpr size_t kSmall = 512, kLarge = size_t{2} << 20;
  if (n < (size_t{1} << 20)) return (n + kSmall - 1) / kSmall * kSmall;
  return (n + kLarge - 1) / kLarge * kLarge;
}

void free_cached(DeviceState& s) {  // with s.mu held and the device current
  KEEL_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  for (auto& [size, blocks] : s.free_blocks)
    for (void* p : blocks) {
      KEEL_CUDA_CHECK(cudaFree(p));
      s.stats.reserved -= size;
    }
  s.free_blocks.clear();
}

cudaStream_t stream_of(int device) {
  DeviceState& s = state(device);
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.stream) KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  return s.stream;
}

std::string gib(size_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1u << 30));
  return buf;
}

void* rt_alloc(size_t nbytes, int device) {
  if (nbytes == 0) return nullptr;
  use_device(device);
  stream_of(device);
  DeviceState& s = state(device);
  const size_t size = round_size(nbytes);
  std::lock_guard<std::mutex> lock(s.mu);
  void* p = nullptr;
  auto it = s.free_blocks.find(size);
  if (it != s.free_blocks.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
  } else {
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation) {  // give the cache back to the driver, then retry
      cudaGetLastError();
      free_cached(s);
      e = cudaMalloc(&p, size);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw Error("CUDA out of memory on cuda:" + std::to_string(device) + " allocating " +
                  gib(size) + " (" + gib(s.stats.allocated) + " held by tensors, " +
                  gib(s.stats.reserved) + " reserved): " + cudaGetErrorString(e) +
                  "; lower train.batch_size or data.seq_len");
    }
    s.stats.reserved += size;
    ++s.stats.cuda_mallocs;
  }
  s.stats.allocated += size;
  if (s.stats.allocated > s.stats.peak) s.stats.peak = s.stats.allocated;
  return p;
}

void rt_release(void* p, size_t nbytes, int device) {
  if (!p) return;
  DeviceState& s = state(device);
  const size_t size = round_size(nbytes);
  std::lock_guard<std::mutex> lock(s.mu);
  s.free_blocks[size].push_back(p);
  s.stats.allocated -= size;
}

void rt_memset0(void* p, size_t nbytes, int device) {
  if (nbytes == 0) return;
  use_device(device);
  KEEL_CUDA_CHECK(cudaMemsetAsync(p, 0, nbytes, stream_of(device)));
  if (g_profiling) profile_mark("memset0");
}

void rt_copy(void* dst, Device dd, const void* src, Device sd, size_t nbytes) {
  if (nbytes == 0) return;
  const int dev = dd.is_cuda() ? dd.index : sd.index;
  use_device(dev);
  cudaStream_t st = stream_of(dev);
  if (dd.is_cuda() && sd.is_cuda() && dd.index != sd.index) {
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_of(sd.index)));
    KEEL_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dd.index, src, sd.index, nbytes, st));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(st));
    return;
  }
  const cudaMemcpyKind kind =
      dd.is_cuda() ? (sd.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                   : cudaMemcpyDeviceToHost;
  KEEL_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kind, st));
  if (g_profiling)
    profile_mark(kind == cudaMemcpyDeviceToDevice ? "copy device to device"
                 : kind == cudaMemcpyHostToDevice ? "copy host to device (synchronizes)"
                                                  : "copy device to host (synchronizes)");
  // To the host: the caller reads the buffer next. From the host: the source may be pageable
  // memory the caller frees next; synchronizing keeps both simple (batches are small).
  if (kind != cudaMemcpyDeviceToDevice) KEEL_CUDA_CHECK(cudaStreamSynchronize(st));
}

// Four elements per load and store when both addresses allow it (a bandwidth-bound kernel: the
// scalar 2-byte loads of a bf16 cast left a third of the bandwidth unused).
template <class TO, class TI, int V>
__global__ void convert_kernel(TO* out, const TI* in, int64_t n) {
  const int64_t nv = n / V;
  auto* vo = reinterpret_cast<Vec<TO, V>*>(out);
  auto* vi = reinterpret_cast<const Vec<TI, V>*>(in);
  KEEL_CUDA_FOR(i, nv) {
    const Vec<TI, V> x = vi[i];
    Vec<TO, V> y;
#pragma unroll
    for (int k = 0; k < V; ++k) st(&y.v[k], ld(&x.v[k]));
    vo[i] = y;
  }
  const int64_t tail = nv * V + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (tail < n) st(out + tail, ld(in + tail));
}

void rt_convert(void* out, DType odt, const void* in, DType idt, int64_t n, int device) {
  if (n <= 0) return;
  use_device(device);
  const bool vec = aligned_to(out, 4 * dtype_size(odt)) && aligned_to(in, 4 * dtype_size(idt));
  KEEL_CUDA_FLOAT_TYPES(odt, TO, KEEL_CUDA_FLOAT_TYPES(idt, TI, {
                          if (vec)
                            convert_kernel<TO, TI, 4>
                                <<<grid_for(n / 4 + 1), 256, 0, stream_of(device)>>>(
                                    static_cast<TO*>(out), static_cast<const TI*>(in), n);
                          else
                            convert_kernel<TO, TI, 1><<<grid_for(n), 256, 0, stream_of(device)>>>(
                                static_cast<TO*>(out), static_cast<const TI*>(in), n);
                        }));
  KEEL_CUDA_LAUNCHED();
}

template <class E>
__global__ void fill_kernel(E* p, E v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

void rt_fill(void* p, uint64_t pattern, size_t elem, int64_t n, int device) {
  if (n <= 0) return;
  use_device(device);
  cudaStream_t st = stream_of(device);
  switch (elem) {
    case 1:
      fill_kernel<<<grid_for(n), 256, 0, st>>>(static_cast<uint8_t*>(p), uint8_t(pattern), n);
      break;
    case 2:
      fill_kernel<<<grid_for(n), 256, 0, st>>>(static_cast<uint16_t*>(p), uint16_t(pattern), n);
      break;
    case 4:
      fill_kernel<<<grid_for(n), 256, 0, st>>>(static_cast<uint32_t*>(p), uint32_t(pattern), n);
      break;
    case 8:
      fill_kernel<<<grid_for(n), 256, 0, st>>>(static_cast<uint64_t*>(p), pattern, n);
      break;
    default:
      KEEL_CHECK(false, "cuda fill: element size " + std::to_string(elem));
  }
  KEEL_CUDA_LAUNCHED();
}

const DeviceRuntime kRuntime = {rt_alloc, rt_release, rt_memset0, rt_copy, rt_convert, rt_fill};

struct Register {
  Register() { register_cuda_runtime(&kRuntime); }
} g_register;

}  // namespace

Scratch::Scratch(size_t nbytes) : n_(nbytes), dev_(current_device()) {
  p_ = rt_alloc(nbytes, dev_);
}
Scratch::~Scratch() { rt_release(p_, n_, dev_); }

void read_back(void* host, const void* dev, size_t nbytes) {
  if (nbytes == 0) return;
  cudaStream_t st = stream();
  KEEL_CUDA_CHECK(cudaMemcpyAsync(host, dev, nbytes, cudaMemcpyDeviceToHost, st));
  if (g_profiling) profile_mark("read_back (synchronizes)");
  KEEL_CUDA_CHECK(cudaStreamSynchronize(st));
}

void convert_async(void* out, DType out_dt, const void* in, DType in_dt, int64_t n) {
  rt_convert(out, out_dt, in, in_dt, n, current_device());
}

int current_device() {
  int d = 0;
  KEEL_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}
cudaStream_t stream() { return stream_of(current_device()); }

int sm_count() {
  static int n[kMaxDevices] = {};
  const int d = current_device();
  if (n[d] == 0) KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&n[d], cudaDevAttrMultiProcessorCount, d));
  return n[d];
}

int compute_capability() {
  static int cc[kMaxDevices] = {};
  const int d = current_device();
  if (cc[d] == 0) {
    int major = 0, minor = 0;
    KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d));
    KEEL_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d));
    cc[d] = major * 10 + minor;
  }
  return cc[d];
}

std::string device_name(int device) {
  use_device(device);
  cudaDeviceProp p{};
  KEEL_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         gib(p.totalGlobalMem) + ")";
}

void synchronize(int device) {
  if (!status().usable) return;
  use_device(device);
  KEEL_CUDA_CHECK(cudaStreamSynchronize(stream_of(device)));
}

MemStats mem_stats(int device) {
  DeviceState& s = state(device);
  std::lock_guard<std::mutex> lock(s.mu);
  return s.stats;
}
void reset_peak(int device) {
  DeviceState& s = state(device);
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.peak = s.stats.allocated;
}
// ---- launch profile --------------------------------------------------------------------------

bool g_profiling = false;

namespace {

using host_clock = std::chrono::steady_clock;
struct Mark {
  std::string site;
  cudaEvent_t event;
  host_clock::time_point host;
};
std::vector<Mark> g_marks;
std::vector<cudaEvent_t> g_spare_events;

}  // namespace

void profile_mark(std::string site) {
  cudaEvent_t e;
  if (g_spare_events.empty()) {
    KEEL_CUDA_CHECK(cudaEventCreate(&e));
  } else {
    e = g_spare_events.back();
    g_spare_events.pop_back();
  }
  KEEL_CUDA_CHECK(cudaEventRecord(e, stream()));
  g_marks.push_back({std::move(site), e, host_clock::now()});
}

void profile_mark(const char* func, const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  profile_mark(std::string(func) + " (" + (base ? base + 1 : file) + ":" + std::to_string(line) +
               ")");
}

void profile_begin() {
  if (!status().usable) return;
  synchronize(current_device());
  g_profiling = true;
  profile_mark("begin");
}

std::vector<ProfileRow> profile_end() {
  if (!g_profiling) return {};
  g_profiling = false;
  synchronize(current_device());
  std::map<std::string, ProfileRow> rows;
  for (size_t i = 1; i < g_marks.size(); ++i) {
    ProfileRow& r = rows[g_marks[i].site];
    r.site = g_marks[i].site;
    float ms = 0;
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, g_marks[i - 1].event, g_marks[i].event));
    ++r.calls;
    r.device_ms += ms;
    r.host_ms +=
        std::chrono::duration<double, std::milli>(g_marks[i].host - g_marks[i - 1].host).count();
  }
  for (Mark& m : g_marks) g_spare_events.push_back(m.event);
  g_marks.clear();
  std::vector<ProfileRow> out;
  for (auto& [site, r] : rows) out.push_back(r);
  std::sort(out.begin(), out.end(),
            [](const ProfileRow& a, const ProfileRow& b) { return a.device_ms > b.device_ms; });
  return out;
}

void empty_cache(int device) {
  if (!status().usable) return;
  use_device(device);
  DeviceState& s = state(device);
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.stream) free_cached(s);
}

}  // namespace keel::cuda
