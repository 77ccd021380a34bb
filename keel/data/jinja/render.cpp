// The Jinja renderer (render.h): statements, expressions, method calls, operators, tests, filters
// and the HF globals (raise_exception, namespace, dict, range, strftime_now).
#include "keel/data/jinja/render.h"

#include "keel/data/chat_template.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>

namespace keel::data::jinja {

// ---- Renderer -----------------------------------------------------------------------------------

namespace {

constexpr int64_t kMaxRange = int64_t{1} << 17;

// An argument by position or keyword (Python's call binding, for the builtins); null when absent.
const Value* arg(const CallArgs& a, size_t index, const char* name) {
  for (const auto& [k, v] : a.named)
    if (k == name) return &v;
  return index < a.positional.size() ? &a.positional[index] : nullptr;
}

int64_t int_arg(const Value* v, int64_t fallback, const char* what, size_t pos) {
  if (!v || v->is(Value::Kind::kNone)) return fallback;
  if (!v->is(Value::Kind::kInt) && !v->is(Value::Kind::kBool))
    fail(std::string(what) + " must be an integer, not " + type_name(*v), pos);
  return v->as_int();
}

const std::string& str_arg(const Value* v, const char* what, size_t pos) {
  if (!v || !v->is(Value::Kind::kString))
    fail(std::string(what) + " must be a string" + (v ? ", not " + type_name(*v) : std::string()),
         pos);
  return v->s;
}

}  // namespace

void Renderer::write(const std::string& s, size_t pos) {
  if (out_->size() + s.size() > kMaxOutput) fail("the rendered text grew past 64 MiB", pos);
  *out_ += s;
}

// Renders `body` into a string of its own (block set, macro call, filter block).
std::string Renderer::capture(const Body& body, const ScopePtr& scope) {
  std::string text;
  std::string* saved = out_;
  out_ = &text;
  const int saved_loops = loop_depth_;
  loop_depth_ = 0;
  try {
    exec(body, scope);
  } catch (...) {
    out_ = saved;
    loop_depth_ = saved_loops;
    throw;
  }
  out_ = saved;
  loop_depth_ = saved_loops;
  return text;
}

Flow Renderer::exec(const Body& body, const ScopePtr& scope) {
  DepthGuard guard(depth_, body.empty() ? 0 : body.front()->pos);
  for (const auto& s : body) {
    const Flow flow = exec(*s, scope);
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

Flow Renderer::exec(const Stmt& s, const ScopePtr& scope) {
  switch (s.kind) {
    case Stmt::kText:
      write(s.text, s.pos);
      return Flow::kNormal;
    case Stmt::kOutput:
      write(to_str(eval(*s.expr, scope), s.pos), s.pos);
      return Flow::kNormal;
    case Stmt::kIf:
      for (const auto& [cond, body] : s.branches)
        if (!cond || truthy(eval(*cond, scope))) return exec(body, scope);
      return Flow::kNormal;
    case Stmt::kFor:
      exec_for(s, scope);
      return Flow::kNormal;
    case Stmt::kSet:
      assign(s.targets, eval(*s.expr, scope), scope, s.pos);
      return Flow::kNormal;
    case Stmt::kSetAttr: {
      Value* ns = scope->find(s.targets[0]);
      if (!ns || !ns->is(Value::Kind::kDict) || !ns->dict->is_namespace)
        fail("cannot assign attribute on non-namespace object '" + s.targets[0] + "'", s.pos);
      const std::shared_ptr<DictData> target = ns->dict;  // eval below may move scope entries
      target->set(s.text, eval(*s.expr, scope));
      return Flow::kNormal;
    }
    case Stmt::kSetBlock:
      scope->set(s.targets[0], make_str(capture(s.body, scope)));
      return Flow::kNormal;
    case Stmt::kMacro:
      scope->set(s.text, make_macro(s, scope));
      return Flow::kNormal;
    case Stmt::kBreak:
    case Stmt::kContinue:
      if (loop_depth_ == 0)
        fail(
            std::string("'") + (s.kind == Stmt::kBreak ? "break" : "continue") + "' outside a loop",
            s.pos);
      return s.kind == Stmt::kBreak ? Flow::kBreak : Flow::kContinue;
    case Stmt::kFilterBlock: {
      const Value body = make_str(capture(s.body, scope));
      write(to_str(apply_filter(*s.expr, body, scope), s.pos), s.pos);
      return Flow::kNormal;
    }
    case Stmt::kGeneration:
      return exec(s.body, scope);  // HF marks assistant text; it renders as is
  }
  return Flow::kNormal;
}

void Renderer::assign(const std::vector<std::string>& targets, Value v, const ScopePtr& scope,
                      size_t pos) {
  if (targets.size() == 1) {
    scope->set(targets[0], std::move(v));
    return;
  }
  if (!v.is(Value::Kind::kList) && !v.is(Value::Kind::kString))
    fail("cannot unpack " + type_name(v), pos);
  const ValueList items = iterate(v, pos);
  if (items.size() != targets.size())
    fail("cannot unpack " + std::to_string(items.size()) + " values into " +
             std::to_string(targets.size()) + " names",
         pos);
  for (size_t k = 0; k < targets.size(); ++k) scope->set(targets[k], items[k]);
}

void Renderer::exec_for(const Stmt& s, const ScopePtr& scope) {
  ValueList items = iterate(eval(*s.expr, scope), s.pos);
  if (s.cond) {  // the loop's `if` filters before loop.length and loop.index are counted
    ValueList kept;
    for (Value& item : items) {
      auto probe = std::make_shared<Scope>(Scope{{}, scope});
      assign(s.targets, item, probe, s.pos);
      if (truthy(eval(*s.cond, probe))) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  const auto n = static_cast<int64_t>(items.size());
  ++loop_depth_;
  for (int64_t k = 0; k < n; ++k) {
    charge_work(1, s.pos);
    auto iteration = std::make_shared<Scope>(Scope{{}, scope});
    NamedValues loop = {{"index", make_int(k + 1)},    {"index0", make_int(k)},
                        {"revindex", make_int(n - k)}, {"revindex0", make_int(n - k - 1)},
                        {"first", make_bool(k == 0)},  {"last", make_bool(k == n - 1)},
                        {"length", make_int(n)},       {"depth", make_int(1)},
                        {"depth0", make_int(0)}};
    if (k > 0) loop.emplace_back("previtem", items[static_cast<size_t>(k - 1)]);
    if (k + 1 < n) loop.emplace_back("nextitem", items[static_cast<size_t>(k + 1)]);
    loop.emplace_back("cycle", make_callable("loop.cycle", [k](Renderer&, CallArgs& a, size_t pos) {
                        if (a.positional.empty()) fail("loop.cycle needs at least one value", pos);
                        return a.positional[static_cast<size_t>(k) % a.positional.size()];
                      }));
    iteration->set("loop", make_dict(std::move(loop)));
    assign(s.targets, items[static_cast<size_t>(k)], iteration, s.pos);
    const Flow flow = exec(s.body, iteration);
    if (flow == Flow::kBreak) break;
  }
  --loop_depth_;
  if (n == 0) exec(s.else_body, scope);
}

Value Renderer::make_macro(const Stmt& s, const ScopePtr& defined_in) {
  const Stmt* macro = &s;
  return make_callable(s.text, [macro, defined_in](Renderer& r, CallArgs& a, size_t pos) {
    DepthGuard guard(r.depth_, pos);
    charge_work(1, pos);
    auto scope = std::make_shared<Scope>(Scope{{}, defined_in});
    const auto& params = macro->targets;
    if (a.positional.size() > params.size())
      fail("macro '" + macro->text + "' takes not more than " + std::to_string(params.size()) +
               " argument(s)",
           pos);
    for (const auto& [k, v] : a.named)
      if (std::find(params.begin(), params.end(), k) == params.end())
        fail("macro '" + macro->text + "' has no parameter named '" + k + "'", pos);
    for (size_t p = 0; p < params.size(); ++p) {
      const Value* given = arg(a, p, params[p].c_str());
      if (given)
        scope->set(params[p], *given);
      else if (macro->defaults[p])
        scope->set(params[p], r.eval(*macro->defaults[p], scope));
      else
        scope->set(params[p], make_undefined("parameter '" + params[p] + "' was not provided"));
    }
    return make_str(r.capture(macro->body, scope));
  });
}

Value Renderer::lookup(const std::string& name, const ScopePtr& scope, size_t pos) {
  if (Value* v = scope->find(name)) return *v;
  if (const Value* v = context_.dict->find(name)) return *v;
  if (name == "raise_exception")
    return make_callable(name, [](Renderer&, CallArgs& a, size_t p) -> Value {
      throw Failure{a.positional.empty() ? "" : to_str(a.positional[0], p), p, true};
    });
  if (name == "namespace")
    return make_callable(name, [](Renderer&, CallArgs& a, size_t p) {
      Value ns = make_dict({}, true);
      for (const Value& v : a.positional) {
        if (!v.is(Value::Kind::kDict)) fail("namespace() takes a dict, not " + type_name(v), p);
        for (const auto& [k, item] : v.dict->entries) ns.dict->set(k, item);
      }
      for (const auto& [k, item] : a.named) ns.dict->set(k, item);
      return ns;
    });
  if (name == "dict")
    return make_callable(name, [](Renderer&, CallArgs& a, size_t p) {
      if (!a.positional.empty()) fail("dict() with positional arguments is not supported", p);
      return make_dict(a.named);
    });
  if (name == "range") return make_callable(name, builtin_range);
  if (name == "strftime_now" && !today_.empty())
    return make_callable(name, [](Renderer& r, CallArgs& a, size_t p) {
      return make_str(
          format_date(r.today_, str_arg(arg(a, 0, "format"), "strftime_now's format", p), p));
    });
  (void)pos;
  // A dataset renders without a date, so that it reads the same on every day (chat_template.h).
  if (name == "strftime_now")
    return make_undefined(
        "'strftime_now' is undefined: the template writes today's date, and keel renders training "
        "data without one so that it reads the same on every day; give the date it should write "
        "as data.chat_date = \"YYYY-MM-DD\" (keel eval and keel tokenize: --chat-date), or a "
        "system message if the template writes the date only in its default one");
  return make_undefined("'" + name + "' is undefined");
}

Value Renderer::builtin_range(Renderer&, CallArgs& a, size_t pos) {
  int64_t start = 0, stop = 0, step = 1;
  if (a.positional.size() == 1) {
    stop = int_arg(&a.positional[0], 0, "range's stop", pos);
  } else if (a.positional.size() == 2 || a.positional.size() == 3) {
    start = int_arg(&a.positional[0], 0, "range's start", pos);
    stop = int_arg(&a.positional[1], 0, "range's stop", pos);
    if (a.positional.size() == 3) step = int_arg(&a.positional[2], 1, "range's step", pos);
  } else {
    fail("range() takes 1 to 3 arguments", pos);
  }
  if (step == 0) fail("range() arg 3 must not be zero", pos);
  ValueList out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (static_cast<int64_t>(out.size()) >= kMaxRange)
      fail("range() longer than 131072 items", pos);
    out.push_back(make_int(i));
  }
  charge_work(1 + static_cast<int64_t>(out.size()), pos);
  return make_list(std::move(out));
}

// strftime on the given day (time of day unknown, so only date fields are supported).
std::string Renderer::format_date(const std::string& today, const std::string& fmt, size_t pos) {
  using namespace std::chrono;
  int y = 0;
  unsigned m = 0, d = 0;
  if (!is_calendar_date(today) || std::sscanf(today.c_str(), "%4d-%2u-%2u", &y, &m, &d) != 3)
    fail("today must be a date written YYYY-MM-DD, got '" + today + "'", pos);
  const year_month_day ymd{year{y}, month{m}, day{d}};
  static const char* const kMonths[] = {"January",   "February", "March",    "April",
                                        "May",       "June",     "July",     "August",
                                        "September", "October",  "November", "December"};
  static const char* const kDays[] = {"Sunday",   "Monday", "Tuesday", "Wednesday",
                                      "Thursday", "Friday", "Saturday"};
  const unsigned wd = weekday{sys_days{ymd}}.c_encoding();
  const auto doy = (sys_days{ymd} - sys_days{year_month_day{year{y}, January, day{1}}}).count() + 1;
  char buf[16];
  std::string out;
  for (size_t k = 0; k < fmt.size(); ++k) {
    if (fmt[k] != '%' || k + 1 == fmt.size()) {
      out += fmt[k];
      continue;
    }
    switch (const char c = fmt[++k]) {
      case 'd':
        std::snprintf(buf, sizeof buf, "%02u", d);
        out += buf;
        break;
      case 'm':
        std::snprintf(buf, sizeof buf, "%02u", m);
        out += buf;
        break;
      case 'Y':
        out += std::to_string(y);
        break;
      case 'y':
        std::snprintf(buf, sizeof buf, "%02d", y % 100);
        out += buf;
        break;
      case 'B':
        out += kMonths[m - 1];
        break;
      case 'b':
        out += std::string(kMonths[m - 1], 3);
        break;
      case 'A':
        out += kDays[wd];
        break;
      case 'a':
        out += std::string(kDays[wd], 3);
        break;
      case 'j':
        std::snprintf(buf, sizeof buf, "%03d", static_cast<int>(doy));
        out += buf;
        break;
      case '%':
        out += '%';
        break;
      default:
        fail(std::string("strftime_now: %") + c + " is not supported (only the date is known)",
             pos);
    }
  }
  return out;
}

// ---- expressions ----

Value Renderer::eval(const Expr& e, const ScopePtr& scope) {
  DepthGuard guard(depth_, e.pos);
  switch (e.kind) {
    case Expr::kLiteral:
      return e.literal;
    case Expr::kName:
      return lookup(e.name, scope, e.pos);
    case Expr::kList:
    case Expr::kTuple: {
      ValueList items;
      for (const auto& a : e.args) items.push_back(eval(*a, scope));
      return make_list(std::move(items), e.kind == Expr::kTuple);
    }
    case Expr::kDict: {
      Value d = make_dict({});
      for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
        const Value key = eval(*e.args[k], scope);
        if (!key.is(Value::Kind::kString))
          fail("dict keys other than strings are not supported", e.args[k]->pos);
        d.dict->set(key.s, eval(*e.args[k + 1], scope));
      }
      return d;
    }
    case Expr::kAttr:
      return get_attr(eval(*e.args[0], scope), e.name, e.pos);
    case Expr::kItem:
      return get_item(eval(*e.args[0], scope), eval(*e.args[1], scope), e.pos);
    case Expr::kSlice:
      return slice(e, scope);
    case Expr::kCall:
      return call(e, scope);
    case Expr::kFilter:
      return apply_filter(e, eval(*e.args[0], scope), scope);
    case Expr::kTest: {
      CallArgs a = eval_args(e, scope);
      return make_bool(apply_test(e.name, eval(*e.args[0], scope), a.positional, e.pos));
    }
    case Expr::kNeg:
    case Expr::kPos: {
      const Value v = eval(*e.args[0], scope);
      if (v.is(Value::Kind::kUndefined)) fail_undefined(v, e.pos);
      if (!v.numeric())
        fail("bad operand type for unary " + std::string(e.kind == Expr::kNeg ? "-" : "+") + ": '" +
                 type_name(v) + "'",
             e.pos);
      if (e.kind == Expr::kPos) return v.is(Value::Kind::kFloat) ? v : make_int(v.as_int());
      if (v.is(Value::Kind::kFloat)) return make_float(-v.f);
      if (v.as_int() == INT64_MIN) fail("integer overflow", e.pos);
      return make_int(-v.as_int());
    }
    case Expr::kNot:
      return make_bool(!truthy(eval(*e.args[0], scope)));
    case Expr::kAnd: {
      Value l = eval(*e.args[0], scope);
      return truthy(l) ? eval(*e.args[1], scope) : l;
    }
    case Expr::kOr: {
      Value l = eval(*e.args[0], scope);
      return truthy(l) ? l : eval(*e.args[1], scope);
    }
    case Expr::kCond:
      if (truthy(eval(*e.args[0], scope))) return eval(*e.args[1], scope);
      return e.args[2] ? eval(*e.args[2], scope)
                       : make_undefined("the inline if had no else branch");
    case Expr::kBinary:
      return binary(e.name, eval(*e.args[0], scope), eval(*e.args[1], scope), e.pos);
  }
  return make_none();
}

CallArgs Renderer::eval_args(const Expr& e, const ScopePtr& scope) {
  CallArgs a;
  for (size_t k = 1; k < e.args.size(); ++k) a.positional.push_back(eval(*e.args[k], scope));
  for (const auto& [name, v] : e.kwargs) a.named.emplace_back(name, eval(*v, scope));
  return a;
}

bool Renderer::is_method(const Value& v, const std::string& name) {
  static const char* const kStr[] = {"strip",    "lstrip", "rstrip", "split", "startswith",
                                     "endswith", "upper",  "lower",  "title", "capitalize",
                                     "replace",  "find",   "join"};
  static const char* const kDict[] = {"items", "keys", "values", "get"};
  if (v.is(Value::Kind::kString)) return known(kStr, name);
  return v.is(Value::Kind::kDict) && !v.dict->is_namespace && known(kDict, name);
}

// jinja2's getattr: Python attributes (here: the methods) first, then the item of that name.
Value Renderer::get_attr(const Value& obj, const std::string& name, size_t pos) {
  if (obj.is(Value::Kind::kUndefined)) fail_undefined(obj, pos);
  if (is_method(obj, name)) {
    return make_callable(name, [obj, name](Renderer& r, CallArgs& a, size_t p) {
      return r.call_method(obj, name, a, p);
    });
  }
  if (obj.is(Value::Kind::kDict)) {
    if (const Value* v = obj.dict->find(name)) return *v;
    return make_undefined("'" + std::string(obj.dict->is_namespace ? "Namespace" : "dict object") +
                          "' has no attribute '" + name + "'");
  }
  return make_undefined("'" + type_name(obj) + " object' has no attribute '" + name + "'");
}

Value Renderer::get_item(const Value& obj, const Value& key, size_t pos) {
  if (obj.is(Value::Kind::kUndefined)) fail_undefined(obj, pos);
  if (key.is(Value::Kind::kUndefined)) fail_undefined(key, pos);
  if (obj.is(Value::Kind::kDict)) {
    if (key.is(Value::Kind::kString))
      if (const Value* v = obj.dict->find(key.s)) return *v;
    return make_undefined("'dict object' has no attribute " + repr(key));
  }
  if ((obj.is(Value::Kind::kList) || obj.is(Value::Kind::kString)) &&
      (key.is(Value::Kind::kInt) || key.is(Value::Kind::kBool))) {
    std::vector<std::string_view> cps;
    if (obj.is(Value::Kind::kString)) cps = code_points(obj.s);
    const auto n =
        static_cast<int64_t>(obj.is(Value::Kind::kList) ? obj.list->items.size() : cps.size());
    int64_t k = key.as_int();
    if (k < 0) k += n;
    if (k < 0 || k >= n)
      return make_undefined(type_name(obj) + " object has no element " + repr(key));
    if (obj.is(Value::Kind::kList)) return obj.list->items[static_cast<size_t>(k)];
    return make_str(std::string(cps[static_cast<size_t>(k)]));
  }
  if (key.is(Value::Kind::kString)) return get_attr(obj, key.s, pos);
  return make_undefined("'" + type_name(obj) + " object' has no element " + repr(key));
}

Value Renderer::slice(const Expr& e, const ScopePtr& scope) {
  const Value obj = eval(*e.args[0], scope);
  if (obj.is(Value::Kind::kUndefined)) fail_undefined(obj, e.pos);
  if (!obj.is(Value::Kind::kList) && !obj.is(Value::Kind::kString))
    fail("'" + type_name(obj) + "' object is not subscriptable", e.pos);
  std::vector<std::string_view> cps;
  if (obj.is(Value::Kind::kString)) cps = code_points(obj.s);
  const auto n =
      static_cast<int64_t>(obj.is(Value::Kind::kList) ? obj.list->items.size() : cps.size());
  const auto bound = [&](const ExprPtr& x, int64_t fallback) {
    if (!x) return std::optional<int64_t>{};
    const Value v = eval(*x, scope);
    if (v.is(Value::Kind::kNone)) return std::optional<int64_t>{};
    return std::optional<int64_t>{int_arg(&v, fallback, "slice indices", e.pos)};
  };
  const auto start_v = bound(e.args[1], 0), stop_v = bound(e.args[2], 0),
             step_v = bound(e.args[3], 1);
  const int64_t step = step_v.value_or(1);
  if (step == 0) fail("slice step cannot be zero", e.pos);
  // Python's slice.indices: clamp to the sequence, counting negatives from the end.
  const auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + n : *v;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t start = clamp(start_v, step > 0 ? 0 : n - 1),
                stop = clamp(stop_v, step > 0 ? n : -1);
  ValueList items;
  std::string text;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
    if (obj.is(Value::Kind::kList))
      items.push_back(obj.list->items[static_cast<size_t>(k)]);
    else
      text += cps[static_cast<size_t>(k)];
  }
  return obj.is(Value::Kind::kList) ? make_list(std::move(items), obj.list->tuple)
                                    : make_str(std::move(text));
}

Value Renderer::call(const Expr& e, const ScopePtr& scope) {
  const Expr& callee = *e.args[0];
  if (callee.kind == Expr::kAttr) {  // obj.method(...) without building a bound method
    const Value obj = eval(*callee.args[0], scope);
    if (is_method(obj, callee.name)) {
      CallArgs a = eval_args(e, scope);
      return call_method(obj, callee.name, a, e.pos);
    }
    const Value fn = get_attr(obj, callee.name, callee.pos);
    if (fn.is(Value::Kind::kUndefined) && obj.is(Value::Kind::kList))
      fail("the list method '" + callee.name +
               "' is not available (lists are immutable in chat templates)",
           e.pos);
    CallArgs a = eval_args(e, scope);
    return invoke(fn, a, e.pos);
  }
  const Value fn = eval(callee, scope);
  CallArgs a = eval_args(e, scope);
  return invoke(fn, a, e.pos);
}

Value Renderer::invoke(const Value& fn, CallArgs& a, size_t pos) {
  if (fn.is(Value::Kind::kUndefined)) fail_undefined(fn, pos);
  if (!fn.is(Value::Kind::kCallable)) fail("'" + type_name(fn) + "' object is not callable", pos);
  return fn.fn->call(*this, a, pos);
}

Value Renderer::call_method(const Value& obj, const std::string& name, CallArgs& a, size_t pos) {
  const Value* a0 = arg(a, 0, "");
  const Value* a1 = arg(a, 1, "");
  if (obj.is(Value::Kind::kDict)) {
    if (name == "get") {
      if (!a0) fail("get() expects a key", pos);
      const Value* v = a0->is(Value::Kind::kString) ? obj.dict->find(a0->s) : nullptr;
      return v ? *v : a1 ? *a1 : make_none();
    }
    ValueList out;
    for (const auto& [k, v] : obj.dict->entries) {
      if (name == "keys")
        out.push_back(make_str(k));
      else if (name == "values")
        out.push_back(v);
      else
        out.push_back(make_list({make_str(k), v}, true));
    }
    return make_list(std::move(out));
  }
  const std::string& s = obj.s;
  const auto chars = [&](const Value* v) -> const Value* {
    if (!v || v->is(Value::Kind::kNone)) return nullptr;
    str_arg(v, "the characters", pos);
    return v;
  };
  if (name == "strip") return make_str(strip(s, chars(a0), true, true));
  if (name == "lstrip") return make_str(strip(s, chars(a0), true, false));
  if (name == "rstrip") return make_str(strip(s, chars(a0), false, true));
  if (name == "split")
    return make_list(
        split(s, arg(a, 0, "sep"), int_arg(arg(a, 1, "maxsplit"), -1, "maxsplit", pos), pos));
  if (name == "upper") return make_str(to_upper(s));
  if (name == "lower") return make_str(to_lower(s));
  if (name == "title") return make_str(py_title(s));
  if (name == "capitalize") return make_str(capitalize(s));
  if (name == "startswith" || name == "endswith") {
    if (!a0) fail(name + "() takes at least 1 argument", pos);
    ValueList options = a0->is(Value::Kind::kList) ? a0->list->items : ValueList{*a0};
    for (const Value& o : options) {
      const std::string& x = str_arg(&o, (name + "'s argument").c_str(), pos);
      if (x.size() <= s.size() &&
          (name == "startswith" ? s.compare(0, x.size(), x)
                                : s.compare(s.size() - x.size(), x.size(), x)) == 0)
        return make_bool(true);
    }
    return make_bool(false);
  }
  if (name == "replace")
    return make_str(replace(s, str_arg(a0, "replace's old", pos), str_arg(a1, "replace's new", pos),
                            int_arg(arg(a, 2, "count"), -1, "count", pos)));
  if (name == "find") {
    const size_t hit = s.find(str_arg(a0, "find's argument", pos));
    return make_int(
        hit == std::string::npos ? -1 : static_cast<int64_t>(code_points(s.substr(0, hit)).size()));
  }
  // join
  if (!a0) fail("join() takes exactly one argument", pos);
  std::string out;
  bool first = true;
  for (const Value& v : iterate(*a0, pos)) {
    if (!first) out += s;
    first = false;
    out += str_arg(&v, "join's items", pos);
  }
  return make_str(std::move(out));
}

// ---- operators ----

Value Renderer::repeat(const Value& seq, int64_t times, size_t pos) {
  if (times <= 0)
    return seq.is(Value::Kind::kString) ? make_str("") : make_list({}, seq.list->tuple);
  const size_t unit = seq.is(Value::Kind::kString) ? seq.s.size() : seq.list->items.size();
  if (unit && static_cast<uint64_t>(times) > kMaxOutput / unit)
    fail("a repeated sequence grew past 64 MiB", pos);
  if (seq.is(Value::Kind::kString)) {
    std::string out;
    for (int64_t k = 0; k < times; ++k) out += seq.s;
    return make_str(std::move(out));
  }
  ValueList out;
  for (int64_t k = 0; k < times; ++k)
    out.insert(out.end(), seq.list->items.begin(), seq.list->items.end());
  return make_list(std::move(out), seq.list->tuple);
}

Value Renderer::binary(const std::string& op, const Value& l, const Value& r, size_t pos) {
  if (op == "==") return make_bool(equals(l, r));
  if (op == "!=") return make_bool(!equals(l, r));
  if (op == "<") return make_bool(compare(l, r, pos) < 0);
  if (op == "<=") return make_bool(compare(l, r, pos) <= 0);
  if (op == ">") return make_bool(compare(l, r, pos) > 0);
  if (op == ">=") return make_bool(compare(l, r, pos) >= 0);
  if (op == "in") return make_bool(contains(r, l, pos));
  if (op == "not in") return make_bool(!contains(r, l, pos));
  if (op == "~") return make_str(to_str(l, pos) + to_str(r, pos));
  if (l.is(Value::Kind::kUndefined)) fail_undefined(l, pos);
  if (r.is(Value::Kind::kUndefined)) fail_undefined(r, pos);
  const auto unsupported = [&]() -> Value {
    fail("unsupported operand type(s) for " + op + ": '" + type_name(l) + "' and '" + type_name(r) +
             "'",
         pos);
  };
  if (op == "+") {
    if (l.is(Value::Kind::kString) && r.is(Value::Kind::kString)) return make_str(l.s + r.s);
    if (l.is(Value::Kind::kList) && r.is(Value::Kind::kList) && l.list->tuple == r.list->tuple) {
      ValueList items = l.list->items;
      items.insert(items.end(), r.list->items.begin(), r.list->items.end());
      return make_list(std::move(items), l.list->tuple);
    }
  }
  if (op == "*") {
    if ((l.is(Value::Kind::kString) || l.is(Value::Kind::kList)) &&
        (r.is(Value::Kind::kInt) || r.is(Value::Kind::kBool)))
      return repeat(l, r.as_int(), pos);
    if ((r.is(Value::Kind::kString) || r.is(Value::Kind::kList)) &&
        (l.is(Value::Kind::kInt) || l.is(Value::Kind::kBool)))
      return repeat(r, l.as_int(), pos);
  }
  if (op == "%" && l.is(Value::Kind::kString))
    fail("string formatting with '%' is not supported", pos);
  if (!l.numeric() || !r.numeric()) return unsupported();
  const bool floats = l.is(Value::Kind::kFloat) || r.is(Value::Kind::kFloat);
  if (op == "/" || (floats && op != "**")) {
    const double x = l.as_double(), y = r.as_double();
    if (op == "+") return make_float(x + y);
    if (op == "-") return make_float(x - y);
    if (op == "*") return make_float(x * y);
    if (y == 0)
      fail(op == "/" ? "division by zero" : "float modulo or floor division by zero", pos);
    if (op == "/") return make_float(x / y);
    // Python's float divmod: the remainder takes the divisor's sign, the quotient is floored.
    double mod = std::fmod(x, y), div = (x - mod) / y;
    if (mod != 0 && ((y < 0) != (mod < 0))) mod += y, div -= 1.0;
    if (mod == 0) mod = std::copysign(0.0, y);
    if (op == "%") return make_float(mod);
    double floor_div = std::copysign(0.0, x / y);
    if (div != 0) {
      floor_div = std::floor(div);
      if (div - floor_div > 0.5) floor_div += 1.0;
    }
    return make_float(floor_div);
  }
  const int64_t x = l.as_int(), y = r.as_int();
  if (op == "+" || op == "-" || op == "*") {
    int64_t v = 0;
    const bool overflow = op == "+"   ? __builtin_add_overflow(x, y, &v)
                          : op == "-" ? __builtin_sub_overflow(x, y, &v)
                                      : __builtin_mul_overflow(x, y, &v);
    if (overflow) fail("integer overflow", pos);
    return make_int(v);
  }
  if (op == "//" || op == "%") {
    if (y == 0) fail("integer division or modulo by zero", pos);
    if (x == INT64_MIN && y == -1) fail("integer overflow", pos);
    int64_t q = x / y, m = x % y;
    if (m != 0 && ((m < 0) != (y < 0))) --q, m += y;
    return make_int(op == "//" ? q : m);
  }
  if (op == "**") {
    if (floats || y < 0) return make_float(std::pow(l.as_double(), r.as_double()));
    int64_t result = 1;
    for (int64_t k = 0; k < y; ++k)
      if (__builtin_mul_overflow(result, x, &result)) fail("integer overflow", pos);
    return make_int(result);
  }
  return unsupported();
}

// ---- tests ----

bool Renderer::apply_test(const std::string& name, const Value& v, const ValueList& args,
                          size_t pos) {
  using K = Value::Kind;
  const auto need = [&](size_t n) -> const Value& {
    if (args.size() < n) fail("the test '" + name + "' needs an argument", pos);
    return args[n - 1];
  };
  if (name == "defined") return !v.is(K::kUndefined);
  if (name == "undefined") return v.is(K::kUndefined);
  if (name == "none") return v.is(K::kNone);
  if (name == "string") return v.is(K::kString);
  if (name == "number") return v.numeric();
  if (name == "integer") return v.is(K::kInt);
  if (name == "float") return v.is(K::kFloat);
  if (name == "boolean") return v.is(K::kBool);
  if (name == "true") return v.is(K::kBool) && v.b;
  if (name == "false") return v.is(K::kBool) && !v.b;
  if (name == "mapping") return v.is(K::kDict) && !v.dict->is_namespace;
  if (name == "iterable")
    return v.is(K::kUndefined) || v.is(K::kString) || v.is(K::kList) ||
           (v.is(K::kDict) && !v.dict->is_namespace);
  if (name == "sequence")
    return v.is(K::kUndefined) || v.is(K::kString) || v.is(K::kList) ||
           (v.is(K::kDict) && !v.dict->is_namespace);
  if (name == "callable") return v.is(K::kCallable);
  if (name == "lower" || name == "upper") {
    if (!v.is(K::kString)) return false;
    return name == "lower" ? to_lower(v.s) == v.s : to_upper(v.s) == v.s;
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (v.is(K::kUndefined)) fail_undefined(v, pos);
    if (!v.is(K::kInt) && !v.is(K::kBool))
      fail("the test '" + name + "' needs an integer, not " + type_name(v), pos);
    const int64_t x = v.as_int();
    if (name == "odd") return x % 2 != 0;
    if (name == "even") return x % 2 == 0;
    const int64_t by = int_arg(&need(1), 1, "divisibleby's argument", pos);
    if (by == 0) fail("integer division or modulo by zero", pos);
    return x % by == 0;
  }
  if (name == "in") return contains(need(1), v, pos);
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, need(1));
  if (name == "ne" || name == "!=") return !equals(v, need(1));
  if (name == "lt" || name == "<" || name == "lessthan") return compare(v, need(1), pos) < 0;
  if (name == "le" || name == "<=") return compare(v, need(1), pos) <= 0;
  if (name == "gt" || name == ">" || name == "greaterthan") return compare(v, need(1), pos) > 0;
  if (name == "ge" || name == ">=") return compare(v, need(1), pos) >= 0;
  fail("the test '" + name + "' is not supported", pos);
}

// ---- filters ----

// The sort/unique/min/max key: an attribute (dotted path) of each item, lower-cased strings
// unless case_sensitive (jinja2's default is case-insensitive).
Value Renderer::sort_key(const Value& item, const Value* attribute, bool case_sensitive,
                         size_t pos) {
  Value key = item;
  if (attribute && !attribute->is(Value::Kind::kNone)) {
    if (attribute->is(Value::Kind::kInt)) {
      key = get_item(key, *attribute, pos);
    } else {
      const std::string& path = str_arg(attribute, "attribute", pos);
      for (size_t start = 0;;) {
        const size_t dot = path.find('.', start);
        const std::string part = path.substr(start, dot - start);
        const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
          return std::isdigit(static_cast<unsigned char>(c));
        });
        key = digits ? get_item(key, make_int(std::stoll(part)), pos)
                     : get_item(key, make_str(part), pos);
        if (dot == std::string::npos) break;
        start = dot + 1;
      }
    }
  }
  if (!case_sensitive && key.is(Value::Kind::kString)) key.s = to_lower(key.s);
  return key;
}

Value Renderer::apply_filter(const Expr& e, const Value& v, const ScopePtr& scope) {
  CallArgs a = eval_args(e, scope);
  return filter(e.name, v, a, e.pos);
}

Value Renderer::filter(const std::string& name, const Value& v, CallArgs& a, size_t pos) {
  using K = Value::Kind;
  const Value* a0 = arg(a, 0, "");
  const auto flag = [&](size_t index, const char* key, bool fallback) {
    const Value* f = arg(a, index, key);
    return f ? truthy(*f) : fallback;
  };
  if (name == "default" || name == "d") {
    const bool boolean = flag(1, "boolean", false);
    if (v.is(K::kUndefined) || (boolean && !truthy(v)))
      return arg(a, 0, "default_value") ? *arg(a, 0, "default_value") : make_str("");
    return v;
  }
  if (name == "safe") return v;
  if (name == "string") return make_str(to_str(v, pos));
  if (name == "length" || name == "count") return make_int(length(v, pos));
  if (name == "tojson") {
    for (const auto& [k, x] : a.named)
      if (k != "indent") fail("tojson's argument '" + k + "' is not supported", pos);
    const Value* indent = arg(a, 0, "indent");
    std::string out;
    to_json(v,
            indent && !indent->is(K::kNone)
                ? static_cast<int>(
                      std::clamp<int64_t>(int_arg(indent, 0, "tojson's indent", pos), 0, 64))
                : -1,
            0, out, pos);
    return make_str(std::move(out));
  }
  if (name == "list") return make_list(iterate(v, pos));
  if (name == "items") {
    if (v.is(K::kUndefined)) return make_list({});
    if (!v.is(K::kDict) || v.dict->is_namespace)
      fail("the items filter needs a mapping, not " + type_name(v), pos);
    return call_method(v, "items", a, pos);
  }
  if (name == "first" || name == "last") {
    if (name == "last" && v.is(K::kDict)) fail("'last' on a dict is not supported", pos);
    ValueList items = iterate(v, pos);
    if (items.empty()) return make_undefined("No " + name + " item, sequence was empty.");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    ValueList items = iterate(v, pos);
    std::reverse(items.begin(), items.end());
    if (!v.is(K::kString)) return make_list(std::move(items));
    std::string out;
    for (const Value& c : items) out += c.s;
    return make_str(std::move(out));
  }
  if (name == "join") {
    const Value* sep = arg(a, 0, "d");
    const Value* attribute = arg(a, 1, "attribute");
    std::string out;
    bool first = true;
    for (const Value& item : iterate(v, pos)) {
      if (!first) out += sep ? to_str(*sep, pos) : "";
      first = false;
      out += to_str(attribute ? sort_key(item, attribute, true, pos) : item, pos);
      if (out.size() > kMaxOutput) fail("a string grew past 64 MiB", pos);
    }
    return make_str(std::move(out));
  }
  if (name == "int") {
    const int64_t fallback = int_arg(arg(a, 0, "default"), 0, "int's default", pos);
    if (v.is(K::kInt) || v.is(K::kBool)) return make_int(v.as_int());
    if (v.is(K::kFloat))
      return std::isfinite(v.f) && std::fabs(v.f) < 9.2e18 ? make_int(static_cast<int64_t>(v.f))
                                                           : make_int(fallback);
    if (!v.is(K::kString)) return make_int(fallback);
    const std::string t = strip(v.s, nullptr, true, true);
    int64_t i = 0;
    const char* b = t.data() + (!t.empty() && t[0] == '+' ? 1 : 0);
    const auto res = std::from_chars(b, t.data() + t.size(), i);
    if (!t.empty() && res.ec == std::errc() && res.ptr == t.data() + t.size()) return make_int(i);
    char* end = nullptr;
    const double d = std::strtod(t.c_str(), &end);
    if (!t.empty() && end == t.c_str() + t.size() && std::isfinite(d) && std::fabs(d) < 9.2e18)
      return make_int(static_cast<int64_t>(d));
    return make_int(fallback);
  }
  if (name == "float") {
    const Value* dflt = arg(a, 0, "default");
    const double fallback = dflt && dflt->numeric() ? dflt->as_double() : 0.0;
    if (v.numeric()) return make_float(v.as_double());
    if (!v.is(K::kString)) return make_float(fallback);
    const std::string t = strip(v.s, nullptr, true, true);
    char* end = nullptr;
    const double d = std::strtod(t.c_str(), &end);
    return make_float(!t.empty() && end == t.c_str() + t.size() ? d : fallback);
  }
  if (name == "abs") {
    if (v.is(K::kFloat)) return make_float(std::fabs(v.f));
    if (!v.is(K::kInt) && !v.is(K::kBool))
      fail("bad operand type for abs(): '" + type_name(v) + "'", pos);
    if (v.as_int() == INT64_MIN) fail("integer overflow", pos);
    return make_int(std::llabs(v.as_int()));
  }
  if (name == "round") {
    const int64_t precision = int_arg(arg(a, 0, "precision"), 0, "round's precision", pos);
    const Value* method = arg(a, 1, "method");
    const std::string how = method ? str_arg(method, "round's method", pos) : "common";
    if (!v.numeric()) fail("round needs a number, not " + type_name(v), pos);
    if (how == "common") {
      if (!v.is(K::kFloat)) return make_int(v.as_int());
      // printf rounds the exact binary value half-to-even, as Python's round() does.
      char buf[512];
      std::snprintf(buf, sizeof buf, "%.*f",
                    static_cast<int>(std::clamp<int64_t>(precision, 0, 300)), v.f);
      return make_float(
          precision < 0 ? std::nearbyint(v.f / std::pow(10.0, static_cast<double>(-precision))) *
                              std::pow(10.0, static_cast<double>(-precision))
                        : std::strtod(buf, nullptr));
    }
    if (how != "ceil" && how != "floor") fail("round's method must be common, ceil or floor", pos);
    const double scale = std::pow(10.0, static_cast<double>(precision));
    return make_float(
        (how == "ceil" ? std::ceil(v.as_double() * scale) : std::floor(v.as_double() * scale)) /
        scale);
  }
  if (name == "trim") {
    const Value* chars = arg(a, 0, "chars");
    if (chars && !chars->is(K::kNone)) str_arg(chars, "trim's characters", pos);
    return make_str(
        strip(to_str(v, pos), chars && !chars->is(K::kNone) ? chars : nullptr, true, true));
  }
  if (name == "upper") return make_str(to_upper(to_str(v, pos)));
  if (name == "lower") return make_str(to_lower(to_str(v, pos)));
  if (name == "capitalize") return make_str(capitalize(to_str(v, pos)));
  if (name == "title") return make_str(jinja_title(to_str(v, pos)));
  if (name == "escape" || name == "e") {
    std::string out;
    for (char c : to_str(v, pos)) {
      switch (c) {
        case '&':
          out += "&amp;";
          break;
        case '<':
          out += "&lt;";
          break;
        case '>':
          out += "&gt;";
          break;
        case '"':
          out += "&#34;";
          break;
        case '\'':
          out += "&#39;";
          break;
        default:
          out += c;
      }
    }
    return make_str(std::move(out));
  }
  if (name == "replace") {
    const std::string& from = str_arg(arg(a, 0, "old"), "replace's old", pos);
    return make_str(replace(to_str(v, pos), from, str_arg(arg(a, 1, "new"), "replace's new", pos),
                            int_arg(arg(a, 2, "count"), -1, "count", pos)));
  }
  if (name == "sort" || name == "unique" || name == "min" || name == "max") {
    const bool sort = name == "sort";
    const Value* attribute = arg(a, sort ? 2 : 1, "attribute");
    const bool case_sensitive = flag(sort ? 1 : 0, "case_sensitive", false);
    const bool reverse = sort && flag(0, "reverse", false);
    ValueList items = iterate(v, pos);
    if (name == "unique") {
      ValueList kept, keys;
      for (const Value& item : items) {
        Value key = sort_key(item, attribute, case_sensitive, pos);
        if (std::none_of(keys.begin(), keys.end(),
                         [&](const Value& k) { return equals(k, key); })) {
          keys.push_back(std::move(key));
          kept.push_back(item);
        }
      }
      return make_list(std::move(kept));
    }
    ValueList keys;
    for (const Value& item : items) keys.push_back(sort_key(item, attribute, case_sensitive, pos));
    std::vector<size_t> order(items.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      return reverse ? compare(keys[y], keys[x], pos) < 0 : compare(keys[x], keys[y], pos) < 0;
    });
    if (name == "min" || name == "max") {
      if (items.empty()) return make_undefined("No aggregated item, sequence was empty.");
      // Python's min/max keep the first of equal items; the stable order has it first for min.
      size_t best = 0;
      for (size_t k = 1; k < items.size(); ++k)
        if (name == "min" ? compare(keys[k], keys[best], pos) < 0
                          : compare(keys[k], keys[best], pos) > 0)
          best = k;
      return items[best];
    }
    ValueList sorted;
    for (size_t k : order) sorted.push_back(items[k]);
    return make_list(std::move(sorted));
  }
  if (name == "dictsort") {
    if (!v.is(K::kDict) || v.dict->is_namespace)
      fail("dictsort needs a mapping, not " + type_name(v), pos);
    const bool case_sensitive = flag(0, "case_sensitive", false);
    const Value* by = arg(a, 1, "by");
    const bool by_value = by && str_arg(by, "dictsort's by", pos) == "value";
    const bool reverse = flag(2, "reverse", false);
    ValueList pairs = call_method(v, "items", a, pos).list->items;
    std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& x, const Value& y) {
      const Value kx = sort_key(x.list->items[by_value ? 1 : 0], nullptr, case_sensitive, pos);
      const Value ky = sort_key(y.list->items[by_value ? 1 : 0], nullptr, case_sensitive, pos);
      return reverse ? compare(ky, kx, pos) < 0 : compare(kx, ky, pos) < 0;
    });
    return make_list(std::move(pairs));
  }
  if (name == "sum") {
    const Value* attribute = arg(a, 0, "attribute");
    Value total = arg(a, 1, "start") ? *arg(a, 1, "start") : make_int(0);
    for (const Value& item : iterate(v, pos))
      total = binary("+", total, attribute ? sort_key(item, attribute, true, pos) : item, pos);
    return total;
  }
  if (name == "map") {
    ValueList out;
    const Value* attribute = arg(a, 99, "attribute");
    if (attribute) {
      const Value* dflt = arg(a, 99, "default");
      for (const Value& item : iterate(v, pos)) {
        Value x = sort_key(item, attribute, true, pos);
        out.push_back(x.is(K::kUndefined) && dflt ? *dflt : x);
      }
      return make_list(std::move(out));
    }
    const std::string& filter_name = str_arg(a0, "map's filter name", pos);
    if (!known(kFilters, filter_name))
      fail("the filter '" + filter_name + "' is not supported", pos);
    CallArgs rest{ValueList(a.positional.begin() + 1, a.positional.end()), a.named};
    for (const Value& item : iterate(v, pos)) out.push_back(filter(filter_name, item, rest, pos));
    return make_list(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool by_attr = name == "selectattr" || name == "rejectattr";
    const bool keep_when = name == "select" || name == "selectattr";
    const size_t test_at = by_attr ? 1 : 0;
    const Value* test = test_at < a.positional.size() ? &a.positional[test_at] : nullptr;
    if (test && (!test->is(K::kString) || !known(kTests, test->s)))
      fail("the test " + (test->is(K::kString) ? "'" + test->s + "'" : repr(*test)) +
               " is not supported",
           pos);
    const ValueList test_args(a.positional.begin() + static_cast<std::ptrdiff_t>(std::min(
                                                         test_at + 1, a.positional.size())),
                              a.positional.end());
    ValueList out;
    for (const Value& item : iterate(v, pos)) {
      const Value subject = by_attr ? sort_key(item, &a.positional.at(0), true, pos) : item;
      const bool passed = test ? apply_test(test->s, subject, test_args, pos) : truthy(subject);
      if (passed == keep_when) out.push_back(item);
    }
    return make_list(std::move(out));
  }
  fail("the filter '" + name + "' is not supported", pos);
}

// The HF globals and the context as one lookup: context variables first (a context may shadow
// a global, as render(**context) does in jinja2).
Value context_value(const nlohmann::ordered_json& context) {
  if (context.is_null()) return make_dict({});
  if (!context.is_object()) throw Failure{"the context must be a JSON object", 0};
  return from_json(context, 0);
}

}  // namespace keel::data::jinja
