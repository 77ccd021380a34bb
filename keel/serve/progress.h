// What a run is doing, read from the files its child writes: metrics.jsonl (one JSON record per
// line: step records, eval records, findings) and the child's stdout and stderr. The server reads
// them as they grow, so progress is the run's own numbers, not a copy kept in step with it.
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace keel::serve {

// The complete lines appended to a file since the last call (a partial last line waits for its
// newline). A file that is missing reads as empty.
class LineTail {
 public:
  explicit LineTail(std::string path) : path_(std::move(path)) {}
  std::vector<std::string> read_new();
  void skip_existing();  // start after what the file holds now

 private:
  std::string path_;
  uint64_t offset_ = 0;
};

// One server-sent event of a run's stream: `id` is the metrics.jsonl line it came from (1-based),
// so Last-Event-ID resumes after it.
struct RunEvent {
  int64_t id = 0;
  std::string type;  // step | eval | advice | finding | record
  nlohmann::json data;
};
// The events of one metrics.jsonl line (a step record with advice gives two, the same id).
std::vector<RunEvent> events_of_line(int64_t line_no, const std::string& line);

// The latest numbers of a run, refreshed from its files on each read.
class RunProgress {
 public:
  // `new_start`: a child was just started: its stdout and stderr are read from their current ends
  // (what earlier starts of the run wrote there is theirs); metrics.jsonl is always read whole.
  RunProgress(const std::string& run_dir, bool new_start);
  // Reads what the files gained and returns the fields of GET /v1/runs/{id}: step, total_steps,
  // loss, grad_norm, loss_scale, learning_rate, skipped_steps, nan_steps, tokens_per_s,
  // steps_per_s, eta_s, advice (latest lines), capture {path, replay}, error_detail.
  nlohmann::json snapshot();
  // The last "error: ..." or "stopped: ..." line of the child's stderr ("" when none).
  std::string last_error();
  // The NaN capture directory named by the child's stderr ("" when none).
  std::string capture();
  // Whether the child printed "stopped by request" (a graceful stop completed).
  bool stopped_by_request();

 private:
  void refresh();  // mu_ held
  std::mutex mu_;
  LineTail metrics_, out_, err_;
  nlohmann::json last_step_;
  int64_t total_steps_ = 0;
  std::deque<nlohmann::json> advice_;  // latest first
  std::string error_, capture_, replay_;
  bool stopped_by_request_ = false;
  // Steps per second over what this server saw (the first step seen and the latest).
  std::chrono::steady_clock::time_point first_seen_;
  int64_t first_step_ = -1;
  double steps_per_s_ = 0;
};

}  // namespace keel::serve
