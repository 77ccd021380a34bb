// Tensor memory reuse changes no result, and no kernel reads memory it never wrote: `keel train`'s
// built-in task gives bit-identical losses and gradient norms with the block cache off (every
// block fresh from the OS, zero-filled) and with every block filled with 0xFF bytes first
// (KEEL_POISON_ALLOC=1: NaN in f32, bf16 and f16), under each precision. A kernel that relied on
// fresh zeros, or read stale values from a reused block, would change the numbers or make them NaN.
// The end-of-run evaluation decodes 16 problems (not the default 500, 3/4 of a sanitized run's
// time): enough to take the loss and key/value cache paths through poisoned blocks too.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

std::vector<nlohmann::json> train(const std::string& out, const std::string& precision,
                                  const std::string& env) {
  const test::KeelRun r = test::run_keel(
      test::with_sets({"train"}, {"run.out_dir=" + out, "run.threads=1", "train.max_steps=8",
                                  "train.precision=" + precision, "train.allow_cpu_bf16=true",
                                  "log.tensorboard=false", "data.eval_examples=16"}),
      {"OMP_NUM_THREADS=1", env});
  EXPECT_EQ(r.code, 0) << r.output;
  return test::step_records(out);
}

TEST(CliMemory, ReusedAndPoisonedBlocksGiveTheBitsOfFreshMemory) {
  for (const std::string precision : {"32-true", "bf16-mixed", "16-mixed"}) {
    const std::string dir = test::temp_dir("cli-memory-" + precision);
    const auto fresh = train(dir + "/fresh", precision, "KEEL_HOST_CACHE=0");
    const auto reused = train(dir + "/reused", precision, "KEEL_HOST_CACHE=1");
    const auto poisoned = train(dir + "/poisoned", precision, "KEEL_POISON_ALLOC=1");
    ASSERT_EQ(fresh.size(), 8u) << precision;
    ASSERT_EQ(reused.size(), fresh.size()) << precision;
    ASSERT_EQ(poisoned.size(), fresh.size()) << precision;
    for (size_t i = 0; i < fresh.size(); ++i) {
      for (const char* key : {"loss", "grad_norm"}) {
        const double f = fresh[i][key].get<double>();
        EXPECT_TRUE(std::isfinite(f)) << precision << " step " << i + 1 << " " << key;
        EXPECT_EQ(reused[i][key].get<double>(), f) << precision << " step " << i + 1 << " " << key;
        EXPECT_EQ(poisoned[i][key].get<double>(), f)
            << precision << " step " << i + 1 << " " << key;
      }
    }
  }
}

}  // namespace
}  // namespace keel
