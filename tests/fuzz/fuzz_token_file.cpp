// llm.c token files (keel/data/token_file): the header, its count against the size, the ids
// against the vocabulary, and the rows of what loads (each collated as training reads it).
#include "keel/data/loader.h"
#include "keel/data/token_file.h"
#include "keel/data/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write("train.bin", data, size);
  static const keel::data::ByteTokenizer tok;
  keel::fuzz::expect_keel_errors_only([&] {
    const auto ds = keel::data::load_token_file(path, "data.path", tok, 8);
    for (int64_t i = 0; i < ds->size(); ++i) keel::data::collate(*ds, {i}, 8, tok.kPad);
  });
  return 0;
}
