// Tensor: a shape, a dtype and a device over shared storage. Always contiguous row-major; views
// (reshape, a slice of the leading dimension) share storage and carry a byte offset.
//
// A Tensor is a handle: copies share the same TensorImpl, as in PyTorch. The autograd fields
// (requires_grad, grad, grad_fn) live here so that any layer can read them; only autograd/ and
// ops/ write them.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "keel/numerics/convert.h"
#include "keel/numerics/dtype.h"
#include "keel/numerics/error.h"
#include "keel/tensor/device.h"

namespace keel {

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 3, 4]"
// The multi-dimensional index of row-major flat position `flat` in `s` (what an error names).
Shape shape_index(const Shape& s, int64_t flat);

struct Node;  // autograd/node.h
struct TensorImpl;

// Raw memory of one device. Three kinds:
//  - owned (the first constructor): from host_memory (64-byte aligned) or the device allocator;
//  - external CPU memory (a view of a file mapping, io/safetensors.h): not owned; `keep_alive`
//    holds what keeps it valid and its deleter runs when the storage dies (a mapped tensor drops
//    its pages there). Aligned to what its creator checked (at least the element size);
//  - deferred (created under DeferStorage): nbytes known, data null until attach_storage().
struct Storage {
  void* data = nullptr;
  size_t nbytes = 0;
  Device device;
  std::shared_ptr<void> keep_alive;  // external memory only
  Storage(size_t nbytes, Device device);
  Storage(void* external, size_t nbytes, std::shared_ptr<void> keep_alive);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  bool external() const { return keep_alive != nullptr; }
  bool deferred() const { return !data && !keep_alive && nbytes > 0; }
  struct Deferred {};
  Storage(Deferred, size_t nbytes) : nbytes(nbytes), device(Device::cpu()) {}
};

// While alive on this thread, Tensor::empty/zeros/full make CPU tensors whose storage is deferred:
// shape and dtype without memory (PyTorch's meta tensors, accelerate's init_empty_weights). A model
// is built this way when its weights come from files: each parameter then gets the file's memory
// (attach_storage) instead of a freshly allocated and initialized copy. data() of a deferred tensor
// is an Error naming it.
class DeferStorage {
 public:
  DeferStorage();
  ~DeferStorage();
  DeferStorage(const DeferStorage&) = delete;
  DeferStorage& operator=(const DeferStorage&) = delete;
  static bool active();

 private:
  bool prev_;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Factories. `empty` leaves memory uninitialized.
  static Tensor empty(const Shape& shape, DType dt = DType::F32, Device dev = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dt = DType::F32, Device dev = Device::cpu());
  static Tensor full(const Shape& shape, float value, DType dt = DType::F32);
  // Values are rounded into `dt` (for a floating dt) or converted exactly (integer dt).
  static Tensor from_floats(const std::vector<float>& v, const Shape& shape, DType dt = DType::F32);
  static Tensor from_ints(const std::vector<int64_t>& v, const Shape& shape, DType dt = DType::I64);
  // A CPU tensor over memory it does not own (`data`, aligned to at least dtype_size(dt)), valid
  // while `keep_alive` lives; the storage holds it and releases it when the tensor's last view
  // dies.
  static Tensor from_external(void* data, const Shape& shape, DType dt,
                              std::shared_ptr<void> keep_alive);
  // A fresh tensor of the same dtype, shape and device (not part of any graph).
  static Tensor empty_like(const Tensor& t) { return empty(t.shape(), t.dtype(), t.device()); }
  static Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const;
  DType dtype() const;
  Device device() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype()); }

  void* data() const;
  template <class T>
  T* data_as() const {
    return static_cast<T*>(data());
  }

  // Storage views, outside autograd (ops/ wraps them with graph nodes).
  Tensor view(const Shape& shape) const;                // same numel; one dim may be -1
  Tensor slice_rows(int64_t begin, int64_t end) const;  // [begin, end) of the leading dim
  bool shares_storage(const Tensor& o) const;
  // Whether the memory is external (a file mapping) or not there yet (built under DeferStorage).
  bool is_external() const;
  bool is_deferred() const;
  // Rewrites this tensor's impl in place to hold `src`'s storage, offset and dtype (same shape):
  // every handle to it (module members, the parameter registry) sees the new memory. The old
  // storage is released when nothing else holds it. Outside autograd (grad is cleared).
  void attach_storage(const Tensor& src);

  // Copies, outside autograd.
  Tensor clone() const;
  Tensor to_dtype(DType dt) const;    // exact rounding (RNE) for floating targets
  Tensor to(Device dev) const;        // a copy on `dev` (shares nothing, even when dev is ours)
  void copy_from(const Tensor& src);  // same shape; converts dtype
  void fill(float value);
  void zero();  // every byte 0 (+0.0 in each floating dtype), in parallel chunks like zeros()
  std::vector<float> to_floats() const;  // any floating dtype, or integers converted
  std::vector<int64_t> to_ints() const;  // integer dtypes
  float item() const;                    // numel() == 1

  // Autograd state (see autograd/). Leaves that require grad accumulate into grad().
  bool requires_grad() const;
  Tensor& set_requires_grad(bool r);
  const Tensor& grad() const;
  Tensor& mutable_grad();
  void set_grad(Tensor g);
  void set_grad_home(Tensor home);  // see TensorImpl::grad_home
  const std::shared_ptr<Node>& grad_fn() const;
  bool is_leaf() const { return grad_fn() == nullptr; }

  // A diagnostic name (parameter name, or the op that produced it).
  const std::string& name() const;
  Tensor& set_name(std::string n);

  // Bumped by every in-place write through the optimizer; caches keyed on it (low-precision weight
  // copies under autocast) see that they are stale.
  uint64_t version() const;
  void bump_version();

  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  size_t offset = 0;  // bytes into storage
  Shape shape;
  DType dtype = DType::F32;
  uint64_t version = 0;
  std::string name;
  // autograd
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;           // the node that produced this tensor (non-leaves)
  std::shared_ptr<Node> grad_accumulator;  // leaves: the node that accumulates into grad
  // Leaves: where a fresh gradient is written (a view of a flat buffer, optim's use_flat_grads),
  // so that grad aliases it instead of adopting the backward's own tensor. Undefined: adopt.
  Tensor grad_home;
};

}  // namespace keel
