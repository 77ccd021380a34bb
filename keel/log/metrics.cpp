#include "keel/log/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "keel/io/atomic_file.h"
#include "keel/io/json_fields.h"

#include "keel/numerics/error.h"

namespace keel::log {

using json = nlohmann::json;

json json_finite(const json& j) {
  if (j.is_number_float()) return io::json_float(j.get<double>());
  if (j.is_object()) {
    json out = json::object();
    for (auto& [k, v] : j.items()) out[k] = json_finite(v);
    return out;
  }
  if (j.is_array()) {
    json out = json::array();
    for (const json& v : j) out.push_back(json_finite(v));
    return out;
  }
  return j;
}

nlohmann::ordered_json metrics_record(const StepResult& r, const json& extra) {
  // ordered_json keeps the documented key order (plain json would sort the keys).
  nlohmann::ordered_json rec = {{"step", r.step},
                                {"epoch", r.epoch},
                                {"loss", io::json_float(r.loss)},
                                {"grad_norm", io::json_float(r.grad_norm)},
                                {"learning_rate", io::json_float(r.lr)},
                                {"loss_scale", io::json_float(r.loss_scale)},
                                {"skipped_steps", r.skipped_steps},
                                {"nan_steps", r.nan_steps},
                                {"tokens_per_s", io::json_float(r.tokens_per_s)}};
  // bf16/f16 weights: the share of this update's elements whose non-zero update rounded away.
  if (r.rounded_away > 0 && r.update_elements > 0)
    rec["rounded_away"] =
        static_cast<double>(r.rounded_away) / static_cast<double>(r.update_elements);
  if (!r.advice.empty()) rec["advice"] = r.advice;
  if (!extra.is_null() && !extra.is_object())
    throw Error("metrics: extra fields must be a JSON object, got " + extra.dump());
  if (extra.is_object())
    for (auto& [k, v] : extra.items()) {
      if (rec.contains(k))
        throw Error("metrics: extra field '" + k +
                    "' collides with a fixed key of metrics.jsonl (rename it, e.g. eval_" + k +
                    ")");
      rec[k] = nlohmann::ordered_json(json_finite(v));
    }
  return rec;
}

void drop_metrics_after(const std::string& out_dir, int64_t step) {
  const std::string path = (std::filesystem::path(out_dir) / "metrics.jsonl").string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return;
  std::istringstream in(io::read_file(path));
  std::string kept, line;
  bool dropped = false;
  while (std::getline(in, line)) {
    const json rec = json::parse(line, nullptr, /*allow_exceptions=*/false);
    const bool keep = rec.is_object() && (!rec.contains("step") || !rec["step"].is_number() ||
                                          rec["step"].get<double>() <= static_cast<double>(step));
    if (keep)
      kept += line + "\n";
    else
      dropped = true;
  }
  if (dropped) io::write_file_atomic(path, kept);
}

MetricsWriter::MetricsWriter(const std::string& out_dir) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  path_ = (std::filesystem::path(out_dir) / "metrics.jsonl").string();
  f_ = std::fopen(path_.c_str(), "a");
  if (!f_) throw Error("cannot open " + path_ + " for appending: " + write_failure(errno));
  // Unbuffered: each line is one write(2), and what a failed one left is cut off below (a full
  // disk left half a record as the file's last line, and the rest waited in stdio's buffer).
  std::setvbuf(f_, nullptr, _IONBF, 0);
  std::fseek(f_, 0, SEEK_END);
  whole_ = std::ftell(f_);
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

void MetricsWriter::write(const StepResult& r, const json& extra) {
  write_line(metrics_record(r, extra).dump());
}

void MetricsWriter::write_record(const json& record) { write_line(json_finite(record).dump()); }

void MetricsWriter::write_line(const std::string& text) {
  const std::string line = text + "\n";
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0) {
    const int err = errno;
    if (::ftruncate(::fileno(f_), whole_) == 0) std::clearerr(f_);
    throw Error("cannot write " + path_ + ": " + write_failure(err) +
                "; the records before this one are kept");
  }
  whole_ += static_cast<long>(line.size());
}

}  // namespace keel::log
