// Non-finite weights found at load time (issue 21 item 5): a checkpoint whose training diverged
// holds nan/inf, and training from it only fails steps later with gradients that name nothing of
// the cause. Every loader (an HF directory or a keel checkpoint as model.path, a resume) passes
// each tensor's raw data here, as the file stores it, before converting or transposing it, so
// that the index the error names is the file's own (GPT-2's Conv1D weights are [in, out] in HF's
// files, [out, in] in keel).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "keel/numerics/dtype.h"
#include "keel/tensor/tensor.h"

namespace keel::io {

struct WeightCheck {
  // model.allow_nonfinite_weights: load anyway, telling `warn` (stderr when unset) about each
  // tensor that holds non-finite values.
  bool allow_nonfinite = false;
  std::function<void(const std::string&)> warn;
  // How the user asks for the override, for the message ("set ..."): a config key by default.
  std::string override_hint = "model.allow_nonfinite_weights = true";
};

// What one tensor holds that is not finite (count 0: nothing).
struct NonfiniteWeights {
  int64_t count = 0, nan = 0, inf = 0;
  int64_t first = -1;  // flat index of the first non-finite value, in the data's own order
  Shape first_index;   // the same as a multi-index of `shape`
};

// Counts the non-finite values of `n` values of `dtype` (F32, BF16, F16; other dtypes hold none)
// laid out row-major in `shape`, and finds the first. One vectorized pass; the first index is
// searched only when there is one.
NonfiniteWeights find_nonfinite_weights(const void* data, DType dtype, const Shape& shape);

// Checks one tensor of `file` as the file lays it out: non-finite values are an Error (kUsage)
// naming the file, the tensor, the count (nan/inf), the first one's index in the file's shape, and
// the override; with check.allow_nonfinite, a warning instead.
void check_weights_finite(const WeightCheck& check, const void* data, DType dtype,
                          const Shape& shape, const std::string& tensor, const std::string& file);

// The same for a tensor read from `file` (a CPU tensor; its shape is the file's).
void check_weights_finite(const WeightCheck& check, const Tensor& t, const std::string& tensor,
                          const std::string& file);

}  // namespace keel::io
