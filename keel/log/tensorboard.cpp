#include "keel/log/tensorboard.h"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>

#include "keel/numerics/error.h"

namespace keel::log {

namespace {

// Byte-at-a-time table for the reflected Castagnoli polynomial.
const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protobuf wire format: varints, fixed 32/64-bit little-endian, length-delimited fields.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_tag(std::string& out, uint32_t field, uint32_t wire_type) {
  put_varint(out, (uint64_t(field) << 3) | wire_type);
}

template <class T>
void put_fixed(std::string& out, T v) {  // little-endian hosts only (x86-64, aarch64)
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

std::string event_header(double wall_time, const int64_t* step) {
  std::string e;
  put_tag(e, 1, 1);  // wall_time: double
  put_fixed(e, wall_time);
  if (step) {
    put_tag(e, 2, 0);  // step: int64 (two's complement varint)
    put_varint(e, static_cast<uint64_t>(*step));
  }
  return e;
}

// double -> float without undefined behaviour for values beyond float's range (they become inf).
float to_float(double x) {
  if (x > std::numeric_limits<float>::max()) return std::numeric_limits<float>::infinity();
  if (x < -std::numeric_limits<float>::max()) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(x);
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto& t = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string encode_file_version_event(double wall_time, const std::string& version) {
  std::string e = event_header(wall_time, nullptr);  // step 0: omitted, as TensorFlow writes it
  put_bytes(e, 3, version);                          // file_version
  return e;
}

std::string encode_session_start_event(double wall_time, int64_t step) {
  std::string log;
  put_tag(log, 1, 0);  // SessionLog.status: enum varint
  put_varint(log, 1);  // START
  std::string e = event_header(wall_time, &step);
  put_bytes(e, 7, log);  // Event.session_log
  return e;
}

std::string encode_scalars_event(double wall_time, int64_t step,
                                 const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (auto& [tag, value] : values) {
    std::string v;
    put_bytes(v, 1, tag);  // Value.tag
    put_tag(v, 2, 5);      // Value.simple_value: float (fixed32)
    put_fixed(v, value);
    put_bytes(summary, 1, v);  // Summary.value (repeated)
  }
  std::string e = event_header(wall_time, &step);
  put_bytes(e, 5, summary);  // Event.summary
  return e;
}

std::string encode_record(const std::string& data) {
  std::string r;
  const uint64_t len = data.size();
  put_fixed(r, len);
  put_fixed(r, masked_crc32c(r.data(), 8));
  r += data;
  put_fixed(r, masked_crc32c(data.data(), data.size()));
  return r;
}

TensorBoardWriter::TensorBoardWriter(const std::string& out_dir, int64_t purge_step) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(out_dir) / "tb";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error("cannot create " + dir.string() + ": " + ec.message());
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || !host[0]) std::strcpy(host, "localhost");
  for (char* c = host; *c; ++c)
    if (*c == '/') *c = '_';
  const double t = now_seconds();
  const std::string base =
      (dir / fmt::format("events.out.tfevents.{:010d}.{}", static_cast<int64_t>(t), host)).string();
  path_ = base;
  for (int i = 1; fs::exists(path_); ++i) path_ = base + "." + std::to_string(i);
  f_ = std::fopen(path_.c_str(), "wb");
  if (!f_) throw Error("cannot create " + path_ + ": " + write_failure(errno));
  append(encode_file_version_event(t, "brain.Event:2"));
  if (purge_step >= 0) append(encode_session_start_event(t, purge_step));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::append(const std::string& event) {
  const std::string rec = encode_record(event);
  if (std::fwrite(rec.data(), 1, rec.size(), f_) != rec.size() || std::fflush(f_) != 0)
    throw Error("cannot write " + path_ + ": " + write_failure(errno));
}

void TensorBoardWriter::write(const StepResult& r) {
  add_scalars(r.step, {{"loss", r.loss},
                       {"grad_norm", r.grad_norm},
                       {"learning_rate", r.lr},
                       {"loss_scale", r.loss_scale},
                       {"skipped_steps", static_cast<double>(r.skipped_steps)},
                       {"nan_steps", static_cast<double>(r.nan_steps)}});
}

void TensorBoardWriter::add_scalars(int64_t step,
                                    const std::vector<std::pair<std::string, double>>& values,
                                    double wall_time) {
  std::vector<std::pair<std::string, float>> v;
  for (auto& [tag, x] : values) v.emplace_back(tag, to_float(x));
  append(encode_scalars_event(wall_time < 0 ? now_seconds() : wall_time, step, v));
}

}  // namespace keel::log
