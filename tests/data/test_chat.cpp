// Conversations ({"messages": [...]}) in the model's chat template: the tokenizer finds the
// template (tokenizer_config.json, chat_template.jinja), a conversation's targets are exactly what
// the assistant says and the turn's end, JSONL datasets read them, and every kind of bad
// conversation or template is an error naming the line and the fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "keel/data/chat.h"
#include "keel/data/dataset.h"
#include "keel/data/tokenizer_base.h"
#include "tests/support/check.h"

namespace keel::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The tiny Llama-style tokenizer (its <|eot|> plays <|begin_of_text|> and <|eot_id|>) with a
// chat template of Llama-3's shape: a header per turn, the content trimmed, an end-of-turn token.
const char* kTemplate =
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content | trim }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}";

std::string chat_tokenizer_dir(const std::string& tag, const json& config) {
  const std::string dir = test::temp_dir(tag);
  fs::copy_file(std::string(KEEL_SOURCE_DIR) +
                    "/tests/data/tokenizer_parity/tiny/llama_style/"
                    "tokenizer.json",
                dir + "/tokenizer.json");
  std::ofstream(dir + "/tokenizer_config.json") << config.dump();
  return dir;
}

const json kConfig = {{"bos_token", "<|eot|>"},
                      {"eos_token", {{"content", "<|eot|>"}}},
                      {"chat_template", kTemplate}};

json conversation() {
  return json::array({{{"role", "system"}, {"content", "be brief"}},
                      {{"role", "user"}, {"content", "the there "}},
                      {{"role", "assistant"}, {"content", " hello there"}},
                      {{"role", "user"}, {"content", "then?"}},
                      {{"role", "assistant"}, {"content", "the end"}}});
}

// The ids of `e`'s targets, in order.
std::vector<int32_t> target_ids(const Example& e) {
  std::vector<int32_t> ids;
  for (size_t t = 0; t < e.tokens.size(); ++t)
    if (e.target[t]) ids.push_back(e.tokens[t]);
  return ids;
}

TEST(Chat, TheTemplateRendersWithTheTokenizersSpecialTokens) {
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-render", kConfig));
  ASSERT_NE(tok->chat_format(), nullptr);
  EXPECT_EQ(render_chat(*tok->chat_format(), conversation(), false),
            "<|eot|>system: be brief<|eot|>user: the there<|eot|>assistant: hello there<|eot|>"
            "user: then?<|eot|>assistant: the end<|eot|>");
  EXPECT_EQ(render_chat(*tok->chat_format(), json::array({conversation()[1]}), true),
            "<|eot|>user: the there<|eot|>assistant: ");
  // A tokenizer without a template has none; GPT-2's and the byte tokenizer never do.
  EXPECT_EQ(load_tokenizer("byte")->chat_format(), nullptr);
  EXPECT_EQ(load_tokenizer("hf:" + chat_tokenizer_dir("chat-none", {{"bos_token", "<|eot|>"}}))
                ->chat_format(),
            nullptr);
}

TEST(Chat, TheTargetsAreTheAssistantsRepliesAndTheirEndOfTurn) {
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-targets", kConfig));
  const Example e = conversation_example(*tok, conversation());
  // The tokens before a reply are those of the prompt that asks for it (as generate --chat
  // writes it, the header's trailing space a token of its own), with no second prefix token; the
  // text is the whole conversation's.
  ASSERT_EQ(e.target.size(), e.tokens.size());
  const json messages = conversation();
  const std::vector<int32_t> prompt = tok->encode(
      render_chat(*tok->chat_format(), json(messages.begin(), messages.begin() + 2), true));
  const auto first = std::find(e.target.begin(), e.target.end(), 1) - e.target.begin();
  EXPECT_EQ(std::vector<int32_t>(e.tokens.begin(), e.tokens.begin() + first), prompt);
  EXPECT_EQ(tok->decode(e.tokens),
            tok->decode(tok->encode(render_chat(*tok->chat_format(), conversation(), false))));
  // What the assistant says, each reply closed by its end-of-turn token; nothing of the system
  // turn, the user's turns or the "assistant: " headers.
  const int32_t eot = static_cast<int32_t>(tok->token_to_id("<|eot|>"));
  std::vector<int32_t> expected = tok->encode("hello there");
  expected.push_back(eot);
  for (int32_t id : tok->encode("the end")) expected.push_back(id);
  expected.push_back(eot);
  EXPECT_EQ(target_ids(e), expected);
  EXPECT_EQ(e.target.back(), 1);
  EXPECT_EQ(e.target.front(), 0);
}

TEST(Chat, ATemplateBesideTheTokenizerAndANamedListAreFound) {
  // chat_template.jinja (transformers >= 4.43) is read before the config's.
  const std::string dir = chat_tokenizer_dir(
      "chat-jinja", {{"bos_token", "<|eot|>"}, {"chat_template", "ignored {{ messages }}"}});
  std::ofstream(dir + "/chat_template.jinja") << kTemplate;
  const auto tok = load_tokenizer("hf:" + dir);
  EXPECT_EQ(render_chat(*tok->chat_format(), json::array({conversation()[1]}), false),
            "<|eot|>user: the there<|eot|>");
  // A list of named templates: apply_chat_template's default is "default".
  const json named = {
      {"bos_token", "<|eot|>"},
      {"chat_template", json::array({{{"name", "tool_use"}, {"template", "x"}},
                                     {{"name", "default"}, {"template", kTemplate}}})}};
  const auto listed = load_tokenizer("hf:" + chat_tokenizer_dir("chat-list", named));
  EXPECT_EQ(render_chat(*listed->chat_format(), json::array({conversation()[1]}), false),
            "<|eot|>user: the there<|eot|>");
  const json no_default = {{"chat_template", json::array({{{"name", "rag"}, {"template", "x"}}})}};
  EXPECT_CONTAINS(
      test::error_of([&] { load_tokenizer("hf:" + chat_tokenizer_dir("chat-list2", no_default)); }),
      "tokenizer_config.json: chat_template: a list without a {\"name\": \"default\"");
  EXPECT_CONTAINS(test::error_of([&] {
                    load_tokenizer("hf:" + chat_tokenizer_dir("chat-num", {{"chat_template", 7}}));
                  }),
                  "chat_template: expected a string (the Jinja template), got number");
}

// A template keel cannot read stops the conversations, not a run on plain text with that
// tokenizer: it is parsed when first used, and its error names where it was read.
TEST(Chat, ABrokenTemplateFailsOnlyWhatUsesIt) {
  const auto tok = load_tokenizer(
      "hf:" + chat_tokenizer_dir("chat-broken", {{"chat_template", "{% for m in %}"}}));
  EXPECT_FALSE(tok->encode("the there").empty());
  const std::string msg = test::error_of([&] { conversation_example(*tok, conversation()); });
  EXPECT_CONTAINS(msg, "tokenizer_config.json's chat_template");
  EXPECT_CONTAINS(msg, "line 1");
}

TEST(Chat, BadConversationsSayWhatIsWrong) {
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-bad", kConfig));
  auto error = [&](const json& messages) {
    return test::error_of([&] { conversation_example(*tok, messages); });
  };
  EXPECT_CONTAINS(error(json::object()), "\"messages\" must be an array");
  EXPECT_CONTAINS(error(json::array()), "\"messages\" is empty");
  EXPECT_CONTAINS(error(json::array({"hi"})), "\"messages\"[0] is a JSON string");
  EXPECT_CONTAINS(error(json::array({{{"content", "hi"}}})), "\"messages\"[0] has no \"role\"");
  EXPECT_CONTAINS(error(json::array({{{"role", "user"}}})), "\"messages\"[0] has no \"content\"");
  EXPECT_CONTAINS(error(json::array({{{"role", "user"}, {"content", 3}}})),
                  "\"messages\"[0]: \"content\" must be a string, got number");
  EXPECT_CONTAINS(error(json::array({{{"role", 1}, {"content", "x"}}})),
                  "\"role\" must be a string");
  EXPECT_CONTAINS(error(json::array({conversation()[1]})),
                  "has no \"assistant\" message: nothing to train on");
  // The template's own refusal (Mistral's and Gemma's insist that roles alternate).
  const json strict = {
      {"chat_template",
       "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
       "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
       "{% endif %}{{ m.content }}{% endfor %}"}};
  const auto alternating = load_tokenizer("hf:" + chat_tokenizer_dir("chat-strict", strict));
  EXPECT_CONTAINS(
      test::error_of([&] {
        conversation_example(*alternating, json::array({conversation()[2], conversation()[1]}));
      }),
      "Conversation roles must alternate");
  // A template that rewrites earlier turns (here: only the last reply keeps its text) leaves no
  // span that is the assistant's.
  const json rewriting = {{"chat_template",
                           "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
                           "[reply]{% else %}{{ m.content }}{% endif %}{% endfor %}"}};
  const auto rewriter = load_tokenizer("hf:" + chat_tokenizer_dir("chat-rewrite", rewriting));
  EXPECT_CONTAINS(test::error_of([&] { conversation_example(*rewriter, conversation()); }),
                  "cannot tell which tokens the assistant says");
  // No template at all.
  EXPECT_CONTAINS(
      test::error_of([&] { conversation_example(*load_tokenizer("byte"), conversation()); }),
      "the run's tokenizer has none");
}

TEST(Chat, JsonlConversationsAreExamplesAndTheirErrorsNameTheLine) {
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-jsonl", kConfig));
  const std::string dir = test::temp_dir("chat-jsonl-data");
  const std::string path = dir + "/chat.jsonl";
  std::ofstream(path) << json({{"messages", conversation()}}).dump() << "\n"
                      << json({{"prompt", "the"}, {"completion", " there"}}).dump() << "\n";
  const auto ds = load_jsonl_dataset(path, *tok, 256);
  ASSERT_EQ(ds->size(), 2);
  const Example direct = conversation_example(*tok, conversation());
  const Example read = ds->get(0).copy();
  EXPECT_EQ(read.tokens, direct.tokens);
  EXPECT_EQ(read.target, direct.target);
  EXPECT_EQ(ds->where(0), path + ":1");
  auto error = [&](const std::string& lines, int64_t seq_len = 256, const Tokenizer* t = nullptr) {
    std::ofstream(path) << lines;
    return test::error_of([&] { load_jsonl_dataset(path, t ? *t : *tok, seq_len); });
  };
  const std::string good = json({{"messages", conversation()}}).dump() + "\n";
  EXPECT_CONTAINS(error(good + R"({"messages": [{"role": "user"}]})"
                               "\n"),
                  path + ": line 2: \"messages\"[0] has no \"content\"");
  EXPECT_CONTAINS(error(R"({"messages": [], "text": "x"})"
                        "\n"),
                  "line 1: has more than one of \"text\", \"prompt\"/\"completion\" and "
                  "\"messages\"");
  const auto byte = load_tokenizer("byte");
  EXPECT_CONTAINS(error(good, 256, byte.get()),
                  path +
                      ": line 1: a conversation ({\"messages\": [...]}) is written in the "
                      "model's chat template, and the run's tokenizer has none");
  // A first reply past seq_len leaves nothing to train on.
  const auto first =
      std::find(direct.target.begin(), direct.target.end(), 1) - direct.target.begin();
  EXPECT_CONTAINS(error(good, first),
                  "line 1: the first assistant reply starts at token " + std::to_string(first) +
                      ", so with seq_len " + std::to_string(first) +
                      " no token of it is left to train on; raise data.seq_len");
  // One more token keeps the reply's first token as a target.
  std::ofstream(path) << good;
  EXPECT_EQ(load_jsonl_dataset(path, *tok, first + 1)->size(), 1);
}

// A tool call's arguments print through the template's tojson in the order the data wrote them,
// as transformers' Python dicts do (a sorted JSON object would train on another text).
TEST(Chat, ATemplateSeesTheDatasKeyOrder) {
  const json config = {{"eos_token", "<|eot|>"},
                       {"chat_template",
                        "{% for m in messages %}{{ m.content }}{% if m.tool_calls %}"
                        "{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}<|eot|>"
                        "{% endfor %}"}};
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-order", config));
  const std::string path = test::temp_dir("chat-order-data") + "/tools.jsonl";
  std::ofstream(path) << R"({"messages": [{"role": "user", "content": "go"}, {"role": "assistant",)"
                      << R"( "content": null, "tool_calls": [{"type": "function", "function":)"
                      << R"( {"name": "f", "arguments": {"zeta": 1, "alpha": "é"}}}]}]})"
                      << "\n";
  const auto ds = load_jsonl_dataset(path, *tok, 256);
  // (A null content prints as Python's None, as jinja2 prints it: real templates test it first.)
  EXPECT_EQ(tok->decode(ds->get(0).copy().tokens), "goNone{\"zeta\": 1, \"alpha\": \"é\"}");
}

}  // namespace
}  // namespace keel::data
