// JSONL datasets (keel/data/dataset): {"prompt", "completion"} or {"text"} lines, byte tokenizer.
#include "keel/data/dataset.h"
#include "keel/data/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = keel::fuzz::write("train.jsonl", data, size);
  static const keel::data::ByteTokenizer tok;
  keel::fuzz::expect_keel_errors_only([&] { keel::data::load_jsonl_dataset(path, tok, 32); });
  return 0;
}
