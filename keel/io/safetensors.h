// safetensors read/write (the format HF models, PEFT adapters and keel checkpoints use):
// u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets},
// __metadata__}, then the raw little-endian data.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::io {

struct Safetensors {
  std::vector<std::pair<std::string, Tensor>> tensors;  // in file order
  std::map<std::string, std::string> metadata;

  const Tensor* find(const std::string& name) const;
  // The named tensor, or an Error naming the file and the missing tensor (no cause, no fix: a
  // caller whose input can lack it uses find() and says what to do).
  const Tensor& at(const std::string& name) const;
  std::string path;  // where it was read from (for messages)
};

// A tensor as its header describes it: byte offsets into the data section.
struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // in file order
  std::map<std::string, std::string> metadata;
};

// Reads and validates only the header (the tensors' names, dtypes, shapes and offsets, checked
// against the file's size), so that sizes can be checked before anything is allocated.
SafetensorsHeader read_safetensors_header(const std::string& path);

// A safetensors file mapped into memory, its header validated as read_safetensors_header does.
// The mapping is MAP_PRIVATE and writable: a write to a tensor (merging an adapter into a mapped
// base) goes to a private copy of that page, never to the user's file.
//
// tensor() gives a view of the mapping without a copy when the tensor's address is aligned to its
// element size: that is all keel's kernels need (the CPU kernels use unaligned vector loads, oneDNN
// takes any address, and a device copy goes through the runtime's memcpy), and what C++ needs for
// a float* or a bf16_t*. safetensors puts the data section at a multiple of 8 bytes and packs
// tensors without gaps, so a tensor is misaligned only after a tensor of an odd number of smaller
// elements; such a tensor is copied. A view keeps the mapping alive; when its last handle dies the
// pages wholly inside it are dropped from memory (madvise MADV_DONTNEED; a later view of them
// would read them from the file again), so converting a model tensor by tensor never keeps the
// file's pages resident.
class MappedSafetensors {
 public:
  explicit MappedSafetensors(const std::string& path);
  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  const TensorInfo* find(const std::string& name) const;
  // The bytes of `t` in the mapping, in the file's dtype and layout.
  const void* raw(const TensorInfo& t) const;
  // Whether tensor() of `t` is a view (no copy).
  bool aligned(const TensorInfo& t) const;
  // The tensor `t` describes. Take each tensor once: two views of the same bytes would each drop
  // its pages when it dies.
  Tensor tensor(const TensorInfo& t) const;

  struct Mapping;  // the mmap'ed file

 private:
  std::string path_;
  SafetensorsHeader header_;
  std::shared_ptr<Mapping> map_;
  size_t data_start_ = 0;
};

// Reads and validates a whole file, through MappedSafetensors: the tensors are views of the
// mapping (copies only where misaligned). Every problem is an Error naming the file and the tensor
// or header position (truncated data, overlapping offsets, unknown dtype, shape/size mismatch).
Safetensors read_safetensors(const std::string& path);

// How write_safetensors wrote the data: `runs` stretches of memory (see below), and
// `write_calls` write(2) calls in all, the header's included (one per run unless a run is over
// the kernel's 2 GiB per call).
struct SafetensorsWrite {
  size_t runs = 0;
  size_t write_calls = 0;
};

// Writes atomically (temporary file, fsync, rename): a crash never leaves a half-written file.
// Tensors that are views of one storage (the optimizer's flat state, optim/optimizer.h) are laid
// out in the storage's order, and every stretch of it that they cover without a gap is one run,
// written with one call (a device run is copied to the host in one piece): the data goes out in
// whole blocks, not tensor by tensor. The file stays a standard safetensors file (no holes: a gap
// between two views, such as the optimizer's 64-byte alignment of its slots, ends a run); the
// header names every tensor with its own offsets, so readers need not know about runs.
SafetensorsWrite write_safetensors(const std::string& path,
                                   const std::vector<std::pair<std::string, Tensor>>& tensors,
                                   const std::map<std::string, std::string>& metadata = {});

// Reads the tensors `into` names from the file at `path` straight into their memory, without a
// mapping: one pread(2) per stretch that follows on both in the file and in memory, so the views
// of a flat buffer that write_safetensors laid out come back in one read per run. Each tensor of
// `into` must be on the CPU and in the file with the same dtype and shape (the file may hold more),
// or an Error names the file and the tensor before anything is read; a read that fails midway
// (an I/O error, a file truncated after its header was read) is an Error naming the tensor, and
// leaves `into` partly overwritten. Returns the pread calls made for the data.
size_t read_safetensors_into(const std::string& path,
                             const std::vector<std::pair<std::string, Tensor>>& into);
// Whether `h` holds exactly the tensors named in `tensors` (no more), each with its dtype and
// shape: then read_safetensors_into fills all of them and leaves nothing of the file unread.
bool holds_exactly(const SafetensorsHeader& h,
                   const std::vector<std::pair<std::string, Tensor>>& tensors);
// The same, against the tensors a read of the file gave (read_safetensors, load_checkpoint), so
// that a file already mapped needs no second read of its header.
bool holds_exactly(const std::vector<std::pair<std::string, Tensor>>& file,
                   const std::vector<std::pair<std::string, Tensor>>& tensors);

// "F32", "BF16", ... as safetensors spells them.
const char* safetensors_dtype(DType dt);

}  // namespace keel::io
