// Text and JSONL datasets: paragraph splitting, packing, prompt/completion masking, and errors that
// name the file, the line and the fix.
#include <gtest/gtest.h>

#include <fstream>

#include "keel/data/dataset.h"
#include "keel/data/loader.h"
#include "keel/data/rng.h"
#include "keel/data/text_pieces.h"
#include "keel/numerics/error.h"
#include "tests/support/check.h"

namespace keel::data {
namespace {
using test::error_of;

std::string write_file(const std::string& name, const std::string& content) {
  const std::string path = test::temp_dir("data") + "/" + name;
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

std::vector<int32_t> ids_of(const std::string& s, bool eos) {
  std::vector<int32_t> v;
  for (unsigned char c : s) v.push_back(c);
  if (eos) v.push_back(258);
  return v;
}

const ByteTokenizer kTok;

TEST(TextDataset, ParagraphsSplitOnBlankLines) {
  const std::string path =
      write_file("t.txt", "\n\nfirst line\nsecond line\n\n \t\n\r\nnext\r\npara\r\n\nlast");
  auto ds = load_text_dataset(path, kTok, 64, false);
  ASSERT_EQ(ds->size(), 3);
  EXPECT_EQ(ds->get(0).copy().tokens, ids_of("first line\nsecond line", true));
  EXPECT_EQ(ds->get(1).copy().tokens, ids_of("next\npara", true));  // CRLF lines lose the '\r'
  EXPECT_EQ(ds->get(2).copy().tokens, ids_of("last", true));
  for (int64_t i = 0; i < ds->size(); ++i)
    EXPECT_EQ(ds->get(i).copy().target, std::vector<uint8_t>(ds->get(i).tokens.size(), 1));
}

// An example keeps the seq_len tokens the loader reads and one more (which says it was longer):
// a 105 MB one-line text held all its ids, 5 bytes a token, to train on 512 of them. The batches
// are those of the whole example, and the long ones are still counted.
TEST(TextDataset, ALongExampleKeepsOnlyWhatTheLoaderReads) {
  const std::string line(100000, 'x');
  const int64_t T = 16;
  const std::string text = write_file("long.txt", "short\n\n" + line + "\n");
  auto ds = load_text_dataset(text, kTok, T, false);
  ASSERT_EQ(ds->size(), 2);
  EXPECT_EQ(ds->get(0).copy().tokens, ids_of("short", true));
  EXPECT_EQ(ds->get(1).copy().tokens, ids_of(line.substr(0, T + 1), false));
  EXPECT_LE(ds->held_tokens(), 6 + T + 1);
  EXPECT_EQ(truncated_examples(*ds, "text", false, T), 1);
  DataLoader loader(*ds, 2, T, kTok.pad_id(), false, 0);
  const Batch b = loader.batch(0, 0);
  const std::vector<int64_t> ids = b.input_ids.to_ints();
  EXPECT_EQ(ids[T + T - 1], 'x');  // row 1 is full: seq_len tokens of the line
  const std::string jsonl = write_file("long.jsonl", "{\"text\": \"" + line + "\"}\n");
  auto js = load_jsonl_dataset(jsonl, kTok, T);
  EXPECT_EQ(js->held_tokens(), T + 1);
  EXPECT_EQ(truncated_examples(*js, "jsonl", false, T), 1);
}

// Packing: rows of seq_len overlapping by one token, so that the labels of all rows, in order,
// are exactly the file's bytes after the first (each predicted once).
TEST(TextDataset, PackingPredictsEveryTokenOnce) {
  SplitMix64 rng(9);
  for (int64_t n : {2, 15, 16, 17, 100, 301}) {
    std::string content(static_cast<size_t>(n), '\0');
    for (char& c : content) c = static_cast<char>(rng.below(256));
    const std::string path = write_file("p.txt", content);
    const int64_t T = 16;
    auto ds = load_text_dataset(path, kTok, T, true);
    EXPECT_EQ(ds->size(), (n - 1 + T - 2) / (T - 1)) << "n=" << n;  // ceil((n-1) / (T-1))
    DataLoader loader(*ds, 3, T, kTok.pad_id(), false, 0);
    std::vector<int32_t> predicted;
    for (int64_t i = 0; i < loader.batches_per_epoch(); ++i) {
      const Batch b = loader.batch(0, i);
      for (int64_t v : b.labels.to_ints())
        if (v != kIgnoreLabel) predicted.push_back(static_cast<int32_t>(v));
    }
    std::vector<int32_t> expected = ids_of(content.substr(1), false);
    EXPECT_EQ(predicted, expected) << "n=" << n;
    for (int64_t i = 0; i < ds->size(); ++i) {
      EXPECT_LE(static_cast<int64_t>(ds->get(i).size()), T);
      EXPECT_GE(ds->get(i).size(), 2u);
    }
  }
}

// The byte tokenizer's ids under a vocabulary too large for 16 bits (Llama 3's 128,256).
struct WideByteTokenizer : ByteTokenizer {
  int64_t vocab_size() const override { return 128256; }
};

// A packed file is read and encoded a piece at a time (kTextPieceBytes; this one is 2.6 pieces),
// giving the ids of encoding it whole, held in 16 bits when the vocabulary fits and in 32 when it
// does not. Before, the file's text and its 32-bit ids were held whole at once.
TEST(TextDataset, PackedTextIsEncodedInPiecesIntoTheNarrowestIds) {
  SplitMix64 rng(10);
  std::string content;
  while (content.size() < kTextPieceBytes * 13 / 5) {
    content +=
        std::string(static_cast<size_t>(1 + rng.below(70)), static_cast<char>('a' + rng.below(26)));
    content += rng.below(9) == 0 ? "\n\n" : "\n";
  }
  const std::string path = write_file("pieces.txt", content);
  const int64_t T = 1000;
  const WideByteTokenizer wide;
  for (const Tokenizer* tok :
       {static_cast<const Tokenizer*>(&kTok), static_cast<const Tokenizer*>(&wide)}) {
    const bool narrow = tok == &kTok;
    auto ds = load_text_dataset(path, *tok, T, true);
    const std::vector<int32_t> want = tok->encode(content);
    std::vector<int32_t> got;
    for (int64_t i = 0; i < ds->size(); ++i) {
      const ExampleView e = ds->get(i);
      EXPECT_EQ(e.tokens16.empty(), !narrow) << i;
      EXPECT_EQ(e.tokens.empty(), narrow) << i;
      for (size_t t = i == 0 ? 0 : 1; t < e.size(); ++t)
        got.push_back(e.id(t));  // rows overlap by one
    }
    EXPECT_EQ(got, want) << (narrow ? "16-bit" : "32-bit");
    EXPECT_EQ(ds->held_tokens(), static_cast<int64_t>(want.size()));
    EXPECT_EQ(ds->held_bytes(), static_cast<int64_t>(want.size()) * (narrow ? 2 : 4) +
                                    ds->size() * static_cast<int64_t>(sizeof(int64_t)));
  }
}

TEST(TextDataset, Errors) {
  EXPECT_CONTAINS(error_of([] { load_text_dataset("/nonexistent/corpus.txt", kTok, 8, false); }),
                  "/nonexistent/corpus.txt");
  const std::string dir = test::temp_dir("data-dir");
  EXPECT_CONTAINS(error_of([&] { load_text_dataset(dir, kTok, 8, false); }), "directory");
  // Read until the OOM killer stopped the run, before: /dev/zero never ends.
  EXPECT_CONTAINS(error_of([&] { load_text_dataset("/dev/zero", kTok, 8, true); }),
                  "dataset file /dev/zero is a character device, not a file; data.path");
  EXPECT_CONTAINS(error_of([&] { load_jsonl_dataset("/dev/zero", kTok, 8); }),
                  "dataset file /dev/zero is a character device");
  const std::string blank = write_file("blank.txt", "\n \n\t\n");
  EXPECT_CONTAINS(error_of([&] { load_text_dataset(blank, kTok, 8, false); }), "no text");
  const std::string empty = write_file("empty.txt", "");
  EXPECT_CONTAINS(error_of([&] { load_text_dataset(empty, kTok, 8, false); }), "empty.txt");
  const std::string one = write_file("one.txt", "x");
  EXPECT_CONTAINS(error_of([&] { load_text_dataset(one, kTok, 8, true); }), "at least 2 tokens");
  const std::string ok = write_file("ok.txt", "hello");
  EXPECT_CONTAINS(error_of([&] { load_text_dataset(ok, kTok, 1, false); }), "seq_len is 1");
  EXPECT_CONTAINS(error_of([&] { load_text_dataset(ok, kTok, 1, true); }), "seq_len is 1");
}

TEST(JsonlDataset, TextAndPromptCompletion) {
  const std::string path =
      write_file("d.jsonl",
                 "{\"text\": \"ab\"}\n"
                 "\n"
                 "{\"prompt\": \"Q: 2+2?\\nA:\", \"completion\": \" 4\", \"id\": 7}\r\n"
                 "   \n"
                 "{\"prompt\": \"\", \"completion\": \"h\\u00e9\"}");  // no final newline
  auto ds = load_jsonl_dataset(path, kTok, 32);
  ASSERT_EQ(ds->size(), 3);
  EXPECT_EQ(ds->get(0).copy().tokens, ids_of("ab", true));
  EXPECT_EQ(ds->get(0).copy().target, std::vector<uint8_t>(3, 1));

  const Example pc = ds->get(1).copy();
  EXPECT_EQ(pc.tokens, ids_of("Q: 2+2?\nA: 4", true));
  // The prompt "Q: 2+2?\nA:" (10 bytes) is context; " 4" and eos are targets.
  const std::vector<uint8_t> want = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1};
  EXPECT_EQ(pc.target, want);

  EXPECT_EQ(ds->get(2).copy().tokens, ids_of("h\xc3\xa9", true));  // \u00e9 as UTF-8
  EXPECT_EQ(ds->get(2).copy().target, std::vector<uint8_t>(4, 1));

  // Through the loader: the loss sits on the completion and eos only; the last prompt position
  // predicts the first completion token.
  DataLoader loader(*ds, 3, 16, kTok.pad_id(), false, 0);
  const Batch b = loader.batch(0, 0);
  const std::vector<int64_t> labels = b.labels.to_ints();
  ASSERT_EQ(b.labels.size(1), 13);  // padded to the longest row ("Q: 2+2?\nA: 4" and eos)
  std::vector<int64_t> row1(labels.begin() + 13, labels.begin() + 26);
  std::vector<int64_t> want_row1(13, kIgnoreLabel);
  want_row1[9] = ' ';
  want_row1[10] = '4';
  want_row1[11] = 258;
  EXPECT_EQ(row1, want_row1);
  EXPECT_EQ(b.n_targets, 2 + 3 + 3);
}

TEST(JsonlDataset, MalformedLinesNameFileLineAndFix) {
  // Line 17 lacks "completion" after 16 good lines.
  std::string content;
  for (int i = 0; i < 16; ++i) content += "{\"prompt\": \"p\", \"completion\": \"c\"}\n";
  content += "{\"prompt\": \"p\"}\n";
  const std::string path = write_file("bad.jsonl", content);
  const std::string msg = error_of([&] { load_jsonl_dataset(path, kTok, 8); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg,
                  "line 17: missing \"completion\"; expected {\"prompt\": ..., \"completion\": "
                  "...}, {\"messages\": [...]} or {\"text\": ...}");

  struct Case {
    std::string content, needle;
  };
  const std::vector<Case> cases = {
      {"{\"text\": \"a\"}\n\n{\"text\": \"b\",}\n", "line 3: invalid JSON"},
      {"{\"text\": \"a\"}\n{\"text\": \"unterminated}\n", "line 2: invalid JSON"},
      {"{\"text\": 1e400}\n", "line 1: invalid JSON: number overflow parsing '1e400'"},
      {"{\"completion\": \"c\"}\n", "line 1: missing \"prompt\""},
      {"{\"input\": \"x\"}\n", "line 1: missing \"text\""},
      {"{\"text\": 5}\n", "line 1: \"text\" must be a string, got number"},
      {"{\"prompt\": \"p\", \"completion\": null}\n", "\"completion\" must be a string, got null"},
      {"[\"text\", \"a\"]\n", "line 1: a JSON array instead of an object"},
      // A key given twice kept the last value without a word.
      {"{\"text\": \"a\"}\n{\"text\": \"a\", \"text\": \"b\"}\n",
       "line 2: the key \"text\" is given more than once"},
      {"{\"text\": \"a\", \"text\": 5}\n", "line 1: the key \"text\" is given more than once"},
      {"{\"text\": \"a\", \"prompt\": \"p\", \"completion\": \"c\"}\n",
       "line 1: has more than one"},
      {"{\"text\": \"\"}\n", "line 1: nothing to train on"},
      {"{\"text\": \"ok\"}\n{\"prompt\": \"0123456789\", \"completion\": \"c\"}\n",
       "line 2: the prompt is 10 tokens"},
      {"", "no examples"},
      {"\n  \n", "no examples"},
  };
  for (const Case& c : cases) {
    const std::string p = write_file("case.jsonl", c.content);
    const std::string m = error_of([&] { load_jsonl_dataset(p, kTok, 8); });
    EXPECT_CONTAINS(m, c.needle);
    EXPECT_CONTAINS(m, p);
  }
  // JSON's "last read" is the token so far: a 1 MB string with a raw control byte at its end was
  // quoted whole, a megabyte of error message. Its end is quoted.
  const std::string long_line =
      write_file("long.jsonl", "{\"text\": \"" + std::string(1 << 20, 'a') + "z\x01\"}\n");
  const std::string m = error_of([&] { load_jsonl_dataset(long_line, kTok, 8); });
  EXPECT_CONTAINS(m, "line 1: invalid JSON at column ");
  EXPECT_CONTAINS(m, "control character U+0001");
  EXPECT_CONTAINS(m, "last read: '...aaa");
  EXPECT_CONTAINS(m, "aaaz<U+0001>'; expected");
  EXPECT_LT(m.size(), 500u);
  // A prompt of seq_len - 1 tokens still leaves its first completion token to predict.
  const std::string fits =
      write_file("fits.jsonl", "{\"prompt\": \"0123456\", \"completion\": \"c\"}");
  EXPECT_EQ(load_jsonl_dataset(fits, kTok, 8)->size(), 1);

  EXPECT_CONTAINS(error_of([] { load_jsonl_dataset("/nonexistent/d.jsonl", kTok, 8); }),
                  "/nonexistent/d.jsonl");
  EXPECT_CONTAINS(error_of([&] { load_jsonl_dataset(fits, kTok, 1); }), "seq_len is 1");
}

// dataset_footprint: exact for a file within its 1 MiB sample, within 2% beyond it (a file of
// varied lines), nothing for a pipe; it is what the run's memory check adds for the data.
TEST(Datasets, FootprintIsWhatLoadingHolds) {
  SplitMix64 rng(4);
  std::string text, jsonl;
  for (int i = 0; i < 60000; ++i) {  // ~3.3 MB of text, ~4.6 MB of JSONL
    std::string line(static_cast<size_t>(10 + rng.below(90)), 'a');
    for (char& c : line) c = static_cast<char>('a' + rng.below(26));
    text += line + (i % 4 == 3 ? "\n\n" : "\n");
    jsonl += "{\"prompt\": \"" + line.substr(0, 8) + "\", \"completion\": \"" + line + "\"}\n";
  }
  const std::string small = write_file("small.txt", text.substr(0, 200000));
  const std::string big = write_file("big.txt", text), js = write_file("big.jsonl", jsonl);
  for (bool pack : {false, true}) {
    const DatasetFootprint f = dataset_footprint(small, "text", kTok, 64, pack);
    const auto ds = load_text_dataset(small, kTok, 64, pack);
    ASSERT_TRUE(f.estimated);
    EXPECT_EQ(f.held, ds->held_bytes()) << pack;
    EXPECT_EQ(f.examples, ds->size()) << pack;
    // Packed text is encoded a piece at a time (this file is one piece): beside the stream, the
    // piece's text about 3 times and its ids in 32 bits. Paragraphs are read whole first.
    EXPECT_EQ(f.load_peak, pack ? f.held + 7 * f.file_bytes : f.file_bytes + f.held);
    const DatasetFootprint b = dataset_footprint(big, "text", kTok, 64, pack);
    const auto whole = load_text_dataset(big, kTok, 64, pack);
    EXPECT_NEAR(static_cast<double>(b.held) / static_cast<double>(whole->held_bytes()), 1.0, 0.02)
        << pack;
    EXPECT_NEAR(static_cast<double>(b.examples) / static_cast<double>(whole->size()), 1.0, 0.02);
  }
  const DatasetFootprint j = dataset_footprint(js, "jsonl", kTok, 128, false);
  const auto whole = load_jsonl_dataset(js, kTok, 128);
  EXPECT_NEAR(static_cast<double>(j.held) / static_cast<double>(whole->held_bytes()), 1.0, 0.02);
  // Packed, a byte-tokenized file is 2 bytes a token (16-bit ids); as examples, 5 and the
  // example's 16.
  const DatasetFootprint packed = dataset_footprint(small, "text", kTok, 64, true);
  EXPECT_NEAR(static_cast<double>(packed.held) / 200000.0, 2.0, 0.2);
  EXPECT_FALSE(dataset_footprint("/dev/null", "text", kTok, 64, true).estimated);
  EXPECT_CONTAINS(error_of([&] { dataset_footprint(small, "text", kTok, 1, true); }),
                  "seq_len is 1");
}

// A dataset holds each token once: packed rows are views of the file's one token stream (a row's
// first token is the previous row's last), and examples lie one after another in one array. Held
// as a pair of vectors an example, a byte-tokenized file took 11 times its size at the peak.
TEST(Datasets, ExamplesAreViewsOfOneArray) {
  const std::string path = write_file("views.txt", "one two\nthree\n\nfour five six\n\nseven\n");
  auto packed = load_text_dataset(path, kTok, 8, true);
  ASSERT_GE(packed->size(), 3);
  for (int64_t i = 1; i < packed->size(); ++i)
    EXPECT_EQ(packed->get(i).tokens16.data(), packed->get(i - 1).tokens16.data() + 7) << i;
  auto paras = load_text_dataset(path, kTok, 64, false);
  ASSERT_EQ(paras->size(), 3);
  for (int64_t i = 1; i < 3; ++i) {
    const ExampleView prev = paras->get(i - 1), e = paras->get(i);
    EXPECT_EQ(e.tokens.data(), prev.tokens.data() + prev.tokens.size()) << i;
    EXPECT_EQ(e.target.data(), prev.target.data() + prev.target.size()) << i;
  }
  // A validation split shares them too, and its examples still name their file and line.
  const int32_t* last = paras->get(2).tokens.data();
  auto [train, eval] = split_dataset(std::move(paras), 1, path);
  ASSERT_EQ(train->size(), 2);
  ASSERT_EQ(eval->size(), 1);
  EXPECT_EQ(eval->get(0).copy().tokens, ids_of("seven", true));
  EXPECT_EQ(eval->get(0).tokens.data(), last);
  EXPECT_EQ(eval->where(0), path + ":6");
  EXPECT_EQ(train->where(1), path + ":4");
  // (a pointer, not the binding: clang 14 cannot capture a structured binding in a lambda)
  const Dataset* held_out = eval.get();
  EXPECT_CONTAINS(error_of([held_out] { held_out->get(1); }),
                  path + " (validation part): example index 1 is outside [0, 1)");
}

}  // namespace
}  // namespace keel::data

namespace keel::data {
namespace {

// Findings name a batch's examples by file and line: the line each example starts on, for
// paragraphs, packed rows and JSONL lines (blank lines counted, as an editor counts them).
TEST(Datasets, ExamplesKnowTheirFileAndLine) {
  const ByteTokenizer tok;
  const std::string dir = test::temp_dir("data-where");
  const std::string text = dir + "/t.txt";
  std::ofstream(text) << "\n\nfirst line\nsecond line\n\n\nthird\n\nlast\n";
  auto paras = load_text_dataset(text, tok, 16, false);
  ASSERT_EQ(paras->size(), 3);
  EXPECT_EQ(paras->where(0), text + ":3");
  EXPECT_EQ(paras->where(1), text + ":7");
  EXPECT_EQ(paras->where(2), text + ":9");
  // Packed rows of 8 tokens, stride 7: row 1 starts at byte 7 (" line\nse"), on line 3; row 2 at
  // byte 14 ("econd li"), on line 4.
  auto packed = load_text_dataset(text, tok, 8, true);
  EXPECT_EQ(packed->where(0), text + ":1");
  EXPECT_EQ(packed->where(1), text + ":3");
  EXPECT_EQ(packed->where(2), text + ":4");
  const std::string jsonl = dir + "/d.jsonl";
  std::ofstream(jsonl) << "{\"text\": \"a\"}\n\n{\"prompt\": \"q\", \"completion\": \"b\"}\n";
  auto js = load_jsonl_dataset(jsonl, tok, 16);
  ASSERT_EQ(js->size(), 2);
  EXPECT_EQ(js->where(0), jsonl + ":1");
  EXPECT_EQ(js->where(1), jsonl + ":3");
  // In-memory data has no file: its source and index.
  ExampleDataset mem({{{1, 2}, {1, 1}}}, "arith train");
  EXPECT_EQ(mem.where(0), "arith train example 0");
}

}  // namespace
}  // namespace keel::data
