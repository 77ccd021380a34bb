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
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <new>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/numerics/error.h"

namespace keel::data {
namespace {

// Runaway input: nesting deeper than this (expressions, blocks, macro calls, JSON values) and
// output longer than this are errors, not a stack overflow or an exhausted machine.
constexpr int kMaxDepth = 256;
constexpr size_t kMaxOutput = size_t{64} << 20;
constexpr int64_t kMaxRange = int64_t{1} << 17;

// A failure at byte `pos` of the (newline-normalized) source; render() and the constructor turn it
// into a keel::Error naming the origin, line and column. `refused`: raise_exception's message.
struct Failure {
  std::string message;
  size_t pos;
  bool refused = false;
};
[[noreturn]] void fail(std::string message, size_t pos) { throw Failure{std::move(message), pos}; }

// ---- UTF-8: Python strings count and index code points, so these do too ------------------------

size_t cp_width(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c >> 5) == 6) return 2;
  if ((c >> 4) == 14) return 3;
  if ((c >> 3) == 30) return 4;
  return 1;  // a stray byte counts as one character
}

std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    const size_t w = std::min(cp_width(static_cast<unsigned char>(s[i])), s.size() - i);
    out.push_back(s.substr(i, w));
    i += w;
  }
  return out;
}

uint32_t decode_cp(std::string_view c) {
  const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(c[i])); };
  if (c.size() == 2) return ((b(0) & 0x1f) << 6) | (b(1) & 0x3f);
  if (c.size() == 3) return ((b(0) & 0x0f) << 12) | ((b(1) & 0x3f) << 6) | (b(2) & 0x3f);
  if (c.size() == 4)
    return ((b(0) & 0x07) << 18) | ((b(1) & 0x3f) << 12) | ((b(2) & 0x3f) << 6) | (b(3) & 0x3f);
  return b(0);
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

// Python's str.isspace(): what strip() and split() remove by default.
bool is_py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

char ascii_upper(char c) { return c >= 'a' && c <= 'z' ? static_cast<char>(c - 32) : c; }
char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; }
std::string to_lower(std::string s) {
  for (char& c : s) c = ascii_lower(c);
  return s;
}
std::string to_upper(std::string s) {
  for (char& c : s) c = ascii_upper(c);
  return s;
}
std::string capitalize(const std::string& s) {
  std::string out = to_lower(s);
  if (!out.empty()) out[0] = ascii_upper(out[0]);
  return out;
}

// ---- Values -------------------------------------------------------------------------------------

struct Value;
struct Renderer;
using ValueList = std::vector<Value>;
using NamedValues = std::vector<std::pair<std::string, Value>>;
struct CallArgs {
  ValueList positional;
  NamedValues named;
};
struct Callable {
  std::string name;
  std::function<Value(Renderer&, CallArgs&, size_t pos)> call;
};
struct ListData;
struct DictData;

struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // the string; for an undefined value, what using it should say
  std::shared_ptr<ListData> list;
  std::shared_ptr<DictData> dict;
  std::shared_ptr<Callable> fn;

  bool is(Kind k) const { return kind == k; }
  bool numeric() const { return kind == Kind::kInt || kind == Kind::kBool || kind == Kind::kFloat; }
  double as_double() const { return kind == Kind::kFloat ? f : static_cast<double>(as_int()); }
  int64_t as_int() const { return kind == Kind::kBool ? (b ? 1 : 0) : i; }
};

struct ListData {
  ValueList items;
  bool tuple = false;
};
// Insertion-ordered, as Python's dict. A namespace() is a dict that `set ns.x = ...` may change.
struct DictData {
  NamedValues entries;
  bool is_namespace = false;
  const Value* find(std::string_view key) const {
    for (const auto& [k, v] : entries)
      if (k == key) return &v;
    return nullptr;
  }
  void set(const std::string& key, Value v) {
    for (auto& [k, old] : entries)
      if (k == key) {
        old = std::move(v);
        return;
      }
    entries.emplace_back(key, std::move(v));
  }
};

Value make_undefined(std::string why) {
  Value v;
  v.s = std::move(why);
  return v;
}
Value make_none() {
  Value v;
  v.kind = Value::Kind::kNone;
  return v;
}
Value make_bool(bool b) {
  Value v;
  v.kind = Value::Kind::kBool;
  v.b = b;
  return v;
}
Value make_int(int64_t i) {
  Value v;
  v.kind = Value::Kind::kInt;
  v.i = i;
  return v;
}
Value make_float(double f) {
  Value v;
  v.kind = Value::Kind::kFloat;
  v.f = f;
  return v;
}
Value make_str(std::string s) {
  if (s.size() > kMaxOutput) throw Failure{"a string grew past 64 MiB", 0};
  Value v;
  v.kind = Value::Kind::kString;
  v.s = std::move(s);
  return v;
}
Value make_list(ValueList items, bool tuple = false) {
  Value v;
  v.kind = Value::Kind::kList;
  v.list = std::make_shared<ListData>(ListData{std::move(items), tuple});
  return v;
}
Value make_dict(NamedValues entries, bool is_namespace = false) {
  Value v;
  v.kind = Value::Kind::kDict;
  v.dict = std::make_shared<DictData>(DictData{std::move(entries), is_namespace});
  return v;
}
Value make_callable(std::string name, std::function<Value(Renderer&, CallArgs&, size_t)> call) {
  Value v;
  v.kind = Value::Kind::kCallable;
  v.fn = std::make_shared<Callable>(Callable{std::move(name), std::move(call)});
  return v;
}

// Python's type names, as its error messages use them.
std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return v.list->tuple ? "tuple" : "list";
    case Value::Kind::kDict:
      return v.dict->is_namespace ? "Namespace" : "dict";
    case Value::Kind::kCallable:
      return "function";
  }
  return "?";
}

[[noreturn]] void fail_undefined(const Value& v, size_t pos) {
  fail(v.s.empty() ? "an undefined value was used" : v.s, pos);
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.b;
    case Value::Kind::kInt:
      return v.i != 0;
    case Value::Kind::kFloat:
      return v.f != 0;
    case Value::Kind::kString:
      return !v.s.empty();
    case Value::Kind::kList:
      return !v.list->items.empty();
    case Value::Kind::kDict:
      return v.dict->is_namespace || !v.dict->entries.empty();
    case Value::Kind::kCallable:
      return true;
  }
  return false;
}

// Python's repr(float): the shortest digits that round-trip, fixed notation for exponents -4..15.
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  const std::string sci(buf, res.ptr);
  const size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  const int exponent = std::stoi(sci.substr(e + 1));
  std::string sign;
  if (mantissa[0] == '-') {
    sign = "-";
    mantissa.erase(0, 1);
  }
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  const int decpt = exponent + 1, n = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) return sign + "0." + std::string(-decpt, '0') + digits;
    if (decpt >= n) return sign + digits + std::string(decpt - n, '0') + ".0";
    return sign + digits.substr(0, decpt) + "." + digits.substr(decpt);
  }
  std::string out = sign + digits.substr(0, 1);
  if (n > 1) out += "." + digits.substr(1);
  const int a = std::abs(exponent);
  return out + (exponent < 0 ? "e-" : "e+") + (a < 10 ? "0" : "") + std::to_string(a);
}

// Python's repr(str): single quotes unless the text holds ' and no ", unprintables escaped.
std::string string_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (std::string_view c : code_points(s)) {
    const uint32_t cp = decode_cp(c);
    char hex[16];
    if (cp == '\\' || cp == static_cast<uint32_t>(q)) {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || (cp >= 0x7f && cp <= 0xa0) || cp == 0xad) {
      std::snprintf(hex, sizeof hex, "\\x%02x", cp);
      out += hex;
    } else if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f) ||
               (cp >= 0x205f && cp <= 0x2064) || cp == 0x3000 || cp == 0xfeff) {
      std::snprintf(hex, sizeof hex, "\\u%04x", cp);
      out += hex;
    } else {
      out += c;
    }
  }
  return out + q;
}

void check_depth(int depth, size_t pos) {
  if (depth > kMaxDepth) fail("nesting deeper than 256 levels", pos);
}

// Runaway work: loops nested in loops that write nothing (`range(100000)` inside another) grow no
// output and would run for hours, and a list built of itself twice over 40 times prints, compares
// or serializes 2^40 items. Every loop iteration, macro call, item a filter walks and value
// printed, compared or serialized costs a unit of one render's budget; a chat template spends a
// few per message.
constexpr int64_t kMaxWork = int64_t{1} << 20;
thread_local int64_t t_work_left = kMaxWork;
void charge_work(int64_t units, size_t pos) {
  t_work_left -= units;
  if (t_work_left < 0)
    fail("the template ran more than " + std::to_string(kMaxWork) +
             " loop iterations and filter items (a loop that never ends?)",
         pos);
}

std::string repr(const Value& v, int depth = 0);

// Python's str(): what {{ }} prints.
std::string to_str(const Value& v, size_t pos = 0) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kString:
      return v.s;
    case Value::Kind::kCallable:
      fail("printing the function " + v.fn->name + " is not supported", pos);
    default:
      return repr(v);
  }
}

std::string repr(const Value& v, int depth) {
  check_depth(depth, 0);
  charge_work(1, 0);  // a list built of itself twice over, 40 times, prints 2^40 items
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.b ? "True" : "False";
    case Value::Kind::kInt:
      return std::to_string(v.i);
    case Value::Kind::kFloat:
      return float_repr(v.f);
    case Value::Kind::kString:
      return string_repr(v.s);
    case Value::Kind::kList: {
      const auto& items = v.list->items;
      std::string out = v.list->tuple ? "(" : "[";
      for (size_t k = 0; k < items.size(); ++k) out += (k ? ", " : "") + repr(items[k], depth + 1);
      if (v.list->tuple && items.size() == 1) out += ",";
      return out + (v.list->tuple ? ")" : "]");
    }
    case Value::Kind::kDict: {
      std::string out = v.dict->is_namespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, item] : v.dict->entries) {
        out += (first ? "" : ", ") + string_repr(k) + ": " + repr(item, depth + 1);
        first = false;
      }
      return out + (v.dict->is_namespace ? "}>" : "}");
    }
    case Value::Kind::kCallable:
      return "<function " + v.fn->name + ">";
  }
  return "";
}

void json_string(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char hex[8];
          std::snprintf(hex, sizeof hex, "\\u%04x", c);
          out += hex;
        } else {
          out += static_cast<char>(c);  // ensure_ascii=False: UTF-8 passes through
        }
    }
  }
  out += '"';
}

// json.dumps(v, ensure_ascii=False, indent=indent): ", " and ": " without indent, "," and ": "
// with.
void to_json(const Value& v, int indent, int level, std::string& out, size_t pos) {
  check_depth(level, pos);
  charge_work(1, pos);
  const auto newline = [&](int lvl) {
    if (indent >= 0) out += "\n" + std::string(static_cast<size_t>(indent) * lvl, ' ');
  };
  const char* comma = indent >= 0 ? "," : ", ";
  switch (v.kind) {
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.b ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.i);
      return;
    case Value::Kind::kFloat:
      out += std::isnan(v.f)   ? "NaN"
             : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                               : float_repr(v.f);
      return;
    case Value::Kind::kString:
      json_string(v.s, out);
      return;
    case Value::Kind::kList: {
      const auto& items = v.list->items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += comma;
        newline(level + 1);
        to_json(items[k], indent, level + 1, out, pos);
      }
      newline(level);
      out += ']';
      return;
    }
    case Value::Kind::kDict:
      if (!v.dict->is_namespace) {
        if (v.dict->entries.empty()) {
          out += "{}";
          return;
        }
        out += '{';
        bool first = true;
        for (const auto& [k, item] : v.dict->entries) {
          if (!first) out += comma;
          first = false;
          newline(level + 1);
          json_string(k, out);
          out += ": ";
          to_json(item, indent, level + 1, out, pos);
        }
        newline(level);
        out += '}';
        return;
      }
      [[fallthrough]];
    default:
      fail("tojson: Object of type " + type_name(v) + " is not JSON serializable", pos);
  }
}

Value from_json(const nlohmann::ordered_json& j, int depth) {
  if (depth > kMaxDepth) throw Failure{"the context nests deeper than 256 levels", 0};
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return make_none();
    case nlohmann::json::value_t::boolean:
      return make_bool(j.get<bool>());
    case nlohmann::json::value_t::number_integer:
      return make_int(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return make_float(static_cast<double>(u));
      return make_int(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float:
      return make_float(j.get<double>());
    case nlohmann::json::value_t::string:
      return make_str(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      ValueList items;
      for (const auto& e : j) items.push_back(from_json(e, depth + 1));
      return make_list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      NamedValues entries;
      for (auto it = j.begin(); it != j.end(); ++it)
        entries.emplace_back(it.key(), from_json(it.value(), depth + 1));
      return make_dict(std::move(entries));
    }
    default:
      throw Failure{"the context holds a value JSON text cannot (binary)", 0};
  }
}

bool equals(const Value& a, const Value& b, int depth = 0) {
  check_depth(depth, 0);
  charge_work(1, 0);
  if (a.numeric() && b.numeric()) {
    if (a.is(Value::Kind::kFloat) || b.is(Value::Kind::kFloat))
      return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.s == b.s;
    case Value::Kind::kList: {
      const auto &x = a.list->items, &y = b.list->items;
      if (a.list->tuple != b.list->tuple || x.size() != y.size()) return false;
      for (size_t k = 0; k < x.size(); ++k)
        if (!equals(x[k], y[k], depth + 1)) return false;
      return true;
    }
    case Value::Kind::kDict: {
      if (a.dict->is_namespace || b.dict->is_namespace) return a.dict == b.dict;
      if (a.dict->entries.size() != b.dict->entries.size()) return false;
      for (const auto& [k, v] : a.dict->entries) {
        const Value* other = b.dict->find(k);
        if (!other || !equals(v, *other, depth + 1)) return false;
      }
      return true;
    }
    case Value::Kind::kCallable:
      return a.fn == b.fn;
    default:
      return false;
  }
}

// Python's ordering (<): numbers, strings by code point (= UTF-8 byte order), lists element-wise.
int compare(const Value& a, const Value& b, size_t pos, int depth = 0) {
  check_depth(depth, pos);
  charge_work(1, pos);
  if (a.is(Value::Kind::kUndefined)) fail_undefined(a, pos);
  if (b.is(Value::Kind::kUndefined)) fail_undefined(b, pos);
  if (a.numeric() && b.numeric()) {
    if (a.is(Value::Kind::kFloat) || b.is(Value::Kind::kFloat)) {
      const double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
  }
  if (a.is(Value::Kind::kString) && b.is(Value::Kind::kString))
    return a.s.compare(b.s) < 0 ? -1 : a.s == b.s ? 0 : 1;
  if (a.is(Value::Kind::kList) && b.is(Value::Kind::kList) && a.list->tuple == b.list->tuple) {
    const auto &x = a.list->items, &y = b.list->items;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k)
      if (!equals(x[k], y[k])) return compare(x[k], y[k], pos, depth + 1);
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  fail(
      "'<' is not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'",
      pos);
}

// What `for` iterates: list items, dict keys, string characters; undefined is empty (as jinja2's).
ValueList iterate(const Value& v, size_t pos) {
  charge_work(1, pos);
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      charge_work(static_cast<int64_t>(v.list->items.size()), pos);
      return v.list->items;
    case Value::Kind::kString: {
      charge_work(static_cast<int64_t>(v.s.size()), pos);
      ValueList out;
      for (std::string_view c : code_points(v.s)) out.push_back(make_str(std::string(c)));
      return out;
    }
    case Value::Kind::kDict:
      if (!v.dict->is_namespace) {
        ValueList out;
        for (const auto& [k, item] : v.dict->entries) out.push_back(make_str(k));
        return out;
      }
      [[fallthrough]];
    default:
      fail("'" + type_name(v) + "' object is not iterable", pos);
  }
}

int64_t length(const Value& v, size_t pos) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return static_cast<int64_t>(code_points(v.s).size());
    case Value::Kind::kList:
      return static_cast<int64_t>(v.list->items.size());
    case Value::Kind::kDict:
      if (!v.dict->is_namespace) return static_cast<int64_t>(v.dict->entries.size());
      [[fallthrough]];
    default:
      fail("object of type '" + type_name(v) + "' has no len()", pos);
  }
}

bool contains(const Value& container, const Value& item, size_t pos) {
  switch (container.kind) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kString:
      if (!item.is(Value::Kind::kString))
        fail("'in <string>' requires string as left operand, not " + type_name(item), pos);
      return container.s.find(item.s) != std::string::npos;
    case Value::Kind::kList:
      for (const Value& v : container.list->items)
        if (equals(v, item)) return true;
      return false;
    case Value::Kind::kDict:
      if (!container.dict->is_namespace)
        return item.is(Value::Kind::kString) && container.dict->find(item.s) != nullptr;
      [[fallthrough]];
    default:
      fail("argument of type '" + type_name(container) + "' is not iterable", pos);
  }
}

// ---- Python string methods ----------------------------------------------------------------------

// str.strip/lstrip/rstrip: `chars` empty means whitespace (Python's, Unicode included).
std::string strip(const std::string& s, const Value* chars, bool left, bool right) {
  const std::vector<std::string_view> cps = code_points(s);
  std::vector<std::string_view> set;
  if (chars) set = code_points(chars->s);
  const auto strippable = [&](std::string_view c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : is_py_space(decode_cp(c));
  };
  size_t begin = 0, end = cps.size();
  while (left && begin < end && strippable(cps[begin])) ++begin;
  while (right && end > begin && strippable(cps[end - 1])) --end;
  if (begin == end) return "";
  const size_t from = static_cast<size_t>(cps[begin].data() - s.data());
  const size_t to = static_cast<size_t>(cps[end - 1].data() - s.data()) + cps[end - 1].size();
  return s.substr(from, to - from);
}

ValueList split(const std::string& s, const Value* sep, int64_t maxsplit, size_t pos) {
  ValueList out;
  if (sep && !sep->is(Value::Kind::kNone)) {
    if (!sep->is(Value::Kind::kString)) fail("split: the separator must be a string", pos);
    if (sep->s.empty()) fail("split: empty separator", pos);
    size_t start = 0;
    for (size_t hit; (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) &&
                     (hit = s.find(sep->s, start)) != std::string::npos;
         start = hit + sep->s.size())
      out.push_back(make_str(s.substr(start, hit - start)));
    out.push_back(make_str(s.substr(start)));
    return out;
  }
  // No separator: runs of whitespace split, and leading/trailing whitespace gives no empty parts.
  const std::vector<std::string_view> cps = code_points(s);
  size_t k = 0;
  while (k < cps.size()) {
    while (k < cps.size() && is_py_space(decode_cp(cps[k]))) ++k;
    if (k == cps.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      // the rest, trailing whitespace included, as Python's split(None, n) leaves it
      out.push_back(make_str(s.substr(static_cast<size_t>(cps[k].data() - s.data()))));
      break;
    }
    std::string word;
    while (k < cps.size() && !is_py_space(decode_cp(cps[k]))) word += cps[k++];
    out.push_back(make_str(std::move(word)));
  }
  return out;
}

std::string replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count) {
  std::string out;
  if (from.empty()) {  // Python inserts `to` around every character
    const auto cps = code_points(s);
    int64_t done = 0;
    for (std::string_view c : cps) {
      if (count < 0 || done < count) out += to, ++done;
      out += c;
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  size_t start = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t hit = s.find(from, start);
    if (hit == std::string::npos) break;
    out.append(s, start, hit - start);
    out += to;
    start = hit + from.size();
    if (out.size() > kMaxOutput) fail("a string grew past 64 MiB", 0);
  }
  out.append(s, start);
  return out;
}

// Python's str.title(): a letter after a non-letter is upper-cased, the others lowered. Non-ASCII
// characters count as letters that do not change.
std::string py_title(const std::string& s) {
  std::string out = s;
  bool prev_letter = false;
  for (char& c : out) {
    const unsigned char u = static_cast<unsigned char>(c);
    const bool letter = std::isalpha(u) || u >= 0x80;
    if (std::isalpha(u)) c = prev_letter ? ascii_lower(c) : ascii_upper(c);
    prev_letter = letter;
  }
  return out;
}

// jinja2's title filter: every word after a run of "-", whitespace, "(", "{", "[" or "<" is
// capitalized (first character upper, the rest lower).
std::string jinja_title(const std::string& s) {
  std::string out;
  bool word_start = true;
  for (char c : s) {
    const bool sep = c == '-' || c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' ||
                     c == '\f' || c == '(' || c == '{' || c == '[' || c == '<';
    out += sep ? c : word_start ? ascii_upper(c) : ascii_lower(c);
    word_start = sep;
  }
  return out;
}

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

bool is_name_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

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

  std::vector<Token> run() {
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

 private:
  void emit_text(std::string text, size_t pos) {
    if (!text.empty()) tokens_.push_back({Token::kText, std::move(text), pos});
  }

  static void strip_before_tag(std::string& text, char kind, char mod, bool line_starting) {
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
  size_t after_tag(size_t end, char mod, bool is_block, bool& line_starting) {
    size_t pos = end;
    if (mod == '-') {
      while (pos < src_.size() && is_ws(src_[pos])) ++pos;
    } else if (is_block && mod != '+' && pos < src_.size() && src_[pos] == '\n') {
      ++pos;
    }
    line_starting = pos > end && src_[pos - 1] == '\n';
    return pos;
  }

  bool is_raw_begin(size_t p) const {
    while (p < src_.size() && is_ws(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0 || (p + 3 < src_.size() && is_name_char(src_[p + 3])))
      return false;
    p += 3;
    while (p < src_.size() && is_ws(src_[p])) ++p;
    return src_.compare(p, 2, "%}") == 0 || src_.compare(p, 3, "-%}") == 0;
  }

  size_t lex_raw(size_t open, size_t inner, bool& line_starting) {
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

  size_t lex_tag(size_t open, size_t p, bool is_block, bool& line_starting) {
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

  size_t lex_number(size_t p) {
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
  size_t lex_string(size_t p) {
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

const char* const kFilters[] = {
    "abs",    "capitalize", "count",  "d",          "default", "dictsort",   "e",       "escape",
    "first",  "float",      "int",    "items",      "join",    "last",       "length",  "list",
    "lower",  "map",        "max",    "min",        "reject",  "rejectattr", "replace", "reverse",
    "round",  "safe",       "select", "selectattr", "sort",    "string",     "sum",     "title",
    "tojson", "trim",       "unique", "upper"};
const char* const kTests[] = {"defined",     "undefined",   "none",     "string",   "number",
                              "integer",     "float",       "boolean",  "true",     "false",
                              "mapping",     "iterable",    "sequence", "callable", "odd",
                              "even",        "divisibleby", "in",       "eq",       "equalto",
                              "==",          "ne",          "!=",       "lt",       "<",
                              "lessthan",    "le",          "<=",       "gt",       ">",
                              "greaterthan", "ge",          ">=",       "lower",    "upper"};
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

  Body parse_template() {
    std::string stopped_at;
    Body body = parse_body({}, stopped_at);
    return body;
  }

 private:
  const Token& peek(size_t ahead = 0) const {
    return tokens_[std::min(at_ + ahead, tokens_.size() - 1)];
  }
  const Token& next() { return tokens_[at_ < tokens_.size() - 1 ? at_++ : at_]; }
  bool is_op(const char* op, size_t ahead = 0) const {
    return peek(ahead).kind == Token::kOp && peek(ahead).text == op;
  }
  bool is_name(const char* name, size_t ahead = 0) const {
    return peek(ahead).kind == Token::kName && peek(ahead).text == name;
  }
  static std::string describe(const Token& t) {
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
  void expect_op(const char* op, const char* after) {
    if (!is_op(op))
      fail(std::string("expected '") + op + "' " + after + ", got " + describe(peek()), peek().pos);
    next();
  }
  std::string expect_name(const char* what) {
    if (peek().kind != Token::kName)
      fail(std::string("expected ") + what + ", got " + describe(peek()), peek().pos);
    return next().text;
  }
  void expect_block_end(const std::string& after) {
    if (peek().kind != Token::kBlockEnd)
      fail("expected '%}' after '" + after + "', got " + describe(peek()), peek().pos);
    next();
  }

  struct DepthGuard {
    DepthGuard(int& depth, size_t pos) : depth_(depth) { check_depth(++depth_, pos); }
    ~DepthGuard() { --depth_; }
    int& depth_;
  };

  static std::unique_ptr<Stmt> stmt(Stmt::Kind kind, size_t pos) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->pos = pos;
    return s;
  }
  static ExprPtr expr(Expr::Kind kind, size_t pos, std::string name = "") {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    e->name = std::move(name);
    return e;
  }

  // Statements until a block tag whose keyword is in `stops` (left unconsumed after its keyword,
  // named in `stopped_at`); at the top level (no stops) until the end.
  Body parse_body(const std::vector<std::string>& stops, std::string& stopped_at) {
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
        if (peek().kind != Token::kVarEnd)
          fail("expected '}}', got " + describe(peek()), peek().pos);
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

  std::unique_ptr<Stmt> parse_statement() {
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
    static const char* const kEnds[] = {"endif",    "endfor",    "endset",
                                        "endmacro", "endfilter", "endgeneration",
                                        "elif",     "else",      "endraw"};
    if (known(kEnds, k)) fail("unexpected '" + k + "': no open block it closes", kw.pos);
    fail("the '{% " + k + " %}' statement is not supported", kw.pos);
  }

  std::vector<std::string> parse_targets(const char* what) {
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
  ExprPtr parse_tuple(bool with_condexpr) {
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

  ExprPtr parse_expression(bool with_condexpr) {
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

  ExprPtr binary(Expr::Kind kind, std::string op, ExprPtr l, ExprPtr r, size_t pos) {
    auto e = expr(kind, pos, std::move(op));
    e->args.push_back(std::move(l));
    e->args.push_back(std::move(r));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr l = parse_and();
    while (is_name("or")) {
      const size_t pos = next().pos;
      l = binary(Expr::kOr, "or", std::move(l), parse_and(), pos);
    }
    return l;
  }
  ExprPtr parse_and() {
    ExprPtr l = parse_not();
    while (is_name("and")) {
      const size_t pos = next().pos;
      l = binary(Expr::kAnd, "and", std::move(l), parse_not(), pos);
    }
    return l;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(depth_, peek().pos);
      auto e = expr(Expr::kNot, next().pos);
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr l = parse_math1();
    while (true) {
      const size_t pos = peek().pos;
      std::string op;
      if (peek().kind == Token::kOp &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
           peek().text == "<=" || peek().text == ">" || peek().text == ">=")) {
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
  ExprPtr parse_math1() {
    ExprPtr l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      l = binary(Expr::kBinary, t.text, std::move(l), parse_concat(), t.pos);
    }
    return l;
  }
  ExprPtr parse_concat() {
    ExprPtr l = parse_math2();
    while (is_op("~")) {
      const size_t pos = next().pos;
      l = binary(Expr::kBinary, "~", std::move(l), parse_math2(), pos);
    }
    return l;
  }
  ExprPtr parse_math2() {
    ExprPtr l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      l = binary(Expr::kBinary, t.text, std::move(l), parse_pow(), t.pos);
    }
    return l;
  }
  ExprPtr parse_pow() {
    ExprPtr l = parse_unary(true);
    while (is_op("**")) {
      const size_t pos = next().pos;
      l = binary(Expr::kBinary, "**", std::move(l), parse_unary(true), pos);
    }
    return l;
  }
  ExprPtr parse_unary(bool with_filter) {
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

  ExprPtr parse_primary() {
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

  ExprPtr parse_postfix(ExprPtr e) {
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

  ExprPtr parse_subscript(ExprPtr subject) {
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

  void parse_args(Expr& call) {
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

  ExprPtr parse_call(ExprPtr callee) {
    auto call = expr(Expr::kCall, peek().pos);
    call->args.push_back(std::move(callee));
    parse_args(*call);
    return call;
  }

  ExprPtr parse_filter(ExprPtr subject) {
    const size_t pos = peek().pos;
    std::string name = expect_name("a filter name");
    if (!known(kFilters, name)) fail("the filter '" + name + "' is not supported", pos);
    auto f = expr(Expr::kFilter, pos, name);
    f->args.push_back(std::move(subject));
    if (is_op("(")) parse_args(*f);
    return f;
  }

  ExprPtr parse_filters(ExprPtr e) {
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

  std::vector<Token> tokens_;
  size_t at_ = 0;
  int depth_ = 0;
};

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

  void write(const std::string& s, size_t pos) {
    if (out_->size() + s.size() > kMaxOutput) fail("the rendered text grew past 64 MiB", pos);
    *out_ += s;
  }

  // Renders `body` into a string of its own (block set, macro call, filter block).
  std::string capture(const Body& body, const ScopePtr& scope) {
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

  Flow exec(const Body& body, const ScopePtr& scope) {
    DepthGuard guard(depth_, body.empty() ? 0 : body.front()->pos);
    for (const auto& s : body) {
      const Flow flow = exec(*s, scope);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s, const ScopePtr& scope) {
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
          fail(std::string("'") + (s.kind == Stmt::kBreak ? "break" : "continue") +
                   "' outside a loop",
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

  void assign(const std::vector<std::string>& targets, Value v, const ScopePtr& scope, size_t pos) {
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

  void exec_for(const Stmt& s, const ScopePtr& scope) {
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
      loop.emplace_back("cycle",
                        make_callable("loop.cycle", [k](Renderer&, CallArgs& a, size_t pos) {
                          if (a.positional.empty())
                            fail("loop.cycle needs at least one value", pos);
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

  Value make_macro(const Stmt& s, const ScopePtr& defined_in) {
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

  Value lookup(const std::string& name, const ScopePtr& scope, size_t pos) {
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
    return make_undefined("'" + name + "' is undefined");
  }

  static Value builtin_range(Renderer&, CallArgs& a, size_t pos) {
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
  static std::string format_date(const std::string& today, const std::string& fmt, size_t pos) {
    using namespace std::chrono;
    int y = 0;
    unsigned m = 0, d = 0;
    if (std::sscanf(today.c_str(), "%4d-%2u-%2u", &y, &m, &d) != 3)
      fail("today must be YYYY-MM-DD, got '" + today + "'", pos);
    const year_month_day ymd{year{y}, month{m}, day{d}};
    if (!ymd.ok()) fail("today is not a valid date: '" + today + "'", pos);
    static const char* const kMonths[] = {"January",   "February", "March",    "April",
                                          "May",       "June",     "July",     "August",
                                          "September", "October",  "November", "December"};
    static const char* const kDays[] = {"Sunday",   "Monday", "Tuesday", "Wednesday",
                                        "Thursday", "Friday", "Saturday"};
    const unsigned wd = weekday{sys_days{ymd}}.c_encoding();
    const auto doy =
        (sys_days{ymd} - sys_days{year_month_day{year{y}, January, day{1}}}).count() + 1;
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

  Value eval(const Expr& e, const ScopePtr& scope) {
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
          fail("bad operand type for unary " + std::string(e.kind == Expr::kNeg ? "-" : "+") +
                   ": '" + type_name(v) + "'",
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

  CallArgs eval_args(const Expr& e, const ScopePtr& scope) {
    CallArgs a;
    for (size_t k = 1; k < e.args.size(); ++k) a.positional.push_back(eval(*e.args[k], scope));
    for (const auto& [name, v] : e.kwargs) a.named.emplace_back(name, eval(*v, scope));
    return a;
  }

  static bool is_method(const Value& v, const std::string& name) {
    static const char* const kStr[] = {"strip",    "lstrip", "rstrip", "split", "startswith",
                                       "endswith", "upper",  "lower",  "title", "capitalize",
                                       "replace",  "find",   "join"};
    static const char* const kDict[] = {"items", "keys", "values", "get"};
    if (v.is(Value::Kind::kString)) return known(kStr, name);
    return v.is(Value::Kind::kDict) && !v.dict->is_namespace && known(kDict, name);
  }

  // jinja2's getattr: Python attributes (here: the methods) first, then the item of that name.
  Value get_attr(const Value& obj, const std::string& name, size_t pos) {
    if (obj.is(Value::Kind::kUndefined)) fail_undefined(obj, pos);
    if (is_method(obj, name)) {
      return make_callable(name, [obj, name](Renderer& r, CallArgs& a, size_t p) {
        return r.call_method(obj, name, a, p);
      });
    }
    if (obj.is(Value::Kind::kDict)) {
      if (const Value* v = obj.dict->find(name)) return *v;
      return make_undefined("'" +
                            std::string(obj.dict->is_namespace ? "Namespace" : "dict object") +
                            "' has no attribute '" + name + "'");
    }
    return make_undefined("'" + type_name(obj) + " object' has no attribute '" + name + "'");
  }

  Value get_item(const Value& obj, const Value& key, size_t pos) {
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

  Value slice(const Expr& e, const ScopePtr& scope) {
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

  Value call(const Expr& e, const ScopePtr& scope) {
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

  Value invoke(const Value& fn, CallArgs& a, size_t pos) {
    if (fn.is(Value::Kind::kUndefined)) fail_undefined(fn, pos);
    if (!fn.is(Value::Kind::kCallable)) fail("'" + type_name(fn) + "' object is not callable", pos);
    return fn.fn->call(*this, a, pos);
  }

  Value call_method(const Value& obj, const std::string& name, CallArgs& a, size_t pos) {
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
      return make_str(replace(s, str_arg(a0, "replace's old", pos),
                              str_arg(a1, "replace's new", pos),
                              int_arg(arg(a, 2, "count"), -1, "count", pos)));
    if (name == "find") {
      const size_t hit = s.find(str_arg(a0, "find's argument", pos));
      return make_int(hit == std::string::npos
                          ? -1
                          : static_cast<int64_t>(code_points(s.substr(0, hit)).size()));
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

  Value repeat(const Value& seq, int64_t times, size_t pos) {
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

  Value binary(const std::string& op, const Value& l, const Value& r, size_t pos) {
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
      fail("unsupported operand type(s) for " + op + ": '" + type_name(l) + "' and '" +
               type_name(r) + "'",
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

  bool apply_test(const std::string& name, const Value& v, const ValueList& args, size_t pos) {
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
  Value sort_key(const Value& item, const Value* attribute, bool case_sensitive, size_t pos) {
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

  Value apply_filter(const Expr& e, const Value& v, const ScopePtr& scope) {
    CallArgs a = eval_args(e, scope);
    return filter(e.name, v, a, e.pos);
  }

  Value filter(const std::string& name, const Value& v, CallArgs& a, size_t pos) {
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
      if (how != "ceil" && how != "floor")
        fail("round's method must be common, ceil or floor", pos);
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
      for (const Value& item : items)
        keys.push_back(sort_key(item, attribute, case_sensitive, pos));
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
};

// The HF globals and the context as one lookup: context variables first (a context may shadow
// a global, as render(**context) does in jinja2).
Value context_value(const nlohmann::ordered_json& context) {
  if (context.is_null()) return make_dict({});
  if (!context.is_object()) throw Failure{"the context must be a JSON object", 0};
  return from_json(context, 0);
}

}  // namespace

struct ChatTemplate::Impl {
  std::string origin;
  std::string source;  // newline-normalized, as positions refer to it
  Body body;

  std::string where(size_t pos) const {
    size_t line = 1, line_start = 0;
    for (size_t k = 0; k < pos && k < source.size(); ++k)
      if (source[k] == '\n') ++line, line_start = k + 1;
    const size_t column = code_points(std::string_view(source).substr(
                                          line_start, std::min(pos, source.size()) - line_start))
                              .size() +
                          1;
    return "line " + std::to_string(line) + ", column " + std::to_string(column);
  }
};

ChatTemplate::ChatTemplate(std::string source, std::string origin)
    : impl_(std::make_unique<Impl>()) {
  impl_->origin = std::move(origin);
  try {
    impl_->source = normalize_newlines(source);
    impl_->body = Parser(Lexer(impl_->source).run()).parse_template();
  } catch (const Failure& f) {
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
    const Value variables = context_value(context);
    Renderer renderer(variables, today);
    t_work_left = kMaxWork;
    std::string out;
    renderer.out_ = &out;
    renderer.exec(impl_->body, std::make_shared<Scope>());
    return out;
  } catch (const Failure& f) {
    if (f.refused)
      throw Error(impl_->origin + " refused the conversation: " + f.message, Error::kUsage);
    throw Error(impl_->origin + ": " + impl_->where(f.pos) + ": " + f.message, Error::kUsage);
  } catch (const std::bad_alloc&) {
    throw Error(impl_->origin + ": out of memory while rendering the template", Error::kUsage);
  } catch (const nlohmann::json::exception& e) {
    throw Error(impl_->origin + ": " + e.what(), Error::kUsage);
  }
}

}  // namespace keel::data
