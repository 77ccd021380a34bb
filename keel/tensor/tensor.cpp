#include "keel/tensor/tensor.h"

#include "keel/numerics/checked.h"
#include "keel/tensor/device_runtime.h"
#include "keel/tensor/host_memory.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace keel {

Device device_from_string(std::string_view s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.substr(0, 5) == "cuda:") {
    try {
      return Device::cuda(std::stoi(std::string(s.substr(5))));
    } catch (...) {
    }
  }
  throw Error("unknown device '" + std::string(s) + "': use cpu, cuda or cuda:N", Error::kUsage);
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s)
    if (d < 0 || __builtin_mul_overflow(n, d, &n))
      throw Error("shape " + shape_str(s) + " has a negative size or more than 2^63 elements");
  return n;
}

Shape shape_index(const Shape& s, int64_t flat) {
  Shape idx(s.size(), 0);
  for (size_t k = s.size(); k-- > 0;) {
    idx[k] = s[k] ? flat % s[k] : 0;
    flat = s[k] ? flat / s[k] : 0;
  }
  return idx;
}

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

namespace {
// fn(offset, length) over [0, n) bytes, one contiguous 64-byte-aligned chunk per OpenMP thread
// from 4 MB up: a serial memset or memcpy of a 154 MB buffer (an embedding gradient) otherwise
// leaves the other cores waiting.
template <class F>
void over_byte_chunks(size_t n, F&& fn) {
  if (n < (size_t{4} << 20) || omp_get_max_threads() == 1 || omp_in_parallel()) return fn(0, n);
#pragma omp parallel
  {
    const size_t nt = static_cast<size_t>(omp_get_num_threads());
    const size_t chunk = (n / nt + 63) / 64 * 64,
                 lo = chunk * static_cast<size_t>(omp_get_thread_num());
    if (lo < n) fn(lo, std::min(chunk, n - lo));
  }
}
void fill_zero(void* dst, size_t n) {
  over_byte_chunks(
      n, [&](size_t lo, size_t len) { std::memset(static_cast<char*>(dst) + lo, 0, len); });
}
void copy_bytes(void* dst, const void* src, size_t n) {  // dst and src do not overlap
  over_byte_chunks(n, [&](size_t lo, size_t len) {
    std::memcpy(static_cast<char*>(dst) + lo, static_cast<const char*>(src) + lo, len);
  });
}

const DeviceRuntime* g_cuda_runtime = nullptr;  // set by backend/cuda at static initialization

const DeviceRuntime& runtime_for(Device dev) {
  if (!g_cuda_runtime)
    throw Error("a tensor on " + dev.str() +
                    " needs the CUDA backend, which this build lacks (configure with "
                    "-DKEEL_CUDA=ON on a machine with the CUDA toolkit); use the cpu device",
                Error::kUsage);
  return *g_cuda_runtime;
}
}  // namespace

const DeviceRuntime* cuda_runtime() { return g_cuda_runtime; }
void register_cuda_runtime(const DeviceRuntime* rt) { g_cuda_runtime = rt; }

Storage::Storage(size_t n, Device dev) : nbytes(n), device(dev) {
  if (dev.is_cuda()) {
    data = runtime_for(dev).alloc(n, dev.index);
    return;
  }
  data = host_memory::allocate(n);
}

Storage::Storage(void* external, size_t n, std::shared_ptr<void> keep)
    : data(external), nbytes(n), device(Device::cpu()), keep_alive(std::move(keep)) {
  KEEL_CHECK(keep_alive, "external storage needs a keep-alive owner");
}

Storage::~Storage() {
  if (keep_alive || !data) return;  // external (keep_alive's deleter releases it) or deferred
  if (device.is_cuda()) {
    if (g_cuda_runtime) g_cuda_runtime->release(data, nbytes, device.index);
    return;
  }
  host_memory::release(data, nbytes);
}

namespace {
thread_local bool t_defer_storage = false;
}  // namespace

DeferStorage::DeferStorage() : prev_(t_defer_storage) { t_defer_storage = true; }
DeferStorage::~DeferStorage() { t_defer_storage = prev_; }
bool DeferStorage::active() { return t_defer_storage; }

static const TensorImpl& need(const std::shared_ptr<TensorImpl>& p) {
  KEEL_CHECK(p, "use of an undefined tensor");
  return *p;
}

Tensor Tensor::empty(const Shape& shape, DType dt, Device dev) {
  for (int64_t d : shape) KEEL_CHECK(d >= 0, "negative dimension in " + shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  const size_t n =
      checked_mul(shape_numel(shape), static_cast<int64_t>(dtype_size(dt)), "tensor bytes");
  if (t_defer_storage && dev.is_cpu() && n > 0)
    impl->storage = std::make_shared<Storage>(Storage::Deferred{}, n);
  else
    impl->storage = std::make_shared<Storage>(n, dev);
  impl->shape = shape;
  impl->dtype = dt;
  return Tensor(std::move(impl));
}

Tensor Tensor::from_external(void* data, const Shape& shape, DType dt,
                             std::shared_ptr<void> keep_alive) {
  KEEL_CHECK(
      reinterpret_cast<uintptr_t>(data) % dtype_size(dt) == 0,
      "from_external: address not aligned to the element size of " + std::string(dtype_name(dt)));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(
      data, checked_mul(shape_numel(shape), static_cast<int64_t>(dtype_size(dt)), "tensor bytes"),
      std::move(keep_alive));
  impl->shape = shape;
  impl->dtype = dt;
  return Tensor(std::move(impl));
}

bool Tensor::is_external() const { return need(impl_).storage->external(); }
bool Tensor::is_deferred() const { return need(impl_).storage->deferred(); }

void Tensor::attach_storage(const Tensor& src) {
  TensorImpl& i = *impl_;
  KEEL_CHECK(src.shape() == i.shape, "attach_storage: shape " + shape_str(src.shape()) +
                                         " for a tensor of shape " + shape_str(i.shape));
  i.storage = src.impl()->storage;
  i.offset = src.impl()->offset;
  i.dtype = src.dtype();
  i.grad = Tensor();
  ++i.version;
}

Tensor Tensor::zeros(const Shape& shape, DType dt, Device dev) {
  Tensor t = empty(shape, dt, dev);
  if (t.is_deferred()) return t;
  t.zero();
  return t;
}

void Tensor::zero() {
  if (device().is_cuda())
    runtime_for(device()).memset0(data(), nbytes(), device().index);
  else
    fill_zero(data(), nbytes());
}

Tensor Tensor::full(const Shape& shape, float value, DType dt) {
  Tensor t = empty(shape, dt);
  if (t.is_deferred()) return t;
  t.fill(value);
  return t;
}

Tensor Tensor::from_floats(const std::vector<float>& v, const Shape& shape, DType dt) {
  KEEL_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape),
             "from_floats: " + std::to_string(v.size()) + " values for shape " + shape_str(shape));
  Tensor t = empty(shape, dt);
  const int64_t n = t.numel();
  if (n == 0) return t;  // an empty vector may hold no buffer
  // The buffer and the dtype are looked up once, not per element: these loops run over whole
  // weights (fill_normal, checkpoints), and Tensor::data() checks the storage at each call.
  void* out = t.data();
  switch (dt) {
    case DType::F32:
      std::memcpy(out, v.data(), n * 4);
      break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) store_f32(static_cast<bf16_t*>(out) + i, v[i]);
      break;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) store_f32(static_cast<f16_t*>(out) + i, v[i]);
      break;
    case DType::I32:
      for (int64_t i = 0; i < n; ++i) static_cast<int32_t*>(out)[i] = static_cast<int32_t>(v[i]);
      break;
    case DType::I64:
      for (int64_t i = 0; i < n; ++i) static_cast<int64_t*>(out)[i] = static_cast<int64_t>(v[i]);
      break;
    case DType::U8:
      for (int64_t i = 0; i < n; ++i) static_cast<uint8_t*>(out)[i] = static_cast<uint8_t>(v[i]);
      break;
  }
  return t;
}

Tensor Tensor::from_ints(const std::vector<int64_t>& v, const Shape& shape, DType dt) {
  KEEL_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape),
             "from_ints: " + std::to_string(v.size()) + " values for shape " + shape_str(shape));
  Tensor t = empty(shape, dt);
  const int64_t n = t.numel();
  if (n == 0) return t;
  KEEL_CHECK(dt == DType::I32 || dt == DType::I64 || dt == DType::U8,
             "from_ints: integer dtype required");
  void* out = t.data();
  for (int64_t i = 0; i < n; ++i) {
    if (dt == DType::I32)
      static_cast<int32_t*>(out)[i] = static_cast<int32_t>(v[i]);
    else if (dt == DType::I64)
      static_cast<int64_t*>(out)[i] = v[i];
    else
      static_cast<uint8_t*>(out)[i] = static_cast<uint8_t>(v[i]);
  }
  return t;
}

const Shape& Tensor::shape() const { return need(impl_).shape; }
int64_t Tensor::numel() const { return shape_numel(shape()); }
DType Tensor::dtype() const { return need(impl_).dtype; }
Device Tensor::device() const { return need(impl_).storage->device; }

int64_t Tensor::size(int64_t d) const {
  const int64_t n = dim();
  if (d < 0) d += n;
  KEEL_CHECK(d >= 0 && d < n,
             "dimension " + std::to_string(d) + " out of range for " + shape_str(shape()));
  return shape()[d];
}

void* Tensor::data() const {
  const TensorImpl& i = need(impl_);
  if (!i.storage->data && i.storage->deferred())
    throw Error("tensor '" + i.name +
                "' has no memory yet: the model was built for loading and this weight was never "
                "attached (a bug in the loader)");
  return static_cast<char*>(i.storage->data) + i.offset;
}

Tensor Tensor::view(const Shape& s) const {
  Shape out = s;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      KEEL_CHECK(infer < 0, "view: more than one -1 in " + shape_str(s));
      infer = static_cast<int64_t>(i);
    } else {
      known *= out[i];
    }
  }
  if (infer >= 0) out[infer] = known ? numel() / known : 0;
  KEEL_CHECK(shape_numel(out) == numel(),
             "view: cannot view " + shape_str(shape()) + " as " + shape_str(s));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = impl_->storage;
  impl->offset = impl_->offset;
  impl->shape = out;
  impl->dtype = impl_->dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  KEEL_CHECK(dim() >= 1 && 0 <= begin && begin <= end && end <= shape()[0],
             "slice_rows [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " +
                 shape_str(shape()));
  const int64_t row = numel() / std::max<int64_t>(shape()[0], 1);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = impl_->storage;
  impl->offset = impl_->offset + static_cast<size_t>(begin * row) * dtype_size(dtype());
  impl->shape = shape();
  impl->shape[0] = end - begin;
  impl->dtype = impl_->dtype;
  return Tensor(std::move(impl));
}

bool Tensor::shares_storage(const Tensor& o) const {
  return defined() && o.defined() && impl_->storage == o.impl_->storage;
}

Tensor Tensor::clone() const { return to(device()); }

Tensor Tensor::to(Device dev) const {
  Tensor t = empty(shape(), dtype(), dev);
  if (nbytes() == 0) return t;
  if (dev.is_cpu() && device().is_cpu())
    copy_bytes(t.data(), data(), nbytes());
  else
    runtime_for(dev.is_cuda() ? dev : device()).copy(t.data(), dev, data(), device(), nbytes());
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  KEEL_CHECK(src.numel() == numel(),
             "copy_from: " + shape_str(src.shape()) + " into " + shape_str(shape()));
  if (device().is_cuda() || src.device().is_cuda()) {
    if (nbytes() == 0 && src.nbytes() == 0) return;
    if (src.dtype() == dtype()) {
      runtime_for(device().is_cuda() ? device() : src.device())
          .copy(data(), device(), src.data(), src.device(), nbytes());
      return;
    }
    KEEL_CHECK(dtype_is_floating(dtype()) && dtype_is_floating(src.dtype()),
               "copy_from: conversion between integer and floating tensors");
    // Convert on the device that holds the destination (after moving the source there).
    const Tensor s = src.device() == device() ? src : src.to(device());
    if (device().is_cuda()) {
      runtime_for(device()).convert(data(), dtype(), s.data(), s.dtype(), numel(), device().index);
    } else {
      copy_from(s);
    }
    return;
  }
  if (src.dtype() == dtype()) {
    if (src.data() == data()) return;
    const char *d = static_cast<const char*>(data()), *s = static_cast<const char*>(src.data());
    if (d + nbytes() <= s || s + nbytes() <= d)
      copy_bytes(data(), src.data(), nbytes());
    else
      std::memmove(data(), src.data(), nbytes());  // overlapping views of one storage
    return;
  }
  KEEL_CHECK(dtype_is_floating(dtype()) && dtype_is_floating(src.dtype()),
             "copy_from: conversion between integer and floating tensors");
  // Element by element through f32 (exact from bf16/f16, rounded to nearest-even into a 16-bit
  // destination), split over the OpenMP threads: the same bits as the backend's convert kernel.
  const int64_t n = numel();
  auto convert = [n](auto* dst, const auto* from) {
#pragma omp parallel for schedule(static) if (n >= (int64_t{1} << 16) && !omp_in_parallel())
    for (int64_t i = 0; i < n; ++i) store_f32(dst + i, load_f32(from + i));
  };
  auto from_src = [&](auto* dst) {
    switch (src.dtype()) {
      case DType::F32:
        return convert(dst, src.data_as<float>());
      case DType::BF16:
        return convert(dst, src.data_as<bf16_t>());
      case DType::F16:
        return convert(dst, src.data_as<f16_t>());
      default:
        return;
    }
  };
  switch (dtype()) {
    case DType::F32:
      return from_src(data_as<float>());
    case DType::BF16:
      return from_src(data_as<bf16_t>());
    case DType::F16:
      return from_src(data_as<f16_t>());
    default:
      return;
  }
}

Tensor Tensor::to_dtype(DType dt) const {
  if (dt == dtype()) return clone();
  Tensor t = empty(shape(), dt, device());
  t.copy_from(*this);
  return t;
}

void Tensor::fill(float value) {
  const int64_t n = numel();
  if (device().is_cuda()) {
    // The element's bits computed here, replicated on the device.
    Tensor one = Tensor::empty({1}, dtype());
    one.fill(value);
    uint64_t pattern = 0;
    std::memcpy(&pattern, one.data(), dtype_size(dtype()));
    runtime_for(device()).fill(data(), pattern, dtype_size(dtype()), n, device().index);
    return;
  }
  if (n == 0) return;
  void* out = data();  // once (see from_floats)
  switch (dtype()) {
    case DType::F32:
      std::fill_n(static_cast<float*>(out), n, value);
      break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) store_f32(static_cast<bf16_t*>(out) + i, value);
      break;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) store_f32(static_cast<f16_t*>(out) + i, value);
      break;
    case DType::I32:
      std::fill_n(static_cast<int32_t*>(out), n, static_cast<int32_t>(value));
      break;
    case DType::I64:
      std::fill_n(static_cast<int64_t*>(out), n, static_cast<int64_t>(value));
      break;
    case DType::U8:
      std::fill_n(static_cast<uint8_t*>(out), n, static_cast<uint8_t>(value));
      break;
  }
}

std::vector<float> Tensor::to_floats() const {
  if (device().is_cuda()) return to(Device::cpu()).to_floats();
  const int64_t n = numel();
  std::vector<float> v(n);
  if (n == 0) return v;
  const void* in = data();  // once (see from_floats)
  switch (dtype()) {
    case DType::F32:
      std::memcpy(v.data(), in, n * 4);
      break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) v[i] = load_f32(static_cast<const bf16_t*>(in) + i);
      break;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) v[i] = load_f32(static_cast<const f16_t*>(in) + i);
      break;
    case DType::I32:
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<const int32_t*>(in)[i]);
      break;
    case DType::I64:
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<const int64_t*>(in)[i]);
      break;
    case DType::U8:
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<const uint8_t*>(in)[i]);
      break;
  }
  return v;
}

std::vector<int64_t> Tensor::to_ints() const {
  if (device().is_cuda()) return to(Device::cpu()).to_ints();
  const DType dt = dtype();
  const int64_t n = numel();
  std::vector<int64_t> v(n);
  if (n == 0) return v;
  KEEL_CHECK(dt == DType::I32 || dt == DType::I64 || dt == DType::U8,
             "to_ints: integer dtype required");
  const void* in = data();
  for (int64_t i = 0; i < n; ++i)
    v[i] = dt == DType::I32   ? static_cast<const int32_t*>(in)[i]
           : dt == DType::I64 ? static_cast<const int64_t*>(in)[i]
                              : static_cast<const uint8_t*>(in)[i];
  return v;
}

float Tensor::item() const {
  KEEL_CHECK(numel() == 1, "item() of a tensor with shape " + shape_str(shape()));
  return to_floats()[0];
}

bool Tensor::requires_grad() const { return impl_ && impl_->requires_grad; }
Tensor& Tensor::set_requires_grad(bool r) {
  need(impl_);
  impl_->requires_grad = r;
  return *this;
}
const Tensor& Tensor::grad() const { return need(impl_).grad; }
Tensor& Tensor::mutable_grad() {
  need(impl_);
  return impl_->grad;
}
void Tensor::set_grad(Tensor g) {
  need(impl_);
  impl_->grad = std::move(g);
}
void Tensor::set_grad_home(Tensor home) {
  need(impl_);
  KEEL_CHECK(!home.defined() ||
                 (home.numel() == numel() && home.dtype() == dtype() && home.device() == device()),
             "set_grad_home: the home must match the tensor's numel, dtype and device");
  impl_->grad_home = std::move(home);
}
const std::shared_ptr<Node>& Tensor::grad_fn() const { return need(impl_).grad_fn; }
const std::string& Tensor::name() const { return need(impl_).name; }
Tensor& Tensor::set_name(std::string n) {
  need(impl_);
  impl_->name = std::move(n);
  return *this;
}
uint64_t Tensor::version() const { return need(impl_).version; }
void Tensor::bump_version() {
  need(impl_);
  ++impl_->version;
}

}  // namespace keel
