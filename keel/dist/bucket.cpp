#include "keel/dist/bucket.h"

#include <algorithm>
#include <cstring>

#include "keel/numerics/convert.h"
#include "keel/numerics/error.h"

namespace keel::dist {

std::vector<Bucket> plan_buckets(const std::vector<int64_t>& numels, int64_t cap_elems) {
  KEEL_CHECK(cap_elems >= 1, "plan_buckets: cap must be >= 1 element");
  std::vector<Bucket> out;
  Bucket cur;
  for (size_t t = 0; t < numels.size(); ++t) {
    int64_t off = 0;
    while (off < numels[t]) {
      if (cur.numel == cap_elems) {
        out.push_back(std::move(cur));
        cur = Bucket{};
      }
      const int64_t take = std::min(numels[t] - off, cap_elems - cur.numel);
      cur.segments.push_back({t, off, take});
      cur.numel += take;
      off += take;
    }
  }
  if (cur.numel > 0) out.push_back(std::move(cur));
  return out;
}

namespace {

template <class T>
void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_f32(src + i);
}
template <class T>
void narrow(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_f32(dst + i, src[i]);
}

void to_f32(const Tensor& g, int64_t off, int64_t n, float* dst) {
  switch (g.dtype()) {
    case DType::F32:
      std::memcpy(dst, g.data_as<float>() + off, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::BF16:
      return widen(g.data_as<bf16_t>() + off, dst, n);
    case DType::F16:
      return widen(g.data_as<f16_t>() + off, dst, n);
    default:
      throw Error(std::string("all-reduce of gradients: dtype ") + dtype_name(g.dtype()) +
                  " is not a floating gradient dtype");
  }
}

void from_f32(const float* src, Tensor& g, int64_t off, int64_t n) {
  switch (g.dtype()) {
    case DType::F32:
      std::memcpy(g.data_as<float>() + off, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::BF16:
      return narrow(src, g.data_as<bf16_t>() + off, n);
    case DType::F16:
      return narrow(src, g.data_as<f16_t>() + off, n);
    default:
      return;  // rejected by to_f32
  }
}

}  // namespace

void all_reduce_in_buckets(std::vector<Tensor>& grads, int64_t cap_bytes,
                           const std::function<void(float*, size_t)>& reduce,
                           std::vector<float>& staging) {
  std::vector<int64_t> numels;
  for (const Tensor& g : grads) numels.push_back(g.defined() ? g.numel() : 0);
  const int64_t cap = std::max<int64_t>(1, cap_bytes / static_cast<int64_t>(sizeof(float)));
  for (const Bucket& b : plan_buckets(numels, cap)) {
    const BucketSegment& s0 = b.segments.front();
    if (b.segments.size() == 1 && grads[s0.tensor].dtype() == DType::F32) {
      reduce(grads[s0.tensor].data_as<float>() + s0.offset, static_cast<size_t>(s0.count));
      continue;
    }
    if (staging.size() < static_cast<size_t>(b.numel)) staging.resize(static_cast<size_t>(b.numel));
    float* p = staging.data();
    for (const BucketSegment& s : b.segments) {
      to_f32(grads[s.tensor], s.offset, s.count, p);
      p += s.count;
    }
    reduce(staging.data(), static_cast<size_t>(b.numel));
    p = staging.data();
    for (const BucketSegment& s : b.segments) {
      from_f32(p, grads[s.tensor], s.offset, s.count);
      p += s.count;
    }
  }
}

}  // namespace keel::dist
