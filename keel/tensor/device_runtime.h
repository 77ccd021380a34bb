// DeviceRuntime: how tensor/ reaches device memory without depending on a backend (tensor/ sits
// above backend/). The CUDA backend registers one table at static initialization; a build without
// CUDA leaves it null and every cuda tensor request fails with a message saying so.
#pragma once
#include <cstddef>
#include <cstdint>

#include "keel/numerics/dtype.h"
#include "keel/tensor/device.h"

namespace keel {

struct DeviceRuntime {
  // Device memory from the caching allocator (throws keel::Error when the device is unusable or
  // out of memory); release returns it to the cache.
  void* (*alloc)(size_t nbytes, int device);
  void (*release)(void* p, size_t nbytes, int device);
  void (*memset0)(void* p, size_t nbytes, int device);
  // Copies between host and device or within devices. Ordered after all work queued on the
  // device; a copy to the host returns when the host buffer holds the data.
  void (*copy)(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes);
  // Conversion between floating dtypes on the device (exact RNE).
  void (*convert)(void* out, DType out_dt, const void* in, DType in_dt, int64_t n, int device);
  // Fills n elements of `elem` bytes with the bit pattern `pattern` (low bytes).
  void (*fill)(void* p, uint64_t pattern, size_t elem, int64_t n, int device);
};

// Null when this build has no CUDA backend.
const DeviceRuntime* cuda_runtime();
void register_cuda_runtime(const DeviceRuntime* rt);

}  // namespace keel
