// safetensors read/write (the format HF models, PEFT adapters and keel checkpoints use):
// u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets},
// __metadata__}, then the raw little-endian data.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::io {

struct Safetensors {
  std::vector<std::pair<std::string, Tensor>> tensors;  // in file order
  std::map<std::string, std::string> metadata;

  const Tensor* find(const std::string& name) const;
  // The named tensor, or an Error naming the file and the missing tensor.
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

// Reads and validates a whole file. Every problem is an Error naming the file and the tensor or
// header position (truncated data, overlapping offsets, unknown dtype, shape/size mismatch).
Safetensors read_safetensors(const std::string& path);

// Writes atomically (temporary file, fsync, rename): a crash never leaves a half-written file.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// "F32", "BF16", ... as safetensors spells them.
const char* safetensors_dtype(DType dt);

}  // namespace keel::io
