// GPT-2 encoder.json + vocab.bpe (keel/data/gpt2_tokenizer): the input is both files, split at
// the first "\n--\n" (the seed corpus holds the tiny fixture's pair).
#include "keel/data/gpt2_tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t cut = in.find("\n--\n");
  const std::string enc = keel::fuzz::write("encoder.json", in.substr(0, cut));
  const std::string bpe =
      keel::fuzz::write("vocab.bpe", cut == std::string::npos ? "" : in.substr(cut + 4));
  keel::fuzz::expect_keel_errors_only([&] {
    auto tok = keel::data::load_gpt2_tokenizer_files(enc, bpe);
    tok->decode(tok->encode("the quick brown fox, 42 times"));
  });
  return 0;
}
