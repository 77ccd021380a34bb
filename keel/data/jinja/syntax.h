// The Jinja syntax of chat templates: tokens and the lexer (whitespace control, trim_blocks,
// lstrip_blocks), the AST (Expr, Stmt) and the parser.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "keel/data/jinja/value.h"

namespace keel::data::jinja {

// ---- Lexer --------------------------------------------------------------------------------------

std::string normalize_newlines(const std::string& src);

struct Token {
  enum Kind {
    kText,
    kVarBegin,
    kVarEnd,
    kBlockBegin,
    kBlockEnd,
    kName,
    kString,
    kInt,
    kFloat,
    kOp,
    kEof
  };
  Kind kind;
  std::string text;  // text, name, operator, or the decoded string literal
  size_t pos;
  int64_t int_value = 0;
  double float_value = 0;
};

// Splits the source into text and tags, applying jinja2's whitespace rules as it goes:
//  - "{%-" / "{{-" / "{#-" strip all whitespace before the tag, "-%}" / "-}}" / "-#}" all after;
//  - trim_blocks: the first newline after a block tag or comment is dropped (so a line holding
//    only "{% if %}" leaves no blank line behind);
//  - lstrip_blocks: spaces and tabs between the start of a line and a block tag or comment are
//    dropped (so indenting the tags does not indent the output); "{%+" keeps them, "+%}" keeps
//    the newline after.
class Lexer {
 public:
  explicit Lexer(const std::string& src) : src_(src) {}
  std::vector<Token> run();

 private:
  void emit_text(std::string text, size_t pos);
  static void strip_before_tag(std::string& text, char kind, char mod, bool line_starting);
  size_t after_tag(size_t end, char mod, bool is_block, bool& line_starting);
  bool is_raw_begin(size_t p) const;
  size_t lex_raw(size_t open, size_t inner, bool& line_starting);
  size_t lex_tag(size_t open, size_t p, bool is_block, bool& line_starting);
  size_t lex_number(size_t p);
  size_t lex_string(size_t p);

  const std::string& src_;
  std::vector<Token> tokens_;
};

// ---- AST and parser -----------------------------------------------------------------------------

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
struct Expr {
  enum Kind {
    kLiteral,
    kName,
    kList,
    kTuple,
    kDict,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNeg,
    kPos,
    kNot,
    kBinary,
    kAnd,
    kOr,
    kCond
  };
  Kind kind;
  size_t pos;
  std::string name;           // variable, attribute, filter, test or binary operator
  Value literal;              // kLiteral
  std::vector<ExprPtr> args;  // operands; the subject first for attr/item/slice/call/filter/test
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;
struct Stmt {
  enum Kind {
    kText,
    kOutput,
    kIf,
    kFor,
    kSet,
    kSetAttr,
    kSetBlock,
    kMacro,
    kBreak,
    kContinue,
    kFilterBlock,
    kGeneration
  };
  Kind kind;
  size_t pos;
  std::string text;                  // kText; macro name; kSetAttr's attribute
  std::vector<std::string> targets;  // for/set names; macro parameters
  ExprPtr expr;                      // output, for iterable, set value, filter block's filter
  ExprPtr cond;                      // for's `if` filter
  std::vector<std::pair<ExprPtr, Body>> branches;  // if/elif/else (else: null condition)
  std::vector<ExprPtr> defaults;                   // macro parameter defaults (null: none)
  Body body, else_body;
};

inline const char* const kFilters[] = {
    "abs",    "capitalize", "count",  "d",          "default", "dictsort",   "e",       "escape",
    "first",  "float",      "int",    "items",      "join",    "last",       "length",  "list",
    "lower",  "map",        "max",    "min",        "reject",  "rejectattr", "replace", "reverse",
    "round",  "safe",       "select", "selectattr", "sort",    "string",     "sum",     "title",
    "tojson", "trim",       "unique", "upper"};
inline const char* const kTests[] = {
    "defined", "undefined", "none",        "string",  "number",   "integer",  "float",
    "boolean", "true",      "false",       "mapping", "iterable", "sequence", "callable",
    "odd",     "even",      "divisibleby", "in",      "eq",       "equalto",  "==",
    "ne",      "!=",        "lt",          "<",       "lessthan", "le",       "<=",
    "gt",      ">",         "greaterthan", "ge",      ">=",       "lower",    "upper"};
template <size_t N>
bool known(const char* const (&names)[N], const std::string& name) {
  return std::any_of(std::begin(names), std::end(names), [&](const char* n) { return name == n; });
}

// Recursive descent with jinja2's precedence, loosest first: x if c else y, or, and, not,
// comparisons (== != < <= > >= in, not in), + -, ~, * / // %, **, unary - +, then a primary with
// its postfix ops (.attr [item] (call)) and filters/tests (| f, is t).
class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}
  Body parse_template();

 private:
  const Token& peek(size_t ahead = 0) const;
  const Token& next();
  bool is_op(const char* op, size_t ahead = 0) const;
  bool is_name(const char* name, size_t ahead = 0) const;
  static std::string describe(const Token& t);
  void expect_op(const char* op, const char* after);
  std::string expect_name(const char* what);
  void expect_block_end(const std::string& after);

  struct DepthGuard {
    DepthGuard(int& depth, size_t pos) : depth_(depth) { check_depth(++depth_, pos); }
    ~DepthGuard() { --depth_; }
    int& depth_;
  };

  static std::unique_ptr<Stmt> stmt(Stmt::Kind kind, size_t pos);
  static ExprPtr expr(Expr::Kind kind, size_t pos, std::string name = "");
  Body parse_body(const std::vector<std::string>& stops, std::string& stopped_at);
  std::unique_ptr<Stmt> parse_statement();
  std::vector<std::string> parse_targets(const char* what);
  ExprPtr parse_tuple(bool with_condexpr);
  ExprPtr parse_expression(bool with_condexpr);
  ExprPtr binary(Expr::Kind kind, std::string op, ExprPtr l, ExprPtr r, size_t pos);
  ExprPtr parse_or();
  ExprPtr parse_and();
  ExprPtr parse_not();
  ExprPtr parse_compare();
  ExprPtr parse_math1();
  ExprPtr parse_concat();
  ExprPtr parse_math2();
  ExprPtr parse_pow();
  ExprPtr parse_unary(bool with_filter);
  ExprPtr parse_primary();
  ExprPtr parse_postfix(ExprPtr e);
  ExprPtr parse_subscript(ExprPtr subject);
  void parse_args(Expr& call);
  ExprPtr parse_call(ExprPtr callee);
  ExprPtr parse_filter(ExprPtr subject);
  ExprPtr parse_filters(ExprPtr e);

  std::vector<Token> tokens_;
  size_t at_ = 0;
  int depth_ = 0;
};

}  // namespace keel::data::jinja
