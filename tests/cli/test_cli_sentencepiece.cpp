// A SentencePiece-style tokenizer (Llama-2's tokenizer.json form) end to end: a Llama trains on a
// Llama-2-style chat template's conversations and prompt-completion lines with it (its loss
// falls), and tokenize, generate and eval read it as the library does.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "keel/data/chat.h"
#include "keel/data/tokenizer_base.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

using json = nlohmann::json;

struct SpFiles {
  std::string dir, model, tokenizer, data;
};

// A tiny Llama over the tiny SentencePiece-style vocabulary (302 tokens), that tokenizer with
// Llama-2's tokenizer_config.json fields (bos <s>, eos </s>, an [INST] chat template), and a JSONL
// file of conversations and prompt-completion lines.
const SpFiles& sp_files() {
  static const SpFiles f = [] {
    SpFiles f;
    f.dir = test::temp_dir("cli-sp");
    const test::TinyChatModel m = test::tiny_chat_model(
        f.dir, 302, 64, "sp_legacy/tokenizer.json",
        {{"bos_token", "<s>"},
         {"eos_token", "</s>"},
         {"chat_template",
          "{% for m in messages %}{% if m.role == 'user' %}{{ bos_token }}[INST] "
          "{{ m.content }} [/INST]{% else %} {{ m.content }} {{ eos_token }}{% endif %}"
          "{% endfor %}"}});
    f.model = m.model;
    f.tokenizer = m.tokenizer;
    f.data = f.dir + "/train.jsonl";
    std::ofstream d(f.data);
    for (int i = 0; i < 8; ++i) {
      d << json({{"messages",
                  {{{"role", "user"}, {"content", i % 2 ? "is the" : "the"}},
                   {{"role", "assistant"}, {"content", "there is"}}}}})
               .dump()
        << "\n"
        << json({{"prompt", "is the"}, {"completion", " there"}}).dump() << "\n";
    }
    return f;
  }();
  return f;
}

TEST(CliSentencePiece, ALlamaTrainsWithItAndEvalCountsTheTargets) {
  const SpFiles& f = sp_files();
  const std::string out = f.dir + "/run";
  const test::KeelRun r = test::run_keel(
      test::with_sets(
          {"train"},
          {"run.out_dir=" + out, "run.threads=1", "model.path=" + f.model, "data.task=jsonl",
           "data.path=" + f.data, "data.tokenizer=hf:" + f.tokenizer, "data.seq_len=64",
           "train.batch_size=8", "train.max_steps=30", "optim.lr=0.01", "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  const auto steps = test::step_records(out);
  ASSERT_EQ(steps.size(), 30u);
  EXPECT_LT(steps.back()["loss"].get<double>(), 0.5 * steps.front()["loss"].get<double>());
  // The targets: each reply and its </s> (the chat lines), each completion and its </s>.
  const auto tok = data::load_tokenizer("hf:" + f.tokenizer);
  const int64_t reply = static_cast<int64_t>(tok->encode_continuation(" there is </s>").size());
  const int64_t completion = static_cast<int64_t>(tok->encode_continuation(" there").size()) + 1;
  const test::KeelRun e = test::run_keel({"eval", out, "--data", f.data, "--json"});
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_EQ(json::parse(e.out).at("tokens").get<int64_t>(), 8 * (reply + completion));
}

TEST(CliSentencePiece, TokenizeAndGenerateReadItAsTheLibraryDoes) {
  const SpFiles& f = sp_files();
  const std::string hf = "hf:" + f.tokenizer;
  const auto tok = data::load_tokenizer(hf);
  const test::KeelRun t = test::run_keel({"tokenize", "--tokenizer", hf, "--json", "the there"});
  ASSERT_EQ(t.code, 0) << t.output;
  EXPECT_EQ(json::parse(t.out).at("ids").get<std::vector<int32_t>>(), tok->encode("the there"));
  const test::KeelRun d =
      test::run_keel({"tokenize", "--tokenizer", hf, "--decode", "[1, 284, 2, 259, 287]"});
  ASSERT_EQ(d.code, 0) << d.output;
  EXPECT_EQ(d.out, "the  there");  // (the text as decoded: no newline added)
  // generate starts the prompt with <s> (the post-processor's) and prints what decode gives.
  const test::KeelRun g = test::run_keel(
      {"generate", f.model, "the there", "--tokenizer", hf, "--max-new-tokens", "4", "--json"},
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(g.code, 0) << g.output;
  const json out = json::parse(g.out);
  EXPECT_EQ(out.at("prompt_tokens").get<size_t>(), tok->encode("the there").size() + 1);
  std::vector<int32_t> ids = out.at("tokens").get<std::vector<int32_t>>();
  if (!ids.empty() && ids.back() == tok->eos_id()) ids.pop_back();
  EXPECT_EQ(out.at("text").get<std::string>(), tok->decode(ids));
}

}  // namespace
}  // namespace keel
