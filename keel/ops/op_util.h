// Small checks shared by the op files. Errors name the op and the shapes involved.
#pragma once
#include <string>

#include "keel/autograd/node.h"
#include "keel/tensor/tensor.h"

namespace keel::ops {

// Two operands of one op: one dtype, and one device (a kernel of one device handed the other's
// pointer would read foreign memory, or fault, instead of saying so).
inline void check_operands(const char* op, const Tensor& a, const Tensor& b) {
  KEEL_CHECK(a.dtype() == b.dtype(), std::string(op) + ": dtype mismatch (" +
                                         dtype_name(a.dtype()) + " vs " + dtype_name(b.dtype()) +
                                         "); cast explicitly or run under autocast");
  KEEL_CHECK(a.device() == b.device(), std::string(op) + ": operands on different devices (" +
                                           a.device().str() + " vs " + b.device().str() +
                                           "); move one with .to(device)");
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
  DType wanted_grad_dtype(DType output) const override {
    return dtype_size(from) > dtype_size(output) ? from : output;
  }
  const char* name() const override { return "cast"; }
};

// The dtype in which to produce the gradient of `t` (its node's Node::wanted_grad_dtype). When
// `t` is a low-precision cast of a wider tensor (autocast's bf16/f16 copy of an f32 weight, or of
// an f32 norm output), the cast's backward only converts the gradient back to the wider dtype: a
// matmul can write it there directly from its f32 accumulator, which skips a rounding to 16 bits
// and a conversion pass (8% of a bf16-mixed GPT-2 step).
inline DType grad_dtype_for(const Tensor& t) {
  return t.grad_fn() ? t.grad_fn()->wanted_grad_dtype(t.dtype()) : t.dtype();
}

}  // namespace keel::ops
