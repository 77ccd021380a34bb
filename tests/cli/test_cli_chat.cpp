// Conversations end to end: a run trains on {"messages": [...]} lines in the model's chat template
// (its loss falls; eval counts only the assistant's tokens), `generate --chat` prompts as the
// template asks for a reply, and a tokenizer without a template is a usage error naming the fix.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "keel/data/chat.h"
#include "keel/data/dataset.h"
#include "keel/data/tokenizer_base.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

using json = nlohmann::json;

struct ChatFiles {
  std::string dir, model, tokenizer, data;
};

// A tiny Llama whose vocabulary covers the tiny Llama-style tokenizer, that tokenizer with a
// chat template of Llama-3's shape, and 8 conversations (system, user, assistant).
const ChatFiles& chat_files() {
  static const ChatFiles f = [] {
    ChatFiles f;
    f.dir = test::temp_dir("cli-chat");
    const test::TinyChatModel m = test::tiny_chat_model(
        f.dir, 290, 96, "llama_style/tokenizer.json",
        {{"bos_token", "<|eot|>"},
         {"eos_token", "<|eot|>"},
         {"chat_template",
          "{{ bos_token }}{% for m in messages %}<sep>{{ m.role }}\n{{ m.content | trim }}"
          "<|eot|>{% endfor %}{% if add_generation_prompt %}<sep>assistant\n{% endif %}"}});
    f.model = m.model;
    f.tokenizer = m.tokenizer;
    f.data = f.dir + "/chat.jsonl";
    std::ofstream d(f.data);
    for (int i = 0; i < 8; ++i)
      d << json({{"messages",
                  {{{"role", "system"}, {"content", "be brief"}},
                   {{"role", "user"}, {"content", "the " + std::to_string(i)}},
                   {{"role", "assistant"}, {"content", i % 2 ? "there the" : "the there"}}}}})
               .dump()
        << "\n";
    return f;
  }();
  return f;
}

// A full fine-tune of `model` on the conversations of `data` (JSONL, `tokenizer`) into `out`.
test::KeelRun train_on_chats(const std::string& out, const std::string& model,
                             const std::string& tokenizer, const std::string& data,
                             int64_t seq_len = 96, int64_t steps = 30,
                             const std::string& lr = "0.01") {
  return test::run_keel(
      test::with_sets(
          {"train"},
          {"run.out_dir=" + out, "run.threads=1", "model.path=" + model, "data.task=jsonl",
           "data.path=" + data, "data.tokenizer=hf:" + tokenizer,
           "data.seq_len=" + std::to_string(seq_len), "train.batch_size=8",
           "train.max_steps=" + std::to_string(steps), "optim.lr=" + lr, "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
}

// chat_files()'s 30-step fine-tune, once per binary (generate and chat read it).
const std::string& chat_run() {
  static const std::string out = [] {
    const ChatFiles& f = chat_files();
    const test::KeelRun r = train_on_chats(f.dir + "/trained", f.model, f.tokenizer, f.data);
    EXPECT_EQ(r.code, 0) << r.output;
    return f.dir + "/trained";
  }();
  return out;
}

TEST(CliChat, ARunTrainsOnTheAssistantsRepliesAndItsLossFalls) {
  const ChatFiles& f = chat_files();
  const std::string out = f.dir + "/run";
  const test::KeelRun r = train_on_chats(out, f.model, f.tokenizer, f.data);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto steps = test::step_records(out);
  ASSERT_EQ(steps.size(), 30u);
  EXPECT_LT(steps.back()["loss"].get<double>(), 0.5 * steps.front()["loss"].get<double>());
  // eval counts the replies' tokens and their end-of-turn token, nothing of the rest.
  const auto tok = data::load_tokenizer("hf:" + f.tokenizer);
  const auto ds = data::load_jsonl_dataset(f.data, *tok, 96);
  int64_t targets = 0;
  for (int64_t i = 0; i < ds->size(); ++i)
    for (size_t t = 1; t < ds->get(i).size(); ++t) targets += ds->get(i).target[t];
  int64_t replies = 0;
  for (int i = 0; i < 8; ++i) replies += tok->encode(i % 2 ? "there the" : "the there").size() + 1;
  EXPECT_EQ(targets, replies);
  const test::KeelRun e = test::run_keel({"eval", out, "--data", f.data, "--json"});
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_EQ(json::parse(e.out).at("tokens").get<int64_t>(), targets);
}

// The seed's recipe on conversations, packed: LoRA r=8 (alpha 16, dropout 0.05) on q, k, v, up and
// down, bf16-mixed, activation checkpointing, data.pack. The replies' loss falls, the rows hold
// several conversations, and eval scores the run's packed rows as one conversation a row.
TEST(CliChat, PackedConversationsTrainALoraAsTheSeedsRecipeDoes) {
  const ChatFiles& f = chat_files();
  const std::string out = f.dir + "/packed-lora";
  const test::KeelRun r = test::run_keel(
      test::with_sets(
          {"train"},
          {"run.out_dir=" + out,
           "run.threads=1",
           "model.path=" + f.model,
           "data.task=jsonl",
           "data.path=" + f.data,
           "data.tokenizer=hf:" + f.tokenizer,
           "data.seq_len=96",
           "data.pack=true",
           "train.batch_size=2",
           "train.max_steps=30",
           "train.precision=bf16-mixed",
           "train.allow_cpu_bf16=true",
           "train.activation_checkpointing=blocks",
           "model.adapter.kind=lora",
           "model.adapter.r=8",
           "model.adapter.alpha=16",
           "model.adapter.dropout=0.05",
           "model.adapter.target_modules=[\"q_proj\", \"k_proj\", \"v_proj\", \"up_proj\", "
           "\"down_proj\"]",
           "optim.lr=0.05",
           "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err, "data: 8 training examples packed into ");
  const auto steps = test::step_records(out);
  ASSERT_EQ(steps.size(), 30u);
  // (a rank-8 adapter on a random 32-wide model, its head frozen: 5.5 -> 5.07 over 4 steps each)
  double first = 0, last = 0;
  for (size_t i = 0; i < 4; ++i) {
    first += steps[i]["loss"].get<double>() / 4;
    last += steps[steps.size() - 1 - i]["loss"].get<double>() / 4;
  }
  EXPECT_LT(last, 0.95 * first);
  const test::KeelRun packed = test::run_keel({"eval", out, "--data", f.data, "--json"});
  ASSERT_EQ(packed.code, 0) << packed.output;
  const test::KeelRun alone = test::run_keel(
      {"eval", out, "--data", f.data, "--json", "--per-example", f.dir + "/packed-lora.jsonl"});
  ASSERT_EQ(alone.code, 0) << alone.output;
  const json p = json::parse(packed.out), a = json::parse(alone.out);
  EXPECT_LT(p.at("rows").get<int64_t>(), 8);
  EXPECT_EQ(p.at("tokens"), a.at("tokens"));
  // bf16-mixed: the same products over rows of other lengths may round apart (measured 2.4e-8).
  EXPECT_NEAR(p.at("loss").get<double>(), a.at("loss").get<double>(),
              1e-4 * a.at("loss").get<double>());
}

TEST(CliChat, GenerateChatPromptsAsTheTemplateAsksForAReply) {
  const ChatFiles& f = chat_files();
  const std::string hf = "hf:" + f.tokenizer;
  const auto tok = data::load_tokenizer(hf);
  auto prompt_tokens = [&](std::vector<std::string> more) {
    std::vector<std::string> args = {"generate",         f.model, "the there", "--tokenizer", hf,
                                     "--max-new-tokens", "2",     "--json"};
    args.insert(args.end(), more.begin(), more.end());
    const test::KeelRun r = test::run_keel(args, {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
    return r.code == 0 ? json::parse(r.out).at("prompt_tokens").get<int64_t>() : -1;
  };
  const json user = {{"role", "user"}, {"content", "the there"}};
  const json system = {{"role", "system"}, {"content", "be brief"}};
  auto rendered = [&](const json& messages) {
    return static_cast<int64_t>(
        tok->encode(data::render_chat(*tok->chat_format(), messages, true)).size());
  };
  EXPECT_EQ(prompt_tokens({"--chat"}), rendered(json::array({user})));
  EXPECT_EQ(prompt_tokens({"--chat", "--system", "be brief"}),
            rendered(json::array({system, user})));
  // Without --chat the prompt is text, behind the tokenizer's prefix token.
  EXPECT_EQ(prompt_tokens({}), static_cast<int64_t>(tok->encode("the there").size() + 1));

  auto refused = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"generate", f.model, "x"});
    const test::KeelRun r = test::run_keel(args, {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 2) << r.output;
    return r.err;
  };
  EXPECT_CONTAINS(refused({"--tokenizer", "byte", "--chat"}),
                  "--chat: a conversation ({\"messages\": [...]}) is written in the model's chat "
                  "template, and the tokenizer byte has none");
  EXPECT_CONTAINS(refused({"--tokenizer", hf, "--system", "x"}),
                  "--system is the system turn of a --chat prompt");
  EXPECT_CONTAINS(refused({"--tokenizer", hf, "--chat", "--no-bos"}),
                  "--no-bos with --chat: the chat template writes how the conversation starts");
}

// --messages answers a conversation given as JSON: the same prompt --chat --system writes, a
// prompt-completion line's prompt (its completion is what the model is to write), several turns;
// a conversation keel cannot answer is refused before the model is loaded.
TEST(CliChat, GenerateMessagesAnswersAConversation) {
  const ChatFiles& f = chat_files();
  const std::string hf = "hf:" + f.tokenizer;
  const auto tok = data::load_tokenizer(hf);
  auto generated = [&](const std::string& prompt, std::vector<std::string> more) {
    std::vector<std::string> args = {"generate",         f.model, prompt,  "--tokenizer", hf,
                                     "--max-new-tokens", "3",     "--json"};
    args.insert(args.end(), more.begin(), more.end());
    const test::KeelRun r = test::run_keel(args, {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(r.code, 0) << r.output;
    return r.code == 0 ? json::parse(r.out) : json::object();
  };
  const json system = {{"role", "system"}, {"content", "be brief"}};
  const json user = {{"role", "user"}, {"content", "the there"}};
  const json reply = {{"role", "assistant"}, {"content", "there the"}};
  const json chat = generated("the there", {"--chat", "--system", "be brief"});
  const json messages = generated(json::array({system, user}).dump(), {"--messages"});
  EXPECT_EQ(messages.at("prompt_tokens"), chat.at("prompt_tokens"));
  EXPECT_EQ(messages.at("tokens"), chat.at("tokens"));
  const json line = {{"prompt", json::array({system, user})}, {"completion", json::array({reply})}};
  EXPECT_EQ(generated(line.dump(), {"--messages"}).at("tokens"), chat.at("tokens"));
  const json turns = json::array({system, user, reply, user});
  EXPECT_EQ(generated(turns.dump(), {"--messages"}).at("prompt_tokens").get<int64_t>(),
            static_cast<int64_t>(
                tok->encode(data::render_chat(*tok->chat_format(), turns, true)).size()));

  auto refused = [&](const std::string& prompt, std::vector<std::string> more) {
    std::vector<std::string> args = {"generate", f.dir + "/no-model", prompt, "--messages"};
    args.insert(args.end(), more.begin(), more.end());
    const test::KeelRun r = test::run_keel(args);
    EXPECT_EQ(r.code, 2) << r.output;
    return r.err;
  };
  EXPECT_CONTAINS(refused("hi", {}), "--messages: the PROMPT argument is not JSON");
  EXPECT_CONTAINS(refused(json::array({user, reply}).dump(), {}),
                  "ends with the assistant's message, which is what the model is to write");
  EXPECT_CONTAINS(refused(json::array({{{"role", "user"}}}).dump(), {}),
                  "--messages: the PROMPT argument: \"messages\"[0] has no \"content\"");
  EXPECT_CONTAINS(refused(json::array({user}).dump(), {"--system", "x"}),
                  "--system with --messages");
}

// tokenize --chat shows a conversation as training sees it (the library's tokens and targets), and
// one without a reply as generate --chat prompts with it.
TEST(CliChat, TokenizeChatShowsWhatTrainingSees) {
  const ChatFiles& f = chat_files();
  const std::string hf = "hf:" + f.tokenizer;
  const auto tok = data::load_tokenizer(hf);
  const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(
      R"([{"role": "user", "content": "the 1"}, {"role": "assistant", "content": "there the"}])");
  auto tokenize = [&](const std::string& input) {
    const test::KeelRun r =
        test::run_keel({"tokenize", "--tokenizer", hf, "--chat", "--json", input});
    EXPECT_EQ(r.code, 0) << r.output;
    return r.code == 0 ? json::parse(r.out) : json::object();
  };
  const data::Example e =
      data::conversation_examples(*tok, data::conversation_of(messages)).at(0).example;
  const json shown = tokenize(json({{"messages", json::parse(messages.dump())}}).dump());
  EXPECT_EQ(shown.at("ids").get<std::vector<int32_t>>(), e.tokens);
  EXPECT_EQ(shown.at("targets").get<std::vector<uint8_t>>(), e.target);
  EXPECT_EQ(shown.at("text"), data::render_chat(*tok->chat_format(), messages, false));
  const nlohmann::ordered_json prompt(messages.begin(), messages.begin() + 1);
  const json asked = tokenize(prompt.dump());
  EXPECT_EQ(asked.at("ids").get<std::vector<int32_t>>(),
            tok->encode(data::render_chat(*tok->chat_format(), prompt, true)));
  EXPECT_EQ(asked.at("targets").get<std::vector<uint8_t>>(),
            std::vector<uint8_t>(asked.at("ids").size(), 0));
  // A prompt-completion line of messages, as data.task = "jsonl" reads it.
  const nlohmann::ordered_json line = {
      {"prompt", prompt}, {"completion", nlohmann::ordered_json::array({messages[1]})}};
  const data::Example completed =
      data::conversation_examples(*tok, data::conversation_of(line)).at(0).example;
  const json split = tokenize(line.dump());
  EXPECT_EQ(split.at("ids").get<std::vector<int32_t>>(), completed.tokens);
  EXPECT_EQ(split.at("targets").get<std::vector<uint8_t>>(), completed.target);
  EXPECT_EQ(completed.tokens, e.tokens);  // one reply: as the messages it joins
  // --pieces marks the targets.
  const test::KeelRun pieces =
      test::run_keel({"tokenize", "--tokenizer", hf, "--chat", "--pieces", messages.dump()});
  ASSERT_EQ(pieces.code, 0) << pieces.output;
  EXPECT_CONTAINS(pieces.out, "+ <|eot|>\n");
  auto refused = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"tokenize", "--chat"});
    const test::KeelRun r = test::run_keel(args);
    EXPECT_EQ(r.code, 2) << r.output;
    return r.err;
  };
  EXPECT_CONTAINS(refused({"--tokenizer", hf, "nope"}),
                  "tokenize --chat: the argument is not JSON");
  EXPECT_CONTAINS(refused({"--tokenizer", hf, R"([{"role": "user"}])"}),
                  "tokenize --chat: the argument: \"messages\"[0] has no \"content\"");
  EXPECT_CONTAINS(refused({"--tokenizer", "byte", "[]"}), "the tokenizer byte has none");
}

// Qwen3's published template renders a reply otherwise once a later user turn follows, so each
// reply of a two-turn conversation is trained in the text that prompts it (data::
// conversation_examples): tokenize --chat shows the two examples, the run reads a row per reply
// and its loss falls, and generate --messages answers in the text the second reply was trained in.
TEST(CliChat, Qwen3MultiTurnConversationsTrainEachReplyInTheTextThatPromptsIt) {
  const std::string dir = test::temp_dir("cli-chat-qwen3");
  const test::TinyChatModel m = test::tiny_chat_model(
      dir, 290, 160, "llama_style/tokenizer.json",
      {{"eos_token", "<|eot|>"},
       {"chat_template", test::published_chat_template("qwen3/alternating/gen=False")}});
  const std::string data = dir + "/chat.jsonl";
  {
    std::ofstream d(data);
    for (int i = 0; i < 8; ++i)
      d << json({{"messages",
                  {{{"role", "user"}, {"content", "the " + std::to_string(i)}},
                   {{"role", "assistant"}, {"content", i % 2 ? "there the" : "the there"}},
                   {{"role", "user"}, {"content", "then?"}},
                   {{"role", "assistant"}, {"content", "the end"}}}}})
               .dump()
        << "\n";
  }
  std::ifstream in(data);
  std::string first_line;
  std::getline(in, first_line);
  const test::KeelRun shown = test::run_keel(
      {"tokenize", "--tokenizer", "hf:" + m.tokenizer, "--chat", "--json", first_line});
  ASSERT_EQ(shown.code, 0) << shown.output;
  const json examples = json::parse(shown.out).at("examples");
  ASSERT_EQ(examples.size(), 2u);
  EXPECT_TRUE(examples[0].at("text").get<std::string>().ends_with(
      "<|im_start|>assistant\n<think>\n\n</think>\n\nthe there<|im_end|>\n"));
  EXPECT_TRUE(examples[1].at("text").get<std::string>().ends_with(
      "<|im_start|>assistant\n<think>\n\n</think>\n\nthe end<|im_end|>\n"));
  const test::KeelRun text =
      test::run_keel({"tokenize", "--tokenizer", "hf:" + m.tokenizer, "--chat", first_line});
  EXPECT_CONTAINS(text.out, "--- example 2 of 2");

  const auto tok = data::load_tokenizer("hf:" + m.tokenizer);
  EXPECT_EQ(data::load_jsonl_dataset(data, *tok, 160)->size(), 16);
  const std::string out = dir + "/run";
  const test::KeelRun r = train_on_chats(out, m.model, m.tokenizer, data, 160, 150, "0.02");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto steps = test::step_records(out);
  ASSERT_EQ(steps.size(), 150u);
  EXPECT_LT(steps.back()["loss"].get<double>(), 0.5 * steps.front()["loss"].get<double>());
  // Asked the first line's second question, the model answers as it was trained to.
  json asking = json::parse(first_line).at("messages");
  asking.erase(3);
  const test::KeelRun g = test::run_keel(
      {"generate", out, "--messages", asking.dump(), "--max-new-tokens", "24", "--json"},
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(g.code, 0) << g.output;
  EXPECT_CONTAINS(json::parse(g.out).at("text").get<std::string>(), "the end");
  // A seq_len too short for the second replies' rows leaves them out, and says so.
  const test::KeelRun short_rows = test::run_keel(
      test::with_sets({"train"},
                      {"run.out_dir=" + dir + "/short", "run.threads=1", "model.path=" + m.model,
                       "data.task=jsonl", "data.path=" + data, "data.tokenizer=hf:" + m.tokenizer,
                       "data.seq_len=72", "train.max_steps=1", "log.tensorboard=false"}),
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(short_rows.code, 0) << short_rows.output;
  EXPECT_CONTAINS(short_rows.err, "note: 8 conversation replies of " + data +
                                      " (data.path) start past data.seq_len = 72 tokens");
  // --chat-template-kwargs reach the template: Qwen3's enable_thinking = false opens the reply
  // with an empty <think></think> (more prompt tokens); bad ones are named.
  auto prompt_tokens = [&](std::vector<std::string> more) {
    std::vector<std::string> args = {"generate",         out, "--chat", "the 1", "--json",
                                     "--max-new-tokens", "0"};
    args.insert(args.end(), more.begin(), more.end());
    const test::KeelRun p = test::run_keel(args, {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(p.code, 0) << p.output;
    return p.code == 0 ? json::parse(p.out).at("prompt_tokens").get<int64_t>() : -1;
  };
  EXPECT_GT(prompt_tokens({"--chat-template-kwargs", R"({"enable_thinking": false})"}),
            prompt_tokens({}));
  auto refused = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"generate", out});
    const test::KeelRun e = test::run_keel(args);
    EXPECT_EQ(e.code, 2) << e.output;
    return e.err;
  };
  EXPECT_CONTAINS(refused({"--chat", "x", "--chat-template-kwargs", "nope"}),
                  "--chat-template-kwargs is not JSON");
  EXPECT_CONTAINS(refused({"--chat", "x", "--chat-template-kwargs", R"({"tools": []})"}),
                  "--chat-template-kwargs gives \"tools\", which keel sets itself");
  EXPECT_CONTAINS(refused({"x", "--chat-template-kwargs", "{}"}),
                  "--chat-template-kwargs are the chat template's variables: give --chat");
  std::ofstream(dir + "/said.txt") << "the 1\n";
  const test::KeelRun c = test::run_keel_sh("chat " + out +
                                            " --json --max-new-tokens 4 --chat-template-kwargs "
                                            "'{\"enable_thinking\": false}' < " +
                                            dir + "/said.txt");
  EXPECT_EQ(c.code, 0) << c.output;
}

// generate --input FILE --output OUT: a reply to every prompt of a JSONL file, each the reply
// generate gives that line alone (--messages for a conversation, the argument for a text prompt),
// with the line's own answer beside it as the reference; bad lines and flags are refused before
// the model loads.
TEST(CliChat, GenerateInputRepliesToEveryLineAsGenerateDoesOne) {
  const ChatFiles& f = chat_files();
  const std::string& out = chat_run();
  std::vector<std::string> lines;
  {
    std::ifstream in(f.data);
    for (std::string l; std::getline(in, l) && lines.size() < 2;) lines.push_back(l);
  }
  lines.push_back(json({{"prompt", "the there"}, {"completion", " the"}}).dump());
  const std::string input = f.dir + "/prompts.jsonl", output = f.dir + "/replies.jsonl";
  std::ofstream(input) << lines[0] << "\n\n" << lines[1] << "\n" << lines[2] << "\n";
  const test::KeelRun g = test::run_keel(
      {"generate", out, "--input", input, "--output", output, "--max-new-tokens", "12"},
      {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(g.code, 0) << g.output;
  EXPECT_CONTAINS(g.err, "keel: line 4: ");
  std::vector<json> replies;
  std::ifstream in(output);
  for (std::string l; std::getline(in, l);) replies.push_back(json::parse(l));
  ASSERT_EQ(replies.size(), 3u);
  EXPECT_FALSE(std::filesystem::exists(output + ".partial"));  // renamed over --output when whole
  // Each reply is compared with its reference, whitespace at either end aside, and counted.
  auto trim = [](std::string t) {
    t.erase(0, t.find_first_not_of(" \t\n"));
    t.erase(t.find_last_not_of(" \t\n") + 1);
    return t;
  };
  int matched = 0;
  for (const json& reply : replies) {
    const bool same = trim(reply.at("completion").get<std::string>()) ==
                      trim(reply.at("reference").get<std::string>());
    EXPECT_EQ(reply.at("exact_match"), same) << reply.dump();
    matched += same;
  }
  EXPECT_CONTAINS(g.err,
                  "keel: " + std::to_string(matched) +
                      " of 3 replies equal their reference (whitespace at either end aside)");
  // A reference that is the reply but for the whitespace around it matches.
  const std::string said = f.dir + "/said.jsonl";
  std::ofstream(said) << json({{"prompt", "the there"},
                               {"completion",
                                " " + replies[2].at("completion").get<std::string>() + "\n"}})
                             .dump()
                      << "\n";
  const test::KeelRun same = test::run_keel({"generate", out, "--input", said, "--output",
                                             f.dir + "/same.jsonl", "--max-new-tokens", "12"},
                                            {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(same.code, 0) << same.output;
  EXPECT_CONTAINS(same.err, "keel: 1 of 1 replies equal their reference");
  const int expected_line[] = {1, 3, 4};
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(replies[i].at("line"), expected_line[i]);
    // The reply generate gives the line alone.
    std::vector<std::string> one = {"generate", out, "--max-new-tokens", "12", "--json"};
    if (i < 2) {  // the conversation less the reply that ends it (the reference)
      json asked = json::parse(lines[i]).at("messages");
      asked.erase(asked.size() - 1);
      one.insert(one.end(), {"--messages", asked.dump()});
      EXPECT_EQ(replies[i].at("reference"),
                json::parse(lines[i]).at("messages").back().at("content"));
    } else {
      one.push_back("the there");
      EXPECT_EQ(replies[i].at("reference"), " the");
      EXPECT_EQ(replies[i].at("prompt"), "the there");
    }
    const test::KeelRun alone = test::run_keel(one, {"OMP_NUM_THREADS=1"});
    ASSERT_EQ(alone.code, 0) << alone.output;
    const json a = json::parse(alone.out);
    EXPECT_EQ(replies[i].at("completion"), a.at("text"));
    EXPECT_EQ(replies[i].at("stop"), a.at("stop"));
    EXPECT_EQ(replies[i].at("tokens"), a.at("tokens").size());
  }
  // --batch-size decodes the lines side by side: each reply is the one decoded alone (greedy, f32:
  // the same tokens, the logits within rounding), the lines in the file's order.
  const test::KeelRun batched =
      test::run_keel({"generate", out, "--input", input, "--output", f.dir + "/batched.jsonl",
                      "--max-new-tokens", "12", "--batch-size", "2"},
                     {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(batched.code, 0) << batched.output;
  {
    std::ifstream b(f.dir + "/batched.jsonl");
    size_t i = 0;
    for (std::string l; std::getline(b, l); ++i) {
      ASSERT_LT(i, replies.size());
      EXPECT_EQ(json::parse(l), replies[i]) << "line " << i;
    }
    EXPECT_EQ(i, replies.size());
  }
  // With --chat (and --system) a text prompt is a user's message in the chat template.
  const test::KeelRun as_chat =
      test::run_keel({"generate", out, "--input", input, "--output", output, "--chat", "--system",
                      "be brief", "--max-new-tokens", "4"},
                     {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(as_chat.code, 0) << as_chat.output;
  std::vector<json> chatted;
  std::ifstream again(output);
  for (std::string l; std::getline(again, l);) chatted.push_back(json::parse(l));
  ASSERT_EQ(chatted.size(), 3u);
  const auto tok = data::load_tokenizer("hf:" + f.tokenizer);
  EXPECT_EQ(chatted[2].at("prompt"),
            data::render_chat(
                *tok->chat_format(),
                nlohmann::ordered_json::array({{{"role", "system"}, {"content", "be brief"}},
                                               {{"role", "user"}, {"content", "the there"}}}),
                true));
  auto refused = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"generate", f.dir + "/no-such-model"});
    const test::KeelRun e = test::run_keel(args);
    EXPECT_EQ(e.code, 2) << e.output;
    return e.err;
  };
  EXPECT_CONTAINS(refused({"--input", input, "--output", input}),
                  "--output " + input + " is the --input file");
  EXPECT_CONTAINS(refused({"--input", input}), "--input needs --output");
  EXPECT_CONTAINS(refused({"--output", output, "x"}), "--output is where --input's replies go");
  EXPECT_CONTAINS(refused({"--batch-size", "4", "x"}),
                  "--batch-size decodes --input's prompts side by side: give --input FILE");
  EXPECT_CONTAINS(
      refused({"--input", input, "--output", output, "--batch-size", "2", "--no-cache"}),
      "--batch-size 2 decodes prompts side by side over their key/value caches, and "
      "--no-cache has none");
  EXPECT_CONTAINS(refused({"--input", input, "--output", output, "--batch-size", "0"}),
                  "--batch-size");
  std::ofstream(f.dir + "/text.jsonl") << R"({"text": "the"})"
                                       << "\n";
  EXPECT_CONTAINS(refused({"--input", f.dir + "/text.jsonl", "--output", output}),
                  "--input " + f.dir + "/text.jsonl: line 1: a {\"text\": ...} line has no prompt");
  std::ofstream(f.dir + "/number.jsonl") << R"({"prompt": 5})"
                                         << "\n";
  EXPECT_CONTAINS(refused({"--input", f.dir + "/number.jsonl", "--output", output}),
                  "line 1: \"prompt\" is a JSON number; give the prompt's text");
  std::ofstream(f.dir + "/broken.jsonl") << lines[0] << "\n{\"messages\": 3}\n";
  EXPECT_CONTAINS(refused({"--input", f.dir + "/broken.jsonl", "--output", output}),
                  "--input " + f.dir + "/broken.jsonl: line 2: ");
}

// keel chat: each line of stdin a user's message, each reply the one generate --messages gives
// the conversation so far (its earlier replies included); /reset starts over, keeping --system.
TEST(CliChat, ChatAnswersEachMessageWithTheConversationSoFar) {
  const ChatFiles& f = chat_files();
  const std::string& out = chat_run();
  const std::string said = f.dir + "/said.txt";
  std::ofstream(said) << "the 1\n\nthen?\n/reset\nthe 1\n/exit\nnever read\n";
  const test::KeelRun c =
      test::run_keel_sh("chat " + out + " --system 'be brief' --max-new-tokens 8 --json < " + said);
  ASSERT_EQ(c.code, 0) << c.output;
  std::vector<json> turns;
  std::istringstream lines(c.out);
  for (std::string l; std::getline(lines, l);) turns.push_back(json::parse(l));
  ASSERT_EQ(turns.size(), 3u) << c.out;
  json conversation = json::array({{{"role", "system"}, {"content", "be brief"}}});
  auto answer = [&](const std::string& message) {
    conversation.push_back({{"role", "user"}, {"content", message}});
    const test::KeelRun g = test::run_keel(
        {"generate", out, "--messages", conversation.dump(), "--max-new-tokens", "8", "--json"},
        {"OMP_NUM_THREADS=1"});
    EXPECT_EQ(g.code, 0) << g.output;
    const json j = json::parse(g.out);
    conversation.push_back({{"role", "assistant"}, {"content", j.at("text")}});
    return j;
  };
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    if (i == 2) conversation = json::array({{{"role", "system"}, {"content", "be brief"}}});
    const json want = answer(i == 1 ? "then?" : "the 1");
    EXPECT_EQ(turns[i].at("turn"), i + 1);
    EXPECT_EQ(turns[i].at("reply"), want.at("text"));
    EXPECT_EQ(turns[i].at("stop"), want.at("stop"));
  }
  // The second turn computed only what the first left out of the cache.
  EXPECT_EQ(turns[0].at("reused_tokens"), 0);
  EXPECT_GT(turns[1].at("reused_tokens").get<int64_t>(),
            turns[0].at("prompt_tokens").get<int64_t>());
  // /save appends the conversation so far as a JSONL line a dataset reads.
  const std::string saved = f.dir + "/saved.jsonl";
  const std::string saving = f.dir + "/saving.txt";
  std::ofstream(saving) << "the 1\n/save " << saved << "\n/save\nthen?\n/save " << saved
                        << "\n/save " << f.dir << "/no/such/dir.jsonl\n";
  const test::KeelRun s = test::run_keel_sh(
      "chat " + out + " --system 'be brief' --max-new-tokens 8 --json < " + saving);
  ASSERT_EQ(s.code, 0) << s.output;
  EXPECT_CONTAINS(s.err, "keel: the conversation (3 messages) appended to " + saved);
  EXPECT_CONTAINS(s.err, "/save FILE appends the conversation");
  EXPECT_CONTAINS(s.err, "keel: cannot write " + f.dir + "/no/such/dir.jsonl: ");
  std::vector<json> lines_saved;
  {
    std::ifstream in(saved);
    for (std::string l; std::getline(in, l);) lines_saved.push_back(json::parse(l));
  }
  ASSERT_EQ(lines_saved.size(), 2u);
  EXPECT_EQ(lines_saved[1].at("messages").size(), 5u);
  EXPECT_EQ(lines_saved[1].at("messages")[3], json({{"role", "user"}, {"content", "then?"}}));
  const auto tok = data::load_tokenizer("hf:" + f.tokenizer);
  EXPECT_EQ(data::load_jsonl_dataset(saved, *tok, 96)->size(), 2);
  // Streamed, each reply ends with a line of its own.
  const test::KeelRun plain = test::run_keel_sh("chat " + out + " --max-new-tokens 4 < " + said);
  ASSERT_EQ(plain.code, 0) << plain.output;
  EXPECT_GE(std::count(plain.out.begin(), plain.out.end(), '\n'), 3) << plain.out;
  // Past the model's context (96 tokens) the oldest exchange leaves, with a note; a message that
  // cannot fit alone is said to be too long and skipped.
  std::string longer;
  for (int i = 0; i < 6; ++i) longer += "the there ";
  std::ofstream(said) << longer << "\n"
                      << longer << "\n"
                      << longer << "\n"
                      << std::string(400, 'x') << "\n"
                      << longer << "\n";
  const test::KeelRun shifted =
      test::run_keel_sh("chat " + out + " --max-new-tokens 4 --json < " + said);
  ASSERT_EQ(shifted.code, 0) << shifted.output;
  EXPECT_CONTAINS(shifted.err, "the conversation outgrew the model's context (96 tokens)");
  EXPECT_CONTAINS(shifted.err, "more than the model's context (96): say it shorter");
  EXPECT_EQ(std::count(shifted.out.begin(), shifted.out.end(), '\n'), 4) << shifted.out;
  // A tokenizer without a chat template has no conversation to hold.
  const test::KeelRun none = test::run_keel_sh("chat " + out + " --tokenizer byte < " + said);
  EXPECT_EQ(none.code, 2) << none.output;
  EXPECT_CONTAINS(none.err, "keel chat: a conversation");
  EXPECT_CONTAINS(none.err, "the tokenizer byte has none");
}

TEST(CliChat, ConversationsWithoutAChatTemplateAreAUsageErrorNamingTheLine) {
  const ChatFiles& f = chat_files();
  const test::KeelRun r = test::run_keel(
      test::with_sets({"train"},
                      {"run.out_dir=" + f.dir + "/byte", "model.path=" + f.model, "data.task=jsonl",
                       "data.path=" + f.data, "data.tokenizer=byte", "train.max_steps=1"}),
      {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, f.data + ": line 1: a conversation");
  EXPECT_CONTAINS(r.err, "give the lines as {\"prompt\": ..., \"completion\": ...}");
}

// Granite-3.1's published template writes today's date into its default system message
// (strftime_now, unguarded), over a StarCoder-style tokenizer (Digits before ByteLevel). A run on
// conversations without a system message is refused naming data.chat_date, and trains with it;
// keel eval reads the run's date, a base model's needs --chat-date, and tokenize --chat shows it.
TEST(CliChat, GranitesDatedTemplateTrainsWithDataChatDate) {
  const std::string dir = test::temp_dir("cli-chat-granite");
  const test::TinyChatModel m = test::tiny_chat_model(
      dir, 290, 512, "starcoder_style/tokenizer.json",
      {{"eos_token", "<|eot|>"},
       {"chat_template", test::published_chat_template("granite-3.1/alternating/gen=False")}});
  const std::string data = dir + "/chat.jsonl";
  {
    std::ofstream d(data);
    for (int i = 0; i < 8; ++i)
      d << json({{"messages",
                  {{{"role", "user"}, {"content", "add " + std::to_string(i) + " and 12"}},
                   {{"role", "assistant"}, {"content", std::to_string(i + 12)}}}}})
               .dump()
        << "\n";
  }
  auto train = [&](const std::string& out, std::vector<std::string> sets) {
    for (const std::string& s : std::vector<std::string>{
             "run.out_dir=" + out, "run.threads=1", "model.path=" + m.model, "data.task=jsonl",
             "data.path=" + data, "data.tokenizer=hf:" + m.tokenizer, "data.seq_len=512",
             "train.batch_size=4", "train.max_steps=2", "log.tensorboard=false"})
      sets.push_back(s);
    return test::run_keel(test::with_sets({"train"}, sets), {"OMP_NUM_THREADS=1"});
  };
  const test::KeelRun undated = train(dir + "/undated", {});
  EXPECT_EQ(undated.code, 2) << undated.output;
  EXPECT_CONTAINS(undated.err, data + ": line 1: ");
  EXPECT_CONTAINS(undated.err, "'strftime_now' is undefined: the template writes today's date");
  EXPECT_CONTAINS(undated.err, "data.chat_date = \"YYYY-MM-DD\"");
  const std::string out = dir + "/dated";
  const test::KeelRun dated = train(out, {"data.chat_date=2024-12-04"});
  ASSERT_EQ(dated.code, 0) << dated.output;
  EXPECT_EQ(test::step_records(out).size(), 2u);
  const test::KeelRun eval = test::run_keel({"eval", out, "--data", data}, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(eval.code, 0) << eval.output;
  const test::KeelRun base = test::run_keel(
      {"eval", m.model, "--data", data, "--tokenizer", "hf:" + m.tokenizer}, {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(base.code, 2) << base.output;
  EXPECT_CONTAINS(base.err, "--chat-date");
  const test::KeelRun base_dated =
      test::run_keel({"eval", m.model, "--data", data, "--tokenizer", "hf:" + m.tokenizer,
                      "--chat-date", "2024-12-04"},
                     {"OMP_NUM_THREADS=1"});
  EXPECT_EQ(base_dated.code, 0) << base_dated.output;
  const std::string conversation = R"([{"role": "user", "content": "add 3 and 12"}])";
  const test::KeelRun shown = test::run_keel({"tokenize", "--tokenizer", "hf:" + m.tokenizer,
                                              "--chat", "--chat-date", "2024-12-04", conversation});
  ASSERT_EQ(shown.code, 0) << shown.output;
  EXPECT_CONTAINS(shown.out, "Today's Date: December 04, 2024.\nYou are Granite");
  const test::KeelRun bad = test::run_keel({"tokenize", "--tokenizer", "hf:" + m.tokenizer,
                                            "--chat", "--chat-date", "2024-02-30", conversation});
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_CONTAINS(bad.err, "--chat-date: 2024-02-30: use a day written YYYY-MM-DD");
}

}  // namespace
}  // namespace keel
