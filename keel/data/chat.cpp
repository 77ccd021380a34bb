#include "keel/data/chat.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "keel/numerics/error.h"
#include "keel/numerics/text.h"

namespace keel::data {

using ojson = nlohmann::ordered_json;  // (not `json`: the unity build shares the namespace)

const ChatTemplate& ChatFormat::parsed() const {
  std::call_once(parsed_once_, [&] { parsed_ = std::make_unique<ChatTemplate>(source, origin); });
  return *parsed_;
}

std::string render_chat(const ChatFormat& chat, const ojson& messages, bool add_generation_prompt,
                        const std::string& today, const ojson& variables) {
  // apply_chat_template's order: the special tokens, then its keyword arguments over them.
  ojson context = chat.special_tokens;  // (sorted: their order is no text's)
  context["tools"] = nullptr;
  context["documents"] = nullptr;
  for (const auto& [name, value] : variables.items()) context[name] = value;
  context["messages"] = messages;
  context["add_generation_prompt"] = add_generation_prompt;
  return chat.parsed().render(context, today);
}

void check_messages(const ojson& messages, const std::string& field) {
  auto bad = [](const std::string& what) { return Error(what, Error::kUsage); };
  const std::string name = "\"" + field + "\"";
  if (!messages.is_array())
    throw bad(name + " must be an array of {\"role\": ..., \"content\": ...}, got " +
              messages.type_name());
  if (messages.empty()) throw bad(name + " is empty: a conversation needs its messages");
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string at = name + "[" + std::to_string(i) + "]";
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

namespace {

Error line_error(const std::string& what) { return Error(what, Error::kUsage); }

// ShareGPT's messages ({"from": "human", "value": ...}) as "messages" (role and content).
ojson sharegpt_messages(const ojson& conversations) {
  if (!conversations.is_array())
    throw line_error(std::string("\"conversations\" must be an array of {\"from\": ..., "
                                 "\"value\": ...}, got ") +
                     conversations.type_name());
  ojson messages = ojson::array();
  for (size_t i = 0; i < conversations.size(); ++i) {
    const ojson& m = conversations[i];
    const std::string at = "\"conversations\"[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("from") || !m.contains("value"))
      throw line_error(at + " is not {\"from\": ..., \"value\": ...} (ShareGPT's message)");
    if (!m["from"].is_string())
      throw line_error(at + ": \"from\" must be a string, got " + m["from"].type_name());
    std::string role = m["from"].get<std::string>();
    if (role == "human") role = "user";
    if (role == "gpt") role = "assistant";
    messages.push_back({{"role", role}, {"content", m["value"]}});
  }
  return messages;
}

// The template variables a line adds: "tools" and the keys of "chat_template_kwargs".
ojson line_variables(const ojson& line) {
  ojson variables = ojson::object();
  if (const auto tools = line.find("tools"); tools != line.end() && !tools->is_null()) {
    ojson list = *tools;
    if (list.is_string()) {  // datasets stores a list of differing schemas as JSON text
      try {
        list = ojson::parse(tools->get<std::string>());
      } catch (const nlohmann::json::exception&) {
        throw line_error(
            "\"tools\" is a string that is not JSON; give the list of function "
            "schemas, or that list as a JSON string");
      }
    }
    if (!list.is_array())
      throw line_error(std::string("\"tools\" must be a list of function schemas, got ") +
                       list.type_name());
    for (size_t i = 0; i < list.size(); ++i)
      if (!list[i].is_object())
        throw line_error("\"tools\"[" + std::to_string(i) + "] is a JSON " + list[i].type_name() +
                         "; a tool is a function schema (an object)");
    variables["tools"] = std::move(list);
  }
  if (const auto kwargs = line.find("chat_template_kwargs"); kwargs != line.end()) {
    const ojson checked = template_kwargs(*kwargs, "\"chat_template_kwargs\"");
    for (const auto& [name, value] : checked.items()) variables[name] = value;
  }
  return variables;
}

}  // namespace

ojson template_kwargs(const ojson& kwargs, const std::string& what) {
  if (!kwargs.is_object())
    throw line_error(what +
                     " must be an object (the template's variables, as "
                     "{\"enable_thinking\": false}), got " +
                     kwargs.type_name());
  for (const auto& [name, value] : kwargs.items())
    // apply_chat_template refuses these twice-given arguments (a TypeError).
    if (name == "messages" || name == "add_generation_prompt" || name == "tools" ||
        name == "documents")
      throw line_error(what + " gives \"" + name + "\", which keel sets itself" +
                       (name == "tools" ? " (give the line's own \"tools\")" : ""));
  return kwargs;
}

Conversation conversation_of(const ojson& line) {
  if (!line.is_object()) {  // the messages alone
    Conversation c;
    c.messages = line;
    check_messages(c.messages);
    return c;
  }
  const bool prompt_completion = line.contains("prompt") || line.contains("completion");
  if (int(line.contains("messages")) + int(line.contains("conversations")) +
          int(prompt_completion) >
      1)
    throw line_error(
        "has more than one of \"messages\", \"conversations\" and \"prompt\"/\"completion\" "
        "(which one is the conversation?)");
  Conversation c;
  c.variables = line_variables(line);
  if (line.contains("messages")) {
    c.messages = line["messages"];
    check_messages(c.messages);
  } else if (line.contains("conversations")) {
    c.messages = sharegpt_messages(line["conversations"]);
    check_messages(c.messages, "conversations");
  } else if (prompt_completion) {
    for (const char* key : {"prompt", "completion"}) {
      if (!line.contains(key)) throw line_error(std::string("missing \"") + key + "\"");
      if (!line[key].is_array())
        throw line_error(
            std::string("\"") + key + "\" is a " + line[key].type_name() +
            " while the other is a list of messages; give both as messages, or both as strings");
      check_messages(line[key], key);
    }
    c.messages = line["prompt"];
    c.prompt_size = c.messages.size();
    for (const ojson& m : line["completion"]) c.messages.push_back(m);
  } else {
    throw line_error(
        "holds no conversation (\"messages\", \"conversations\" or a "
        "\"prompt\" and \"completion\" of messages)");
  }
  return c;
}

Conversation parse_conversation(const std::string& text, const std::string& source) {
  ojson parsed;
  try {
    parsed = ojson::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw line_error(source + " is not JSON (" + json_error_detail(e.what()) +
                     "); give a conversation: [{\"role\": \"user\", \"content\": ...}, ...] "
                     "or a JSONL line {\"messages\": [...]}");
  }
  try {
    return conversation_of(parsed);
  } catch (const Error& e) {
    throw line_error(source + ": " + e.what());
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

// The template's text of the first `n` messages of `c`.
std::string render_first(const ChatFormat& chat, const Conversation& c, size_t n,
                         bool add_generation_prompt, const std::string& today) {
  const ojson first(c.messages.begin(), c.messages.begin() + static_cast<ptrdiff_t>(n));
  return render_chat(chat, first, add_generation_prompt, today, c.variables);
}

using Spans = std::vector<std::pair<size_t, size_t>>;  // [begin, end) byte ranges, in order

// `text` tokenized span by span, the spans' tokens targets. Each span after the first continues
// the text (no SentencePiece "▁" of its own), so a reply's tokens follow exactly the tokens of the
// prompt that asks for it.
ConversationExample example_of(const Tokenizer& tok, std::string text, const Spans& spans) {
  ConversationExample out;
  out.text = std::move(text);
  Example& e = out.example;
  size_t at = 0;
  auto add = [&](size_t end, uint8_t target) {
    if (end <= at) return;
    const std::string_view span = std::string_view(out.text).substr(at, end - at);
    const std::vector<int32_t> ids = at == 0 ? tok.encode(span) : tok.encode_continuation(span);
    e.tokens.insert(e.tokens.end(), ids.begin(), ids.end());
    e.target.resize(e.tokens.size(), target);
    at = end;
  };
  for (const auto& [begin, end] : spans) {
    add(begin, 0);
    add(end, 1);
  }
  add(out.text.size(), 0);
  return out;
}

// A prompt and completion: from where the prompt and its generation header end to the end.
ConversationExample completion_example(const Tokenizer& tok, const ChatFormat& chat,
                                       const Conversation& c, std::string whole,
                                       const std::string& today) {
  const std::string prompt = render_first(chat, c, c.prompt_size, true, today);
  if (!whole.starts_with(prompt))
    throw Error(
        "the chat template renders the prompt otherwise than as the start of the "
        "prompt and completion, so keel cannot tell which tokens are the completion's; "
        "give the line as {\"prompt\": ..., \"completion\": ...} rendered by hand",
        Error::kUsage);
  if (whole.size() == prompt.size())
    throw Error(
        "the completion adds no text to the prompt's (nothing to train on); give the "
        "completion's messages content, or remove the line",
        Error::kUsage);
  const size_t begin = prompt.size(), end = whole.size();
  return example_of(tok, std::move(whole), {{begin, end}});
}

}  // namespace

std::vector<ConversationExample> conversation_examples(const Tokenizer& tok, const Conversation& c,
                                                       const std::string& today) {
  const ChatFormat* chat = tok.chat_format();
  if (!chat) throw Error(no_chat_template("the run's tokenizer"), Error::kUsage);
  const bool has_reply = std::any_of(c.messages.begin(), c.messages.end(),
                                     [](const ojson& m) { return m["role"] == "assistant"; });
  if (c.prompt_size == 0 && !has_reply)
    throw Error(
        "the conversation has no \"assistant\" message: nothing to train on (keel trains on what "
        "the assistant says); add the reply, or remove the line",
        Error::kUsage);
  std::string whole = render_chat(*chat, c.messages, false, today, c.variables);
  if (c.prompt_size > 0) return {completion_example(tok, *chat, c, std::move(whole), today)};
  // Each reply's span: where the prompt that asks for it ends, render(messages[:i],
  // add_generation_prompt), to where render(messages[:i + 1]) ends.
  struct Reply {
    std::string through;  // the conversation up to and including the reply
    size_t begin = 0;
  };
  std::vector<Reply> replies;
  bool prefixes = true;  // every reply's text is the start of the whole conversation's
  for (size_t i = 0; i < c.messages.size(); ++i) {
    if (c.messages[i]["role"] != "assistant") continue;
    const std::string before = render_first(*chat, c, i, /*add_generation_prompt=*/true, today);
    std::string through = render_first(*chat, c, i + 1, false, today);
    if (!through.starts_with(before))
      throw Error("the chat template renders the conversation up to \"messages\"[" +
                      std::to_string(i) +
                      "] otherwise than as the prompt that asks for it followed by the reply, so "
                      "keel cannot tell which tokens the assistant says; give the conversation as "
                      "{\"prompt\": ..., \"completion\": ...} rendered by hand",
                  Error::kUsage);
    prefixes = prefixes && whole.starts_with(through);
    if (through.size() > before.size()) replies.push_back({std::move(through), before.size()});
  }
  if (prefixes) {
    Spans spans;
    for (const Reply& r : replies) spans.emplace_back(r.begin, r.through.size());
    return {example_of(tok, std::move(whole), spans)};
  }
  // The template renders an earlier turn otherwise once later ones follow (Qwen3's drops the
  // reasoning of the replies before the last user message): no text holds every reply as it was
  // said. Each reply is an example of its own, in the text the model is prompted with when it
  // says it (generate --messages's), as inference renders the earlier turns.
  if (replies.empty()) return {example_of(tok, std::move(whole), {})};  // (nothing said)
  std::vector<ConversationExample> out;
  for (Reply& r : replies) {
    const size_t end = r.through.size();
    out.push_back(example_of(tok, std::move(r.through), {{r.begin, end}}));
  }
  return out;
}

}  // namespace keel::data
