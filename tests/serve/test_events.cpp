// The events of one metrics.jsonl line (serve/progress.h): a step record is a `step` event (and an
// `advice` event when it carries advice), an eval record `eval`, an advisor finding ({kind:
// advisor, ...}) `finding`, anything else `record`; every event keeps the line's number as its id.
#include <gtest/gtest.h>

#include "keel/serve/progress.h"

namespace keel::serve {
namespace {

using json = nlohmann::json;

TEST(ServeEvents, EachKindOfMetricsLineIsItsOwnEventType) {
  const json finding = {{"kind", "advisor"},
                        {"step", 9},
                        {"trend", "spiking"},
                        {"cause", "a data spike"},
                        {"action", "inspect the batch"},
                        {"examples", {"corpus.txt:81"}}};
  auto ev = events_of_line(7, finding.dump());
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].type, "finding");
  EXPECT_EQ(ev[0].id, 7);
  EXPECT_EQ(ev[0].data, finding);  // the record as written

  ev = events_of_line(3, R"({"step": 3, "loss": 2.5, "grad_norm": 1.0, "advice": ["x"]})");
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].type, "step");
  EXPECT_EQ(ev[1].type, "advice");
  EXPECT_EQ(ev[1].id, 3);
  EXPECT_EQ(events_of_line(4, R"({"step": 4, "eval_loss": 2.0})")[0].type, "eval");
  EXPECT_EQ(events_of_line(5, R"({"epoch": 0, "epoch_loss": 2.1})")[0].type, "record");
  EXPECT_EQ(events_of_line(6, R"({"kind": "other", "step": 6})")[0].type, "record");
  EXPECT_TRUE(events_of_line(8, "{not json").empty());
  EXPECT_TRUE(events_of_line(9, "[1, 2]").empty());
}

}  // namespace
}  // namespace keel::serve
