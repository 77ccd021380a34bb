// The Jinja renderer's values: Value and its kinds, Python's semantics for them, UTF-8 and Python's
// string methods, the Failure type and the limits of one parse or render.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace keel::data::jinja {

// Runaway input: nesting deeper than this (expressions, blocks, macro calls, JSON values) and
// output longer than this are errors, not a stack overflow or an exhausted machine.
constexpr int kMaxDepth = 256;
constexpr size_t kMaxOutput = size_t{64} << 20;

// A failure at byte `pos` of the (newline-normalized) source; render() and the constructor turn it
// into a keel::Error naming the origin, line and column. `refused`: raise_exception's message.
struct Failure {
  std::string message;
  size_t pos;
  bool refused = false;
};

[[noreturn]] void fail(std::string message, size_t pos);

// ---- UTF-8: Python strings count and index code points, so these do too ------------------------

std::vector<std::string_view> code_points(std::string_view s);
void append_utf8(std::string& out, uint32_t cp);
std::string to_lower(std::string s);
std::string to_upper(std::string s);
std::string capitalize(const std::string& s);

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

Value make_undefined(std::string why);
Value make_none();
Value make_bool(bool b);
Value make_int(int64_t i);
Value make_float(double f);
Value make_str(std::string s);
Value make_list(ValueList items, bool tuple = false);
Value make_dict(NamedValues entries, bool is_namespace = false);
Value make_callable(std::string name, std::function<Value(Renderer&, CallArgs&, size_t)> call);
std::string type_name(const Value& v);
[[noreturn]] void fail_undefined(const Value& v, size_t pos);
bool truthy(const Value& v);

void check_depth(int depth, size_t pos);

// Runaway work: loops nested in loops that write nothing (`range(100000)` inside another) grow no
// output and would run for hours, and a list built of itself twice over 40 times prints, compares
// or serializes 2^40 items. Every loop iteration, macro call, item a filter walks and value
// printed, compared or serialized costs a unit of one render's budget; a chat template spends a
// few per message.
constexpr int64_t kMaxWork = int64_t{1} << 20;
extern thread_local int64_t t_work_left;

void charge_work(int64_t units, size_t pos);

std::string repr(const Value& v, int depth = 0);

std::string to_str(const Value& v, size_t pos = 0);

void to_json(const Value& v, int indent, int level, std::string& out, size_t pos);
Value from_json(const nlohmann::ordered_json& j, int depth);
bool equals(const Value& a, const Value& b, int depth = 0);
int compare(const Value& a, const Value& b, size_t pos, int depth = 0);
ValueList iterate(const Value& v, size_t pos);
int64_t length(const Value& v, size_t pos);
bool contains(const Value& container, const Value& item, size_t pos);

// ---- Python string methods ----------------------------------------------------------------------

std::string strip(const std::string& s, const Value* chars, bool left, bool right);
ValueList split(const std::string& s, const Value* sep, int64_t maxsplit, size_t pos);
std::string replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count);
std::string py_title(const std::string& s);
std::string jinja_title(const std::string& s);

}  // namespace keel::data::jinja
