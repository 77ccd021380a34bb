// Conversations: TRL's conversational format ({"messages": [{"role": ..., "content": ...}, ...]})
// as the model's own chat template renders it, and as an example whose targets are what the
// assistant says. An Instruct model was fine-tuned on its template's text; a conversation written
// any other way trains it on a format it has never seen.
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

// The template's text of `messages`: render(messages, add_generation_prompt, the special tokens).
// `today` as ChatTemplate::render (empty: no strftime_now, the template's fixed date).
std::string render_chat(const ChatFormat& chat, const nlohmann::ordered_json& messages,
                        bool add_generation_prompt, const std::string& today = "");

// Checks `messages` is what a conversation is: a non-empty array of objects, each with a string
// "role" and a string "content" (an assistant message that calls tools may have a null one).
// Errors (kUsage) say what is wrong, as "\"messages\"[2] has no \"role\"".
void check_messages(const nlohmann::ordered_json& messages);

// One conversation as a training example, as TRL's assistant_only_loss makes it: the tokens of its
// rendered text, with each assistant message's tokens as targets — the reply and what the template
// closes it with (Llama-3's <|eot_id|>: the model learns to stop), not the header that opens it —
// and everything else (system, user, tool text, the headers) context. An assistant message's span
// is where render(messages[:i], add_generation_prompt) ends and render(messages[:i + 1]) ends. The
// spans are tokenized one after another, so a reply's tokens follow exactly the tokens of the
// prompt that asks for it (generate --chat's), even where the header ends in a space that
// encoding the whole text would join to the reply's first word. No
// prefix token is added: the template writes its own (<|begin_of_text|>), as apply_chat_template
// tokenizes without special tokens. Errors (kUsage): no chat template (`tok` names none), a bad
// `messages`, no assistant message, the template refusing the conversation (raise_exception), and
// a template that renders a conversation's beginning differently inside the whole (the spans
// would not be the assistant's).
// `messages` keeps its objects' key order (ordered_json), as transformers renders Python dicts.
Example conversation_example(const Tokenizer& tok, const nlohmann::ordered_json& messages);

// The error of a conversation given to a tokenizer without a chat template, naming `tokenizer`
// ("the tokenizer gpt2:DIR") and the fixes.
std::string no_chat_template(const std::string& tokenizer);

}  // namespace keel::data
