// HF config.json (keel/io/hf_model): the sizes and fields of a model directory without weights,
// and the model they describe built for loading; the same bytes as its generation_config.json.
#include <filesystem>

#include "keel/io/hf_model.h"
#include "keel/models/causal_lm.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  keel::fuzz::write("config.json", data, size);
  std::filesystem::remove(keel::fuzz::work_dir() + "/model.safetensors");
  keel::fuzz::expect_keel_errors_only([&] {
    const keel::io::HfConfig c = keel::io::read_hf_config(keel::fuzz::work_dir());
    // A config that reads builds its model's modules (deferred: names and shapes, no memory),
    // as loading does next: every architecture's constructor over the sizes and fields read.
    if (c.spec.n_layer <= 8 && c.spec.n_embd <= 4096 && c.spec.n_head <= 64)
      keel::models::make_causal_lm_for_loading(c.spec);
  });
  // The same bytes as the directory's generation_config.json (eos_token_id: an id or a list).
  keel::fuzz::write("generation_config.json", data, size);
  keel::fuzz::expect_keel_errors_only(
      [&] { keel::io::generation_eos_ids(keel::fuzz::work_dir()); });
  std::filesystem::remove(keel::fuzz::work_dir() + "/generation_config.json");
  return 0;
}
