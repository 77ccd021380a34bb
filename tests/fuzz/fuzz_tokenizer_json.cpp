// HF tokenizer.json (keel/data/hf_tokenizer): loading, then a round trip of a short text.
#include "keel/data/hf_tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write("tokenizer.json", data, size);
  keel::fuzz::expect_keel_errors_only([&] {
    auto tok = keel::data::load_hf_tokenizer(path);
    tok->decode(tok->encode("Hello world, 12 \xF0\x9F\x98\x80 tokens!"));
  });
  return 0;
}
