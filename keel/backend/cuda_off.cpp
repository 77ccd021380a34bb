// The CUDA runtime API in a build without the CUDA backend: never usable, and says why.
#ifndef KEEL_HAVE_CUDA
#include "keel/backend/cuda_api.h"
#include "keel/numerics/error.h"

namespace keel::cuda {

const Status& status() {
  static const Status s{false, false, 0,
                        "this build has no CUDA backend (configured with KEEL_CUDA=OFF or "
                        "without the CUDA toolkit)"};
  return s;
}
std::string device_name(int) { return "none"; }
void synchronize(int) {}
MemStats mem_stats(int) { return {}; }
size_t cublaslt_version() { return 0; }
void reset_peak(int) {}
void empty_cache(int) {}
void profile_begin() {}
std::vector<ProfileRow> profile_end() { return {}; }

}  // namespace keel::cuda
#endif
