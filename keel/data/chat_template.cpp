// ChatTemplate: the Jinja subset of HF chat templates, rendered byte for byte as jinja2 renders it
// under transformers' apply_chat_template (ImmutableSandboxedEnvironment, trim_blocks,
// lstrip_blocks, loopcontrols, HF's tojson and {% generation %}).
//
// Supported:
//   syntax      text, {{ }}, {% %}, {# #}, the '-' and '+' whitespace modifiers, {% raw %};
//   newlines
//               normalized to "\n" and one trailing newline dropped, as jinja2 does by default.
//   statements  if/elif/else, for (tuple targets, `if` filter, else, loop.*), break/continue,
//               set (name, tuple, ns.attr, block set), macro (defaults, keyword calls),
//               filter blocks, generation (its body renders as is).
//   expressions literals (str with Python escapes, int, float, true/false/none in both cases),
//               lists, tuples, dicts, attribute/item access, slices, calls with keyword arguments,
//               x if c else y, or/and/not, in/not in, is [not] TEST, == != < <= > >=, + - ~ * / //
//               % **, unary - and +, filters; precedence as jinja2's parser.
//   tests       defined undefined none string number integer float boolean true false mapping
//               iterable sequence callable odd even divisibleby in eq/equalto/== ne/!=
//               lt/</lessthan le/<= gt/>/greaterthan ge/>= lower upper.
//   filters     abs capitalize count d default dictsort e escape first float int items join last
//               length list lower map max min reject rejectattr replace reverse round safe select
//               selectattr sort string sum title tojson trim unique upper.
//   methods     str: strip lstrip rstrip split startswith endswith upper lower title capitalize
//               replace find join; dict: items keys values get.
//   globals     raise_exception, namespace, range (at most 131072 items), dict, strftime_now (only
//               when a date is given; date fields only: %d %m %Y %y %b %B %a %A %j %%).
// Not supported (an Error naming it): include/extends/import/block/call/with/do, recursive loops,
// *args/**kwargs, % string formatting, other filters, tests and methods.
// Differences left: upper/lower/title/capitalize change ASCII letters only; filters that return
// iterators in jinja2 (map, select, reverse, ...) return lists here, so printing one directly shows
// a list where jinja2 shows "<generator object ...>". A context's objects keep their keys in the
// order given (nlohmann::ordered_json, as Python dicts), so a tool call's arguments serialize as
// the data wrote them; a context built as nlohmann::json arrives with its keys sorted.
#include "keel/data/chat_template.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <utility>

#include "keel/data/jinja/render.h"
#include "keel/data/jinja/syntax.h"
#include "keel/data/jinja/value.h"
#include "keel/numerics/error.h"

namespace keel::data {

struct ChatTemplate::Impl {
  std::string origin;
  std::string source;  // newline-normalized, as positions refer to it
  jinja::Body body;

  std::string where(size_t pos) const {
    size_t line = 1, line_start = 0;
    for (size_t k = 0; k < pos && k < source.size(); ++k)
      if (source[k] == '\n') ++line, line_start = k + 1;
    const size_t column =
        jinja::code_points(
            std::string_view(source).substr(line_start, std::min(pos, source.size()) - line_start))
            .size() +
        1;
    return "line " + std::to_string(line) + ", column " + std::to_string(column);
  }
};

ChatTemplate::ChatTemplate(std::string source, std::string origin)
    : impl_(std::make_unique<Impl>()) {
  impl_->origin = std::move(origin);
  try {
    impl_->source = jinja::normalize_newlines(source);
    impl_->body = jinja::Parser(jinja::Lexer(impl_->source).run()).parse_template();
  } catch (const jinja::Failure& f) {
    throw Error(impl_->origin + ": " + impl_->where(f.pos) + ": " + f.message, Error::kUsage);
  } catch (const std::bad_alloc&) {
    throw Error(impl_->origin + ": out of memory while parsing the template", Error::kUsage);
  }
}

ChatTemplate::~ChatTemplate() = default;

ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

const std::string& ChatTemplate::origin() const { return impl_->origin; }

std::string ChatTemplate::render(const nlohmann::ordered_json& context,
                                 const std::string& today) const {
  try {
    const jinja::Value variables = jinja::context_value(context);
    jinja::Renderer renderer(variables, today);
    jinja::t_work_left = jinja::kMaxWork;
    std::string out;
    renderer.out_ = &out;
    renderer.exec(impl_->body, std::make_shared<jinja::Scope>());
    return out;
  } catch (const jinja::Failure& f) {
    if (f.refused)
      throw Error(impl_->origin + " refused the conversation: " + f.message, Error::kUsage);
    throw Error(impl_->origin + ": " + impl_->where(f.pos) + ": " + f.message, Error::kUsage);
  } catch (const std::bad_alloc&) {
    throw Error(impl_->origin + ": out of memory while rendering the template", Error::kUsage);
  } catch (const nlohmann::json::exception& e) {
    throw Error(impl_->origin + ": " + e.what(), Error::kUsage);
  }
}

bool is_calendar_date(std::string_view date) {
  if (date.size() != 10 || date[4] != '-' || date[7] != '-') return false;
  for (size_t k : {0, 1, 2, 3, 5, 6, 8, 9})
    if (date[k] < '0' || date[k] > '9') return false;
  const auto number = [&](size_t at, size_t n) {
    unsigned v = 0;
    for (size_t k = at; k < at + n; ++k) v = v * 10 + static_cast<unsigned>(date[k] - '0');
    return v;
  };
  using namespace std::chrono;
  return year_month_day{year{static_cast<int>(number(0, 4))}, month{number(5, 2)},
                        day{number(8, 2)}}
      .ok();
}

}  // namespace keel::data
