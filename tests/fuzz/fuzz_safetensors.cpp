// safetensors files (keel/io/safetensors): the header-only reader and the full reader.
#include "keel/io/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write("model.safetensors", data, size);
  keel::fuzz::expect_keel_errors_only([&] { keel::io::read_safetensors_header(path); });
  keel::fuzz::expect_keel_errors_only([&] { keel::io::read_safetensors(path); });
  return 0;
}
