#include "keel/serve/progress.h"

#include <fstream>
#include <regex>

namespace keel::serve {

using json = nlohmann::json;

std::vector<std::string> LineTail::read_new() {
  std::vector<std::string> lines;
  std::ifstream in(path_, std::ios::binary);
  if (!in) return lines;
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  if (size < offset_) offset_ = 0;  // truncated or replaced: start over
  if (size == offset_) return lines;
  in.seekg(static_cast<std::streamoff>(offset_));
  std::string chunk(size - offset_, '\0');
  in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
  chunk.resize(static_cast<size_t>(in.gcount()));
  size_t begin = 0, nl;
  while ((nl = chunk.find('\n', begin)) != std::string::npos) {
    lines.push_back(chunk.substr(begin, nl - begin));
    begin = nl + 1;
  }
  offset_ += begin;
  return lines;
}

void LineTail::skip_existing() {
  std::ifstream in(path_, std::ios::binary | std::ios::ate);
  if (in) offset_ = static_cast<uint64_t>(in.tellg());
}

std::vector<RunEvent> events_of_line(int64_t line_no, const std::string& line) {
  json rec = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (rec.is_discarded() || !rec.is_object()) return {};
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

RunProgress::RunProgress(const std::string& run_dir, bool new_start)
    : metrics_(run_dir + "/metrics.jsonl"),
      out_(run_dir + "/stdout.log"),
      err_(run_dir + "/stderr.log") {
  if (new_start) {
    out_.skip_existing();
    err_.skip_existing();
  }
}

void RunProgress::refresh() {
  const auto now = std::chrono::steady_clock::now();
  for (const std::string& line : metrics_.read_new()) {
    json rec = json::parse(line, nullptr, false);
    if (rec.is_discarded() || !rec.is_object()) continue;
    if (rec.contains("grad_norm") && rec.contains("step")) {
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
        if (advice_.size() > 10) advice_.pop_back();
      }
    }
  }
  // The header line of `keel train`: "... | 400 steps | out DIR".
  static const std::regex kSteps(R"(\| (\d+) steps(?: \||$))");
  for (const std::string& line : out_.read_new()) {
    std::smatch m;
    if (line.rfind("keel train |", 0) == 0 && std::regex_search(line, m, kSteps))
      total_steps_ = std::stoll(m[1]);
    if (line.rfind("stopped by request", 0) == 0) stopped_by_request_ = true;
  }
  static const std::regex kCapture(R"(capture written to (\S+?);? replay with: (keel replay \S+))");
  for (const std::string& line : err_.read_new()) {
    if (line.rfind("error", 0) == 0 || line.rfind("stopped", 0) == 0) error_ = line;
    std::smatch m;
    if (std::regex_search(line, m, kCapture)) {
      capture_ = m[1];
      replay_ = m[2];
    }
  }
}

json RunProgress::snapshot() {
  std::lock_guard<std::mutex> lock(mu_);
  refresh();
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

std::string RunProgress::last_error() {
  std::lock_guard<std::mutex> lock(mu_);
  refresh();
  return error_;
}

std::string RunProgress::capture() {
  std::lock_guard<std::mutex> lock(mu_);
  refresh();
  return capture_;
}

bool RunProgress::stopped_by_request() {
  std::lock_guard<std::mutex> lock(mu_);
  refresh();
  return stopped_by_request_;
}

}  // namespace keel::serve
