// Reads the event file back with a decoder written here from the format's description (TFRecord
// framing, masked CRC-32C, protobuf wire format of tensorflow.Event), independent of the writer.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <sstream>

#include "keel/log/tensorboard.h"
#include "tests/support/check.h"
#include "tests/support/tb_events.h"

namespace keel::log {
namespace {

using test::decode_event;
using test::Event;
using test::read_records;
using test::ref_crc32c;
using test::ref_mask;

TEST(TensorBoard, Crc32cMatchesTheCheckValue) {
  EXPECT_EQ(ref_crc32c("123456789"), 0xe3069283u);  // the reference decoder is right
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);   // and so is the writer's
  EXPECT_EQ(crc32c("", 0), 0u);
  std::string bytes;
  for (int i = 0; i < 1000; ++i) bytes.push_back(static_cast<char>(i * 37 + 11));
  EXPECT_EQ(crc32c(bytes.data(), bytes.size()), ref_crc32c(bytes));
  EXPECT_EQ(masked_crc32c(bytes.data(), bytes.size()), ref_mask(ref_crc32c(bytes)));
}

double now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

StepResult step_result(int64_t step, double loss, double grad_norm, double lr, double scale) {
  StepResult r;
  r.step = step;
  r.loss = loss;
  r.grad_norm = grad_norm;
  r.lr = lr;
  r.loss_scale = scale;
  r.stepped = std::isfinite(grad_norm);
  r.found_inf = !r.stepped;
  r.skipped_steps = step % 3;
  r.nan_steps = step % 2;
  return r;
}

TEST(TensorBoard, WritesAnEventFileTensorBoardCanRead) {
  const std::string out = test::temp_dir("tb");
  const double t0 = std::floor(now());
  const double inf = std::numeric_limits<double>::infinity();
  std::string path;
  {
    TensorBoardWriter w(out);
    path = w.path();
    w.write(step_result(1, 2.5, 0.75, 3e-3, 65536));
    w.write(step_result(2, 2.25, inf, 2.9e-5, 65536));
    w.write(step_result(3, std::nan(""), std::nan(""), 1e-4, 32768));
    w.add_scalars(3, {{"eval_loss", 1.125}, {"huge", 1e300}}, 1234.5);
    w.write(step_result(300000000000, 0.5, 0.1, 1e-6, 1));  // steps beyond 32 bits
  }
  const double t1 = now();
  // out_dir/tb/events.out.tfevents.<10-digit time>.<host>
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string name = std::filesystem::path(path).filename().string();
  EXPECT_EQ(std::filesystem::path(path).parent_path(), std::filesystem::path(out) / "tb");
  std::smatch m;
  ASSERT_TRUE(std::regex_match(name, m, std::regex(R"(events\.out\.tfevents\.(\d{10})\.(.+))")))
      << name;
  EXPECT_EQ(m[2].str(), host);
  EXPECT_GE(std::stod(m[1]), t0 - 1);
  EXPECT_LE(std::stod(m[1]), t1);

  const std::vector<std::string> records = read_records(path);
  ASSERT_EQ(records.size(), 6u);
  const Event first = decode_event(records[0]);
  EXPECT_EQ(first.file_version, "brain.Event:2");
  EXPECT_TRUE(first.values.empty());
  EXPECT_GE(first.wall_time, t0);
  EXPECT_LE(first.wall_time, t1);

  const std::vector<std::string> tags = {"loss",       "grad_norm",     "learning_rate",
                                         "loss_scale", "skipped_steps", "nan_steps"};
  auto expect_step = [&](const Event& e, int64_t step, const std::vector<float>& values) {
    EXPECT_TRUE(e.has_step);
    EXPECT_EQ(e.step, step);
    EXPECT_TRUE(e.file_version.empty());
    EXPECT_GE(e.wall_time, t0);
    EXPECT_LE(e.wall_time, t1);
    ASSERT_EQ(e.values.size(), tags.size());
    for (size_t i = 0; i < tags.size(); ++i) {
      EXPECT_EQ(e.values[i].first, tags[i]);
      if (std::isnan(values[i]))
        EXPECT_TRUE(std::isnan(e.values[i].second)) << tags[i];
      else
        EXPECT_EQ(e.values[i].second, values[i]) << tags[i];
    }
  };
  const float finf = std::numeric_limits<float>::infinity(), fnan = std::nanf("");
  expect_step(decode_event(records[1]), 1, {2.5f, 0.75f, 3e-3f, 65536.f, 1.f, 1.f});
  expect_step(decode_event(records[2]), 2, {2.25f, finf, 2.9e-5f, 65536.f, 2.f, 0.f});
  expect_step(decode_event(records[3]), 3, {fnan, fnan, 1e-4f, 32768.f, 0.f, 1.f});
  const Event extra = decode_event(records[4]);
  EXPECT_EQ(extra.step, 3);
  EXPECT_EQ(extra.wall_time, 1234.5);
  ASSERT_EQ(extra.values.size(), 2u);
  EXPECT_EQ(extra.values[0], (std::pair<std::string, float>{"eval_loss", 1.125f}));
  EXPECT_EQ(extra.values[1].first, "huge");
  EXPECT_EQ(extra.values[1].second, finf);  // beyond float's range: inf, not garbage
  expect_step(decode_event(records[5]), 300000000000, {0.5f, 0.1f, 1e-6f, 1.f, 0.f, 0.f});
}

TEST(TensorBoard, EachWriterGetsItsOwnFile) {
  const std::string out = test::temp_dir("tb");
  TensorBoardWriter a(out), b(out);  // same second, same host
  EXPECT_NE(a.path(), b.path());
  a.write(step_result(1, 1, 1, 1, 1));
  EXPECT_EQ(read_records(a.path()).size(), 2u);  // flushed at once: TensorBoard sees the step
  EXPECT_EQ(read_records(b.path()).size(), 1u);
}

// A resumed run's writer starts with the session START at its first step; TensorBoard's view of the
// directory then has each step once, with the resumed run's value.
TEST(TensorBoard, AResumedWriterHidesTheInterruptedRunsLaterSteps) {
  const std::string out = test::temp_dir("tb-resume");
  {
    TensorBoardWriter interrupted(out);
    for (int64_t s = 1; s <= 4; ++s) interrupted.write(step_result(s, 10.0 + s, 1, 1, 1));
  }
  std::string resumed_path;
  {
    TensorBoardWriter resumed(out, /*purge_step=*/3);  // the checkpoint held step 2
    resumed_path = resumed.path();
    for (int64_t s = 3; s <= 5; ++s) resumed.write(step_result(s, 20.0 + s, 1, 1, 1));
  }
  const std::vector<std::string> records = read_records(resumed_path);
  ASSERT_EQ(records.size(), 5u);
  EXPECT_EQ(decode_event(records[0]).file_version, "brain.Event:2");
  const Event start = decode_event(records[1]);
  EXPECT_TRUE(start.session_start);
  EXPECT_EQ(start.step, 3);
  EXPECT_TRUE(start.values.empty());
  const auto view = test::tensorboard_view(out + "/tb", "loss");
  const std::vector<std::pair<int64_t, float>> want = {
      {1, 11.f}, {2, 12.f}, {3, 23.f}, {4, 24.f}, {5, 25.f}};
  EXPECT_EQ(view, want);
}

TEST(TensorBoard, EncodesKnownBytes) {
  // Hand-assembled: Event{wall_time = 1.0, step = 300, summary {value {tag "a" simple_value 0.5}}}
  const std::string expected = std::string("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f", 9) +
                               std::string("\x10\xac\x02", 3) +  // step 300
                               std::string(
                                   "\x2a\x0a\x0a\x08\x0a\x01"
                                   "a",
                                   7) +                                 // summary{value{tag
                               std::string("\x15\x00\x00\x00\x3f", 5);  // simple_value 0.5
  EXPECT_EQ(encode_scalars_event(1.0, 300, {{"a", 0.5f}}), expected);
  const std::string rec = encode_record(expected);
  ASSERT_EQ(rec.size(), 8 + 4 + expected.size() + 4);
  EXPECT_EQ(rec.substr(0, 8), std::string("\x18\0\0\0\0\0\0\0", 8));
  // Event{wall_time = 1.0, step = 3, session_log {status START}}
  EXPECT_EQ(encode_session_start_event(1.0, 3),
            std::string("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f\x10\x03\x3a\x02\x08\x01", 15));
}

}  // namespace
}  // namespace keel::log
