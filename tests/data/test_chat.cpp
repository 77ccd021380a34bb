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
#include "tests/support/run_keel.h"

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

// The example of a conversation that is one (conversation_examples splits only a conversation
// whose template rewrites earlier turns), or of the messages given bare.
Example one_example(const Tokenizer& tok, const Conversation& c) {
  const std::vector<ConversationExample> all = conversation_examples(tok, c);
  EXPECT_EQ(all.size(), 1u);
  return all.at(0).example;
}
Example one_example(const Tokenizer& tok, const nlohmann::ordered_json& messages) {
  Conversation c;
  c.messages = messages;
  check_messages(c.messages);
  return one_example(tok, c);
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
  const Example e = one_example(*tok, conversation());
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
  const std::string msg = test::error_of([&] { one_example(*tok, conversation()); });
  EXPECT_CONTAINS(msg, "tokenizer_config.json's chat_template");
  EXPECT_CONTAINS(msg, "line 1");
}

TEST(Chat, BadConversationsSayWhatIsWrong) {
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-bad", kConfig));
  auto error = [&](const json& messages) {
    return test::error_of([&] { one_example(*tok, messages); });
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
  EXPECT_CONTAINS(test::error_of([&] {
                    one_example(*alternating, json::array({conversation()[2], conversation()[1]}));
                  }),
                  "Conversation roles must alternate");
  // A reply's turn that does not start with the prompt that asks for it (the generation header
  // is "A:", the turn "assistant=") leaves no span that is the assistant's.
  const json unprompted = {{"chat_template",
                            "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
                            "{% if add_generation_prompt %}A:{% endif %}"}};
  const auto mismatched = load_tokenizer("hf:" + chat_tokenizer_dir("chat-unprompted", unprompted));
  EXPECT_CONTAINS(test::error_of([&] { one_example(*mismatched, conversation()); }),
                  "renders the conversation up to \"messages\"[2] otherwise than as the prompt "
                  "that asks for it followed by the reply, so keel cannot tell which tokens the "
                  "assistant says");
  // No template at all.
  EXPECT_CONTAINS(test::error_of([&] { one_example(*load_tokenizer("byte"), conversation()); }),
                  "the run's tokenizer has none");
}

// Qwen3's published template renders a reply otherwise once a later user turn follows: the last
// reply (after the last user query) gets an empty <think></think>, earlier ones lose theirs. No
// text holds every reply as it was said, so each reply is an example of its own: the text that
// prompts it (generate --messages's) followed by the reply, earlier turns as inference renders
// them. A single turn stays one example; a JSONL line of two turns is two rows of that line.
TEST(Chat, ATemplateThatRewritesEarlierTurnsTrainsEachReplyInTheTextThatPromptsIt) {
  const auto tok = load_tokenizer(
      "hf:" + chat_tokenizer_dir("chat-qwen3",
                                 {{"eos_token", "<|eot|>"},
                                  {"chat_template",
                                   test::published_chat_template("qwen3/alternating/gen=False")}}));
  const ChatFormat& chat = *tok->chat_format();
  const json messages = conversation();  // system, user, reply, user, reply
  const std::vector<ConversationExample> all =
      conversation_examples(*tok, conversation_of(messages));
  ASSERT_EQ(all.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    SCOPED_TRACE(k);
    const size_t reply = k == 0 ? 2 : 4;
    const json through(messages.begin(), messages.begin() + reply + 1);
    const json asking(messages.begin(), messages.begin() + reply);
    EXPECT_EQ(all[k].text, render_chat(chat, through, false));
    const Example& e = all[k].example;
    // Context: exactly the prompt generate gives; targets: the reply as the template closes it.
    const std::vector<int32_t> prompt = tok->encode(render_chat(chat, asking, true));
    const auto first = std::find(e.target.begin(), e.target.end(), 1) - e.target.begin();
    ASSERT_EQ(static_cast<size_t>(first), prompt.size());
    EXPECT_EQ(std::vector<int32_t>(e.tokens.begin(), e.tokens.begin() + first), prompt);
    EXPECT_EQ(
        tok->decode(target_ids(e)),
        "<think>\n\n</think>\n\n" + messages[reply]["content"].get<std::string>() + "<|im_end|>\n");
  }
  // In the second, the first reply is context, without the <think></think> it was said with.
  EXPECT_CONTAINS(all[1].text, "<|im_start|>assistant\n hello there<|im_end|>");
  EXPECT_EQ(
      conversation_examples(*tok, conversation_of(json(messages.begin(), messages.begin() + 3)))
          .size(),
      1u);
  const std::string path = test::temp_dir("chat-qwen3-data") + "/chat.jsonl";
  std::ofstream(path) << json({{"messages", messages}}).dump() << "\n";
  const auto ds = load_jsonl_dataset(path, *tok, 256);
  ASSERT_EQ(ds->size(), 2);
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ds->get(i).copy().tokens, all[static_cast<size_t>(i)].example.tokens);
    EXPECT_EQ(ds->where(i), path + ":1");
  }
  // A row too short for the second reply keeps the first: that reply is left out, as a reply
  // past seq_len in one example is cut off.
  const size_t second_starts = all[1].example.tokens.size() - target_ids(all[1].example).size();
  const auto short_rows = load_jsonl_dataset(path, *tok, static_cast<int64_t>(second_starts) - 1);
  EXPECT_EQ(short_rows->size(), 1);
  EXPECT_EQ(short_rows->left_out(), 1);  // said by train and eval
  EXPECT_EQ(ds->left_out(), 0);
}

TEST(Chat, JsonlConversationsAreExamplesAndTheirErrorsNameTheLine) {
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-jsonl", kConfig));
  const std::string dir = test::temp_dir("chat-jsonl-data");
  const std::string path = dir + "/chat.jsonl";
  std::ofstream(path) << json({{"messages", conversation()}}).dump() << "\n"
                      << json({{"prompt", "the"}, {"completion", " there"}}).dump() << "\n";
  const auto ds = load_jsonl_dataset(path, *tok, 256);
  ASSERT_EQ(ds->size(), 2);
  const Example direct = one_example(*tok, conversation());
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

// Granite's template writes strftime_now's date into its default system message, unguarded. A
// dataset renders without a date (the same text on every day), so such a line is an error naming
// data.chat_date, and with the key every reply's prompt and the whole text carry that day.
TEST(Chat, ATemplateThatWritesTodaysDateTakesDataChatDate) {
  const json config = {
      {"eos_token", "<|eot|>"},
      {"chat_template",
       "{% if messages[0].role != 'system' %}Today: {{ strftime_now('%B %d, %Y') }}<|eot|>"
       "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}<|eot|>{% endfor %}"
       "{% if add_generation_prompt %}assistant: {% endif %}"}};
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-date", config));
  const std::string path = test::temp_dir("chat-date-data") + "/chat.jsonl";
  const auto messages = json::array({{{"role", "user"}, {"content", "the"}},
                                     {{"role", "assistant"}, {"content", " there"}},
                                     {{"role", "user"}, {"content", "then?"}},
                                     {{"role", "assistant"}, {"content", "the end"}}});
  std::ofstream(path) << json({{"messages", messages}}).dump() << "\n";
  const std::string m = test::error_of([&] { load_jsonl_dataset(path, *tok, 256); });
  EXPECT_CONTAINS(m, path + ": line 1: ");
  EXPECT_CONTAINS(m, "'strftime_now' is undefined: the template writes today's date");
  EXPECT_CONTAINS(m, "data.chat_date = \"YYYY-MM-DD\"");
  JsonlOptions dated;
  dated.chat_date = "2024-12-04";
  const auto ds = load_jsonl_dataset(path, *tok, 256, "data.path", dated);
  ASSERT_EQ(ds->size(), 1);
  const std::vector<ConversationExample> direct =
      conversation_examples(*tok, conversation_of(json({{"messages", messages}})), "2024-12-04");
  ASSERT_EQ(direct.size(), 1u);
  EXPECT_EQ(direct[0].text.rfind("Today: December 04, 2024<|eot|>user: the<|eot|>", 0), 0u)
      << direct[0].text;
  EXPECT_EQ(ds->get(0).copy().tokens, direct[0].example.tokens);
  EXPECT_EQ(target_ids(ds->get(0).copy()), target_ids(direct[0].example));
  // The targets: each reply and its end of turn (decode leaves the special <|eot|> out).
  const std::vector<int32_t> targets = target_ids(direct[0].example);
  EXPECT_EQ(tok->decode(targets), " therethe end");
  EXPECT_EQ(std::count(targets.begin(), targets.end(), tok->token_to_id("<|eot|>")), 2);
  // Another day is another text; the estimate of the file reads it as the loader does.
  dated.chat_date = "2025-01-01";
  EXPECT_NE(load_jsonl_dataset(path, *tok, 256, "data.path", dated)->get(0).copy().tokens,
            direct[0].example.tokens);
  EXPECT_TRUE(dataset_footprint(path, "jsonl", *tok, 256, false, dated).estimated);
  EXPECT_CONTAINS(test::error_of([&] { dataset_footprint(path, "jsonl", *tok, 256, false); }),
                  "data.chat_date");
  // A conversation with its own system message never asks for the date.
  auto with_system = messages;
  with_system.insert(with_system.begin(), json{{"role", "system"}, {"content", "be brief"}});
  std::ofstream(path) << json({{"messages", with_system}}).dump() << "\n";
  EXPECT_EQ(load_jsonl_dataset(path, *tok, 256)->size(), 1);
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

// TRL's other conversational formats: a prompt-completion of messages trains on all the completion
// adds to the prompt and its generation header; ShareGPT's from/value lines are messages.
TEST(Chat, PromptCompletionAndShareGptConversations) {
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-formats", kConfig));
  const json messages = conversation();
  auto example_of = [&](const json& line) {
    return one_example(*tok, conversation_of(nlohmann::ordered_json(line)));
  };
  // One reply: the same example as the messages it joins.
  const json first_turn(messages.begin(), messages.begin() + 3);
  const Example as_messages = one_example(*tok, first_turn);
  const Example as_completion =
      example_of({{"prompt", json(messages.begin(), messages.begin() + 2)},
                  {"completion", json::array({messages[2]})}});
  EXPECT_EQ(as_completion.tokens, as_messages.tokens);
  EXPECT_EQ(as_completion.target, as_messages.target);
  EXPECT_TRUE(is_conversation(json{{"prompt", json::array()}}));
  EXPECT_FALSE(is_conversation(json{{"prompt", "text"}, {"completion", "text"}}));
  // A completion of several turns is a target whole, the user's turn inside it included (TRL's
  // completion_only_loss), where "messages" trains on the replies alone.
  const Example whole = example_of({{"prompt", json(messages.begin(), messages.begin() + 2)},
                                    {"completion", json(messages.begin() + 2, messages.end())}});
  const std::string prompt_text =
      render_chat(*tok->chat_format(), json(messages.begin(), messages.begin() + 2), true);
  const std::vector<int32_t> prompt = tok->encode(prompt_text);
  ASSERT_GT(whole.tokens.size(), prompt.size());
  EXPECT_EQ(std::vector<int32_t>(whole.tokens.begin(), whole.tokens.begin() + prompt.size()),
            prompt);
  EXPECT_EQ(std::count(whole.target.begin(), whole.target.end(), 0), prompt.size());
  EXPECT_EQ(target_ids(whole),
            tok->encode("hello there<|eot|>user: then?<|eot|>assistant: the end<|eot|>"));
  // ShareGPT's roles: human -> user, gpt -> assistant; others as they are.
  json sharegpt = json::array();
  for (const json& m : messages) {
    const std::string role = m["role"] == "user"        ? "human"
                             : m["role"] == "assistant" ? "gpt"
                                                        : "system";
    sharegpt.push_back({{"from", role}, {"value", m["content"]}});
  }
  const Example shared = example_of({{"conversations", sharegpt}});
  const Example direct = one_example(*tok, messages);
  EXPECT_EQ(shared.tokens, direct.tokens);
  EXPECT_EQ(shared.target, direct.target);
}

// A line's "tools" and "chat_template_kwargs" reach the template as apply_chat_template's keyword
// arguments do; without them "tools" and "documents" are defined and none, as transformers passes
// them.
TEST(Chat, ToolsAndTemplateArgumentsReachTheTemplate) {
  const json config = {
      {"eos_token", "<|eot|>"},
      {"chat_template",
       "{% if tools is none %}none{% else %}{% for t in tools %}[{{ t.function.name }}]"
       "{% endfor %}{% endif %}{% if documents is defined and documents is none %}.{% endif %}"
       "{% if think is defined %}think={{ think }}{% endif %}"
       "{% for m in messages %}{{ m.role }}: {{ m.content }}<|eot|>{% endfor %}"}};
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-tools", config));
  const json tools = json::array(
      {{{"type", "function"}, {"function", {{"name", "there"}, {"parameters", json::object()}}}}});
  const json reply = json::array(
      {{{"role", "user"}, {"content", "the"}}, {{"role", "assistant"}, {"content", "then"}}});
  auto text_of = [&](const json& line) {
    const Conversation c = conversation_of(nlohmann::ordered_json(line));
    return render_chat(*tok->chat_format(), c.messages, false, "", c.variables);
  };
  EXPECT_EQ(text_of({{"messages", reply}}), "none.user: the<|eot|>assistant: then<|eot|>");
  EXPECT_EQ(text_of({{"messages", reply}, {"tools", tools}}),
            "[there].user: the<|eot|>assistant: then<|eot|>");
  // datasets stores a column of differing schemas as JSON text; TRL parses it.
  EXPECT_EQ(text_of({{"messages", reply}, {"tools", tools.dump()}}),
            text_of({{"messages", reply}, {"tools", tools}}));
  EXPECT_EQ(text_of({{"messages", reply}, {"chat_template_kwargs", {{"think", false}}}}),
            "none.think=Falseuser: the<|eot|>assistant: then<|eot|>");
  // The targets are still the reply (this template has no generation header: its turn whole), the
  // tools context. (decode drops the special <|eot|>.)
  const Example e = one_example(
      *tok, conversation_of(nlohmann::ordered_json({{"messages", reply}, {"tools", tools}})));
  EXPECT_EQ(target_ids(e), tok->encode("assistant: then<|eot|>"));
}

TEST(Chat, BadConversationLinesSayWhatIsWrong) {
  auto error = [](const json& line) {
    return test::error_of([&] { conversation_of(nlohmann::ordered_json(line)); });
  };
  const json user = json::array({{{"role", "user"}, {"content", "hi"}}});
  const json reply = json::array({{{"role", "assistant"}, {"content", "yo"}}});
  EXPECT_CONTAINS(error({{"messages", user}, {"prompt", user}}),
                  "more than one of \"messages\", \"conversations\" and \"prompt\"/\"completion\"");
  EXPECT_CONTAINS(error({{"prompt", user}}), "missing \"completion\"");
  EXPECT_CONTAINS(error({{"completion", reply}}), "missing \"prompt\"");
  EXPECT_CONTAINS(error({{"prompt", "hi"}, {"completion", reply}}),
                  "\"prompt\" is a string while the other is a list of messages");
  EXPECT_CONTAINS(error({{"prompt", user}, {"completion", json::array()}}),
                  "\"completion\" is empty");
  EXPECT_CONTAINS(error({{"prompt", json::array({{{"role", "user"}}})}, {"completion", reply}}),
                  "\"prompt\"[0] has no \"content\"");
  EXPECT_CONTAINS(error({{"conversations", "hi"}}), "\"conversations\" must be an array");
  EXPECT_CONTAINS(error({{"conversations", json::array({{{"from", "human"}}})}}),
                  "\"conversations\"[0] is not {\"from\": ..., \"value\": ...}");
  EXPECT_CONTAINS(error({{"messages", user}, {"tools", 5}}),
                  "\"tools\" must be a list of function schemas, got number");
  EXPECT_CONTAINS(error({{"messages", user}, {"tools", "[{"}}),
                  "\"tools\" is a string that is not JSON");
  EXPECT_CONTAINS(error({{"messages", user}, {"tools", json::array({"f"})}}),
                  "\"tools\"[0] is a JSON string; a tool is a function schema");
  EXPECT_CONTAINS(error({{"messages", user}, {"chat_template_kwargs", json::array()}}),
                  "\"chat_template_kwargs\" must be an object");
  EXPECT_CONTAINS(error({{"messages", user}, {"chat_template_kwargs", {{"messages", user}}}}),
                  "\"chat_template_kwargs\" gives \"messages\", which keel sets itself");
  // A completion the template renders as nothing is nothing to train on.
  const auto tok = load_tokenizer(
      "hf:" + chat_tokenizer_dir("chat-silent", {{"chat_template",
                                                  "{% for m in messages %}{% if m.role == 'user' %}"
                                                  "{{ m.content }}{% endif %}{% endfor %}"}}));
  EXPECT_CONTAINS(test::error_of([&] {
                    one_example(*tok, conversation_of(nlohmann::ordered_json(
                                          {{"prompt", user}, {"completion", reply}})));
                  }),
                  "the completion adds no text to the prompt's");
}

// A JSONL file may mix the formats line by line; tools on a line of text are an error naming it.
TEST(Chat, JsonlReadsEveryConversationalFormat) {
  const auto tok = load_tokenizer("hf:" + chat_tokenizer_dir("chat-jsonl-formats", kConfig));
  const std::string path = test::temp_dir("chat-jsonl-formats-data") + "/mixed.jsonl";
  const json messages = conversation();
  std::ofstream(path) << json({{"prompt", json(messages.begin(), messages.begin() + 2)},
                               {"completion", json::array({messages[2]})}})
                             .dump()
                      << "\n"
                      << json({{"conversations",
                                json::array({{{"from", "human"}, {"value", "the"}},
                                             {{"from", "gpt"}, {"value", "there"}}})}})
                             .dump()
                      << "\n";
  const auto ds = load_jsonl_dataset(path, *tok, 256);
  ASSERT_EQ(ds->size(), 2);
  EXPECT_EQ(ds->get(0).copy().tokens,
            one_example(*tok, json(messages.begin(), messages.begin() + 3)).tokens);
  EXPECT_EQ(target_ids(ds->get(1).copy()), tok->encode("there<|eot|>"));
  std::ofstream(path) << R"({"text": "the", "tools": []})"
                      << "\n";
  EXPECT_CONTAINS(test::error_of([&] { load_jsonl_dataset(path, *tok, 256); }),
                  path + ": line 1: \"tools\" goes with a conversation");
  std::ofstream(path)
      << json({{"prompt", "the"}, {"completion", json::array({messages[2]})}}).dump() << "\n";
  EXPECT_CONTAINS(test::error_of([&] { load_jsonl_dataset(path, *tok, 256); }),
                  path + ": line 1: \"prompt\" is a string while the other is a list");
  // A prompt past seq_len names the completion.
  std::ofstream(path) << json({{"prompt", json(messages.begin(), messages.begin() + 2)},
                               {"completion", json::array({messages[2]})}})
                             .dump()
                      << "\n";
  EXPECT_CONTAINS(test::error_of([&] { load_jsonl_dataset(path, *tok, 4); }),
                  "line 1: the completion starts at token");
}

}  // namespace
}  // namespace keel::data
