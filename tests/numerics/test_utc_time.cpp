// numerics/utc_time.h: fixed instants in both formats keel writes.
#include "keel/numerics/utc_time.h"

#include <gtest/gtest.h>

#include <regex>

namespace keel {
namespace {

TEST(UtcTime, FormatsFixedInstants) {
  EXPECT_EQ(utc_time(kUtcIso8601, 0), "1970-01-01T00:00:00Z");
  EXPECT_EQ(utc_time(kUtcIso8601, 1700000000), "2023-11-14T22:13:20Z");
  EXPECT_EQ(utc_time(kUtcDirName, 1700000000), "20231114-221320");
}

TEST(UtcTime, NowHasTheFormatsShape) {
  EXPECT_TRUE(
      std::regex_match(utc_time(kUtcIso8601), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")));
  EXPECT_TRUE(std::regex_match(utc_time(kUtcDirName), std::regex(R"(\d{8}-\d{6})")));
}

}  // namespace
}  // namespace keel
