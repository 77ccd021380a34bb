// keel serve: the training service over HTTP/JSON (cpp-httplib). Routes, under /v1 and behind
// `Authorization: Bearer KEY` (all but /health and the dashboard page at /):
//   POST /v1/runs                      create a run (body: config JSON; Idempotency-Key header)
//   GET  /v1/runs                      list runs
//   GET  /v1/runs/{id}                 one run: state, progress, advice, capture, error
//   GET  /v1/runs/{id}/events          server-sent events (Last-Event-ID resumes)
//   POST /v1/runs/{id}/stop            checkpoint, then stopped
//   POST /v1/runs/{id}/resume          continue a stopped or interrupted run
//   GET  /v1/runs/{id}/artifacts[/P]   list the run's files, or download one
#pragma once
#include <string>
#include <vector>

namespace keel::serve {

struct ServeOptions {
  std::string listen = "127.0.0.1:8080";  // HOST:PORT (PORT 0: any free port, printed)
  std::string root;                       // runs and the registry live here
  std::string api_key_file;               // one key per line
  bool insecure_open = false;             // no keys: allowed on a loopback address only
  std::vector<std::string> data_roots;    // request paths must resolve inside these
  size_t max_body_bytes = 1 << 20;        // larger request bodies get 413
  int threads = 256;  // connections served at once; events streams may hold 3/4 of them (each one)
  std::string keel_binary;  // "" = this executable
};

// Whether HOST is a loopback address (127.0.0.0/8, ::1, localhost).
bool is_loopback_host(const std::string& host);

// Runs the service until SIGINT or SIGTERM (then the active run is checkpointed and left
// `interrupted`). Throws Error (kUsage) for bad options: no API key without --insecure-open, or
// --insecure-open on an address that is not loopback. Returns the exit code.
int run_server(const ServeOptions& opt);

}  // namespace keel::serve
