// What Hugging Face's own safetensors reader (the Rust crate behind Python's `safetensors` and
// `transformers`) accepts, checked byte by byte: keel's reader is more lenient (it allows holes
// between tensors), so a file keel reads back is not yet proof that PyTorch users can read it.
#pragma once
#include <string>

namespace keel::test {

// EXPECTs that `path` passes the checks of safetensors' read_metadata and Metadata::validate
// (safetensors/src/tensor.rs): a header of at most 100 MB that starts with '{', string metadata,
// and tensors that, sorted by offset, tile the data section from byte 0 to the end of the file
// without a hole or an overlap, each holding exactly its shape's bytes.
void expect_standard_safetensors(const std::string& path);

}  // namespace keel::test
