// A run's files read once for all of its clients. One poller (RunService) refreshes the feed of
// the active run a few dozen times a second: a stat of each file, and a read of what it gained.
// Each new metrics.jsonl line is parsed once: folded into the run's progress (GET /v1/runs/{id}
// answers from it, without touching the files) and formatted once as server-sent events, kept in
// a window of the latest lines that every events stream copies from. Streams sleep on a condition
// variable between records: an idle stream costs nothing, and 100 streams cost one parse a line.
//
// A stream that needs lines older than the window (a late client, or Last-Event-ID far back)
// reads them from the file itself (FeedSubscriber), then joins the window; each line reaches it
// once, by its number.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "keel/serve/progress.h"

namespace keel::serve {

class RunFeed {
 public:
  using Clock = std::chrono::steady_clock;
  // Reads what the run's files hold now. `window_lines`: how many of the latest lines' events it
  // keeps for the streams.
  explicit RunFeed(const std::string& run_dir, size_t window_lines = 4096);

  // Reads what the files gained; wakes the streams when metrics.jsonl gained lines.
  void refresh();
  // A child was just started: its stdout and stderr are read from their current ends (what
  // earlier starts wrote there is theirs); metrics.jsonl goes on where it was.
  void new_start();
  // The run's state (the registry's, set by RunService at every change); wakes the streams.
  void set_state(const std::string& state);
  // The server is shutting down: the streams end.
  void close();

  // The progress fields of GET /v1/runs/{id} (Progress::snapshot), as of the last refresh.
  nlohmann::json snapshot();
  std::string last_error();
  std::string capture();
  bool stopped_by_request();

  // What a stream that has every line before `next` can take now.
  struct View {
    std::string events;        // the events of lines [max(next, window_begin), end)
    int64_t window_begin = 1;  // the oldest line whose events the window holds
    int64_t end = 1;           // one past the last line read (lines are numbered from 1)
    std::string state;
    bool closed = false;
  };
  View view(int64_t next);
  // The id of the newest event given to the streams (0: none yet).
  int64_t last_event_id();
  // Blocks until lines from `next` on exist, the state is no longer `state`, the feed is closed,
  // or `deadline` passes.
  void wait(int64_t next, const std::string& state, Clock::time_point deadline);

  const std::string& metrics_path() const { return metrics_path_; }

 private:
  void refresh_locked();  // mu_ held; returns after notifying when lines came
  const std::string metrics_path_;
  const size_t window_lines_;
  std::mutex mu_;
  std::condition_variable changed_;
  LineTail metrics_, out_, err_;
  Progress progress_;
  std::deque<std::string> window_;  // SSE text of lines [end_ - window_.size(), end_)
  int64_t end_ = 1;                 // one past the last line given to the streams
  int64_t file_lines_ = 0;          // lines read of metrics.jsonl as it is now (end_ - 1 but
                                    // while a resume does again the steps it dropped)
  std::string state_;
  bool closed_ = false;
};

// One events stream's position in a feed: which lines it still lacks, and the state it last told.
class FeedSubscriber {
 public:
  // `last_event_id`: the last line the client has (0: none).
  FeedSubscriber(std::shared_ptr<RunFeed> feed, int64_t last_event_id);
  struct Chunk {
    std::string text;   // events to send now ("" when nothing is new)
    bool done = false;  // every line is sent and the run is no longer active (or the feed closed)
  };
  // What is new, without waiting: the lines it lacks (from the feed's window, or from the file
  // when they have left it: at most `file_bytes` of it a call) and a `state` event when the state
  // changed.
  Chunk take(uint64_t file_bytes = 1 << 20);
  // Blocks until take() may have something, or `deadline`.
  void wait(RunFeed::Clock::time_point deadline);
  int64_t next() const { return next_; }

 private:
  std::shared_ptr<RunFeed> feed_;
  int64_t next_;       // the first line it lacks
  std::string state_;  // the state it last sent
  // Reading the lines that left the window, from the file: the lines read so far.
  std::optional<LineTail> file_;
  int64_t file_lines_ = 0;
};

}  // namespace keel::serve
