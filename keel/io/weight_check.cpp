#include "keel/io/weight_check.h"

#include <cstdio>

#include "keel/backend/monitor.h"
#include "keel/numerics/error.h"

namespace keel::io {

namespace {

// The first value whose exponent bits are all ones (nan or inf), or -1.
template <class Bits>
int64_t first_nonfinite_bits(const void* data, int64_t n, Bits exponent) {
  const Bits* v = static_cast<const Bits*>(data);
  for (int64_t i = 0; i < n; ++i)
    if ((v[i] & exponent) == exponent) return i;
  return -1;
}

}  // namespace

NonfiniteWeights find_nonfinite_weights(const void* data, DType dtype, const Shape& shape) {
  NonfiniteWeights w;
  if (!dtype_is_floating(dtype)) return w;
  const int64_t n = shape_numel(shape);
  if (n == 0) return w;
  const TensorStats st = monitor_kernels(Device::cpu()).stats(data, dtype, n, dtype);
  w.nan = st.nan;
  w.inf = st.inf;
  w.count = st.nan + st.inf;
  if (w.count == 0) return w;
  w.first = dtype == DType::F32    ? first_nonfinite_bits<uint32_t>(data, n, 0x7f800000u)
            : dtype == DType::BF16 ? first_nonfinite_bits<uint16_t>(data, n, uint16_t{0x7f80})
                                   : first_nonfinite_bits<uint16_t>(data, n, uint16_t{0x7c00});
  w.first_index = shape_index(shape, w.first);
  return w;
}

void check_weights_finite(const WeightCheck& check, const void* data, DType dtype,
                          const Shape& shape, const std::string& tensor, const std::string& file) {
  const NonfiniteWeights w = find_nonfinite_weights(data, dtype, shape);
  if (w.count == 0) return;
  const int64_t n = shape_numel(shape);
  std::string what = file + ": tensor '" + tensor + "' holds " + std::to_string(w.count) +
                     " non-finite value" + (w.count == 1 ? "" : "s") + " of " + std::to_string(n) +
                     " (" + std::to_string(w.nan) + " nan, " + std::to_string(w.inf) +
                     " inf); the first at " + shape_str(w.first_index) + " of its " +
                     shape_str(shape) + " " + dtype_name(dtype) + " in the file";
  if (check.allow_nonfinite) {
    const std::string m = "warning: " + what + "; loaded anyway (" + check.override_hint + ")";
    if (check.warn)
      check.warn(m);
    else
      std::fprintf(stderr, "%s\n", m.c_str());
    return;
  }
  throw Error(what +
                  ". Training from it fails at the first step (the weights came from a run that "
                  "diverged, or the file is damaged): load an earlier checkpoint, or set " +
                  check.override_hint + " to load it anyway",
              Error::kUsage);
}

void check_weights_finite(const WeightCheck& check, const Tensor& t, const std::string& tensor,
                          const std::string& file) {
  KEEL_CHECK(t.device().is_cpu(), "check_weights_finite: a CPU tensor");
  check_weights_finite(check, t.data(), t.dtype(), t.shape(), tensor, file);
}

}  // namespace keel::io
