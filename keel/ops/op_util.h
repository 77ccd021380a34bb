// Small checks shared by the op files. Errors name the op and the shapes involved.
#pragma once
#include <string>

#include "keel/autograd/node.h"
#include "keel/tensor/tensor.h"

namespace keel::ops {

inline void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  KEEL_CHECK(a.dtype() == b.dtype(), std::string(op) + ": dtype mismatch (" +
                                         dtype_name(a.dtype()) + " vs " + dtype_name(b.dtype()) +
                                         "); cast explicitly or run under autocast");
}
inline void check_floating(const char* op, const Tensor& a) {
  KEEL_CHECK(dtype_is_floating(a.dtype()),
             std::string(op) + ": floating tensor required, got " + dtype_name(a.dtype()));
}
// True when `suffix` equals the trailing dims of `shape` (row broadcast).
inline bool is_suffix_shape(const Shape& shape, const Shape& suffix) {
  if (suffix.size() > shape.size()) return false;
  return std::equal(suffix.begin(), suffix.end(), shape.end() - suffix.size());
}

// The node of ops::cast: its backward converts the gradient back to the source dtype `from` (and
// passes it through when it already has that dtype).
struct CastNode final : Node {
  DType from = DType::F32;
  std::vector<Tensor> backward(const Tensor& g) override;
  bool passes_through(DType dt) const override { return dt == from; }
  const char* name() const override { return "cast"; }
};

// The dtype in which to produce the gradient of `t`. When `t` is a low-precision cast of a wider
// tensor (autocast's bf16/f16 copy of an f32 weight, or of an f32 norm output), the cast's
// backward only converts the gradient back to the wider dtype: a matmul can write it there
// directly from its f32 accumulator, which skips a rounding to 16 bits and a conversion pass
// (8% of a bf16-mixed GPT-2 step).
// The node of ops::dropout_cast (ops/dropout.cpp): in the graph it stands for
// cast(dropout(cast(x, f32)), a 16-bit dtype), so it asks for its gradient in f32 as that
// narrowing cast did.
struct DropoutCastNode final : Node {
  DType in = DType::F32;  // x's dtype: the gradient's
  uint64_t seed = 0;
  uint32_t threshold = 0;
  float scale = 1.f;
  std::vector<Tensor> backward(const Tensor& g) override;
  const char* name() const override { return "dropout_cast"; }
};

inline DType grad_dtype_for(const Tensor& t) {
  if (dynamic_cast<const DropoutCastNode*>(t.grad_fn().get())) return DType::F32;
  const auto* n = dynamic_cast<const CastNode*>(t.grad_fn().get());
  if (n && dtype_size(n->from) > dtype_size(t.dtype())) return n->from;
  return t.dtype();
}

}  // namespace keel::ops
