// GET /v1/runs/{id}/events: server-sent events of a run. Each metrics.jsonl line is an event
// (`step`, `eval`, `finding` for the advisor's findings {kind: advisor, step, trend, cause, action,
// examples}, `record` for the rest, plus `advice` for a step record that carries advice) whose id
// is its line number, so a client that reconnects with Last-Event-ID gets exactly what it missed; a
// `state` event tells each change of the run's state, and `end` (the run's JSON) closes the
// stream once the run is no longer active.
#pragma once
#include <httplib.h>
#include <atomic>
#include <functional>
#include <string>

namespace keel::serve {

struct EventStreamSource {
  std::string metrics_path;
  std::function<std::string()> state;          // the run's current state
  std::function<std::string()> run_json;       // the run's JSON (for `end`)
  const std::atomic<bool>* closing = nullptr;  // the server is shutting down
};

// Streams the events after line `last_event_id` into `res`.
void stream_run_events(httplib::Response& res, EventStreamSource src, int64_t last_event_id);

// One event in the text/event-stream format.
std::string sse_event(const std::string& type, const std::string& data, int64_t id = -1);

}  // namespace keel::serve
