// Errors a user reads name their input, not keel's sources: an internal check's message carries
// keel's file and line only with KEEL_DEBUG_ERRORS=1 (issue 22, item 5).
#include <gtest/gtest.h>

#include <cstdlib>

#include "keel/numerics/checked.h"
#include "keel/numerics/error.h"
#include "tests/support/check.h"

namespace keel {
namespace {

TEST(Errors, SourceLocationsOnlyInDebugMode) {
  auto failing = [] { KEEL_CHECK(1 + 1 == 3, "layer_norm: eps must be >= 0, got -1"); };
  unsetenv("KEEL_DEBUG_ERRORS");
  std::string m = test::error_of(failing);
  EXPECT_EQ(m, "layer_norm: eps must be >= 0, got -1");
  setenv("KEEL_DEBUG_ERRORS", "1", 1);
  m = test::error_of(failing);
  unsetenv("KEEL_DEBUG_ERRORS");
  EXPECT_CONTAINS(m, "test_errors.cpp:");
  EXPECT_CONTAINS(m, ": layer_norm: eps must be >= 0");
}

TEST(Errors, CheckedMultiplicationNamesWhatOverflowed) {
  EXPECT_EQ(checked_mul(1 << 20, 1 << 20, "tokens"), int64_t{1} << 40);
  EXPECT_CONTAINS(test::error_of([] { checked_mul(int64_t{1} << 32, int64_t{1} << 32, "tokens"); }),
                  "tokens: 4294967296 x 4294967296 is negative or does not fit in 64 bits");
  EXPECT_CONTAINS(test::error_of([] { checked_mul(-1, 2, "rows"); }), "rows: -1 x 2");
}

}  // namespace
}  // namespace keel
