// adapter_config.json of a PEFT adapter directory (keel/io/peft_dir): read, then applied to a
// two-layer Llama (tests/io's tiny spec) as `keel generate --adapter` would (the seed is the file
// keel writes).
#include "keel/io/peft_dir.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/io/tiny_specs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  keel::fuzz::write("adapter_config.json", data, size);
  keel::fuzz::expect_keel_errors_only([&] {
    const keel::nn::AdapterOptions opt = keel::io::read_peft_config(keel::fuzz::work_dir());
    auto model = keel::models::make_causal_lm(keel::io::test_specs::llama_spec(false), 1);
    keel::nn::apply_adapters(*model, opt);
  });
  return 0;
}
