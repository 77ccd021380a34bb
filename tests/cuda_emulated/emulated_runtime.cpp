// The runtime calls of backend/cuda's kernel files (common.cuh), for their host builds: memory is
// the host's, the stream an ordered no-op (kernels run when launched), the device an sm_90.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/cuda_emulated/prelude.h"
#define cuda emucuda
#include "keel/backend/cuda/common.cuh"

namespace keel::emucuda {

// Every launch is recorded (the tests ask which kernels ran): the file of its site.
bool g_profiling = true;
std::vector<std::string>& launched_files() {
  static std::vector<std::string> files;
  return files;
}
void profile_mark(const char* func, const char* file, int) {  // "attention.cu attn_flash_forward"
  const char* base = std::strrchr(file, '/');
  launched_files().push_back(std::string(base ? base + 1 : file) + " " + func);
}
void profile_mark(std::string) {}
cudaStream_t stream() { return nullptr; }
int current_device() { return 0; }
int sm_count() { return 1; }  // (grids of at most 32 blocks: fewer to run)
int compute_capability() { return 90; }

void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  throw Error(std::string("emulated CUDA error ") + std::to_string(e) + " in " + what + " at " +
              file + ":" + std::to_string(line));
}

Scratch::Scratch(size_t nbytes) : n_(nbytes), dev_(0) {
  p_ = nbytes ? std::aligned_alloc(256, (nbytes + 255) / 256 * 256) : nullptr;
}
Scratch::~Scratch() { std::free(p_); }

void read_back(void* host, const void* dev, size_t nbytes) {
  if (nbytes) std::memcpy(host, dev, nbytes);
}
void convert_async(void* out, DType out_dt, const void* in, DType in_dt, int64_t n) {
  elementwise_kernels(Device::cpu()).convert(out, out_dt, in, in_dt, n);
}

}  // namespace keel::emucuda
