// The Jinja renderer: scopes, and the Renderer that executes statements and evaluates expressions,
// operators, tests, filters and globals over Values.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "keel/data/jinja/syntax.h"
#include "keel/data/jinja/value.h"

namespace keel::data::jinja {

// ---- Renderer -----------------------------------------------------------------------------------

// Jinja's scoping: a for loop's body (each iteration) and a macro call get their own scope, so a
// `set` inside them does not leak out (templates carry state out of loops with namespace());
// `if` has no scope, so a `set` in an if branch is visible after it.
struct Scope {
  NamedValues vars;
  std::shared_ptr<Scope> parent;
  Value* find(const std::string& name) {
    for (Scope* s = this; s; s = s->parent.get())
      for (auto& [k, v] : s->vars)
        if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars)
      if (k == name) {
        old = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { kNormal, kBreak, kContinue };

struct Renderer {
  Renderer(const Value& context, const std::string& today) : context_(context), today_(today) {}

  const Value& context_;
  const std::string& today_;
  std::string* out_ = nullptr;
  int depth_ = 0;
  int loop_depth_ = 0;

  struct DepthGuard {
    DepthGuard(int& depth, size_t pos) : depth_(depth) { check_depth(++depth_, pos); }
    ~DepthGuard() { --depth_; }
    int& depth_;
  };

  void write(const std::string& s, size_t pos);
  std::string capture(const Body& body, const ScopePtr& scope);
  Flow exec(const Body& body, const ScopePtr& scope);
  Flow exec(const Stmt& s, const ScopePtr& scope);
  void assign(const std::vector<std::string>& targets, Value v, const ScopePtr& scope, size_t pos);
  void exec_for(const Stmt& s, const ScopePtr& scope);
  Value make_macro(const Stmt& s, const ScopePtr& defined_in);
  Value lookup(const std::string& name, const ScopePtr& scope, size_t pos);
  static Value builtin_range(Renderer&, CallArgs& a, size_t pos);
  static std::string format_date(const std::string& today, const std::string& fmt, size_t pos);
  Value eval(const Expr& e, const ScopePtr& scope);
  CallArgs eval_args(const Expr& e, const ScopePtr& scope);
  static bool is_method(const Value& v, const std::string& name);
  Value get_attr(const Value& obj, const std::string& name, size_t pos);
  Value get_item(const Value& obj, const Value& key, size_t pos);
  Value slice(const Expr& e, const ScopePtr& scope);
  Value call(const Expr& e, const ScopePtr& scope);
  Value invoke(const Value& fn, CallArgs& a, size_t pos);
  Value call_method(const Value& obj, const std::string& name, CallArgs& a, size_t pos);
  Value repeat(const Value& seq, int64_t times, size_t pos);
  Value binary(const std::string& op, const Value& l, const Value& r, size_t pos);
  bool apply_test(const std::string& name, const Value& v, const ValueList& args, size_t pos);
  Value sort_key(const Value& item, const Value* attribute, bool case_sensitive, size_t pos);
  Value apply_filter(const Expr& e, const Value& v, const ScopePtr& scope);
  Value filter(const std::string& name, const Value& v, CallArgs& a, size_t pos);
};

Value context_value(const nlohmann::ordered_json& context);

}  // namespace keel::data::jinja
