#include "keel/serve/events.h"

#include <chrono>
#include <memory>
#include <thread>

#include "keel/serve/progress.h"
#include "keel/serve/registry.h"

namespace keel::serve {

std::string sse_event(const std::string& type, const std::string& data, int64_t id) {
  std::string e;
  if (id >= 0) e += "id: " + std::to_string(id) + "\n";
  e += "event: " + type + "\n";
  e += "data: " + data + "\n\n";  // JSON dumps hold no newline
  return e;
}

namespace {
// The state of one connection's stream.
struct Stream {
  EventStreamSource src;
  LineTail tail;
  int64_t line = 0;  // metrics.jsonl lines read so far
  int64_t skip = 0;  // lines the client already has (Last-Event-ID)
  std::string state;
  std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
  Stream(EventStreamSource s, int64_t last_id)
      : src(std::move(s)), tail(src.metrics_path), skip(last_id) {}
};

constexpr auto kPoll = std::chrono::milliseconds(100);
constexpr auto kKeepAlive = std::chrono::seconds(15);
}  // namespace

void stream_run_events(httplib::Response& res, EventStreamSource src, int64_t last_event_id) {
  auto st = std::make_shared<Stream>(std::move(src), last_event_id);
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider("text/event-stream", [st](size_t, httplib::DataSink& sink) {
    // Each call writes what is new, or waits a poll interval; the stream ends with the run.
    std::string out;
    const std::string state = st->src.state();  // before reading: lines then are complete
    for (const std::string& l : st->tail.read_new()) {
      ++st->line;
      if (st->line <= st->skip) continue;
      for (const RunEvent& e : events_of_line(st->line, l))
        out += sse_event(
            e.type, e.data.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), e.id);
    }
    if (state != st->state) {
      st->state = state;
      out += sse_event("state", nlohmann::json{{"state", state}}.dump());
    }
    const bool done = !is_active_state(state) || (st->src.closing && st->src.closing->load());
    if (done) out += sse_event("end", st->src.run_json());
    const auto now = std::chrono::steady_clock::now();
    if (out.empty() && now - st->last_write > kKeepAlive) out = ": keep-alive\n\n";
    if (!out.empty()) {
      if (!sink.is_writable() || !sink.write(out.data(), out.size())) return false;
      st->last_write = now;
    }
    if (done) {
      sink.done();
      return true;
    }
    if (out.empty()) std::this_thread::sleep_for(kPoll);
    return true;
  });
}

}  // namespace keel::serve
