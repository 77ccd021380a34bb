// safetensors headers are input: a shape whose element or byte count does not fit in 64 bits is
// an error naming the file and the tensor (it used to wrap to 0 bytes and be accepted), and the
// header can be read alone, so that sizes are checked before anything is allocated.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "keel/io/safetensors.h"
#include "tests/support/check.h"

namespace keel::io {
namespace {

using json = nlohmann::json;
using test::error_of;

// A file with `header` and `data_bytes` zero bytes of data.
std::string write_raw(const std::string& name, const json& header, size_t data_bytes) {
  const std::string path = test::temp_dir("safetensors") + "/" + name;
  const std::string h = header.dump();
  const uint64_t n = h.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << h << std::string(data_bytes, '\0');
  return path;
}

TEST(Safetensors, ShapesThatOverflowAreErrorsNamingFileAndTensor) {
  // [2^32, 2^32] of F32: 2^64 elements wrap to 0, which matched data_offsets [0, 0].
  const int64_t big = int64_t{1} << 32;
  std::string p =
      write_raw("wrap.safetensors",
                {{"w", {{"dtype", "F32"}, {"shape", {big, big}}, {"data_offsets", {0, 0}}}}}, 0);
  std::string m = error_of([&] { read_safetensors(p); });
  EXPECT_CONTAINS(m, p);
  EXPECT_CONTAINS(m, "tensor 'w'");
  EXPECT_CONTAINS(m, "more than 2^64 bytes");
  EXPECT_CONTAINS(error_of([&] { read_safetensors_header(p); }), "tensor 'w'");
  // 2^62 elements of F32: the element count fits, the byte count does not.
  p = write_raw(
      "bytes.safetensors",
      {{"w", {{"dtype", "F32"}, {"shape", {int64_t{1} << 62}}, {"data_offsets", {0, 0}}}}}, 0);
  EXPECT_CONTAINS(error_of([&] { read_safetensors(p); }), "more than 2^64 bytes");
  // A size that does not match the data: named with both numbers.
  p = write_raw("short.safetensors",
                {{"w", {{"dtype", "F32"}, {"shape", {4, 4}}, {"data_offsets", {0, 8}}}}}, 8);
  m = error_of([&] { read_safetensors(p); });
  EXPECT_CONTAINS(m,
                  "tensor 'w': data_offsets [0, 8) hold 8 bytes but shape [4, 4] of f32 needs 64");
  p = write_raw("shape.safetensors",
                {{"w", {{"dtype", "F32"}, {"shape", 4}, {"data_offsets", {0, 16}}}}}, 16);
  EXPECT_CONTAINS(error_of([&] { read_safetensors(p); }), "shape must be an array");
  // shape_numel itself refuses to wrap.
  EXPECT_CONTAINS(error_of([&] { shape_numel({big, big}); }), "more than 2^63 elements");
}

TEST(Safetensors, HeaderAloneGivesNamesShapesAndOffsets) {
  const std::string p =
      write_raw("ok.safetensors",
                {{"b", {{"dtype", "BF16"}, {"shape", {3}}, {"data_offsets", {16, 22}}}},
                 {"a", {{"dtype", "F32"}, {"shape", {2, 2}}, {"data_offsets", {0, 16}}}},
                 {"__metadata__", {{"format", "pt"}}}},
                22);
  const SafetensorsHeader h = read_safetensors_header(p);
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "a");  // in file order
  EXPECT_EQ(h.tensors[0].shape, (Shape{2, 2}));
  EXPECT_EQ(h.tensors[1].dtype, DType::BF16);
  EXPECT_EQ(h.tensors[1].end, 22u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
  const Safetensors full = read_safetensors(p);
  EXPECT_EQ(full.tensors[0].first, "a");
  EXPECT_EQ(full.at("b").shape(), (Shape{3}));
}

}  // namespace
}  // namespace keel::io
