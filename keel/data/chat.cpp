#include "keel/data/chat.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "keel/numerics/error.h"

namespace keel::data {

using ojson = nlohmann::ordered_json;  // (not `json`: the unity build shares the namespace)

const ChatTemplate& ChatFormat::parsed() const {
  std::call_once(parsed_once_, [&] { parsed_ = std::make_unique<ChatTemplate>(source, origin); });
  return *parsed_;
}

std::string render_chat(const ChatFormat& chat, const ojson& messages, bool add_generation_prompt,
                        const std::string& today) {
  ojson context = chat.special_tokens;  // (sorted: their order is no text's)
  context["messages"] = messages;
  context["add_generation_prompt"] = add_generation_prompt;
  return chat.parsed().render(context, today);
}

void check_messages(const ojson& messages) {
  auto bad = [](const std::string& what) { return Error(what, Error::kUsage); };
  if (!messages.is_array())
    throw bad(std::string("\"messages\" must be an array of {\"role\": ..., \"content\": ...}, "
                          "got ") +
              messages.type_name());
  if (messages.empty()) throw bad("\"messages\" is empty: a conversation needs its messages");
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string at = "\"messages\"[" + std::to_string(i) + "]";
    if (!m.is_object())
      throw bad(at + " is a JSON " + m.type_name() +
                "; expected {\"role\": ..., \"content\": ...}");
    const auto role = m.find("role");
    if (role == m.end()) throw bad(at + " has no \"role\" (\"system\", \"user\", \"assistant\")");
    if (!role->is_string()) throw bad(at + ": \"role\" must be a string, got " + role->type_name());
    const auto content = m.find("content");
    // An assistant message that only calls tools carries its call in "tool_calls" (OpenAI's and
    // TRL's format), with a null or absent content.
    const bool calls_tools = m.contains("tool_calls");
    if (content == m.end()) {
      if (!calls_tools) throw bad(at + " has no \"content\"");
    } else if (!content->is_string() && !(calls_tools && content->is_null())) {
      throw bad(at + ": \"content\" must be a string, got " + content->type_name());
    }
  }
}

std::string no_chat_template(const std::string& tokenizer) {
  return "a conversation ({\"messages\": [...]}) is written in the model's chat template, and " +
         tokenizer +
         " has none (an Instruct model's tokenizer_config.json holds it as \"chat_template\", or "
         "chat_template.jinja beside it); use the tokenizer of a chat model, or give the lines as "
         "{\"prompt\": ..., \"completion\": ...}";
}

namespace {

// Where the assistant's text lies in the rendered conversation: [begin, end) byte ranges, in order.
std::vector<std::pair<size_t, size_t>> assistant_spans(const ChatFormat& chat,
                                                       const ojson& messages,
                                                       const std::string& whole) {
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i]["role"] != "assistant") continue;
    const ojson before_turn(messages.begin(), messages.begin() + static_cast<ptrdiff_t>(i));
    const ojson through_turn(messages.begin(), messages.begin() + static_cast<ptrdiff_t>(i) + 1);
    const std::string before = render_chat(chat, before_turn, /*add_generation_prompt=*/true);
    const std::string through = render_chat(chat, through_turn, false);
    // Templates that rewrite earlier turns (Qwen3's drops the reasoning of all but the last
    // reply) have no such spans: which tokens the assistant said would be a guess.
    if (!through.starts_with(before) || !whole.starts_with(through))
      throw Error("the chat template renders the conversation up to \"messages\"[" +
                      std::to_string(i) +
                      "] otherwise than as the start of the whole conversation, so keel cannot "
                      "tell which tokens the assistant says; give the conversation as "
                      "{\"prompt\": ..., \"completion\": ...} rendered by hand",
                  Error::kUsage);
    if (through.size() > before.size()) spans.emplace_back(before.size(), through.size());
  }
  return spans;
}

}  // namespace

Example conversation_example(const Tokenizer& tok, const ojson& messages) {
  const ChatFormat* chat = tok.chat_format();
  if (!chat) throw Error(no_chat_template("the run's tokenizer"), Error::kUsage);
  check_messages(messages);
  const bool has_reply = std::any_of(messages.begin(), messages.end(),
                                     [](const ojson& m) { return m["role"] == "assistant"; });
  if (!has_reply)
    throw Error(
        "the conversation has no \"assistant\" message: nothing to train on (keel trains on what "
        "the assistant says); add the reply, or remove the line",
        Error::kUsage);
  const std::string whole = render_chat(*chat, messages, false);
  Example e;
  size_t at = 0;
  auto add = [&](size_t end, uint8_t target) {
    if (end <= at) return;
    const std::vector<int32_t> ids = tok.encode(std::string_view(whole).substr(at, end - at));
    e.tokens.insert(e.tokens.end(), ids.begin(), ids.end());
    e.target.resize(e.tokens.size(), target);
    at = end;
  };
  for (const auto& [begin, end] : assistant_spans(*chat, messages, whole)) {
    add(begin, 0);
    add(end, 1);
  }
  add(whole.size(), 0);
  return e;
}

}  // namespace keel::data
