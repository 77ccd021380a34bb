#include "keel/serve/progress.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <regex>

namespace keel::serve {

using json = nlohmann::json;

std::vector<std::string> LineTail::read_new(uint64_t max_bytes) {
  std::vector<std::string> lines;
  started_over_ = false;
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) return lines;
  const auto size = static_cast<uint64_t>(st.st_size);
  const bool replaced = ino_ != 0 && (st.st_ino != ino_ || st.st_dev != dev_);
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  if (size < offset_ || replaced) {  // truncated or replaced: start over
    started_over_ = offset_ > 0;
    offset_ = 0;
  }
  if (size == offset_) return lines;
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);  // CLOEXEC: runs are forked
  if (fd < 0) return lines;
  std::string chunk;
  uint64_t want = std::min(size - offset_, max_bytes);
  for (;;) {
    const size_t had = chunk.size();
    chunk.resize(had + want);
    size_t got = 0;
    while (got < want) {
      const ssize_t n = ::pread(fd, chunk.data() + had + got, want - got,
                                static_cast<off_t>(offset_ + had + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    chunk.resize(had + got);
    // A bounded read that holds no whole line: read the rest of that line too.
    if (got < want || chunk.find('\n', had) != std::string::npos || offset_ + chunk.size() >= size)
      break;
    want = std::min<uint64_t>(size - offset_ - chunk.size(), std::max<uint64_t>(max_bytes, 4096));
  }
  ::close(fd);
  size_t begin = 0, nl;
  while ((nl = chunk.find('\n', begin)) != std::string::npos) {
    lines.push_back(chunk.substr(begin, nl - begin));
    begin = nl + 1;
  }
  offset_ += begin;
  return lines;
}

void LineTail::skip_existing() {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) return;
  offset_ = static_cast<uint64_t>(st.st_size);
  dev_ = st.st_dev;
  ino_ = st.st_ino;
}

std::vector<RunEvent> events_of_record(int64_t line_no, const json& rec) {
  if (!rec.is_object()) return {};
  std::vector<RunEvent> ev;
  // The advisor's findings are records of their own ({kind: advisor, step, trend, cause, action,
  // examples}: apps/keel/train.cpp) and reach a client as `finding` events.
  const bool finding = rec.contains("finding") || rec.value("kind", json()) == "advisor";
  const char* type = finding                     ? "finding"
                     : rec.contains("grad_norm") ? "step"
                     : rec.contains("eval_loss") ? "eval"
                                                 : "record";
  ev.push_back({line_no, type, rec});
  if (rec.contains("advice") && std::string(type) == "step")
    ev.push_back({line_no, "advice", {{"step", rec.value("step", 0)}, {"advice", rec["advice"]}}});
  return ev;
}

std::vector<RunEvent> events_of_line(int64_t line_no, const std::string& line) {
  const json rec = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (rec.is_discarded()) return {};
  return events_of_record(line_no, rec);
}

std::string sse_event(const std::string& type, const std::string& data, int64_t id) {
  std::string e;
  if (id >= 0) e += "id: " + std::to_string(id) + "\n";
  e += "event: " + type + "\n";
  e += "data: " + data + "\n\n";  // JSON dumps hold no newline
  return e;
}

std::string sse_of_record(int64_t line_no, const json& rec) {
  std::string out;
  for (const RunEvent& e : events_of_record(line_no, rec))
    out += sse_event(e.type, e.data.dump(-1, ' ', false, json::error_handler_t::replace), e.id);
  return out;
}

void Progress::on_metrics(const json& rec, std::chrono::steady_clock::time_point now) {
  if (!rec.is_object() || !rec.contains("grad_norm") || !rec.contains("step")) return;
  last_step_ = rec;
  const int64_t step = rec["step"].is_number() ? rec["step"].get<int64_t>() : 0;
  if (first_step_ < 0 || step < first_step_) {  // first seen, or a resume started over
    first_step_ = step;
    first_seen_ = now;
  } else if (step > first_step_) {
    const double s = std::chrono::duration<double>(now - first_seen_).count();
    if (s > 0) steps_per_s_ = static_cast<double>(step - first_step_) / s;
  }
  if (rec.contains("advice")) {
    advice_.push_front({{"step", step}, {"advice", rec["advice"]}});
    if (advice_.size() > kMaxAdvice) advice_.pop_back();
  }
}

void Progress::on_stdout(const std::string& line) {
  // The header line of `keel train`: "... | 400 steps | out DIR".
  static const std::regex kSteps(R"(\| (\d+) steps(?: \||$))");
  std::smatch m;
  if (line.rfind("keel train |", 0) == 0) {
    // A start's first line: what an earlier start of the run printed to stdout.log is not this
    // one's (a feed built from the whole file, after a restart, reads every start's lines).
    stopped_by_request_ = false;
    if (std::regex_search(line, m, kSteps)) total_steps_ = std::stoll(m[1]);
  }
  if (line.rfind("stopped by request", 0) == 0) stopped_by_request_ = true;
}

void Progress::on_stderr(const std::string& line) {
  // The path may hold spaces (the replay command quotes it then, numerics/text.h shell_word).
  static const std::regex kCapture(R"(capture written to (.+?); replay with: (keel replay .+)$)");
  // keel train explains a non-finite stop over up to three lines: the tracer's finding (which
  // module made the first non-finite value), the stop itself, and its cause (a 16-bit AdamW state
  // that underflowed). The run's error kept only the stop, and the explanation was in stderr.log
  // alone: it is the lines as keel train printed them.
  if (line.rfind("underflow/overflow tracer: ", 0) == 0) {
    finding_ = line;
  } else if (line.rfind("error", 0) == 0 || line.rfind("stopped", 0) == 0) {
    error_ = finding_.empty() ? line : finding_ + "\n" + line;
    finding_.clear();
  } else if (line.rfind("cause: ", 0) == 0 && !error_.empty()) {
    error_ += "\n" + line;
  }
  std::smatch m;
  if (std::regex_search(line, m, kCapture)) {
    capture_ = m[1];
    replay_ = m[2];
  }
}

void Progress::new_start() {
  total_steps_ = 0;
  error_.clear();
  finding_.clear();
  capture_.clear();
  replay_.clear();
  stopped_by_request_ = false;
  first_step_ = -1;
  steps_per_s_ = 0;
}

json Progress::snapshot() const {
  json s = json::object();
  const json& r = last_step_;
  auto field = [&](const char* k) { return r.is_object() && r.contains(k) ? r[k] : json(); };
  const int64_t step = field("step").is_number() ? field("step").get<int64_t>() : 0;
  s["step"] = step;
  s["total_steps"] = total_steps_;
  s["epoch"] = field("epoch");
  s["loss"] = field("loss");
  s["grad_norm"] = field("grad_norm");
  s["loss_scale"] = field("loss_scale");
  s["learning_rate"] = field("learning_rate");
  s["skipped_steps"] = field("skipped_steps").is_null() ? json(0) : field("skipped_steps");
  s["nan_steps"] = field("nan_steps").is_null() ? json(0) : field("nan_steps");
  s["tokens_per_s"] = field("tokens_per_s");
  s["steps_per_s"] = steps_per_s_;
  s["eta_s"] = steps_per_s_ > 0 && total_steps_ > step
                   ? json(static_cast<double>(total_steps_ - step) / steps_per_s_)
                   : json();
  s["advice"] = json(advice_);
  s["capture"] = capture_.empty() ? json() : json{{"path", capture_}, {"replay", replay_}};
  return s;
}

}  // namespace keel::serve
