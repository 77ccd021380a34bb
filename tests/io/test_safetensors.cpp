// safetensors headers are input: a shape whose element or byte count does not fit in 64 bits is
// an error naming the file and the tensor (it used to wrap to 0 bytes and be accepted), and the
// header can be read alone, so that sizes are checked before anything is allocated.
#include <gtest/gtest.h>

#include <cstdlib>

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "keel/io/safetensors.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"
#include "tests/support/standard_safetensors.h"

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

// The data section holds the tensors back to back and nothing else (the reference
// implementation's InvalidOffset and MetadataIncompleteBuffer): bytes appended to a file, a hole
// before or between tensors, and a tensor named twice in the header (JSON keeps the last entry,
// whose bytes the first one's leave uncovered) were read without a word.
TEST(Safetensors, BytesNoTensorCoversAreAnErrorNamingTheFile) {
  const json one = {{"w", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}}};
  std::string p = write_raw("appended.safetensors", one, 8 + 100);
  std::string m = error_of([&] { read_safetensors(p); });
  EXPECT_CONTAINS(m, p + ": not a valid safetensors file: the tensors end at data byte 8 but the "
                         "file holds 108 data bytes: 100 bytes after the last tensor");
  EXPECT_CONTAINS(error_of([&] { read_safetensors_header(p); }), "100 bytes after the last tensor");
  p = write_raw("hole.safetensors",
                {{"a", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}}},
                 {"b", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {8, 12}}}}},
                12);
  EXPECT_CONTAINS(error_of([&] { read_safetensors(p); }),
                  "tensor 'b' starts at data byte 8 but the tensor before it ends at 4");
  p = write_raw("late.safetensors",
                {{"w", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {4, 8}}}}}, 8);
  EXPECT_CONTAINS(error_of([&] { read_safetensors(p); }),
                  "tensor 'w' starts at data byte 4 but the data section starts at 0");
  // The same name twice: {"w": [0, 4), "w": [4, 8)} parses as the last entry alone.
  p = test::temp_dir("safetensors") + "/twice.safetensors";
  const std::string h = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, )"
                        R"("w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  const uint64_t n = h.size();
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(&n), 8)
      << h << std::string(8, '\0');
  EXPECT_CONTAINS(error_of([&] { read_safetensors(p); }), "a tensor named twice in the header?");
  // What keel writes reads back (zero-sized tensors included).
  p = test::temp_dir("safetensors") + "/ok.safetensors";
  write_safetensors(
      p, {{"a", Tensor::zeros({3})}, {"e", Tensor::zeros({0})}, {"b", Tensor::zeros({2, 2})}});
  EXPECT_EQ(read_safetensors(p).tensors.size(), 3u);
}

// A zero-sized tensor starts where the next one does: the header's tensors were sorted by their
// first byte alone, so the pair could come out in either order, and keel's own file {a, e: [0],
// b} was refused as "tensors 'b' and 'e' overlap".
TEST(Safetensors, AnEmptyTensorBesideAnotherReadsBack) {
  const std::string p = test::temp_dir("safetensors") + "/empty.safetensors";
  write_safetensors(
      p, {{"a", Tensor::zeros({3})}, {"e", Tensor::zeros({0})}, {"b", Tensor::zeros({2, 2})}});
  const Safetensors st = read_safetensors(p);
  ASSERT_EQ(st.tensors.size(), 3u);
  EXPECT_EQ(st.at("e").numel(), 0);
  EXPECT_EQ(st.at("b").shape(), (Shape{2, 2}));
}

// nlohmann's parse throws out_of_range, not parse_error, for a number beyond a double: it escaped
// every reader that caught parse_error only (found by tests/fuzz's run_request campaign).
TEST(Safetensors, ANumberBeyondADoubleInTheHeaderIsAnErrorNamingTheFile) {
  const std::string p = test::temp_dir("safetensors") + "/overflow.safetensors";
  const std::string h = R"({"w": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 0]}})";
  const uint64_t n = h.size();
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(&n), 8) << h;
  const std::string m = error_of([&] { read_safetensors(p); });
  EXPECT_CONTAINS(m, p + ": not a valid safetensors file: header JSON: number overflow");
  EXPECT_EQ(m.find("json.exception"), std::string::npos) << m;
}

// Safetensors files are read by offset: a device (/dev/zero read as an empty file: "shorter than
// the 8-byte header"; a mapping's "Success") and a pipe (open waited for a writer) are refused.
TEST(Safetensors, DevicesAndPipesAreRefusedNamingTheFile) {
  for (const auto& read : std::vector<std::function<void(const std::string&)>>{
           [](const std::string& p) { read_safetensors_header(p); },
           [](const std::string& p) { read_safetensors(p); },
           [](const std::string& p) { read_safetensors_into(p, {}); }}) {
    EXPECT_EQ(error_of([&] { read("/dev/zero"); }),
              "cannot read /dev/zero: it is a character device, not a file; a safetensors "
              "file was expected");
    const std::string fifo = test::temp_dir("safetensors-fifo") + "/model.safetensors";
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    EXPECT_CONTAINS(error_of([&] { read(fifo); }),
                    "cannot read " + fifo +
                        ": it is not a regular file (a pipe cannot be read by "
                        "offset)");
  }
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

// Views of one buffer (the optimizer's flat state) are laid out in the buffer's order and written
// as one block per buffer, whatever order they are given in; the file is a standard safetensors
// file, and a reader that fills views of a flat buffer gets each block back with one read.
TEST(Safetensors, ViewsOfOneBufferAreWrittenAsOneBlockAndReadBackInOne) {
  const Tensor f32 = test::randn({64}, 1), bf16 = test::randn({64}, 2, 1.f, DType::BF16);
  const Tensor count = Tensor::from_ints({3}, {}, DType::I64);  // a storage of its own
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"w.m", f32.slice_rows(0, 48).view({6, 8})},
      {"w.v", bf16.slice_rows(0, 48).view({6, 8})},
      {"w.step", count},
      {"b.m", f32.slice_rows(48, 64)},
      {"b.v", bf16.slice_rows(48, 64)},
  };
  const std::string p = test::temp_dir("safetensors") + "/blocks.safetensors";
  const SafetensorsWrite w = write_safetensors(p, tensors);
  EXPECT_EQ(w.runs, 3u);         // the f32 buffer, the bf16 buffer, the count
  EXPECT_EQ(w.write_calls, 4u);  // the header, then one per run
  test::expect_standard_safetensors(p);
  const SafetensorsHeader h = read_safetensors_header(p);
  std::vector<std::string> order;
  for (const TensorInfo& t : h.tensors) order.push_back(t.name);
  EXPECT_EQ(order, (std::vector<std::string>{"w.m", "b.m", "w.v", "b.v", "w.step"}));
  const Safetensors back = read_safetensors(p);
  for (const auto& [name, t] : tensors) test::expect_bitwise_equal(back.at(name), t, name);

  // Into views of fresh buffers of the same layout: one read per block.
  const Tensor f32_in = Tensor::zeros({64}), bf16_in = Tensor::zeros({64}, DType::BF16);
  const Tensor count_in = Tensor::zeros({}, DType::I64);
  const std::vector<std::pair<std::string, Tensor>> into = {
      {"b.v", bf16_in.slice_rows(48, 64)},
      {"w.step", count_in},
      {"w.m", f32_in.slice_rows(0, 48).view({6, 8})},
      {"b.m", f32_in.slice_rows(48, 64)},
      {"w.v", bf16_in.slice_rows(0, 48).view({6, 8})},
  };
  EXPECT_TRUE(holds_exactly(h, into));
  EXPECT_TRUE(holds_exactly(back.tensors, into));  // the same answer from the tensors read
  EXPECT_EQ(read_safetensors_into(p, into), 3u);
  test::expect_bitwise_equal(f32_in, f32, "f32 buffer");
  test::expect_bitwise_equal(bf16_in, bf16, "bf16 buffer");
  EXPECT_EQ(count_in.to_ints()[0], 3);
  // Into tensors of their own: one read each (the file is the same either way).
  const Tensor alone = Tensor::zeros({16});
  EXPECT_EQ(read_safetensors_into(p, {{"b.m", alone}}), 1u);
  test::expect_bitwise_equal(alone, f32.slice_rows(48, 64), "b.m alone");
  EXPECT_FALSE(holds_exactly(h, {{"b.m", alone}}));  // the file holds more
  EXPECT_FALSE(holds_exactly(back.tensors, {{"b.m", alone}}));
}

// A gap between two views (the optimizer aligns each slot to 64 bytes) cannot be written as data:
// safetensors has no holes. It ends the block; the file stays standard and reads back exactly.
TEST(Safetensors, AGapBetweenViewsEndsTheBlock) {
  const Tensor buf = test::randn({48}, 3);
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"a", buf.slice_rows(0, 10)}, {"b", buf.slice_rows(16, 40)}, {"c", buf.slice_rows(40, 48)}};
  const std::string p = test::temp_dir("safetensors") + "/gap.safetensors";
  const SafetensorsWrite w = write_safetensors(p, tensors);
  EXPECT_EQ(w.runs, 2u);  // a | gap | b c
  EXPECT_EQ(w.write_calls, 3u);
  test::expect_standard_safetensors(p);
  EXPECT_EQ(read_safetensors_header(p).tensors.back().end, 4u * (10 + 24 + 8));  // no hole
  const Tensor in = Tensor::zeros({48});
  const std::vector<std::pair<std::string, Tensor>> into = {
      {"a", in.slice_rows(0, 10)}, {"b", in.slice_rows(16, 40)}, {"c", in.slice_rows(40, 48)}};
  EXPECT_EQ(read_safetensors_into(p, into), 2u);
  for (size_t i = 0; i < into.size(); ++i)
    test::expect_bitwise_equal(into[i].second, tensors[i].second, tensors[i].first);
  // The same view twice (an alias) is written twice, not folded into one block.
  const std::string q = test::temp_dir("safetensors") + "/alias.safetensors";
  EXPECT_EQ(write_safetensors(q, {{"x", buf.slice_rows(0, 8)}, {"y", buf.slice_rows(0, 8)}}).runs,
            2u);
  test::expect_standard_safetensors(q);
}

// A destination that does not match the file is an Error naming the file and the tensor, and
// nothing is read.
TEST(Safetensors, ReadingIntoAMismatchNamesTheTensorAndReadsNothing) {
  const std::string p = test::temp_dir("safetensors") + "/into.safetensors";
  write_safetensors(p, {{"a", test::randn({4}, 5)}, {"b", test::randn({2, 2}, 6)}});
  const Tensor a = Tensor::full({4}, 7.f), b = Tensor::full({4}, 7.f);
  std::string m = error_of([&] { read_safetensors_into(p, {{"a", a}, {"b", b}}); });
  EXPECT_CONTAINS(m, p);
  EXPECT_CONTAINS(m, "tensor 'b' is f32 [2, 2], expected f32 [4]");
  m = error_of([&] { read_safetensors_into(p, {{"a", a}, {"c", b}}); });
  EXPECT_CONTAINS(m, "tensor 'c' is missing");
  EXPECT_EQ(a.to_floats(), std::vector<float>(4, 7.f));  // untouched
  EXPECT_CONTAINS(error_of([&] {
                    read_safetensors_into(p, {{"a", a.to_dtype(DType::BF16)}});
                  }),
                  "expected bf16 [4]");
}

// A write that fails in the middle of a stretch (here: the file-size limit, reached inside the
// flat buffer's one write) is an Error naming the file and the cause; the file it was replacing
// is unchanged and no temporary file is left beside it.
TEST(Safetensors, AWriteFailingInsideABlockKeepsThePreviousFile) {
  const std::string dir = test::temp_dir("safetensors-fsize");
  const std::string p = dir + "/state.safetensors";
  const Tensor old = test::randn({1024}, 7);
  write_safetensors(p, {{"m", old}});
  const std::string before = test::slurp(p);
  const Tensor flat = test::randn({8192}, 8);  // 32 KB, written as one stretch
  const std::vector<std::pair<std::string, Tensor>> views = {{"w.m", flat.slice_rows(0, 4096)},
                                                             {"b.m", flat.slice_rows(4096, 8192)}};

  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = 16384;                      // the header and part of the stretch
  auto* const was = signal(SIGXFSZ, SIG_IGN);  // past the limit write(2) fails with EFBIG
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string m = error_of([&] { write_safetensors(p, views); });
  setrlimit(RLIMIT_FSIZE, &saved);
  signal(SIGXFSZ, was);

  EXPECT_CONTAINS(m, "cannot write " + p);
  EXPECT_CONTAINS(m, "File too large");
  EXPECT_CONTAINS(m, "ulimit -f");
  EXPECT_EQ(test::slurp(p), before);
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1u) << "a temporary file was left in " << dir;
  // With the limit back, the same write goes through.
  write_safetensors(p, views);
  test::expect_bitwise_equal(read_safetensors(p).at("b.m"), flat.slice_rows(4096, 8192), "b.m");
}

// The open-file limit reached (EMFILE) was reported as "check that the directory exists and is
// writable", the one thing that was fine. Now the cause's own fix: raise ulimit -n.
TEST(Safetensors, AFailedCreateSaysTheFixOfItsCause) {
  EXPECT_CONTAINS(write_failure(EROFS), "read-only");
  EXPECT_CONTAINS(write_failure(ENOSPC), "free space");
  EXPECT_CONTAINS(write_failure(EMFILE), "ulimit -n");
  // UBSan's vptr check probes memory through a pipe, which needs two of the descriptors this test
  // takes away: the Error thrown then reads as "object has invalid vptr" (a false report).
  if (std::getenv("KEEL_TEST_SANITIZED"))
    GTEST_SKIP() << "UBSan needs descriptors to check the thrown Error";
  const std::string p = test::temp_dir("safetensors-nofile") + "/state.safetensors";
  const int lowest_free = ::open("/dev/null", O_RDONLY);  // every descriptor below it is open
  ASSERT_GE(lowest_free, 0);
  ::close(lowest_free);
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = static_cast<rlim_t>(lowest_free);  // no descriptor can be opened
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &small), 0);
  const std::string m = error_of([&] { write_safetensors(p, {{"m", test::randn({8}, 1)}}); });
  setrlimit(RLIMIT_NOFILE, &saved);
  EXPECT_CONTAINS(m, "cannot write " + p);
  EXPECT_CONTAINS(m, "Too many open files");
  EXPECT_CONTAINS(m, "ulimit -n");
  EXPECT_EQ(m.find("writable"), std::string::npos) << m;
}

// A pipe (or device) at the path is refused, not replaced by the file renamed over it: as root,
// /dev/null became a regular file that way (keel tokenize --output /dev/null).
TEST(Safetensors, APipeAtThePathIsRefusedNotReplaced) {
  const std::string fifo = test::temp_dir("safetensors-fifo") + "/pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  EXPECT_CONTAINS(test::error_of([&] {
                    write_safetensors(fifo, {{"m", test::randn({4}, 1)}});
                  }),
                  "cannot write " + fifo + ": it is a pipe, which the written file would replace");
  struct stat st {};
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

}  // namespace
}  // namespace keel::io
