// A NaN capture directory (keel/monitor/nan_capture): capture.json fuzzed beside valid, small
// safetensors files (the seed corpus holds a real capture.json).
#include "keel/io/safetensors.h"
#include "keel/monitor/nan_capture.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool files = [] {
    using keel::Tensor;
    const std::string d = keel::fuzz::work_dir();
    keel::io::write_safetensors(d + "/model.safetensors", {{"w", Tensor::zeros({2})}});
    keel::io::write_safetensors(d + "/optimizer.safetensors", {});
    keel::io::write_safetensors(d + "/microbatches.safetensors",
                                {{"mb0.input_ids", Tensor::zeros({1, 4}, keel::DType::I64)},
                                 {"mb0.labels", Tensor::zeros({1, 4}, keel::DType::I64)}});
    return true;
  }();
  (void)files;
  keel::fuzz::write("capture.json", data, size);
  keel::fuzz::expect_keel_errors_only(
      [&] { keel::monitor::read_nan_capture(keel::fuzz::work_dir()); });
  return 0;
}
