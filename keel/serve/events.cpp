#include "keel/serve/events.h"

#include <chrono>
#include <thread>

namespace keel::serve {

namespace {
// The state of one connection's stream.
struct EventStream {
  FeedSubscriber sub;
  std::function<std::string()> run_json;
  RunFeed::Clock::time_point last_write = RunFeed::Clock::now();
  std::shared_ptr<void> hold;
  EventStream(std::shared_ptr<RunFeed> feed, std::function<std::string()> json, int64_t last_id,
              std::shared_ptr<void> h)
      : sub(std::move(feed), last_id), run_json(std::move(json)), hold(std::move(h)) {}
};

// A fast run writes a few hundred lines a second: a stream gathers them for this long after a
// write, so it writes (and its client wakes) at most 10 times a second.
constexpr auto kBatch = std::chrono::milliseconds(100);
constexpr auto kKeepAlive = std::chrono::seconds(15);
}  // namespace

void stream_run_events(httplib::Response& res, std::shared_ptr<RunFeed> feed,
                       std::function<std::string()> run_json, int64_t last_event_id,
                       std::shared_ptr<void> hold) {
  auto st = std::make_shared<EventStream>(std::move(feed), std::move(run_json), last_event_id,
                                          std::move(hold));
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider("text/event-stream", [st](size_t, httplib::DataSink& sink) {
    // Each call writes what is new, waiting (asleep) until there is something; the stream ends
    // with the run.
    FeedSubscriber::Chunk c = st->sub.take();
    while (c.text.empty() && !c.done) {
      const auto keep_alive_at = st->last_write + kKeepAlive;
      if (RunFeed::Clock::now() >= keep_alive_at) {
        c.text = ": keep-alive\n\n";
        break;
      }
      st->sub.wait(keep_alive_at);
      const auto batch_at = st->last_write + kBatch;
      if (RunFeed::Clock::now() < batch_at) std::this_thread::sleep_until(batch_at);
      c = st->sub.take();
    }
    if (c.done) c.text += sse_event("end", st->run_json());
    if (!sink.is_writable() || !sink.write(c.text.data(), c.text.size())) return false;
    st->last_write = RunFeed::Clock::now();
    if (c.done) {
      // The stream's slot is free before its last chunk goes out: a client that saw the end and
      // opened the next stream was refused (503, "2 events streams are open") while this
      // response was still being torn down.
      st->hold.reset();
      sink.done();
    }
    return true;
  });
}

}  // namespace keel::serve
