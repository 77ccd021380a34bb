// GET /v1/runs/{id}/events: server-sent events of a run. Each metrics.jsonl line is an event
// (`step`, `eval`, `finding` for the advisor's findings {kind: advisor, step, trend, cause, action,
// examples}, `record` for the rest, plus `advice` for a step record that carries advice) whose id
// is its line number, so a client that reconnects with Last-Event-ID gets exactly what it missed; a
// `state` event tells each change of the run's state, and `end` (the run's JSON) closes the
// stream once the run is no longer active. The lines come from the run's shared feed
// (run_feed.h): a stream sleeps until its run writes, and writes at most every 100 ms.
#pragma once
#include <httplib.h>

#include <functional>
#include <memory>
#include <string>

#include "keel/serve/run_feed.h"

namespace keel::serve {

// Streams the events after line `last_event_id` of `feed` into `res`; `run_json` gives the run's
// JSON for `end`. `hold` is kept while the stream lives (released when its connection is done).
void stream_run_events(httplib::Response& res, std::shared_ptr<RunFeed> feed,
                       std::function<std::string()> run_json, int64_t last_event_id,
                       std::shared_ptr<void> hold = nullptr);

}  // namespace keel::serve
