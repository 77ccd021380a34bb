// Conversations: TRL's conversational formats ({"messages": [{"role": ..., "content": ...}, ...]},
// a prompt and completion of messages, ShareGPT's) as the model's own chat template renders them,
// and as an example whose targets are what the assistant says. An Instruct model was fine-tuned on
// its template's text; a conversation written any other way trains it on a format it has never
// seen.
#pragma once
#include <memory>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "keel/data/chat_template.h"
#include "keel/data/dataset.h"

namespace keel::data {

// A tokenizer's chat template and the variables transformers renders it with: the special tokens'
// text (bos_token, eos_token, ... of tokenizer_config.json: apply_chat_template passes
// special_tokens_map). The template is parsed when first rendered, not when the tokenizer loads: a
// template keel cannot read stops only the commands that use it, not a run on plain text.
struct ChatFormat {
  std::string source, origin;  // the Jinja text and where it was read (ChatTemplate's)
  nlohmann::json special_tokens = nlohmann::json::object();

  const ChatTemplate& parsed() const;  // Errors as ChatTemplate's constructor

 private:
  mutable std::once_flag parsed_once_;
  mutable std::unique_ptr<ChatTemplate> parsed_;
};

// The template's text of `messages`: render(messages, add_generation_prompt, the special tokens),
// with `tools` and `documents` none, as apply_chat_template passes them when not given, and
// `variables` (an object: "tools", a line's chat_template_kwargs) over those.
// `today` as ChatTemplate::render (empty: no strftime_now, the template's fixed date).
std::string render_chat(const ChatFormat& chat, const nlohmann::ordered_json& messages,
                        bool add_generation_prompt, const std::string& today = "",
                        const nlohmann::ordered_json& variables = nlohmann::ordered_json::object());

// Checks `messages` is what a conversation is: a non-empty array of objects, each with a string
// "role" and a string "content" (an assistant message that calls tools may have a null one).
// Errors (kUsage) say what is wrong, as "\"messages\"[2] has no \"role\"" (`field`: the line's
// key that holds them).
void check_messages(const nlohmann::ordered_json& messages, const std::string& field = "messages");

// A conversation as one JSONL line holds it, in each of TRL's conversational formats:
//   {"messages": [...]}: the targets are each assistant message (TRL's assistant_only_loss);
//   {"prompt": [...], "completion": [...]}: the targets are all the completion adds to the prompt
//     and its generation header (TRL's completion_only_loss);
//   {"conversations": [{"from": "human", "value": ...}, ...]}: ShareGPT's, read as "messages"
//     with from/value as role/content and the roles human -> user, gpt -> assistant (TRL's
//     maybe_convert_to_chatml);
// each with optional "tools" (a list of function schemas, or that list as a JSON string) and
// "chat_template_kwargs" (more variables for the template: enable_thinking, date_string, ...), as
// TRL passes them to apply_chat_template.
struct Conversation {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // the whole conversation
  size_t prompt_size = 0;  // prompt-completion: how many of `messages` are the prompt; else 0
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();  // render_chat's
};

// Whether `line` (a JSONL object, its keys sorted or not) is a conversation: it holds "messages"
// or "conversations", or a "prompt" or "completion" that is a list.
template <class Json>
bool is_conversation(const Json& line) {
  auto is_list = [&](const char* key) {
    const auto it = line.find(key);
    return it != line.end() && it->is_array();
  };
  return line.contains("messages") || line.contains("conversations") || is_list("prompt") ||
         is_list("completion");
}

// Checks `kwargs` are variables a template may be given (an object without messages,
// add_generation_prompt, tools or documents, which apply_chat_template refuses twice) and returns
// them. Errors (kUsage) start with `what` ("\"chat_template_kwargs\"", a flag).
nlohmann::ordered_json template_kwargs(const nlohmann::ordered_json& kwargs,
                                       const std::string& what);

// The conversation `line` holds (an array is "messages" given bare). Errors (kUsage) name the key
// and what is wrong.
Conversation conversation_of(const nlohmann::ordered_json& line);

// The conversation of a command's input (tokenize --chat, generate --messages): JSON text holding
// an array of messages or a line in any of the formats above, read from `source` ("the PROMPT
// argument"). Errors (kUsage) start with `source`: "SOURCE is not JSON (...)", "SOURCE: what
// conversation_of says".
Conversation parse_conversation(const std::string& text, const std::string& source);

// One training example of a conversation: the text it renders and its tokens and targets.
struct ConversationExample {
  std::string text;
  Example example;
};

// A conversation as training examples, as TRL's assistant_only_loss makes them: the tokens of its
// rendered text, with each assistant message's tokens as targets — the reply and what the template
// closes it with (Llama-3's <|eot_id|>: the model learns to stop), not the header that opens it —
// and everything else (system, user, tool text, the headers) context. An assistant message's span
// is where render(messages[:i], add_generation_prompt) ends and render(messages[:i + 1]) ends. The
// spans are tokenized one after another, so a reply's tokens follow exactly the tokens of the
// prompt that asks for it (generate --chat's), even where the header ends in a space that
// encoding the whole text would join to the reply's first word. No prefix token is added: the
// template writes its own (<|begin_of_text|>), as apply_chat_template tokenizes without special
// tokens. `messages` keeps its objects' key order (ordered_json), as transformers renders Python
// dicts.
//
// One example holds every reply, unless the template renders an earlier turn otherwise once later
// turns follow (Qwen3's drops the reasoning of the replies before the last user message, and
// writes an empty <think></think> into the last): then each reply is an example of its own,
// render(messages[:i + 1]), the text the model is prompted with when it says it followed by the
// reply, earlier turns rendered as inference renders them. (TRL instead swaps in a patched
// template that keeps every reasoning block.)
//
// A prompt-completion conversation is one example whose targets are one span, from where
// render(prompt, add_generation_prompt) ends to the end.
//
// Errors (kUsage): no chat template (`tok` names none), no assistant message, the template
// refusing the conversation (raise_exception), a template that renders the prompt of a reply
// otherwise than as the start of the reply's turn (the span would not be the assistant's), and a
// completion that adds no text. `today`: the day strftime_now writes (render_chat's; empty for
// none, as a dataset renders: data.chat_date).
std::vector<ConversationExample> conversation_examples(const Tokenizer& tok,
                                                       const Conversation& conversation,
                                                       const std::string& today = "");

// The error of a conversation given to a tokenizer without a chat template, naming `tokenizer`
// ("the tokenizer gpt2:DIR") and the fixes.
std::string no_chat_template(const std::string& tokenizer);

}  // namespace keel::data
