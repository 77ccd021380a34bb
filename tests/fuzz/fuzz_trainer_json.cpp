// trainer.json of a checkpoint (keel/train/trainer_checkpoint): a tiny run's checkpoint with its
// trainer.json fuzzed, loaded by the run's Trainer as a resume would (the seed is the real file).
#include <filesystem>

#include "keel/train/trainer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static keel::Trainer* trainer = [] {
    keel::Config c = keel::load_config(
        "", {"run.out_dir=" + keel::fuzz::work_dir() + "/run", "run.threads=1", "model.n_layer=1",
             "model.n_embd=8", "model.n_head=2", "data.num_examples=8", "data.eval_examples=0",
             "data.seq_len=8", "train.batch_size=4"});
    auto* t = new keel::Trainer(c, {});
    t->save_checkpoint(keel::fuzz::work_dir() + "/ck");
    return t;
  }();
  keel::fuzz::write("ck/trainer.json", data, size);
  keel::fuzz::expect_keel_errors_only(
      [&] { trainer->load_checkpoint(keel::fuzz::work_dir() + "/ck"); });
  return 0;
}
