// The TOML run config (keel/train/config): reading, validating and writing it back.
#include "keel/train/config.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write("config.toml", data, size);
  keel::fuzz::expect_keel_errors_only([&] {
    const keel::Config c = keel::load_config(path);
    // The effective config reads back (DESIGN §6).
    const std::string again = keel::fuzz::write("again.toml", keel::config_to_toml(c));
    keel::load_config(again);
  });
  return 0;
}
