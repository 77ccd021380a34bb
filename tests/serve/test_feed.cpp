// A run's shared feed (serve/run_feed.h): its files read once, the progress answered from memory,
// and every events stream given each metrics.jsonl line exactly once, by number, whether the line
// is still in the feed's window or has left it (a late client, a Last-Event-ID resume, a stream
// that fell behind), with `state` events at each change and the end only once all is given.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "keel/serve/run_feed.h"
#include "tests/support/check.h"

namespace keel::serve {
namespace {

using json = nlohmann::json;

// A run directory whose metrics.jsonl the test writes, as a trainer would.
struct RunFiles {
  std::string dir = keel::test::temp_dir("serve-feed");
  int written = 0;
  // Appends step records up to step `to` (each its own line, line number = step).
  void steps_to(int to) {
    std::ofstream f(dir + "/metrics.jsonl", std::ios::app);
    for (; written < to; ++written)
      f << json{{"step", written + 1}, {"loss", 2.0 - 0.001 * written}, {"grad_norm", 1.0}}.dump()
        << "\n";
  }
  // Replaces the file with its steps up to `step`, as a resume from the checkpoint of that step
  // does (a new file renamed over it: log::drop_metrics_after).
  void rewrite_to(int step) {
    {
      std::ofstream f(dir + "/metrics.jsonl.tmp");
      for (int i = 0; i < step; ++i)
        f << json{{"step", i + 1}, {"loss", 2.0 - 0.001 * i}, {"grad_norm", 1.0}}.dump() << "\n";
    }
    std::filesystem::rename(dir + "/metrics.jsonl.tmp", dir + "/metrics.jsonl");
    written = step;
  }
  void raw(const std::string& text) {
    std::ofstream(dir + "/metrics.jsonl", std::ios::app) << text;
  }
};

// The event ids of a chunk of text/event-stream text, in order, and its `state` events.
struct Parsed {
  std::vector<int64_t> ids;
  std::vector<std::string> states;
};
Parsed parse_sse(const std::string& text) {
  Parsed p;
  static const std::regex kId(R"(^id: (\d+)$)");
  static const std::regex kState(R"re(^data: \{"state":"(\w+)"\}$)re");
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_match(line, m, kId)) p.ids.push_back(std::stoll(m[1]));
    if (std::regex_match(line, m, kState)) p.states.push_back(m[1]);
  }
  return p;
}

// Takes until nothing is new; returns the ids given (and whether the subscriber is done).
std::vector<int64_t> take_all(FeedSubscriber& s, bool* done = nullptr,
                              uint64_t file_bytes = 1 << 20) {
  std::vector<int64_t> ids;
  for (int i = 0; i < 1000; ++i) {
    FeedSubscriber::Chunk c = s.take(file_bytes);
    const Parsed p = parse_sse(c.text);
    ids.insert(ids.end(), p.ids.begin(), p.ids.end());
    if (done) *done = c.done;
    if (c.text.empty() || c.done) break;
  }
  return ids;
}

std::vector<int64_t> ids_from_to(int64_t from, int64_t to) {  // [from, to]
  std::vector<int64_t> v;
  for (int64_t i = from; i <= to; ++i) v.push_back(i);
  return v;
}

TEST(ServeFeed, ALateSubscriberGetsEveryLineOnceFromTheFileThenTheWindow) {
  RunFiles run;
  run.steps_to(10);  // before the feed: read from the file only
  auto feed = std::make_shared<RunFeed>(run.dir, /*window_lines=*/4);
  feed->set_state("running");
  run.steps_to(30);
  feed->refresh();  // lines 11..30; the window keeps 27..30
  FeedSubscriber late(feed, 0);
  // A small read bound: the file is read over several takes, each line still once.
  EXPECT_EQ(take_all(late, nullptr, /*file_bytes=*/200), ids_from_to(1, 30));
  run.steps_to(33);
  feed->refresh();
  EXPECT_EQ(take_all(late), ids_from_to(31, 33));  // then from the window
  EXPECT_EQ(take_all(late), std::vector<int64_t>{});
}

TEST(ServeFeed, ALastEventIdResumeGetsExactlyTheLinesAfterIt) {
  RunFiles run;
  run.steps_to(5);
  auto feed = std::make_shared<RunFeed>(run.dir, 4);
  feed->set_state("running");
  run.steps_to(20);
  feed->refresh();  // window: 17..20
  FeedSubscriber far_back(feed, 7), in_window(feed, 18), at_end(feed, 20);
  EXPECT_EQ(take_all(far_back), ids_from_to(8, 20));
  EXPECT_EQ(take_all(in_window), ids_from_to(19, 20));
  EXPECT_EQ(take_all(at_end), std::vector<int64_t>{});
}

TEST(ServeFeed, AStreamThatFellBehindTheWindowCatchesUpFromTheFile) {
  RunFiles run;
  auto feed = std::make_shared<RunFeed>(run.dir, 4);
  feed->set_state("running");
  FeedSubscriber s(feed, 0);
  std::vector<int64_t> got;
  for (int to : {3, 5, 15, 16, 30}) {  // 5 -> 15 and 16 -> 30: more than the window at once
    run.steps_to(to);
    feed->refresh();
    for (int64_t id : take_all(s)) got.push_back(id);
  }
  EXPECT_EQ(got, ids_from_to(1, 30));
}

TEST(ServeFeed, StatusIsTheNewestRecordAsOfTheLastRefresh) {
  RunFiles run;
  run.steps_to(3);
  RunFeed feed(run.dir, 4);
  EXPECT_EQ(feed.snapshot()["step"], 3);  // what the files held when it was made
  run.steps_to(9);
  run.raw(json{{"step", 10}, {"grad_norm", 1.0}}.dump().substr(0, 8));  // a line being written
  EXPECT_EQ(feed.snapshot()["step"], 3);  // answered from memory: no file read per request
  feed.refresh();
  EXPECT_EQ(feed.snapshot()["step"], 9);  // the newest complete line
  run.raw(json{{"step", 10}, {"grad_norm", 1.0}}.dump().substr(8) + "\n");
  feed.refresh();
  EXPECT_EQ(feed.snapshot()["step"], 10);
  EXPECT_TRUE(feed.snapshot()["loss"].is_null());  // that record's fields, not step 9's
}

TEST(ServeFeed, StateEventsAtEachChangeAndTheEndOnlyOnceEverythingIsGiven) {
  RunFiles run;
  auto feed = std::make_shared<RunFeed>(run.dir, 4);
  feed->set_state("running");
  FeedSubscriber s(feed, 0);
  FeedSubscriber::Chunk c = s.take();
  EXPECT_EQ(parse_sse(c.text).states, std::vector<std::string>{"running"});
  EXPECT_FALSE(c.done);
  // The run ends with lines the stream has not had, some of them out of the window.
  run.steps_to(12);
  feed->refresh();
  feed->set_state("succeeded");
  c = s.take();
  EXPECT_FALSE(c.done) << "done before lines 1..8 (out of the window) were given";
  EXPECT_EQ(parse_sse(c.text).ids, ids_from_to(1, 12));
  c = s.take();
  EXPECT_TRUE(c.done);
  EXPECT_EQ(parse_sse(c.text).states, std::vector<std::string>{"succeeded"});
  EXPECT_EQ(parse_sse(c.text).ids, std::vector<int64_t>{});
}

TEST(ServeFeed, WaitSleepsUntilALineComesAndCloseEndsTheStreams) {
  RunFiles run;
  auto feed = std::make_shared<RunFeed>(run.dir, 4);
  feed->set_state("running");
  FeedSubscriber s(feed, 0);
  s.take();  // the state event
  using Clock = RunFeed::Clock;
  // Nothing new: the wait lasts until its deadline.
  auto t0 = Clock::now();
  s.wait(t0 + std::chrono::milliseconds(150));
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(150));
  // A line: the waiter wakes long before its deadline.
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    run.steps_to(1);
    feed->refresh();
  });
  t0 = Clock::now();
  s.wait(t0 + std::chrono::seconds(30));
  writer.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(20));
  EXPECT_EQ(parse_sse(s.take().text).ids, std::vector<int64_t>{1});
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    feed->close();
  });
  t0 = Clock::now();
  s.wait(t0 + std::chrono::seconds(30));
  closer.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(20));
  EXPECT_TRUE(s.take().done);
}

TEST(ServeFeed, ANewStartReadsTheLogsFromTheirEndsAndKeepsTheMetrics) {
  RunFiles run;
  run.steps_to(4);
  std::ofstream(run.dir + "/stderr.log") << "error: the first start failed\n";
  RunFeed feed(run.dir, 4);
  EXPECT_EQ(feed.last_error(), "error: the first start failed");
  feed.new_start();
  EXPECT_EQ(feed.last_error(), "");  // the previous start's, not this one's
  EXPECT_EQ(feed.snapshot()["step"], 4);
  std::ofstream(run.dir + "/stderr.log", std::ios::app) << "stopped: by the second start\n";
  run.steps_to(6);
  feed.refresh();
  EXPECT_EQ(feed.last_error(), "stopped: by the second start");
  EXPECT_EQ(feed.snapshot()["step"], 6);
}

// A feed built over a finished run's file parses only the lines its progress keeps (the newest
// step record, the newest advice): its status is the one every line folded in gives.
TEST(ServeFeed, AFeedBuiltOverAFileHasTheProgressOfEveryLine) {
  RunFiles run;
  Progress every;
  const auto now = RunFeed::Clock::now();
  std::ofstream f(run.dir + "/metrics.jsonl");
  for (int i = 1; i <= 60; ++i) {
    json rec = {{"step", i}, {"loss", 3.0 / i}, {"grad_norm", 1.0 + i}};
    if (i % 4 == 0) rec["advice"] = "advice of step " + std::to_string(i);
    const std::string line = i == 30 ? "{\"grad_norm\": not json" : i == 59 ? "[1, 2]" : rec.dump();
    f << line << "\n";
    every.on_metrics(json::parse(line, nullptr, false), now);
    if (i == 60) f << json{{"eval_loss", 0.5}, {"step", 60}}.dump() << "\n";
  }
  f.close();
  RunFeed feed(run.dir);
  EXPECT_EQ(feed.snapshot(), every.snapshot());
  EXPECT_EQ(feed.snapshot()["step"], 60);
  EXPECT_EQ(feed.snapshot()["advice"].size(), Progress::kMaxAdvice);
  EXPECT_EQ(feed.last_event_id(), 61);  // every line counted, the eval record's too
}

// A feed built after a restart reads the whole stdout.log, every start's lines: a "stopped by
// request" of an earlier start is not the latest start's (its header line begins it).
TEST(ServeFeed, StoppedByRequestIsTheLatestStartsOwn) {
  RunFiles run;
  const std::string header = "keel train | gpt2 2L 32-wide 2 heads | 10 steps | out x\n";
  std::ofstream(run.dir + "/stdout.log") << header << "stopped by request at step 4; ...\n"
                                         << header;
  EXPECT_FALSE(RunFeed(run.dir).stopped_by_request());
  std::ofstream(run.dir + "/stdout.log", std::ios::app) << "stopped by request at step 7; ...\n";
  EXPECT_TRUE(RunFeed(run.dir).stopped_by_request());
}

// A non-finite stop as keel train prints it: the tracer's finding, the stop, its cause. The run's
// error is those lines (it was the stop's alone); a note is not part of it.
TEST(ServeFeed, TheErrorIsTheStopWithTheFindingBeforeItAndTheCauseAfterIt) {
  RunFiles run;
  std::ofstream(run.dir + "/stderr.log")
      << "note: 3 of 8 examples are cut\n"
      << "underflow/overflow tracer: the first non-finite value was produced by 'h.1' at batch 4\n"
      << "stopped: step 4: non-finite loss (nan)\n"
      << "cause: AdamW's second moment (exp_avg_sq, stored in f16) underflowed to 0\n";
  RunFeed feed(run.dir, 4);
  EXPECT_EQ(feed.last_error(),
            "underflow/overflow tracer: the first non-finite value was produced by 'h.1' at batch "
            "4\nstopped: step 4: non-finite loss (nan)\ncause: AdamW's second moment (exp_avg_sq, "
            "stored in f16) underflowed to 0");
  feed.new_start();
  std::ofstream(run.dir + "/stderr.log", std::ios::app) << "error: data.path: line 2: not JSON\n";
  feed.refresh();
  EXPECT_EQ(feed.last_error(), "error: data.path: line 2: not JSON");
}

// A run killed after its checkpoint of step 20, at step 30, then resumed: the resume rewrites
// metrics.jsonl without steps 21..30 and does them again. A stream that had lines 1..30 goes on
// with line 31 (step 31), and an event's id stays its line in the file. The feed read the
// rewritten file as new lines: steps 1..20 came again as events 31..50, and ids no longer matched
// the file that a Last-Event-ID reconnect reads by.
TEST(ServeFeed, AResumeThatRewroteTheMetricsGoesOnAtTheLineAfterTheLastGiven) {
  RunFiles run;
  run.steps_to(30);
  auto feed = std::make_shared<RunFeed>(run.dir, 4);
  feed->set_state("running");
  FeedSubscriber live(feed, 0);
  EXPECT_EQ(take_all(live), ids_from_to(1, 30));
  feed->new_start();
  run.rewrite_to(20);
  feed->refresh();
  EXPECT_EQ(take_all(live), std::vector<int64_t>{});
  EXPECT_EQ(feed->snapshot()["step"], 20);  // where the resumed run is
  run.steps_to(34);                         // 21..30 again, then new steps
  feed->refresh();
  EXPECT_EQ(feed->snapshot()["step"], 34);
  FeedSubscriber::Chunk c = live.take();
  EXPECT_EQ(parse_sse(c.text).ids, ids_from_to(31, 34));
  EXPECT_CONTAINS(c.text,
                  "id: 31\nevent: step\ndata: {\"grad_norm\":1.0,\"loss\":1.97,\"step\":31}");
  // Reconnects, from the window and from the file, get the lines after their id once each.
  FeedSubscriber after_32(feed, 32), from_start(feed, 0);
  EXPECT_EQ(take_all(after_32), ids_from_to(33, 34));
  EXPECT_EQ(take_all(from_start), ids_from_to(1, 34));
}

}  // namespace
}  // namespace keel::serve
