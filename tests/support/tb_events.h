// A TensorBoard event-file decoder written from the format's description (TFRecord framing, masked
// CRC-32C, protobuf wire format of tensorflow.Event), independent of keel's writer, and the view
// TensorBoard shows of a run's tb/ directory.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace keel::test {

// Bit-at-a-time CRC-32C (reflected Castagnoli polynomial), the slowest obviously-right form.
uint32_t ref_crc32c(const std::string& s);
uint32_t ref_mask(uint32_t crc);

struct Event {
  double wall_time = 0;
  int64_t step = 0;
  bool has_step = false;
  std::string file_version;
  bool session_start = false;                         // session_log {status: START}
  std::vector<std::pair<std::string, float>> values;  // summary values in order
};

Event decode_event(const std::string& data);
// Splits a file into records, checking the framing and both masked CRCs of each (gtest failures).
std::vector<std::string> read_records(const std::string& path);

// What TensorBoard plots for `tag` from the event files of `tb_dir`: files in name order (the
// directory loader's), events in file order, and TensorBoard's restart purge: a session START at
// step S drops every earlier event at a step >= S. (step, value) pairs in the order kept.
std::vector<std::pair<int64_t, float>> tensorboard_view(const std::string& tb_dir,
                                                        const std::string& tag);

}  // namespace keel::test
