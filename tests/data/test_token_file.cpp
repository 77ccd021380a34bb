// llm.c token files (data.task = "tokens"): written as llm.c's dev/data/data_common.py writes them
// (a 256-int32 header: magic, version, count; then uint16 or uint32 ids), their rows are the rows
// of the same text packed, read from the file's mapping without a copy; every malformed file is a
// usage error naming the file, the key and what is wrong.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "keel/data/dataset.h"
#include "keel/data/loader.h"
#include "keel/data/token_file.h"
#include "keel/data/tokenizer.h"
#include "keel/numerics/error.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel::data {
namespace {

const std::string kTokenizerDir =
    std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";
const std::string kText =
    "the quick brown fox jumps over the lazy dog\n\nthen it ran; 3 + 4 = 7, naïve café\n"
    "and the dog slept again and again and again under the old oak tree\n";

std::string write(const std::string& name, const std::string& bytes) {
  const std::string path = test::temp_dir("token-file") + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// A file laid out as llm.c's write_datafile lays it out, from its three header fields.
std::string llmc_file(int32_t magic, int32_t version, int32_t count, const std::string& ids) {
  std::string header(1024, '\0');
  const int32_t h[3] = {magic, version, count};
  std::memcpy(header.data(), h, sizeof h);
  return header + ids;
}

std::string u32_ids(const std::vector<uint32_t>& ids) {
  return std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
}

std::string load_error(const std::string& path, const Tokenizer& tok, int64_t seq_len = 8) {
  try {
    load_token_file(path, "data.path", tok, seq_len);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind, Error::kUsage) << e.what();
    return e.what();
  }
  ADD_FAILURE() << path << " loaded";
  return "";
}

// The process's anonymous resident memory (RssAnon): what a copy of the ids would add, unlike
// the file pages a mapping brings in.
int64_t rss_anon_bytes() {
  std::ifstream in("/proc/self/status");
  std::string key;
  int64_t kb = 0;
  while (in >> key) {
    if (key == "RssAnon:") {
      in >> kb;
      return kb * 1024;
    }
    in.ignore(1 << 20, '\n');
  }
  ADD_FAILURE() << "no RssAnon in /proc/self/status";
  return 0;
}

std::vector<int64_t> values(const Tensor& t) {
  const int64_t* p = t.data_as<int64_t>();
  return {p, p + t.numel()};
}

void expect_same_rows(const Dataset& a, const Dataset& b) {
  ASSERT_EQ(a.size(), b.size());
  for (int64_t i = 0; i < a.size(); ++i) {
    const Example x = a.get(i).copy(), y = b.get(i).copy();
    EXPECT_EQ(x.tokens, y.tokens) << i;
    EXPECT_EQ(x.target, y.target) << i;
  }
}

TEST(TokenFile, RowsAreThoseOfThePackedTextForEveryTokenizerAndSeqLen) {
  // The Llama-style tokenizer starts a text with its template's token: the token file too, as
  // `keel tokenize --output` writes it.
  for (const std::string& spec :
       {std::string("byte"), "gpt2:" + kTokenizerDir, "hf:" + kTokenizerDir + "/llama_style"}) {
    const auto tok = load_tokenizer(spec);
    const std::string txt = write("corpus.txt", kText);
    const std::string bin =
        write("corpus.bin", token_file_bytes(encode_with_prefix(*tok, kText), tok->vocab_size()));
    EXPECT_EQ(read_token_file_header(bin, "data.path").width, 2) << spec;  // GPT-2's layout
    for (int64_t T : {2, 3, 8, 33, 4096}) {
      const auto packed = load_text_dataset(txt, *tok, T, /*pack=*/true);
      const auto mapped = load_token_file(bin, "data.path", *tok, T);
      expect_same_rows(*packed, *mapped);
      // The same batches, collated from 16-bit views.
      const Batch p = collate(*packed, {0, packed->size() - 1}, T, tok->vocab_size());
      const Batch m = collate(*mapped, {0, mapped->size() - 1}, T, tok->vocab_size());
      EXPECT_EQ(values(p.input_ids), values(m.input_ids)) << spec << " T=" << T;
      EXPECT_EQ(values(p.labels), values(m.labels)) << spec << " T=" << T;
      EXPECT_EQ(p.n_targets, m.n_targets);
    }
  }
}

TEST(TokenFile, RowsAreViewsOfTheMappingAndNameTheirTokens) {
  const ByteTokenizer tok;
  const std::string bin = write("views.bin", token_file_bytes(tok.encode(kText), tok.vocab_size()));
  const auto ds = load_token_file(bin, "data.path", tok, 8);
  ASSERT_GT(ds->size(), 3);
  for (int64_t i = 1; i < ds->size(); ++i) {
    ASSERT_TRUE(ds->get(i).tokens.empty());  // 16-bit ids, in place
    EXPECT_EQ(ds->get(i).tokens16.data(), ds->get(i - 1).tokens16.data() + 7) << i;
  }
  EXPECT_EQ(ds->held_bytes(), 8);  // the target flags of a row; the ids are the page cache's
  EXPECT_EQ(ds->held_tokens(), static_cast<int64_t>(tok.encode(kText).size()));
  EXPECT_EQ(ds->where(2), bin + " row 2 (tokens from 14)");
  EXPECT_CONTAINS(test::error_of([&] { ds->get(ds->size()); }), "outside [0, ");
}

TEST(TokenFile, LlamaThreeLayoutHoldsThirtyTwoBitIds) {
  const ByteTokenizer tok;
  const std::vector<int32_t> ids = tok.encode(kText);
  // token_file_bytes picks Llama 3's layout for a vocabulary beyond 16 bits.
  const std::string bytes = token_file_bytes(ids, 128256);
  int32_t h[3];
  std::memcpy(h, bytes.data(), sizeof h);
  EXPECT_EQ(h[0], 20240801);
  EXPECT_EQ(h[1], 7);
  EXPECT_EQ(h[2], static_cast<int32_t>(ids.size()));
  ASSERT_EQ(bytes.size(), 1024 + 4 * ids.size());
  const std::string bin = write("llama3.bin", bytes);
  EXPECT_EQ(read_token_file_header(bin, "data.path").width, 4);
  const auto mapped = load_token_file(bin, "data.path", tok, 16);
  expect_same_rows(*load_text_dataset(write("l3.txt", kText), tok, 16, true), *mapped);
  EXPECT_FALSE(mapped->get(0).tokens.empty());  // read as int32 in place
}

TEST(TokenFile, ACorpusIsNotCopiedIntoTheProcess) {
  // 8M 16-bit ids (16 MB): held as int32 they would be 32 MB of the process's own memory.
  const int64_t n = 8 << 20;
  std::string ids(static_cast<size_t>(2 * n), '\0');
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(2 * i)] = static_cast<char>(i % 251);
  const std::string bin = write("large.bin", llmc_file(20240520, 1, static_cast<int32_t>(n), ids));
  ids = std::string();
  const ByteTokenizer tok;
  const int64_t before = rss_anon_bytes();
  const auto ds = load_token_file(bin, "data.path", tok, 1024);
  int64_t sum = 0;
  for (int64_t i = 0; i < ds->size(); i += 97) sum += ds->get(i).id(5);  // touch the mapping
  EXPECT_GT(sum, 0);
  EXPECT_LT(rss_anon_bytes() - before, 4 << 20) << "the ids were copied";
}

TEST(TokenFile, MalformedFilesNameTheFileKeyAndFix) {
  const ByteTokenizer tok;
  const std::string good = token_file_bytes(tok.encode(kText), tok.vocab_size());
  const std::string p = write("x.bin", good.substr(0, 1000));
  EXPECT_CONTAINS(load_error(p, tok),
                  "token file " + p + " (data.path): holds 1000 bytes, less than");
  EXPECT_CONTAINS(load_error(write("t.bin", good.substr(0, good.size() - 3)), tok),
                  "the file is truncated");
  EXPECT_CONTAINS(load_error(write("e.bin", good + "x"), tok), "bytes after the ids");
  EXPECT_CONTAINS(load_error(write("txt.bin", kText + std::string(2000, 'a')), tok),
                  "not the magic 20240520 (GPT-2, 16-bit ids) or 20240801");
  EXPECT_CONTAINS(load_error(write("v.bin", llmc_file(20240520, 2, 0, "")), tok),
                  "version is 2; the magic 20240520 (GPT-2) comes with version 1");
  EXPECT_CONTAINS(load_error(write("v7.bin", llmc_file(20240801, 1, 0, "")), tok),
                  "comes with version 7");
  EXPECT_CONTAINS(load_error(write("neg.bin", llmc_file(20240520, 1, -5, "")), tok),
                  "counts -5 tokens");
  EXPECT_CONTAINS(load_error(write("one.bin", llmc_file(20240520, 1, 1, "ab")), tok),
                  "holds 1 token; training needs at least 2");
  // Ids from another tokenizer: the first one beyond the vocabulary, and where it is.
  EXPECT_CONTAINS(
      load_error(write("wide.bin", llmc_file(20240801, 7, 3, u32_ids({1, 2, 4000000000u}))), tok),
      "token 2 is id 4000000000, beyond the tokenizer's vocabulary (259 ids)");
  EXPECT_CONTAINS(
      load_error(write("gpt2.bin", llmc_file(20240520, 1, 2, std::string("\x01\x00\x59\xc4", 4))),
                 tok),
      "token 1 is id 50265, beyond");
  EXPECT_CONTAINS(load_error("/no/such.bin", tok), "/no/such.bin does not exist; data.path must");
  EXPECT_CONTAINS(load_error(test::temp_dir("token-file"), tok), "is a directory");
  EXPECT_CONTAINS(load_error(write("ok.bin", good), tok, 1), "seq_len is 1");
  EXPECT_CONTAINS(test::error_of([&] {
                    token_file_bytes(std::vector<int32_t>{1, 300}, 259);
                  }),
                  "token 1 is id 300, outside the tokenizer's vocabulary of 259");
}

TEST(TokenFile, APipeIsRefusedWithoutWaitingForAWriter) {
  const std::string fifo = test::temp_dir("token-file") + "/fifo.bin";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const ByteTokenizer tok;
  EXPECT_CONTAINS(load_error(fifo, tok), "is a pipe, not a file: a token file is mapped");
}

TEST(TokenFile, AWriterWritesTheFileAtCommitAndNothingWithout) {
  const ByteTokenizer tok;
  const std::vector<int32_t> ids = tok.encode(kText);
  const std::string dir = test::temp_dir("token-file-writer");
  {
    TokenFileWriter w(dir + "/out.bin", tok.vocab_size());
    w.append(std::span(ids).first(10));
    w.append(std::span(ids).subspan(10));
    EXPECT_EQ(w.tokens(), static_cast<int64_t>(ids.size()));
    w.commit();
  }
  EXPECT_EQ(test::slurp(dir + "/out.bin"), token_file_bytes(ids, tok.vocab_size()));
  {
    TokenFileWriter w(dir + "/never.bin", tok.vocab_size());
    w.append(ids);
    EXPECT_CONTAINS(test::error_of([&] {
                      w.append(std::vector<int32_t>{5, 999});
                    }),
                    "token " + std::to_string(ids.size() + 1) + " is id 999, outside");
  }  // no commit: nothing left behind
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1);
  EXPECT_CONTAINS(test::error_of([&] { TokenFileWriter("/no/such/dir/x.bin", 259); }),
                  "cannot write the token file /no/such/dir/x.bin");
  // A device or a pipe at the path is refused, not replaced: `keel tokenize --output /dev/null`
  // as root renamed a regular file over /dev/null. A FIFO stands for both (no root needed).
  const std::string fifo = dir + "/pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  EXPECT_CONTAINS(test::error_of([&] { TokenFileWriter(fifo, 259); }),
                  "cannot write the token file " + fifo +
                      ": it is a pipe, which the written "
                      "file would replace");
  struct stat st {};
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

// A token file cut while mapped (rewritten in place by another program): the next read past its
// new end is SIGBUS, which keel turns into an error naming the file and exit 1.
TEST(TokenFileDeathTest, AFileCutWhileMappedStopsTheRunNamingIt) {
  const ByteTokenizer tok;
  std::string ids(1 << 20, '\x01');  // 512k ids of 1: 256 pages
  const std::string bin = write("cut.bin", llmc_file(20240520, 1, 1 << 19, ids));
  EXPECT_EXIT(
      {
        const auto ds = load_token_file(bin, "data.path", tok, 64);
        if (::truncate(bin.c_str(), 4096) != 0) std::abort();
        int64_t sum = 0;
        for (int64_t i = 0; i < ds->size(); ++i) sum += ds->get(i).id(3);
        std::printf("%lld\n", static_cast<long long>(sum));
      },
      ::testing::ExitedWithCode(1),
      "token file " + bin + " \\(data.path\\) was cut while the run read it");
}

TEST(TokenFile, FootprintCountsTheHeaderNotTheIds) {
  const ByteTokenizer tok;
  const std::string bin = write("fp.bin", token_file_bytes(tok.encode(kText), tok.vocab_size()));
  const DatasetFootprint f = dataset_footprint(bin, "tokens", tok, 8, false);
  EXPECT_TRUE(f.estimated);
  EXPECT_EQ(f.tokens, static_cast<int64_t>(tok.encode(kText).size()));
  EXPECT_EQ(f.examples, load_token_file(bin, "data.path", tok, 8)->size());
  EXPECT_EQ(f.held, 8);
}

}  // namespace
}  // namespace keel::data
