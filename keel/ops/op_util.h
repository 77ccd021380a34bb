// Small checks shared by the op files. Errors name the op and the shapes involved.
#pragma once
#include <string>

#include "keel/autograd/node.h"
#include "keel/tensor/tensor.h"

namespace keel::ops {

inline void check_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  KEEL_CHECK(a.dtype() == b.dtype(), std::string(op) + ": dtype mismatch (" + dtype_name(a.dtype()) +
                                         " vs " + dtype_name(b.dtype()) +
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

}  // namespace keel::ops
