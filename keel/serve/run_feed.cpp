#include "keel/serve/run_feed.h"

#include <utility>

#include "keel/serve/registry.h"

namespace keel::serve {

using json = nlohmann::json;

RunFeed::RunFeed(const std::string& run_dir, size_t window_lines)
    : metrics_path_(run_dir + "/metrics.jsonl"),
      window_lines_(std::max<size_t>(window_lines, 1)),
      metrics_(metrics_path_),
      out_(run_dir + "/stdout.log"),
      err_(run_dir + "/stderr.log") {
  // What the files hold already is folded into the progress but not kept as events: a stream
  // that wants those lines reads them from the file (a finished run's feed then holds no window).
  //
  // Of those lines the progress keeps only the newest step record and the newest advice (steps
  // per second are of what this server sees run), so only they are parsed, found from the end by
  // their keys: parsing every line of a long run took 80 ms a 20,000-step run, seconds for the
  // first list after a restart.
  const auto now = Clock::now();
  const std::vector<std::string> lines = metrics_.read_new();
  end_ += static_cast<int64_t>(lines.size());
  file_lines_ = end_ - 1;
  std::vector<json> kept;  // newest first
  bool have_step = false;
  size_t advice = 0;
  for (auto it = lines.rbegin();
       it != lines.rend() && !(have_step && advice >= Progress::kMaxAdvice); ++it) {
    const bool may_advise =
        advice < Progress::kMaxAdvice && it->find("\"advice\"") != std::string::npos;
    if (have_step && !may_advise) continue;
    if (it->find("\"grad_norm\"") == std::string::npos) continue;  // no step record
    json rec = json::parse(*it, nullptr, /*allow_exceptions=*/false);
    if (!rec.is_object() || !rec.contains("grad_norm") || !rec.contains("step")) continue;
    have_step = true;
    advice += rec.contains("advice");
    kept.push_back(std::move(rec));
  }
  for (auto it = kept.rbegin(); it != kept.rend(); ++it) progress_.on_metrics(*it, now);
  for (const std::string& line : out_.read_new()) progress_.on_stdout(line);
  for (const std::string& line : err_.read_new()) progress_.on_stderr(line);
}

void RunFeed::refresh_locked() {
  const auto now = Clock::now();
  bool grew = false;
  const std::vector<std::string> lines = metrics_.read_new();
  // The file was rewritten: a resume drops the records after its checkpoint, then does those
  // steps again. Its lines count from 1 again, and those below end_ were given to the streams
  // already (the same steps, bit for bit): they are not given again, so that an event's id stays
  // its line in the file, which a Last-Event-ID reconnect reads by. Read as new lines, every step
  // up to the checkpoint was sent twice, under ids past the end of the file.
  const bool over = metrics_.started_over();
  if (over) file_lines_ = 0;
  json reread;  // the newest line that the start over read again: where the run is now
  for (const std::string& line : lines) {
    const json rec = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (++file_lines_ < end_) {
      // Re-read at once, they would count as steps done in no time (steps_per_s): only the
      // newest is the run's progress. Later ones are the steps done again, as they come.
      if (over)
        reread = rec;
      else
        progress_.on_metrics(rec, now);
      continue;
    }
    if (!reread.is_null()) progress_.on_metrics(std::exchange(reread, json()), now);
    progress_.on_metrics(rec, now);
    window_.push_back(rec.is_discarded() ? std::string() : sse_of_record(end_, rec));
    if (window_.size() > window_lines_) window_.pop_front();
    ++end_;
    grew = true;
  }
  if (!reread.is_null()) progress_.on_metrics(reread, now);
  for (const std::string& line : out_.read_new()) progress_.on_stdout(line);
  for (const std::string& line : err_.read_new()) progress_.on_stderr(line);
  if (grew) changed_.notify_all();
}

void RunFeed::refresh() {
  std::lock_guard<std::mutex> lock(mu_);
  refresh_locked();
}

void RunFeed::new_start() {
  std::lock_guard<std::mutex> lock(mu_);
  refresh_locked();  // the metrics the previous start wrote are the run's
  progress_.new_start();
  out_.skip_existing();
  err_.skip_existing();
}

void RunFeed::set_state(const std::string& state) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state == state_) return;
  state_ = state;
  changed_.notify_all();
}

void RunFeed::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  changed_.notify_all();
}

json RunFeed::snapshot() {
  std::lock_guard<std::mutex> lock(mu_);
  return progress_.snapshot();
}

std::string RunFeed::last_error() {
  std::lock_guard<std::mutex> lock(mu_);
  return progress_.last_error();
}

std::string RunFeed::capture() {
  std::lock_guard<std::mutex> lock(mu_);
  return progress_.capture();
}

bool RunFeed::stopped_by_request() {
  std::lock_guard<std::mutex> lock(mu_);
  return progress_.stopped_by_request();
}

RunFeed::View RunFeed::view(int64_t next) {
  std::lock_guard<std::mutex> lock(mu_);
  View v;
  v.window_begin = end_ - static_cast<int64_t>(window_.size());
  v.end = end_;
  for (int64_t i = std::max(next, v.window_begin); i < end_; ++i)
    v.events += window_[static_cast<size_t>(i - v.window_begin)];
  v.state = state_;
  v.closed = closed_;
  return v;
}

int64_t RunFeed::last_event_id() {
  std::lock_guard<std::mutex> lock(mu_);
  return end_ - 1;
}

void RunFeed::wait(int64_t next, const std::string& state, Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait_until(lock, deadline, [&] { return end_ > next || state_ != state || closed_; });
}

FeedSubscriber::FeedSubscriber(std::shared_ptr<RunFeed> feed, int64_t last_event_id)
    : feed_(std::move(feed)), next_(std::max<int64_t>(last_event_id, 0) + 1) {}

FeedSubscriber::Chunk FeedSubscriber::take(uint64_t file_bytes) {
  RunFeed::View v = feed_->view(next_);
  Chunk c;
  if (next_ < v.window_begin) {
    // Lines that left the window (or were read before the feed kept one): from the file, by
    // number, each once. The state and the end wait until the stream has caught up.
    if (!file_) file_.emplace(feed_->metrics_path());
    const std::vector<std::string> lines = file_->read_new(file_bytes);
    if (file_->started_over()) file_lines_ = 0;  // rewritten by a resume (RunFeed::refresh_locked)
    for (const std::string& line : lines) {
      if (++file_lines_ < next_) continue;  // the client has it
      const json rec = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!rec.is_discarded()) c.text += sse_of_record(file_lines_, rec);
      next_ = file_lines_ + 1;
    }
    // The file holds fewer lines than the feed counted (it was replaced): go on from the window.
    if (lines.empty()) next_ = v.window_begin;
    return c;
  }
  c.text = std::move(v.events);
  next_ = std::max(next_, v.end);
  if (v.state != state_) {
    state_ = v.state;
    c.text += sse_event("state", json{{"state", state_}}.dump());
  }
  c.done = v.closed || !is_active_state(v.state);
  return c;
}

void FeedSubscriber::wait(RunFeed::Clock::time_point deadline) {
  feed_->wait(next_, state_, deadline);
}

}  // namespace keel::serve
