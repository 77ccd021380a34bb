#include "keel/numerics/tensor_stats.h"

#include <cmath>
#include <limits>

#include "keel/numerics/convert.h"
#include "keel/numerics/error.h"
#include "keel/numerics/format_info.h"

namespace keel {

namespace {

template <class T>
TensorStats stats_of(const T* x, int64_t n, const FormatInfo& fi) {
  TensorStats s;
  s.count = n;
  double amin = std::numeric_limits<double>::infinity(), amax = 0;
  const double near = fi.max / 2;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_f32(x + i);
    if (std::isnan(v)) { ++s.nan; continue; }
    if (std::isinf(v)) { ++s.inf; continue; }
    const double a = std::fabs(static_cast<double>(v));
    if (a == 0) ++s.zero;
    else if (a < fi.min_normal) ++s.subnormal;
    if (a >= near) ++s.near_max;
    if (a < amin) amin = a;
    if (a > amax) amax = a;
  }
  s.abs_min = std::isinf(amin) ? 0 : amin;
  s.abs_max = amax;
  s.headroom_bits = amax > 0 ? std::log2(fi.max / amax) : std::numeric_limits<double>::infinity();
  return s;
}

}  // namespace

TensorStats tensor_stats(const void* data, DType dt, int64_t n, DType fmt) {
  const FormatInfo& fi = format_info(fmt);
  switch (dt) {
    case DType::F32: return stats_of(static_cast<const float*>(data), n, fi);
    case DType::BF16: return stats_of(static_cast<const bf16_t*>(data), n, fi);
    case DType::F16: return stats_of(static_cast<const f16_t*>(data), n, fi);
    default: throw Error(std::string("tensor_stats: ") + dtype_name(dt) + " is not a floating format");
  }
}

}  // namespace keel
