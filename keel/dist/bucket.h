// Gradient buckets (DESIGN §3 step 3): the gradients are summed across ranks in calls of at most
// `cap` bytes. One call per tensor would pay the per-call latency ~150 times for a GPT-2; one
// call for everything makes Open MPI allocate (and page-fault) a temporary as large as the model
// on every step, which on our VMs runs at 0.4 GB/s instead of 5-9 GB/s
// (reference/cpu-dependencies.md §5). 25 MB buckets avoid both.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::dist {

// Elements [offset, offset + count) of tensor `tensor` of the list.
struct BucketSegment {
  size_t tensor = 0;
  int64_t offset = 0, count = 0;
};
struct Bucket {
  std::vector<BucketSegment> segments;
  int64_t numel = 0;  // sum of the segments' counts, <= the cap
};

// Greedy in list order: consecutive tensors share a bucket while they fit in `cap_elems`
// elements; a tensor larger than the cap is cut into cap-sized pieces (each its own bucket, the
// last piece may share with what follows). Every element is in exactly one segment, in order.
// Tensors with 0 elements get no segment. cap_elems >= 1.
std::vector<Bucket> plan_buckets(const std::vector<int64_t>& numels, int64_t cap_elems);

// Sums `grads` across ranks with reduce(buffer, n) per bucket, in the bucket order above (the
// same on every rank: the plan depends only on the shapes). An f32 bucket made of one segment is
// reduced in place; any other goes through `staging` as f32 (bf16/f16 gradients are widened,
// summed in f32 and rounded back to nearest-even once). `cap_bytes` counts f32 bytes.
void all_reduce_in_buckets(std::vector<Tensor>& grads, int64_t cap_bytes,
                           const std::function<void(float*, size_t)>& reduce,
                           std::vector<float>& staging);

}  // namespace keel::dist
