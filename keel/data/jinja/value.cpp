// The Jinja renderer's values (value.h): truthiness, equality, ordering, repr, str, tojson and
// iteration as Python has them, the UTF-8 helpers and Python's string methods.
#include "keel/data/jinja/value.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "keel/data/utf8.h"

namespace keel::data::jinja {

[[noreturn]] void fail(std::string message, size_t pos) { throw Failure{std::move(message), pos}; }

// ---- UTF-8: Python strings count and index code points, so these do too ------------------------

namespace {

size_t cp_width(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c >> 5) == 6) return 2;
  if ((c >> 4) == 14) return 3;
  if ((c >> 3) == 30) return 4;
  return 1;  // a stray byte counts as one character
}

uint32_t decode_cp(std::string_view c) {
  const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(c[i])); };
  if (c.size() == 2) return ((b(0) & 0x1f) << 6) | (b(1) & 0x3f);
  if (c.size() == 3) return ((b(0) & 0x0f) << 12) | ((b(1) & 0x3f) << 6) | (b(2) & 0x3f);
  if (c.size() == 4)
    return ((b(0) & 0x07) << 18) | ((b(1) & 0x3f) << 12) | ((b(2) & 0x3f) << 6) | (b(3) & 0x3f);
  return b(0);
}

// Python's str.isspace(): what strip() and split() remove by default.
bool is_py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

char ascii_upper(char c) { return c >= 'a' && c <= 'z' ? static_cast<char>(c - 32) : c; }
char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; }

}  // namespace

std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    const size_t w = std::min(cp_width(static_cast<unsigned char>(s[i])), s.size() - i);
    out.push_back(s.substr(i, w));
    i += w;
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cp) { data::append_utf8(cp, &out); }
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
Value make_list(ValueList items, bool tuple) {
  Value v;
  v.kind = Value::Kind::kList;
  v.list = std::make_shared<ListData>(ListData{std::move(items), tuple});
  return v;
}
Value make_dict(NamedValues entries, bool is_namespace) {
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

namespace {

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

void json_string(const std::string& s, std::string& out) {
  // Python's json.dumps(s, ensure_ascii=False) is nlohmann's serializer: the same short escapes
  // for quote, backslash, newline, return, tab, backspace and form feed, \u00xx for the other
  // control characters, UTF-8 as it is. (Bytes that are not UTF-8, which a Python str cannot
  // hold, become U+FFFD.)
  out += nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

void check_depth(int depth, size_t pos) {
  if (depth > kMaxDepth) fail("nesting deeper than 256 levels", pos);
}
thread_local int64_t t_work_left = kMaxWork;
void charge_work(int64_t units, size_t pos) {
  t_work_left -= units;
  if (t_work_left < 0)
    fail("the template ran more than " + std::to_string(kMaxWork) +
             " loop iterations and filter items (a loop that never ends?)",
         pos);
}

// Python's str(): what {{ }} prints.
std::string to_str(const Value& v, size_t pos) {
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

bool equals(const Value& a, const Value& b, int depth) {
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
int compare(const Value& a, const Value& b, size_t pos, int depth) {
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

}  // namespace keel::data::jinja
