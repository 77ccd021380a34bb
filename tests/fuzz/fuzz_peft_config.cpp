// adapter_config.json of a PEFT adapter directory (keel/io/peft_dir): read, then applied to a
// one-layer Llama as `keel generate --adapter` would (the seed is the file keel writes).
#include "keel/io/peft_dir.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  keel::fuzz::write("adapter_config.json", data, size);
  keel::fuzz::expect_keel_errors_only([&] {
    const keel::nn::AdapterOptions opt = keel::io::read_peft_config(keel::fuzz::work_dir());
    keel::models::ModelSpec s;
    s.family = "llama";
    s.n_layer = 1;
    s.n_embd = 16;
    s.n_head = 2;
    s.n_kv_head = 1;
    s.intermediate_size = 24;
    s.vocab_size = 32;
    s.max_seq_len = 8;
    auto model = keel::models::make_causal_lm(s, 1);
    keel::nn::apply_adapters(*model, opt);
  });
  return 0;
}
