// What a run is doing, read from the files its child writes: metrics.jsonl (one JSON record per
// line: step records, eval records, findings) and the child's stdout and stderr. The server reads
// them as they grow, so progress is the run's own numbers, not a copy kept in step with it. The
// reading itself is shared by every client of a run (run_feed.h); this file holds its parts.
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace keel::serve {

// The complete lines appended to a file since the last call (a partial last line waits for its
// newline). A file that is missing reads as empty; one that shrank or was replaced by another
// file (a resumed run rewrites metrics.jsonl without the records after its checkpoint) is read
// again from its start. An unchanged file costs one stat. `max_bytes` bounds one call's read (a
// longer single line is still read whole).
class LineTail {
 public:
  explicit LineTail(std::string path) : path_(std::move(path)) {}
  std::vector<std::string> read_new(uint64_t max_bytes = UINT64_MAX);
  void skip_existing();  // start after what the file holds now
  // Whether the last read_new started the file over: its lines are numbered from 1 again.
  bool started_over() const { return started_over_; }

 private:
  std::string path_;
  uint64_t offset_ = 0;
  uint64_t dev_ = 0, ino_ = 0;  // the file read so far (0, 0: none yet)
  bool started_over_ = false;
};

// One server-sent event of a run's stream: `id` is the metrics.jsonl line it came from (1-based),
// so Last-Event-ID resumes after it.
struct RunEvent {
  int64_t id = 0;
  std::string type;  // step | eval | advice | finding | record
  nlohmann::json data;
};
// The events of one metrics.jsonl line (a step record with advice gives two, the same id); a line
// that is not a JSON object gives none.
std::vector<RunEvent> events_of_line(int64_t line_no, const std::string& line);
std::vector<RunEvent> events_of_record(int64_t line_no, const nlohmann::json& rec);

// One event in the text/event-stream format (id < 0: no id line).
std::string sse_event(const std::string& type, const std::string& data, int64_t id = -1);
// The events of a parsed metrics.jsonl line as text/event-stream text ("" for none).
std::string sse_of_record(int64_t line_no, const nlohmann::json& rec);

// The latest numbers of a run, folded from its files' lines as they come (no locking, no files:
// RunFeed feeds it).
class Progress {
 public:
  static constexpr size_t kMaxAdvice = 10;  // the latest advice kept
  void on_metrics(const nlohmann::json& rec, std::chrono::steady_clock::time_point now);
  void on_stdout(const std::string& line);
  void on_stderr(const std::string& line);
  // A child was just started: what the previous start printed (its error, capture, "stopped by
  // request", step count) and its speed are no longer this run's; the metrics seen so far are.
  void new_start();
  // The fields of GET /v1/runs/{id}: step, total_steps, epoch, loss, grad_norm, loss_scale,
  // learning_rate, skipped_steps, nan_steps, tokens_per_s, steps_per_s, eta_s, advice (latest
  // first), capture {path, replay}.
  nlohmann::json snapshot() const;
  // The last "error: ..." or "stopped: ..." line of the child's stderr, with the tracer's finding
  // printed before it and the "cause: ..." after it, one a line, as keel train printed them (""
  // when none).
  const std::string& last_error() const { return error_; }
  // The NaN capture directory named by the child's stderr ("" when none).
  const std::string& capture() const { return capture_; }
  // Whether the child printed "stopped by request" (a graceful stop completed).
  bool stopped_by_request() const { return stopped_by_request_; }

 private:
  nlohmann::json last_step_;
  int64_t total_steps_ = 0;
  std::deque<nlohmann::json> advice_;  // latest first
  std::string error_, capture_, replay_;
  std::string finding_;  // the tracer's finding, until the stop line it explains
  bool stopped_by_request_ = false;
  // Steps per second over what this server saw of this start (the first step seen, the latest).
  std::chrono::steady_clock::time_point first_seen_;
  int64_t first_step_ = -1;
  double steps_per_s_ = 0;
};

}  // namespace keel::serve
