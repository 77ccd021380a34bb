// ChatTemplate: byte-for-byte parity with jinja2 as transformers' apply_chat_template configures it
// (fixtures/chat_templates.json, written by fixtures/gen_chat_templates.py from real model
// templates and one synthetic template per construct), and the errors: syntax errors with line and
// column, unsupported constructs named, undefined values misused, raise_exception, runaway input.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "keel/data/chat_template.h"
#include "keel/numerics/error.h"

namespace keel::data {
namespace {

nlohmann::json load_fixture() {
  std::ifstream in(std::string(KEEL_FIXTURES_DIR) + "/chat_templates.json");
  EXPECT_TRUE(in.good()) << "missing fixture: run tests/fixtures/gen_chat_templates.py";
  return nlohmann::json::parse(in);
}

// Where two renderings first differ, with a little context, escaped so whitespace shows.
std::string first_difference(const std::string& want, const std::string& got) {
  size_t at = 0;
  while (at < want.size() && at < got.size() && want[at] == got[at]) ++at;
  const auto show = [&](const std::string& s) {
    const size_t from = at < 40 ? 0 : at - 40;
    return nlohmann::json(s.substr(from, 80))
        .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  };
  return "first difference at byte " + std::to_string(at) + " (lengths " +
         std::to_string(want.size()) + " vs " + std::to_string(got.size()) +
         ")\n  jinja2: " + show(want) + "\n  keel:   " + show(got);
}

// The message of the Error `fn` throws ("" when it throws none).
template <typename Fn>
std::string usage_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind, Error::kUsage);
    return e.what();
  }
  return "";
}

std::string render_template(const std::string& source,
                            const nlohmann::json& context = nlohmann::json::object(),
                            const std::string& today = "") {
  return ChatTemplate(source, "test template").render(context, today);
}

TEST(ChatTemplateParity, MatchesJinja2OnEveryFixture) {
  const nlohmann::json cases = load_fixture();
  ASSERT_GT(cases.size(), 100u);
  int rendered = 0, refused = 0;
  for (const auto& c : cases) {
    const std::string name = c.at("name");
    SCOPED_TRACE(name);
    const std::string today = c.value("today", "");
    try {
      const ChatTemplate tpl(c.at("template").get<std::string>(),
                             "tokenizer_config.json's chat_template");
      if (c.contains("expected")) {
        const std::string want = c.at("expected");
        const std::string got = tpl.render(c.at("context"), today);
        EXPECT_EQ(got, want) << first_difference(want, got);
        ++rendered;
      } else {
        const std::string message = usage_error_of([&] { tpl.render(c.at("context"), today); });
        EXPECT_NE(message.find(c.at("error_contains").get<std::string>()), std::string::npos)
            << message;
        EXPECT_NE(message.find("tokenizer_config.json's chat_template"), std::string::npos)
            << message;
        ++refused;
      }
    } catch (const Error& e) {
      ADD_FAILURE() << "unexpected Error: " << e.what();
    }
  }
  EXPECT_GT(refused, 5);
  std::cout << "[ parity ] " << rendered << " renderings and " << refused
            << " refusals match jinja2\n";
}

TEST(ChatTemplateErrors, SyntaxErrorsNameLineAndColumn) {
  const std::string message = usage_error_of([] {
    ChatTemplate("{% for m in messages %}\n{{ m }}\n  {% endfor x %}",
                 "tokenizer_config.json's chat_template");
  });
  EXPECT_NE(
      message.find(
          "tokenizer_config.json's chat_template: line 3, column 13: expected '%}' after 'endfor'"),
      std::string::npos)
      << message;
  EXPECT_NE(
      usage_error_of([] { render_template("{% if true %}x"); }).find("expected '{% endif %}'"),
      std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{{ 'abc }}"); }).find("unterminated string"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("a\n{{ 1 + }}");
            }).find("line 2, column 8: expected an expression, got '}}'"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{{ x "); }).find("unclosed tag"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{% endif %}"); }).find("no open block"),
            std::string::npos);
}

TEST(ChatTemplateErrors, UnsupportedConstructsAreNamed) {
  EXPECT_NE(usage_error_of([] {
              render_template("{{ x | wordwrap }}");
            }).find("the filter 'wordwrap' is not supported"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{% if x is sameas y %}{% endif %}");
            }).find("the test 'sameas' is not supported"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{% include 'x.j2' %}");
            }).find("'{% include %}' statement is not supported"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{{ '%s' % 1 }}"); }).find("'%' is not supported"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{{ f(*xs) }}"); }).find("*args"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{{ xs|map('wordwrap')|list }}", {{"xs", {1}}});
            }).find("the filter 'wordwrap' is not supported"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{{ [1].append(2) }}");
            }).find("'append' is not available"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{{ strftime_now('%H') }}", {}, "2024-01-01");
            }).find("%H is not supported"),
            std::string::npos);
}

TEST(ChatTemplateErrors, UndefinedValuesFailWhereJinja2Does) {
  // Printing, testing and iterating an undefined value is fine; looking into it or calling it is
  // not.
  EXPECT_EQ(
      render_template(
          "[{{ nope }}]{{ nope is defined }}{% for x in nope %}x{% endfor %}{{ nope|length }}"),
      "[]False0");
  EXPECT_NE(usage_error_of([] { render_template("{{ nope.attr }}"); }).find("'nope' is undefined"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{{ nope['k'] }}"); }).find("'nope' is undefined"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{{ nope() }}"); }).find("'nope' is undefined"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{{ m.a.b }}", {{"m", nlohmann::json::object()}});
            }).find("'dict object' has no attribute 'a'"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{{ nope + 1 }}"); }).find("is undefined"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{{ 'a' + 1 }}");
            }).find("unsupported operand type(s) for +: 'str' and 'int'"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{{ 1 < 'a' }}"); }).find("not supported between"),
            std::string::npos);
  EXPECT_NE(
      usage_error_of([] { render_template("{{ 1 // 0 }}"); }).find("division or modulo by zero"),
      std::string::npos);
  // Runtime errors name the line too.
  EXPECT_NE(
      usage_error_of([] { render_template("ok\n{{ nope.x }}"); }).find("test template: line 2"),
      std::string::npos);
}

TEST(ChatTemplateErrors, RaiseExceptionRefusesWithTheTemplatesMessage) {
  const std::string message =
      usage_error_of([] { render_template("{{ raise_exception('roles must alternate') }}"); });
  EXPECT_NE(message.find("test template"), std::string::npos) << message;
  EXPECT_NE(message.find("roles must alternate"), std::string::npos) << message;
}

TEST(ChatTemplateErrors, RunawayInputIsAnErrorNotACrash) {
  // Output cap (64 MiB): a loop printing 1 KB 100000 times, and a string doubled in a loop.
  const nlohmann::json kilobyte = {{"s", std::string(1000, 'x')}};
  EXPECT_NE(usage_error_of([&] {
              render_template("{% for i in range(100000) %}{{ s }}{% endfor %}", kilobyte);
            }).find("64 MiB"),
            std::string::npos);
  EXPECT_NE(usage_error_of([&] {
              render_template(
                  "{% set ns = namespace(s=s) %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s "
                  "%}{% endfor %}",
                  kilobyte);
            }).find("64 MiB"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] { render_template("{{ 'ab' * 100000000 }}"); }).find("64 MiB"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{% for i in range(100000000) %}{% endfor %}");
            }).find("range()"),
            std::string::npos);
  // Work limit: loops in loops that write nothing, and a filter walking a long list in a loop.
  EXPECT_NE(usage_error_of([] {
              render_template(
                  "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                  "{% endfor %}");
            }).find("loop iterations and filter items"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template(
                  "{% for i in range(100000) %}{% set n = range(100000) | length %}"
                  "{% endfor %}");
            }).find("loop iterations and filter items"),
            std::string::npos);
  // ... and a list that holds itself twice, 40 levels deep, printed, serialized or compared.
  const std::string doubled =
      "{% set ns = namespace(a=[1]) %}{% for i in range(40) %}{% set ns.a = [ns.a, ns.a] %}"
      "{% endfor %}";
  for (const char* use : {"{{ ns.a }}", "{{ ns.a | tojson }}", "{{ ns.a == ns.a }}"})
    EXPECT_NE(usage_error_of([&] {
                render_template(doubled + use);
              }).find("loop iterations and filter items"),
              std::string::npos)
        << use;
  // Depth limit: deeply nested expressions and blocks, and unbounded macro recursion.
  EXPECT_NE(
      usage_error_of([] {
        render_template("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}");
      }).find("nesting deeper than 256"),
      std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{{ " + std::string(5000, '-') + "1 }}");
            }).find("nesting deeper than 256"),
            std::string::npos);
  std::string blocks;
  for (int k = 0; k < 1000; ++k) blocks += "{% if true %}";
  EXPECT_NE(usage_error_of([&] { render_template(blocks); }).find("nesting deeper than 256"),
            std::string::npos);
  EXPECT_NE(usage_error_of([] {
              render_template("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
            }).find("nesting deeper than 256"),
            std::string::npos);
  nlohmann::json deep = 1;
  for (int k = 0; k < 1000; ++k) deep = nlohmann::json::array({deep});
  EXPECT_NE(usage_error_of([&] {
              render_template("{{ x }}", {{"x", deep}});
            }).find("deeper than 256"),
            std::string::npos);
}

TEST(ChatTemplateGlobals, StrftimeNowIsUndefinedWithoutADate) {
  const std::string tpl =
      "{{ strftime_now is defined }}|{{ strftime_now('%d %b %Y') if strftime_now is defined }}";
  EXPECT_EQ(render_template(tpl), "False|");
  EXPECT_EQ(render_template(tpl, {}, "2025-07-04"), "True|04 Jul 2025");
  EXPECT_EQ(
      render_template("{{ strftime_now('%A %B %-d') if false else strftime_now('%a %j %y') }}", {},
                      "2000-03-01"),
      "Wed 061 00");
  // Called without a date (Granite's default system message writes it): the error names the fix.
  const std::string undated = usage_error_of([] { render_template("{{ strftime_now('%d') }}"); });
  EXPECT_NE(undated.find("'strftime_now' is undefined: the template writes today's date"),
            std::string::npos)
      << undated;
  EXPECT_NE(undated.find("data.chat_date = \"YYYY-MM-DD\""), std::string::npos) << undated;
  for (const char* bad : {"2025-02-30", "2025-2-3", "2025-02-03x", "20250203", " 2025-02-03"})
    EXPECT_NE(usage_error_of([&] {
                render_template("{{ strftime_now('%d') }}", {}, bad);
              }).find("must be a date written YYYY-MM-DD"),
              std::string::npos)
        << bad;
  EXPECT_TRUE(is_calendar_date("2024-02-29"));
  EXPECT_FALSE(is_calendar_date("2023-02-29"));
  EXPECT_FALSE(is_calendar_date("2024-13-01"));
  EXPECT_FALSE(is_calendar_date(""));
  // A context variable shadows a global, as render_template(**context) does in jinja2.
  EXPECT_EQ(render_template("{{ range }}", {{"range", "mine"}}), "mine");
}

TEST(ChatTemplateApi, ParsesOnceRendersManyAndMoves) {
  ChatTemplate tpl("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", "config");
  EXPECT_EQ(tpl.origin(), "config");
  const nlohmann::json one = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  const nlohmann::json two = {
      {"messages",
       {{{"role", "user"}, {"content", "a"}}, {{"role", "assistant"}, {"content", "b"}}}}};
  EXPECT_EQ(tpl.render(one), "<user>hi");
  EXPECT_EQ(tpl.render(two), "<user>a<assistant>b");
  ChatTemplate moved = std::move(tpl);
  EXPECT_EQ(moved.render(one), "<user>hi");
  EXPECT_NE(
      usage_error_of([&] { moved.render(nlohmann::json::array()); }).find("must be a JSON object"),
      std::string::npos);
}

}  // namespace
}  // namespace keel::data
