// `keel tokenize` against the library: for every kind of tokenizer spec (byte, gpt2:DIR, hf:PATH,
// a bare directory), the CLI's ids, pieces and decoded text are the library's; bad input is a
// usage error naming the flag or the token.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "keel/data/dataset.h"
#include "keel/data/token_file.h"
#include "keel/data/tokenizer_base.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

const std::string kTiny = std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny";
const std::string kText = "the quick brown fox, 3 + 4 = 7\nnaïve café\n";

class CliTokenize : public ::testing::TestWithParam<std::string> {};

TEST_P(CliTokenize, IdsPiecesAndDecodeEqualTheLibrary) {
  const std::string spec = GetParam();
  const auto tok = data::load_tokenizer(spec);
  const std::vector<int32_t> ids = tok->encode(kText);
  ASSERT_FALSE(ids.empty());

  const test::KeelRun plain = test::run_keel({"tokenize", "--tokenizer", spec, kText});
  ASSERT_EQ(plain.code, 0) << plain.output;
  std::string want;
  for (size_t i = 0; i < ids.size(); ++i) want += (i ? " " : "") + std::to_string(ids[i]);
  EXPECT_EQ(plain.out, want + "\n");

  const test::KeelRun js = test::run_keel({"tokenize", "--tokenizer", spec, "--json", kText});
  ASSERT_EQ(js.code, 0) << js.output;
  const auto j = nlohmann::json::parse(js.out);
  EXPECT_EQ(j["ids"].get<std::vector<int32_t>>(), ids);
  EXPECT_EQ(j["count"].get<size_t>(), ids.size());
  ASSERT_EQ(j["pieces"].size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    // Pieces that are not UTF-8 alone (one byte >= 0x80) are printed with U+FFFD.
    const std::string piece = nlohmann::json(tok->id_to_token(ids[i]))
                                  .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    EXPECT_EQ(j["pieces"][i], nlohmann::json::parse(piece)) << i;
  }

  // Decode: ids back to the text, from the argument (comma-separated) and from a file.
  std::string csv;
  for (size_t i = 0; i < ids.size(); ++i) csv += (i ? "," : "") + std::to_string(ids[i]);
  const test::KeelRun dec = test::run_keel({"tokenize", "--tokenizer", spec, "--decode", csv});
  ASSERT_EQ(dec.code, 0) << dec.output;
  EXPECT_EQ(dec.out, tok->decode(ids));
  const std::string file = test::temp_dir("cli-tokenize") + "/ids.json";
  std::ofstream(file) << nlohmann::json(ids).dump();
  const test::KeelRun decf =
      test::run_keel({"tokenize", "--tokenizer", spec, "--decode", "--json", "--file", file});
  ASSERT_EQ(decf.code, 0) << decf.output;
  EXPECT_EQ(nlohmann::json::parse(decf.out)["text"].get<std::string>(), tok->decode(ids));
}

INSTANTIATE_TEST_SUITE_P(Specs, CliTokenize,
                         ::testing::Values("byte", "gpt2:" + kTiny,
                                           "hf:" + kTiny + "/llama_style/tokenizer.json",
                                           "hf:" + kTiny + "/gpt2_style", kTiny + "/llama_style"),
                         [](const auto& info) { return "spec" + std::to_string(info.index); });

TEST(CliTokenize, TextFromStdinAndPiecesOneALine) {
  const test::KeelRun r =
      test::run_keel_sh("tokenize --pieces --tokenizer gpt2:" + kTiny +
                        " < /dev/null; printf 'the fox' | " + test::keel_binary() +
                        " tokenize --pieces "
                        "--tokenizer gpt2:" +
                        kTiny);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto tok = data::load_tokenizer("gpt2:" + kTiny);
  std::string want = "\n";  // the empty stdin: no tokens
  const auto ids = tok->encode("the fox");
  for (size_t i = 0; i < ids.size(); ++i) want += (i ? "\n" : "") + tok->id_to_token(ids[i]);
  EXPECT_EQ(r.out, want + "\n");
}

TEST(CliTokenize, BadInputNamesTheFlagOrTheToken) {
  const test::KeelRun unknown = test::run_keel({"tokenize", "--tokenizer", "/no/such/dir", "x"});
  EXPECT_EQ(unknown.code, 2) << unknown.output;
  EXPECT_CONTAINS(unknown.err, "/no/such/dir");
  // The flag is named, not the config key data.tokenizer the loaders named.
  EXPECT_CONTAINS(unknown.err, "--tokenizer = \"/no/such/dir\": not a tokenizer");
  const test::KeelRun missing =
      test::run_keel({"tokenize", "--tokenizer", "hf:/no/such.json", "x"});
  EXPECT_EQ(missing.code, 2) << missing.output;
  EXPECT_CONTAINS(missing.err, "--tokenizer must name a file");
  EXPECT_EQ(missing.err.find("data.tokenizer"), std::string::npos) << missing.err;
  // --pieces beside --decode was ignored.
  const test::KeelRun decode_pieces = test::run_keel({"tokenize", "--decode", "--pieces", "65 66"});
  EXPECT_EQ(decode_pieces.code, 2) << decode_pieces.output;
  EXPECT_CONTAINS(decode_pieces.err, "excludes --");
  const test::KeelRun word = test::run_keel({"tokenize", "--decode", "12 x7 3"});
  EXPECT_EQ(word.code, 2) << word.output;
  EXPECT_CONTAINS(word.err, "'x7' is not a token id");
  for (const char* big : {"99999999999", "99999999999999999999"}) {  // an integer, but no id
    const test::KeelRun r = test::run_keel({"tokenize", "--decode", std::string("5 ") + big});
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, "'" + std::string(big) + "' is outside every vocabulary");
  }
  // No ids at all printed nothing and exited 0, as if they had decoded to no text.
  for (const char* none : {"", " , ", "[]"}) {
    const test::KeelRun r = test::run_keel({"tokenize", "--decode", none});
    EXPECT_EQ(r.code, 2) << "'" << none << "': " << r.output;
    EXPECT_CONTAINS(r.err, "tokenize --decode: the argument holds no token ids");
    EXPECT_CONTAINS(r.err, "--decode expects a list of token ids");
    EXPECT_EQ(r.out, "");
  }
  const std::string empty = test::temp_dir("tokenize-decode") + "/empty.txt";
  std::ofstream(empty).close();
  const test::KeelRun empty_file = test::run_keel({"tokenize", "--decode", "--file", empty});
  EXPECT_EQ(empty_file.code, 2) << empty_file.output;
  EXPECT_CONTAINS(empty_file.err, "--file " + empty + " holds no token ids");
  const test::KeelRun empty_stdin = test::run_keel_sh("tokenize --decode < /dev/null");
  EXPECT_EQ(empty_stdin.code, 2) << empty_stdin.output;
  EXPECT_CONTAINS(empty_stdin.err, "stdin holds no token ids");
  const test::KeelRun range = test::run_keel({"tokenize", "--decode", "65 9999"});
  EXPECT_EQ(range.code, 2) << range.output;
  EXPECT_CONTAINS(range.err, "the byte tokenizer cannot decode id 9999 at position 1");
  EXPECT_NOT_CONTAINS(range.err, "::");  // it named keel's class: "ByteTokenizer::decode: id"
  const test::KeelRun nofile = test::run_keel({"tokenize", "--file", "/no/such/file.txt"});
  EXPECT_EQ(nofile.code, 2) << nofile.output;
  EXPECT_CONTAINS(nofile.err, "--file /no/such/file.txt");
  const test::KeelRun both = test::run_keel({"tokenize", "--file", "/etc/hostname", "abc"});
  EXPECT_EQ(both.code, 2) << both.output;
  EXPECT_CONTAINS(both.err, "not both");
}

// An id the tokenizer has no token for is the user's input, like 'x7': it exited 1 with a sentence
// that did not parse ("cannot decode id 9999 at position 1 is outside the vocabulary"), and with
// --json the position was lost (the pieces were looked up first).
TEST(CliTokenize, DecodingAnIdOutsideTheVocabularyIsAUsageErrorNamingItsPosition) {
  for (const std::string& spec : {std::string("byte"), "gpt2:" + kTiny}) {
    for (const bool json : {false, true}) {
      std::vector<std::string> args = {"tokenize", "--tokenizer", spec, "--decode", "65 9999"};
      if (json) args.push_back("--json");
      const test::KeelRun r = test::run_keel(args);
      EXPECT_EQ(r.code, 2) << r.output;
      EXPECT_CONTAINS(r.err, "cannot decode id 9999 at position 1: it is outside the vocabulary");
      EXPECT_NOT_CONTAINS(r.err, "position 1 is");
      EXPECT_EQ(r.out, "");
    }
  }
}

// "1,,2" and a trailing comma decoded as "1 2" without a word (an id lost in editing gave other
// text). The separators that lists are written with decode; an empty item, a non-integer, or an
// id past int32 is a usage error naming its position, and the fix.
TEST(CliTokenize, DecodeListsNameTheBadItemsPosition) {
  for (const char* ok : {"72 105", "72,105", "72, 105", "[72, 105]", " 72\n105\n", "72 ,105"}) {
    const test::KeelRun r = test::run_keel({"tokenize", "--decode", ok});
    EXPECT_EQ(r.code, 0) << "'" << ok << "': " << r.output;
    EXPECT_EQ(r.out, "Hi") << "'" << ok << "'";
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"72,,105", "no id between two commas at position 1: give one id between each two commas"},
      {"72, ,105", "no id between two commas at position 1"},
      {"72,105,", "a comma after the last id (position 1) with no id after it: drop it"},
      {"[72, 105,]", "a comma after the last id (position 1)"},
      {",72", "a comma before the first id: drop it"},
      {"72 x7", "'x7' is not a token id (at position 1); give integers"},
      {"72 1.5", "'1.5' is not a token id (at position 1)"},
      {"72 [105]", "'[105]' is not a token id (at position 1)"},
      {"72 1099511627776", "'1099511627776' is outside every vocabulary (at position 1;"},
      {"72 -1", "'-1' is not a token id (at position 1): token ids are whole numbers >= 0"},
      {"72 259", "cannot decode id 259 at position 1: it is outside the vocabulary [0, 259)"}};
  for (const auto& [in, want] : bad) {
    const test::KeelRun r = test::run_keel({"tokenize", "--decode", in});
    EXPECT_EQ(r.code, 2) << "'" << in << "': " << r.output;
    EXPECT_CONTAINS(r.err, "tokenize --decode: ");
    EXPECT_CONTAINS(r.err, want);
    EXPECT_EQ(r.out, "");
  }
}

// A tokenizer file keel cannot use is bad input, as a missing one is (exit 2): each exited 1.
TEST(CliTokenize, AMalformedTokenizerFileIsAUsageErrorNamingTheFileAndField) {
  const std::string dir = test::temp_dir("cli-tokenize-bad");
  nlohmann::json j = nlohmann::json::parse(test::slurp(kTiny + "/gpt2_style/tokenizer.json"));
  j["model"]["type"] = "WordPiece";
  std::ofstream(dir + "/wordpiece.json") << j.dump();
  std::ofstream(dir + "/cut.json") << "{\"model\": [1,";
  std::filesystem::create_directories(dir + "/gpt2");
  std::filesystem::copy_file(kTiny + "/encoder.json", dir + "/gpt2/encoder.json");
  std::ofstream(dir + "/gpt2/vocab.bpe") << "#version: 0.2\nfoo\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"hf:" + dir + "/wordpiece.json",
       "wordpiece.json: model.type: \"WordPiece\" is not supported"},
      {"hf:" + dir + "/cut.json", "cut.json: not valid JSON"},
      {"gpt2:" + dir + "/gpt2", "vocab.bpe:2: expected two tokens separated by one space"}};
  for (const auto& [spec, error] : cases) {
    const test::KeelRun r = test::run_keel({"tokenize", "--tokenizer", spec, "x"});
    EXPECT_EQ(r.code, 2) << spec << ": " << r.output;
    EXPECT_CONTAINS(r.err, error);
  }
  const test::KeelRun r = test::run_keel(test::with_sets(
      {"train"}, {"run.out_dir=" + dir + "/out", "data.task=text", "data.path=" + dir + "/cut.json",
                  "data.tokenizer=hf:" + dir + "/wordpiece.json", "train.max_steps=1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "wordpiece.json: model.type");
}

// A tokenizer.json given as gpt2:DIR was said not to exist.
TEST(CliTokenize, AFileGivenAsAGpt2DirectoryIsNamedAsAFile) {
  const std::string json = kTiny + "/gpt2_style/tokenizer.json";
  const test::KeelRun r = test::run_keel({"tokenize", "--tokenizer", "gpt2:" + json, "x"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, json + " is a file, not a directory");
  EXPECT_CONTAINS(r.err, "a tokenizer.json is read with \"hf:PATH\"");
  EXPECT_NOT_CONTAINS(r.err, "does not exist");
}

// `--output` naming the --file it reads replaced the user's text with its token ids, exit 0: the
// corpus was gone. Refused (through another spelling of the path too), the text left as it was.
TEST(CliTokenize, OutputThatIsTheInputFileIsRefusedAndTheTextKept) {
  const std::string dir = test::temp_dir("cli-tokenize-same");
  const std::string txt = dir + "/corpus.txt";
  std::ofstream(txt) << "hello world\n";
  for (const std::string& out : {txt, dir + "/./corpus.txt"}) {
    const test::KeelRun r = test::run_keel({"tokenize", "--file", txt, "--output", out});
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, "--output " + out + " is the --file it reads");
    EXPECT_EQ(test::slurp(txt), "hello world\n");
  }
}

// A tokenizer that starts every text with a token (Llama-3's <|begin_of_text|>; here the tiny
// Llama-style one's) starts the token file with it, as the packed text's stream starts: the rows
// of the two are the same.
TEST(CliTokenize, OutputStartsAsThePackedTextDoes) {
  const std::string dir = test::temp_dir("cli-tokenize-prefix");
  const std::string txt = dir + "/corpus.txt", spec = "hf:" + kTiny + "/llama_style";
  std::ofstream(txt) << "the there the there\n\nthe quick brown fox, again and again\n";
  const test::KeelRun r =
      test::run_keel({"tokenize", "--tokenizer", spec, "--file", txt, "--output", txt + ".bin"});
  ASSERT_EQ(r.code, 0) << r.output;
  const auto tok = data::load_tokenizer(spec);
  ASSERT_GE(tok->prefix_id(), 0);
  const auto packed = data::load_text_dataset(txt, *tok, 8, /*pack=*/true);
  const auto mapped = data::load_token_file(txt + ".bin", "data.path", *tok, 8);
  ASSERT_EQ(mapped->size(), packed->size());
  EXPECT_EQ(mapped->get(0).copy().tokens.front(), tok->prefix_id());
  for (int64_t i = 0; i < packed->size(); ++i)
    EXPECT_EQ(mapped->get(i).copy().tokens, packed->get(i).copy().tokens) << i;
}

// `--output` writes an llm.c token file; a run on it (data.task = "tokens") is the run on the text
// packed, bit for bit: the same losses and gradient norms, the same validation loss through
// data.eval_path, the same `keel eval`.
TEST(CliTokenize, OutputTrainsAsTheTextPacked) {
  const std::string dir = test::temp_dir("cli-tokenize-output");
  const std::string txt = dir + "/corpus.txt", val = dir + "/val.txt";
  {
    std::ofstream t(txt), v(val);
    for (int i = 0; i < 60; ++i) t << "line " << i << ": the quick brown fox " << i * 7 << "\n";
    for (int i = 0; i < 12; ++i) v << "held out " << i << "\n";
  }
  for (const std::string& f : {txt, val}) {
    const test::KeelRun r = test::run_keel(
        {"tokenize", "--tokenizer", "gpt2:" + kTiny, "--file", f, "--output", f + ".bin"});
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_CONTAINS(r.err, "wrote ");
  }
  auto run = [&](const std::string& out, std::vector<std::string> data) {
    std::vector<std::string> sets = {"run.out_dir=" + out,           "run.threads=1",
                                     "data.tokenizer=gpt2:" + kTiny, "data.seq_len=24",
                                     "train.batch_size=4",           "train.max_steps=4",
                                     "train.eval_every=2",           "log.tensorboard=false"};
    sets.insert(sets.end(), data.begin(), data.end());
    const test::KeelRun r = test::run_keel(test::with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
    return r;
  };
  run(dir + "/text",
      {"data.task=text", "data.pack=true", "data.path=" + txt, "data.eval_path=" + val});
  run(dir + "/tokens",
      {"data.task=tokens", "data.path=" + txt + ".bin", "data.eval_path=" + val + ".bin"});
  const auto a = test::step_records(dir + "/text"), b = test::step_records(dir + "/tokens");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << i;
    EXPECT_EQ(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>()) << i;
  }
  const auto ea = test::records_with(dir + "/text", "eval_loss"),
             eb = test::records_with(dir + "/tokens", "eval_loss");
  ASSERT_GE(ea.size(), 2u);
  ASSERT_EQ(eb.size(), ea.size());
  for (size_t i = 0; i < ea.size(); ++i)
    EXPECT_EQ(ea[i]["eval_loss"].get<double>(), eb[i]["eval_loss"].get<double>()) << i;
  // keel eval picks the token file's task from its extension.
  const test::KeelRun et = test::run_keel(
      {"eval", dir + "/text", "--data", val, "--pack", "--json"}, {"OMP_NUM_THREADS=1"});
  const test::KeelRun eb2 = test::run_keel(
      {"eval", dir + "/text", "--data", val + ".bin", "--json"}, {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(et.code, 0) << et.output;
  ASSERT_EQ(eb2.code, 0) << eb2.output;
  EXPECT_EQ(nlohmann::json::parse(et.out)["loss"], nlohmann::json::parse(eb2.out)["loss"]);
  // --pack and --pad mean nothing for a token file: refused (they were taken without a word).
  for (const char* flag : {"--pack", "--pad=eos"}) {
    const test::KeelRun f = test::run_keel({"eval", dir + "/text", "--data", val + ".bin", flag});
    EXPECT_EQ(f.code, 2) << f.output;
    EXPECT_CONTAINS(f.err, std::string(flag).substr(0, 5));
  }
  // The estimate counts the mapped ids as the page cache's, not the run's.
  const test::KeelRun mem = test::run_keel(
      test::with_sets({"memory"}, {"data.task=tokens", "data.path=" + txt + ".bin",
                                   "data.tokenizer=gpt2:" + kTiny, "data.seq_len=24"}));
  ASSERT_EQ(mem.code, 0) << mem.output;
  EXPECT_CONTAINS(mem.out, txt + ".bin: ");
  EXPECT_CONTAINS(mem.out, "rows, mapped (page cache, not counted)");
  // --output writes ids, not text: the flags that print are refused beside it.
  const test::KeelRun both =
      test::run_keel({"tokenize", "--output", dir + "/x.bin", "--json", "a"});
  EXPECT_EQ(both.code, 2) << both.output;
}

// An empty text made a 0-token file, exit 0, that keel train and keel eval then refused. Fewer
// than 2 tokens is refused here (exit 2, naming the input and the fix), and nothing is written.
TEST(CliTokenize, OutputOfTooFewTokensIsRefusedAndNothingWritten) {
  const std::string dir = test::temp_dir("cli-tokenize-empty");
  const std::string empty = dir + "/empty.txt";
  std::ofstream(empty) << "";
  const std::vector<std::pair<test::KeelRun, std::string>> runs = {
      {test::run_keel_sh("tokenize --output " + dir + "/a.bin < /dev/null"),
       "tokenize --output: stdin encodes to 0 tokens"},
      {test::run_keel({"tokenize", "--file", empty, "--output", dir + "/b.bin"}),
       "tokenize --output: --file " + empty + " encodes to 0 tokens"},
      {test::run_keel({"tokenize", "a", "--output", dir + "/c.bin"}),
       "tokenize --output: the argument encodes to 1 token;"},
  };
  for (const auto& [r, want] : runs) {
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, want);
    EXPECT_CONTAINS(r.err, "a token file needs at least 2 to train or evaluate on");
    EXPECT_CONTAINS(r.err, "give a text with more content (nothing was written to " + dir);
  }
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1);  // empty.txt alone
}

// --output reads and encodes the text a piece at a time (8 MiB; here 64 bytes): the file holds
// the ids of encoding it whole, from --file and from stdin. A write that fails (a file-size limit
// here, a full disk alike) is an error naming the file, and leaves no file and no partial one.
TEST(CliTokenize, OutputIsWrittenInPiecesAndNothingOnAFailedWrite) {
  const std::string dir = test::temp_dir("cli-tokenize-pieces");
  const std::string txt = dir + "/corpus.txt";
  std::string text;
  for (int i = 0; i < 400; ++i)
    text +=
        "line " + std::to_string(i) + (i % 5 ? ": the quick brown fox.\n" : ":\n\n  indented\n");
  std::ofstream(txt) << text;
  const auto tok = data::load_tokenizer("gpt2:" + kTiny);
  const std::string want = data::token_file_bytes(tok->encode(text), tok->vocab_size());
  const std::vector<std::string> env = {"KEEL_TEST_TOKENIZE_PIECE_BYTES=64"};
  test::KeelRun r = test::run_keel(
      {"tokenize", "--tokenizer", "gpt2:" + kTiny, "--file", txt, "--output", dir + "/a.bin"}, env);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(test::slurp(dir + "/a.bin") == want);
  r = test::run_keel_sh(
      "tokenize --tokenizer gpt2:" + kTiny + " --output " + dir + "/b.bin < " + txt, env);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(test::slurp(dir + "/b.bin") == want);

  const std::string bad = dir + "/limited";
  std::filesystem::create_directories(bad);
  r = test::run_command({"/bin/sh", "-c",
                         "ulimit -f 4; exec " + test::keel_binary() + " tokenize --file " + txt +
                             " --output " + bad + "/c.bin"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "cannot write the token file " + bad + "/c.bin: File too large");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(bad), {}), 0);
}

// A tokenize killed while writing (SIGKILL, the OOM killer) left FILE.tmp-PID, as large as the
// corpus's ids, for good: now the next --output FILE removes those of processes gone. And the
// rename into place was never made durable (no fsync of the directory): a failing one is an error.
TEST(CliTokenize, OutputRemovesTheTemporaryOfAKilledWriteAndFsyncsItsDirectory) {
  const std::string dir = test::temp_dir("cli-tokenize-stale");
  const int dead = test::dead_pid();
  ASSERT_GT(dead, 0);
  const std::string stale = dir + "/a.bin.tmp-" + std::to_string(dead);
  const std::string live = dir + "/a.bin.tmp-" + std::to_string(::getpid());
  std::ofstream(stale) << "half a corpus";
  std::ofstream(live) << "a write in progress";
  test::KeelRun r = test::run_keel({"tokenize", "--output", dir + "/a.bin", kText});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(live));

  r = test::run_keel({"tokenize", "--output", dir + "/b.bin", kText}, {"KEEL_TEST_FAIL_FSYNC=1"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "cannot fsync directory " + dir);
}

// Printed ids are the command's output: lost to a full disk they ended in exit 0.
TEST(CliTokenize, IdsThatCannotBePrintedAreAnError) {
  const test::KeelRun r =
      test::run_command({"/bin/sh", "-c", test::keel_binary() + " tokenize hello > /dev/full"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "cannot write standard output: No space left on device");
}

}  // namespace
}  // namespace keel
