// HF tokenizer.json (keel/data/hf_tokenizer): loading, then a round trip of a short text, whole
// and as a continuation (byte-level and SentencePiece-style files).
#include "keel/data/hf_tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write("tokenizer.json", data, size);
  keel::fuzz::expect_keel_errors_only([&] {
    auto tok = keel::data::load_hf_tokenizer(path);
    const char* text = "Hello world, 12 \xF0\x9F\x98\x80 tokens!<s> the  there </s>";
    tok->decode(tok->encode(text));
    tok->decode(tok->encode_continuation(text));
  });
  return 0;
}
