// ChatTemplate: a model's chat template (the Jinja text of an HF tokenizer_config.json's
// "chat_template", or of chat_template.jinja), rendered as transformers' apply_chat_template
// renders it: Jinja with trim_blocks and lstrip_blocks, the loopcontrols extension, and the globals
// raise_exception, namespace, range and (when the caller gives a date) strftime_now. The subset of
// Jinja that chat templates use is implemented (chat_template.cpp lists it); a template that uses
// more is an Error naming the template, its line and column, and what is not supported.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace keel::data {

class ChatTemplate {
 public:
  // Parses `source` once. `origin` names it in every error ("tokenizer_config.json's
  // chat_template"). A syntax error is an Error (kUsage) naming origin, line and column.
  ChatTemplate(std::string source, std::string origin);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // The text the template renders with `context`, a JSON object of its variables (messages,
  // add_generation_prompt, bos_token, eos_token, ...; what it does not hold is undefined, as in
  // Jinja). Its objects iterate in their keys' order, as Python's dicts (ordered_json: a tool
  // call's arguments and a tool's schema print through tojson as the data wrote them). `today`:
  // what strftime_now formats, as "YYYY-MM-DD"; empty leaves strftime_now undefined, so templates
  // that test `strftime_now is defined` take their fixed date (a dataset renders the same on every
  // day). raise_exception(msg) in the template, and an error while rendering (an undefined value
  // used, a type mismatch), is an Error (kUsage) holding the template's own message or the problem,
  // and the origin.
  std::string render(const nlohmann::ordered_json& context, const std::string& today = "") const;

  const std::string& origin() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Whether `date` is a day of the calendar written "YYYY-MM-DD" (what render's `today` and
// data.chat_date take).
bool is_calendar_date(std::string_view date);

}  // namespace keel::data
