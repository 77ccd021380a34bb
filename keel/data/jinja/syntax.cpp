// The Jinja lexer and parser (syntax.h): source text to tokens, with jinja2's whitespace rules, and
// tokens to statements and expressions with jinja2's precedence.
#include "keel/data/jinja/syntax.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <cstring>

namespace keel::data::jinja {

// ---- Lexer --------------------------------------------------------------------------------------

// jinja2 reads the source through str.splitlines(): every line break becomes "\n", and (without
// keep_trailing_newline) one final line break is dropped.
std::string normalize_newlines(const std::string& src) {
  std::string out;
  out.reserve(src.size());
  for (size_t k = 0; k < src.size(); ++k) {
    const unsigned char c = static_cast<unsigned char>(src[k]);
    if (c == '\r') {
      if (k + 1 < src.size() && src[k + 1] == '\n') ++k;
      out += '\n';
    } else if (c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e)) {
      out += '\n';
    } else if (c == 0xc2 && k + 1 < src.size() && static_cast<unsigned char>(src[k + 1]) == 0x85) {
      out += '\n', ++k;
    } else if (c == 0xe2 && k + 2 < src.size() && static_cast<unsigned char>(src[k + 1]) == 0x80 &&
               (static_cast<unsigned char>(src[k + 2]) == 0xa8 ||
                static_cast<unsigned char>(src[k + 2]) == 0xa9)) {
      out += '\n', k += 2;
    } else {
      out += src[k];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

namespace {

bool is_name_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

}  // namespace

std::vector<Token> Lexer::run() {
  size_t pos = 0;
  bool line_starting = true;  // the previous tag's match ended a line (lstrip_blocks needs it)
  while (pos < src_.size()) {
    size_t open = pos;
    while ((open = src_.find('{', open)) != std::string::npos && open + 1 < src_.size() &&
           src_[open + 1] != '{' && src_[open + 1] != '%' && src_[open + 1] != '#')
      ++open;
    if (open == std::string::npos || open + 1 >= src_.size()) {
      emit_text(src_.substr(pos), pos);
      break;
    }
    const char kind = src_[open + 1];
    const char mod = open + 2 < src_.size() ? src_[open + 2] : '\0';
    std::string text = src_.substr(pos, open - pos);
    strip_before_tag(text, kind, mod, line_starting);
    emit_text(std::move(text), pos);
    size_t inner = open + 2 + (mod == '-' || mod == '+' ? 1 : 0);
    if (kind == '#') {
      size_t close = src_.find("#}", inner);
      if (close == std::string::npos) fail("unclosed comment: expected '#}'", open);
      pos = after_tag(close + 2, src_[close - 1], true, line_starting);
    } else if (kind == '%' && is_raw_begin(inner)) {
      pos = lex_raw(open, inner, line_starting);
    } else {
      pos = lex_tag(open, inner, kind == '%', line_starting);
    }
  }
  tokens_.push_back({Token::kEof, "", src_.size()});
  return std::move(tokens_);
}
void Lexer::emit_text(std::string text, size_t pos) {
  if (!text.empty()) tokens_.push_back({Token::kText, std::move(text), pos});
}

void Lexer::strip_before_tag(std::string& text, char kind, char mod, bool line_starting) {
  if (mod == '-') {
    while (!text.empty() && is_ws(text.back())) text.pop_back();
  } else if (mod != '+' && kind != '{') {
    const size_t nl = text.rfind('\n');
    const size_t line = nl == std::string::npos ? 0 : nl + 1;
    if ((line > 0 || line_starting) && text.find_first_not_of(" \t", line) == std::string::npos)
      text.resize(line);
  }
}

// After a tag closing at `end` (one past "}}", "%}" or "#}"), with `mod` the character before
// the closer: where the next text starts, and whether this match ended a line.
size_t Lexer::after_tag(size_t end, char mod, bool is_block, bool& line_starting) {
  size_t pos = end;
  if (mod == '-') {
    while (pos < src_.size() && is_ws(src_[pos])) ++pos;
  } else if (is_block && mod != '+' && pos < src_.size() && src_[pos] == '\n') {
    ++pos;
  }
  line_starting = pos > end && src_[pos - 1] == '\n';
  return pos;
}

bool Lexer::is_raw_begin(size_t p) const {
  while (p < src_.size() && is_ws(src_[p])) ++p;
  if (src_.compare(p, 3, "raw") != 0 || (p + 3 < src_.size() && is_name_char(src_[p + 3])))
    return false;
  p += 3;
  while (p < src_.size() && is_ws(src_[p])) ++p;
  return src_.compare(p, 2, "%}") == 0 || src_.compare(p, 3, "-%}") == 0;
}

size_t Lexer::lex_raw(size_t open, size_t inner, bool& line_starting) {
  size_t close = src_.find("%}", inner);
  size_t body = after_tag(close + 2, src_[close - 1], true, line_starting);
  for (size_t at = body; (at = src_.find("{%", at)) != std::string::npos; at += 2) {
    size_t p = at + 2;
    const char mod = p < src_.size() ? src_[p] : '\0';
    if (mod == '-' || mod == '+') ++p;
    while (p < src_.size() && is_ws(src_[p])) ++p;
    if (src_.compare(p, 6, "endraw") != 0) continue;
    p += 6;
    while (p < src_.size() && is_ws(src_[p])) ++p;
    char end_mod = '\0';
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) end_mod = src_[p++];
    if (src_.compare(p, 2, "%}") != 0) fail("expected '%}' after 'endraw'", p);
    std::string text = src_.substr(body, at - body);
    strip_before_tag(text, '%', mod, line_starting);
    emit_text(std::move(text), body);
    return after_tag(p + 2, end_mod, true, line_starting);
  }
  fail("unclosed raw block: expected '{% endraw %}'", open);
}

size_t Lexer::lex_tag(size_t open, size_t p, bool is_block, bool& line_starting) {
  tokens_.push_back({is_block ? Token::kBlockBegin : Token::kVarBegin, "", open});
  int balance = 0;  // brackets open: "}}" inside {'a': {'b': 1}} does not close the tag
  while (true) {
    while (p < src_.size() && is_ws(src_[p])) ++p;
    if (p >= src_.size())
      fail(is_block ? "unclosed tag: expected '%}'" : "unclosed tag: expected '}}'", open);
    const char c = src_[p];
    if (balance == 0) {
      const char* closer = is_block ? "%}" : "}}";
      size_t at = std::string::npos;
      if (src_.compare(p, 2, closer) == 0)
        at = p;
      else if ((c == '-' || (is_block && c == '+')) && src_.compare(p + 1, 2, closer) == 0)
        at = p + 1;
      if (at != std::string::npos) {
        tokens_.push_back({is_block ? Token::kBlockEnd : Token::kVarEnd, "", p});
        return after_tag(at + 2, at > p ? c : '\0', is_block, line_starting);
      }
    }
    if (is_name_start(c)) {
      size_t e = p;
      while (e < src_.size() && is_name_char(src_[e])) ++e;
      tokens_.push_back({Token::kName, src_.substr(p, e - p), p});
      p = e;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      p = lex_number(p);
    } else if (c == '\'' || c == '"') {
      p = lex_string(p);
    } else {
      static const char* const kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                         "/",  "%",  "~",  "<",  ">",  "=",  ".", ",", ":",
                                         "|",  "(",  ")",  "[",  "]",  "{",  "}"};
      const char* op = nullptr;
      for (const char* candidate : kOps)
        if (src_.compare(p, std::strlen(candidate), candidate) == 0) {
          op = candidate;
          break;
        }
      if (!op) fail(std::string("unexpected character '") + c + "'", p);
      if (*op == '(' || *op == '[' || *op == '{') ++balance;
      if ((*op == ')' || *op == ']' || *op == '}') && --balance < 0)
        fail(std::string("unexpected '") + op + "'", p);
      tokens_.push_back({Token::kOp, op, p});
      p += std::strlen(op);
    }
  }
}

size_t Lexer::lex_number(size_t p) {
  const size_t start = p;
  const auto digits = [&] {
    while (p < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[p])) ||
                               (src_[p] == '_' && p + 1 < src_.size() &&
                                std::isdigit(static_cast<unsigned char>(src_[p + 1])))))
      ++p;
  };
  digits();
  bool is_float = false;
  if (p + 1 < src_.size() && src_[p] == '.' &&
      std::isdigit(static_cast<unsigned char>(src_[p + 1]))) {
    is_float = true;
    ++p;
    digits();
  }
  if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
    size_t q = p + 1;
    if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
    if (q < src_.size() && std::isdigit(static_cast<unsigned char>(src_[q]))) {
      is_float = true;
      p = q;
      digits();
    }
  }
  std::string text;
  for (size_t k = start; k < p; ++k)
    if (src_[k] != '_') text += src_[k];
  Token t{is_float ? Token::kFloat : Token::kInt, text, start};
  if (is_float) {
    t.float_value = std::strtod(text.c_str(), nullptr);
  } else {
    const auto res = std::from_chars(text.data(), text.data() + text.size(), t.int_value);
    if (res.ec != std::errc()) fail("integer literal " + text + " is too large", start);
  }
  tokens_.push_back(std::move(t));
  return p;
}

// A quoted literal with Python's escapes; an unknown escape keeps its backslash, as Python does.
size_t Lexer::lex_string(size_t p) {
  const char quote = src_[p];
  const size_t start = p++;
  std::string value;
  while (true) {
    if (p >= src_.size()) fail("unterminated string literal", start);
    const char c = src_[p++];
    if (c == quote) break;
    if (c != '\\') {
      value += c;
      continue;
    }
    if (p >= src_.size()) fail("unterminated string literal", start);
    const char e = src_[p++];
    const auto hex = [&](int n) {
      uint32_t cp = 0;
      for (int k = 0; k < n; ++k, ++p) {
        if (p >= src_.size() || !std::isxdigit(static_cast<unsigned char>(src_[p])))
          fail("truncated \\x, \\u or \\U escape in a string literal", p);
        const char h = src_[p];
        cp = cp * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                 ? h - '0'
                                                 : (h | 0x20) - 'a' + 10);
      }
      if (cp > 0x10ffff) fail("escape beyond U+10FFFF in a string literal", p);
      append_utf8(value, cp);
    };
    switch (e) {
      case 'n':
        value += '\n';
        break;
      case 't':
        value += '\t';
        break;
      case 'r':
        value += '\r';
        break;
      case '\\':
        value += '\\';
        break;
      case '\'':
        value += '\'';
        break;
      case '"':
        value += '"';
        break;
      case 'a':
        value += '\a';
        break;
      case 'b':
        value += '\b';
        break;
      case 'f':
        value += '\f';
        break;
      case 'v':
        value += '\v';
        break;
      case '\n':
        break;  // line continuation
      case 'x':
        hex(2);
        break;
      case 'u':
        hex(4);
        break;
      case 'U':
        hex(8);
        break;
      case 'N':
        fail("\\N{...} escapes are not supported", p - 2);
      default:
        if (e >= '0' && e <= '7') {
          uint32_t cp = static_cast<uint32_t>(e - '0');
          for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k)
            cp = cp * 8 + static_cast<uint32_t>(src_[p++] - '0');
          append_utf8(value, cp);
        } else {
          value += '\\';
          value += e;
        }
    }
  }
  tokens_.push_back({Token::kString, std::move(value), start});
  return p;
}

// ---- AST and parser -----------------------------------------------------------------------------

Body Parser::parse_template() {
  std::string stopped_at;
  Body body = parse_body({}, stopped_at);
  return body;
}
const Token& Parser::peek(size_t ahead) const {
  return tokens_[std::min(at_ + ahead, tokens_.size() - 1)];
}
const Token& Parser::next() { return tokens_[at_ < tokens_.size() - 1 ? at_++ : at_]; }
bool Parser::is_op(const char* op, size_t ahead) const {
  return peek(ahead).kind == Token::kOp && peek(ahead).text == op;
}
bool Parser::is_name(const char* name, size_t ahead) const {
  return peek(ahead).kind == Token::kName && peek(ahead).text == name;
}
std::string Parser::describe(const Token& t) {
  switch (t.kind) {
    case Token::kEof:
      return "the end of the template";
    case Token::kBlockEnd:
      return "'%}'";
    case Token::kVarEnd:
      return "'}}'";
    case Token::kString:
      return "a string";
    case Token::kInt:
    case Token::kFloat:
      return "a number";
    default:
      return "'" + t.text + "'";
  }
}
void Parser::expect_op(const char* op, const char* after) {
  if (!is_op(op))
    fail(std::string("expected '") + op + "' " + after + ", got " + describe(peek()), peek().pos);
  next();
}
std::string Parser::expect_name(const char* what) {
  if (peek().kind != Token::kName)
    fail(std::string("expected ") + what + ", got " + describe(peek()), peek().pos);
  return next().text;
}
void Parser::expect_block_end(const std::string& after) {
  if (peek().kind != Token::kBlockEnd)
    fail("expected '%}' after '" + after + "', got " + describe(peek()), peek().pos);
  next();
}

std::unique_ptr<Stmt> Parser::stmt(Stmt::Kind kind, size_t pos) {
  auto s = std::make_unique<Stmt>();
  s->kind = kind;
  s->pos = pos;
  return s;
}
ExprPtr Parser::expr(Expr::Kind kind, size_t pos, std::string name) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->pos = pos;
  e->name = std::move(name);
  return e;
}

// Statements until a block tag whose keyword is in `stops` (left unconsumed after its keyword,
// named in `stopped_at`); at the top level (no stops) until the end.
Body Parser::parse_body(const std::vector<std::string>& stops, std::string& stopped_at) {
  DepthGuard guard(depth_, peek().pos);
  Body body;
  while (true) {
    const Token& t = peek();
    if (t.kind == Token::kEof) {
      if (!stops.empty())
        fail("unexpected end of template: expected '{% " + stops.back() + " %}'", t.pos);
      return body;
    }
    if (t.kind == Token::kText) {
      auto s = stmt(Stmt::kText, t.pos);
      s->text = next().text;
      body.push_back(std::move(s));
    } else if (t.kind == Token::kVarBegin) {
      next();
      auto s = stmt(Stmt::kOutput, t.pos);
      s->expr = parse_tuple(true);
      if (peek().kind != Token::kVarEnd) fail("expected '}}', got " + describe(peek()), peek().pos);
      next();
      body.push_back(std::move(s));
    } else {  // block tag
      next();
      const Token& kw = peek();
      if (kw.kind != Token::kName)
        fail("expected a statement name after '{%', got " + describe(kw), kw.pos);
      if (std::find(stops.begin(), stops.end(), kw.text) != stops.end()) {
        stopped_at = next().text;
        return body;
      }
      body.push_back(parse_statement());
    }
  }
}

std::unique_ptr<Stmt> Parser::parse_statement() {
  const Token kw = next();
  const std::string& k = kw.text;
  std::string stopped;
  if (k == "if") {
    auto s = stmt(Stmt::kIf, kw.pos);
    ExprPtr cond = parse_tuple(true);
    while (true) {
      expect_block_end(stopped.empty() ? "if" : stopped);
      Body branch = parse_body({"elif", "else", "endif"}, stopped);
      s->branches.emplace_back(std::move(cond), std::move(branch));
      if (stopped == "elif") {
        cond = parse_tuple(true);
      } else if (stopped == "else") {
        expect_block_end("else");
        s->branches.emplace_back(nullptr, parse_body({"endif"}, stopped));
        break;
      } else {
        break;
      }
    }
    expect_block_end("endif");
    return s;
  }
  if (k == "for") {
    auto s = stmt(Stmt::kFor, kw.pos);
    s->targets = parse_targets("for");
    if (!is_name("in"))
      fail("expected 'in' after the loop variable, got " + describe(peek()), peek().pos);
    next();
    s->expr = parse_tuple(false);  // no inline `if` here: `for x in xs if c` filters the loop
    if (is_name("if")) {
      next();
      s->cond = parse_tuple(true);
    }
    if (is_name("recursive")) fail("recursive loops are not supported", peek().pos);
    expect_block_end("for");
    s->body = parse_body({"else", "endfor"}, stopped);
    if (stopped == "else") {
      expect_block_end("else");
      s->else_body = parse_body({"endfor"}, stopped);
    }
    expect_block_end("endfor");
    return s;
  }
  if (k == "set") {
    if (peek().kind == Token::kName && is_op(".", 1)) {
      auto s = stmt(Stmt::kSetAttr, kw.pos);
      s->targets = {next().text};
      next();
      s->text = expect_name("an attribute name after '.'");
      expect_op("=", "in a namespace assignment");
      s->expr = parse_tuple(true);
      expect_block_end("set");
      return s;
    }
    std::vector<std::string> targets = parse_targets("set");
    if (peek().kind == Token::kBlockEnd) {
      if (targets.size() != 1) fail("a block set assigns one name", kw.pos);
      next();
      auto s = stmt(Stmt::kSetBlock, kw.pos);
      s->targets = std::move(targets);
      s->body = parse_body({"endset"}, stopped);
      expect_block_end("endset");
      return s;
    }
    if (is_op("|")) fail("filtered block set is not supported", peek().pos);
    expect_op("=", "after the name in 'set'");
    auto s = stmt(Stmt::kSet, kw.pos);
    s->targets = std::move(targets);
    s->expr = parse_tuple(true);
    expect_block_end("set");
    return s;
  }
  if (k == "macro") {
    auto s = stmt(Stmt::kMacro, kw.pos);
    s->text = expect_name("a macro name");
    expect_op("(", "after the macro name");
    while (!is_op(")")) {
      s->targets.push_back(expect_name("a parameter name"));
      if (is_op("=")) {
        next();
        s->defaults.push_back(parse_expression(true));
      } else {
        if (!s->defaults.empty() && s->defaults.back())
          fail("a parameter without a default follows one with a default", peek().pos);
        s->defaults.push_back(nullptr);
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")", "to close the macro's parameters");
    expect_block_end("macro");
    s->body = parse_body({"endmacro"}, stopped);
    if (peek().kind == Token::kName) next();  // {% endmacro name %}
    expect_block_end("endmacro");
    return s;
  }
  if (k == "generation") {
    expect_block_end("generation");
    auto s = stmt(Stmt::kGeneration, kw.pos);
    s->body = parse_body({"endgeneration"}, stopped);
    expect_block_end("endgeneration");
    return s;
  }
  if (k == "filter") {
    auto s = stmt(Stmt::kFilterBlock, kw.pos);
    s->expr = parse_filter(expr(Expr::kLiteral, kw.pos));
    expect_block_end("filter");
    s->body = parse_body({"endfilter"}, stopped);
    expect_block_end("endfilter");
    return s;
  }
  if (k == "break" || k == "continue") {
    expect_block_end(k);
    return stmt(k == "break" ? Stmt::kBreak : Stmt::kContinue, kw.pos);
  }
  static const char* const kEnds[] = {"endif",         "endfor", "endset", "endmacro", "endfilter",
                                      "endgeneration", "elif",   "else",   "endraw"};
  if (known(kEnds, k)) fail("unexpected '" + k + "': no open block it closes", kw.pos);
  fail("the '{% " + k + " %}' statement is not supported", kw.pos);
}

std::vector<std::string> Parser::parse_targets(const char* what) {
  std::vector<std::string> names;
  const bool paren = is_op("(");
  if (paren) next();
  do {
    if (!names.empty()) next();
    names.push_back(expect_name((std::string("a variable name after '") + what + "'").c_str()));
  } while (is_op(","));
  if (paren) expect_op(")", "to close the names");
  return names;
}

// An expression, or a tuple when commas follow at the top level ({{ a, b }}, set x = 1, 2).
ExprPtr Parser::parse_tuple(bool with_condexpr) {
  const size_t pos = peek().pos;
  ExprPtr first = parse_expression(with_condexpr);
  if (!is_op(",")) return first;
  auto t = expr(Expr::kTuple, pos);
  t->args.push_back(std::move(first));
  while (is_op(",")) {
    next();
    if (peek().kind == Token::kBlockEnd || peek().kind == Token::kVarEnd) break;
    t->args.push_back(parse_expression(with_condexpr));
  }
  return t;
}

ExprPtr Parser::parse_expression(bool with_condexpr) {
  DepthGuard guard(depth_, peek().pos);
  ExprPtr e = parse_or();
  while (with_condexpr && is_name("if")) {
    auto c = expr(Expr::kCond, next().pos);
    ExprPtr cond = parse_or();
    ExprPtr otherwise;
    if (is_name("else")) {
      next();
      otherwise = parse_expression(true);
    }
    c->args.push_back(std::move(cond));
    c->args.push_back(std::move(e));
    c->args.push_back(std::move(otherwise));
    e = std::move(c);
  }
  return e;
}

ExprPtr Parser::binary(Expr::Kind kind, std::string op, ExprPtr l, ExprPtr r, size_t pos) {
  auto e = expr(kind, pos, std::move(op));
  e->args.push_back(std::move(l));
  e->args.push_back(std::move(r));
  return e;
}

ExprPtr Parser::parse_or() {
  ExprPtr l = parse_and();
  while (is_name("or")) {
    const size_t pos = next().pos;
    l = binary(Expr::kOr, "or", std::move(l), parse_and(), pos);
  }
  return l;
}
ExprPtr Parser::parse_and() {
  ExprPtr l = parse_not();
  while (is_name("and")) {
    const size_t pos = next().pos;
    l = binary(Expr::kAnd, "and", std::move(l), parse_not(), pos);
  }
  return l;
}
ExprPtr Parser::parse_not() {
  if (is_name("not")) {
    DepthGuard guard(depth_, peek().pos);
    auto e = expr(Expr::kNot, next().pos);
    e->args.push_back(parse_not());
    return e;
  }
  return parse_compare();
}
ExprPtr Parser::parse_compare() {
  ExprPtr l = parse_math1();
  while (true) {
    const size_t pos = peek().pos;
    std::string op;
    if (peek().kind == Token::kOp &&
        (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == "<=" ||
         peek().text == ">" || peek().text == ">=")) {
      op = next().text;
    } else if (is_name("in")) {
      next();
      op = "in";
    } else if (is_name("not") && is_name("in", 1)) {
      next(), next();
      op = "not in";
    } else {
      return l;
    }
    l = binary(Expr::kBinary, op, std::move(l), parse_math1(), pos);
  }
}
ExprPtr Parser::parse_math1() {
  ExprPtr l = parse_concat();
  while (is_op("+") || is_op("-")) {
    const Token& t = next();
    l = binary(Expr::kBinary, t.text, std::move(l), parse_concat(), t.pos);
  }
  return l;
}
ExprPtr Parser::parse_concat() {
  ExprPtr l = parse_math2();
  while (is_op("~")) {
    const size_t pos = next().pos;
    l = binary(Expr::kBinary, "~", std::move(l), parse_math2(), pos);
  }
  return l;
}
ExprPtr Parser::parse_math2() {
  ExprPtr l = parse_pow();
  while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
    const Token& t = next();
    l = binary(Expr::kBinary, t.text, std::move(l), parse_pow(), t.pos);
  }
  return l;
}
ExprPtr Parser::parse_pow() {
  ExprPtr l = parse_unary(true);
  while (is_op("**")) {
    const size_t pos = next().pos;
    l = binary(Expr::kBinary, "**", std::move(l), parse_unary(true), pos);
  }
  return l;
}
ExprPtr Parser::parse_unary(bool with_filter) {
  DepthGuard guard(depth_, peek().pos);
  ExprPtr e;
  if (is_op("-") || is_op("+")) {
    const bool negate = is_op("-");
    e = expr(negate ? Expr::kNeg : Expr::kPos, next().pos);
    e->args.push_back(parse_unary(false));
  } else {
    e = parse_primary();
  }
  e = parse_postfix(std::move(e));
  return with_filter ? parse_filters(std::move(e)) : std::move(e);
}

ExprPtr Parser::parse_primary() {
  const Token& t = peek();
  switch (t.kind) {
    case Token::kName: {
      next();
      auto e = expr(Expr::kLiteral, t.pos);
      if (t.text == "true" || t.text == "True")
        e->literal = make_bool(true);
      else if (t.text == "false" || t.text == "False")
        e->literal = make_bool(false);
      else if (t.text == "none" || t.text == "None")
        e->literal = make_none();
      else
        e = expr(Expr::kName, t.pos, t.text);
      return e;
    }
    case Token::kString: {
      auto e = expr(Expr::kLiteral, t.pos);
      std::string s;
      while (peek().kind == Token::kString) s += next().text;  // 'a' 'b' is 'ab'
      e->literal = make_str(std::move(s));
      return e;
    }
    case Token::kInt:
    case Token::kFloat: {
      next();
      auto e = expr(Expr::kLiteral, t.pos);
      e->literal = t.kind == Token::kInt ? make_int(t.int_value) : make_float(t.float_value);
      return e;
    }
    case Token::kOp:
      if (t.text == "(") {
        next();
        if (is_op(")")) {
          next();
          return expr(Expr::kTuple, t.pos);
        }
        ExprPtr inner = parse_expression(true);
        if (is_op(",")) {
          auto tuple = expr(Expr::kTuple, t.pos);
          tuple->args.push_back(std::move(inner));
          while (is_op(",")) {
            next();
            if (is_op(")")) break;
            tuple->args.push_back(parse_expression(true));
          }
          inner = std::move(tuple);
        }
        expect_op(")", "to close '('");
        return inner;
      }
      if (t.text == "[") {
        next();
        auto list = expr(Expr::kList, t.pos);
        while (!is_op("]")) {
          list->args.push_back(parse_expression(true));
          if (!is_op(",")) break;
          next();
        }
        expect_op("]", "to close the list");
        return list;
      }
      if (t.text == "{") {
        next();
        auto dict = expr(Expr::kDict, t.pos);
        while (!is_op("}")) {
          dict->args.push_back(parse_expression(true));
          expect_op(":", "after a dict key");
          dict->args.push_back(parse_expression(true));
          if (!is_op(",")) break;
          next();
        }
        expect_op("}", "to close the dict");
        return dict;
      }
      break;
    default:
      break;
  }
  fail("expected an expression, got " + describe(t), t.pos);
}

ExprPtr Parser::parse_postfix(ExprPtr e) {
  while (true) {
    if (is_op(".")) {
      const size_t pos = next().pos;
      if (peek().kind == Token::kInt) {  // x.0 is x[0]
        auto item = expr(Expr::kItem, pos);
        auto index = expr(Expr::kLiteral, peek().pos);
        index->literal = make_int(next().int_value);
        item->args.push_back(std::move(e));
        item->args.push_back(std::move(index));
        e = std::move(item);
        continue;
      }
      auto attr = expr(Expr::kAttr, pos, expect_name("an attribute name after '.'"));
      attr->args.push_back(std::move(e));
      e = std::move(attr);
    } else if (is_op("[")) {
      e = parse_subscript(std::move(e));
    } else if (is_op("(")) {
      e = parse_call(std::move(e));
    } else {
      return e;
    }
  }
}

ExprPtr Parser::parse_subscript(ExprPtr subject) {
  const size_t pos = next().pos;
  ExprPtr parts[3];
  int part = 0;
  bool slice = false;
  while (!is_op("]")) {
    if (is_op(":")) {
      next();
      slice = true;
      if (++part > 2) fail("a slice takes at most three parts", pos);
      continue;
    }
    if (parts[part])
      fail("expected ':' or ']' in a subscript, got " + describe(peek()), peek().pos);
    parts[part] = parse_expression(true);
  }
  next();
  if (!slice && !parts[0]) fail("empty subscript", pos);
  auto e = expr(slice ? Expr::kSlice : Expr::kItem, pos);
  e->args.push_back(std::move(subject));
  if (slice) {
    for (auto& p : parts) e->args.push_back(std::move(p));
  } else {
    e->args.push_back(std::move(parts[0]));
  }
  return e;
}

void Parser::parse_args(Expr& call) {
  expect_op("(", "to open the arguments");
  while (!is_op(")")) {
    if (is_op("*") || is_op("**"))
      fail("*args and **kwargs in calls are not supported", peek().pos);
    if (peek().kind == Token::kName && is_op("=", 1)) {
      std::string key = next().text;
      next();
      call.kwargs.emplace_back(std::move(key), parse_expression(true));
    } else {
      if (!call.kwargs.empty())
        fail("a positional argument follows a keyword argument", peek().pos);
      call.args.push_back(parse_expression(true));
    }
    if (!is_op(",")) break;
    next();
  }
  expect_op(")", "to close the arguments");
}

ExprPtr Parser::parse_call(ExprPtr callee) {
  auto call = expr(Expr::kCall, peek().pos);
  call->args.push_back(std::move(callee));
  parse_args(*call);
  return call;
}

ExprPtr Parser::parse_filter(ExprPtr subject) {
  const size_t pos = peek().pos;
  std::string name = expect_name("a filter name");
  if (!known(kFilters, name)) fail("the filter '" + name + "' is not supported", pos);
  auto f = expr(Expr::kFilter, pos, name);
  f->args.push_back(std::move(subject));
  if (is_op("(")) parse_args(*f);
  return f;
}

ExprPtr Parser::parse_filters(ExprPtr e) {
  while (true) {
    if (is_op("|")) {
      next();
      e = parse_filter(std::move(e));
    } else if (is_name("is")) {
      const size_t pos = next().pos;
      const bool negated = is_name("not");
      if (negated) next();
      std::string name;
      if (peek().kind != Token::kName)
        fail("expected a test name after 'is', got " + describe(peek()), peek().pos);
      name = next().text;
      if (!known(kTests, name)) fail("the test '" + name + "' is not supported", pos);
      auto t = expr(Expr::kTest, pos, name);
      t->args.push_back(std::move(e));
      if (is_op("(")) {
        parse_args(*t);
      } else if ((peek().kind == Token::kName || peek().kind == Token::kString ||
                  peek().kind == Token::kInt || peek().kind == Token::kFloat || is_op("(") ||
                  is_op("[") || is_op("{")) &&
                 !is_name("else") && !is_name("or") && !is_name("and")) {
        if (is_name("is")) fail("tests cannot be chained with 'is'", peek().pos);
        t->args.push_back(parse_postfix(parse_primary()));
      }
      e = std::move(t);
      if (negated) {
        auto n = expr(Expr::kNot, pos);
        n->args.push_back(std::move(e));
        e = std::move(n);
      }
    } else if (is_op("(")) {
      e = parse_call(std::move(e));
    } else {
      return e;
    }
  }
}

}  // namespace keel::data::jinja
