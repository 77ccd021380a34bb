// Autocast: a thread-local policy that the nn layers consult (DESIGN §2, §8), with PyTorch's op
// rules in one table. Ops themselves never cast; modules ask `autocast(op, t)` for each input.
//
//   lower precision: linear, matmul, attention -> compute dtype (f32 accumulation inside)
//   f32:             softmax, log_softmax, layer_norm, rms_norm -> f32; cross_entropy reads its
//                    16-bit logits as they are and computes in f32 inside (kFp32Inside)
//   input dtype:     everything else (gelu, silu, swiglu, embedding, rope, dropout, add, mul);
//                    binary ops with mixed dtypes promote to the widest (f32 beats bf16/f16).
//
// Casts of f32 leaves that require grad (the weights) to the compute dtype are cached, keyed on
// the tensor and its version, until the outermost AutocastGuard exits — one copy per step, not per
// use; the optimizer bumps versions, so a stale copy is never reused.
#pragma once
#include <utility>

#include "keel/tensor/tensor.h"

namespace keel::amp {

// kFp32Inside: the op's kernel reads 16-bit inputs and does all its math in f32 (cross_entropy):
// the input passes through, which gives the bits of casting it to f32 first without the f32 copy
// (for GPT-2 at B=8, T=256 that copy is a 411 MB [N, V] tensor, and its gradient another pass).
enum class CastPolicy { kLowerPrecision, kFp32, kFp32Inside, kInputDtype };
enum class AmpOp {
  kLinear,
  kMatmul,
  kAttention,  // lower precision
  kSoftmax,
  kLogSoftmax,
  kLayerNorm,
  kRmsNorm,
  kCrossEntropy,  // f32
  kGelu,
  kSilu,
  kSwiglu,
  kEmbedding,
  kRope,
  kDropout,
  kAdd,
  kMul,  // input dtype
};
CastPolicy cast_policy(AmpOp op);
const char* amp_op_name(AmpOp op);

bool autocast_enabled();
DType autocast_dtype();

class AutocastGuard {
 public:
  AutocastGuard(bool enabled, DType dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool prev_enabled_;
  DType prev_dtype_;
};

// The tensor `op` should receive for input `t` under the current state (t itself when no cast).
// Integer tensors and undefined tensors pass through.
Tensor autocast(AmpOp op, const Tensor& t);
// Both operands in their widest floating dtype (type promotion of binary ops).
std::pair<Tensor, Tensor> promote(const Tensor& a, const Tensor& b);

// Number of cached weight casts (tests).
size_t cast_cache_size();

// Weight copies kept across steps. Every cached weight cast also stays here after the step, keyed
// on the weight and its version. An optimizer that updates the f32 weight can write the rounded
// new values into the copy in the same pass (AdamW does on the CPU) and then mark it current:
// the next step's cast then costs nothing. A copy whose weight changed any other way (a version
// the copy was not marked with) is never used, and is replaced by a fresh cast.
//
// The copy of `weight` if it holds the weight's current values, else an undefined tensor.
Tensor weight_copy(const Tensor& weight);
// After writing round(weight) into weight_copy(weight) and bumping the weight's version.
void weight_copy_refreshed(const Tensor& weight);
// Number of kept copies; dropping them all (tests, and before a long idle phase).
size_t weight_copy_count();
void clear_weight_copies();

}  // namespace keel::amp
