// Reading fields of keel's own JSON files (trainer.json, capture.json) so that a missing field or
// one of the wrong type or range is an Error naming the file and the key, never a raw
// `[json.exception...]`.
#pragma once
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "keel/numerics/error.h"

namespace keel::io {

// nlohmann's message without its "[json.exception.type_error.302] " prefix.
inline std::string json_problem(const nlohmann::json::exception& e) {
  const std::string m = e.what();
  const size_t close = m.find("] ");
  return m.rfind('[', 0) == 0 && close != std::string::npos ? m.substr(close + 2) : m;
}

// A double as keel's JSON files write it: the number, or the string "nan", "inf" or "-inf" (JSON
// has neither; nlohmann would write null, which hides which it was).
inline nlohmann::json json_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

// The integer `key` of object `j` read from `file`, in [lo, hi]: an Error naming both otherwise
// (a float such as 1.5, a string, -5 where counts start at 0, 2^64 - 1).
inline int64_t json_int(const nlohmann::json& j, const char* key, const std::string& file,
                        int64_t lo, int64_t hi, const std::string& fix) {
  const auto it = j.is_object() ? j.find(key) : j.end();
  if (!j.is_object() || it == j.end()) throw Error(file + ": \"" + key + "\" is missing; " + fix);
  const bool in_range =
      it->is_number_unsigned()
          ? it->get<uint64_t>() <= static_cast<uint64_t>(hi) &&
                (lo <= 0 || it->get<uint64_t>() >= static_cast<uint64_t>(lo))
          : it->is_number_integer() && it->get<int64_t>() >= lo && it->get<int64_t>() <= hi;
  if (!in_range)
    throw Error(file + ": \"" + key + "\" = " + it->dump() + " is not an integer in [" +
                std::to_string(lo) + ", " + std::to_string(hi) + "]; " + fix);
  return it->get<int64_t>();
}

inline double json_number(const nlohmann::json& j, const char* key, const std::string& file,
                          const std::string& fix) {
  const auto it = j.is_object() ? j.find(key) : j.end();
  if (!j.is_object() || it == j.end()) throw Error(file + ": \"" + key + "\" is missing; " + fix);
  if (!it->is_number())
    throw Error(file + ": \"" + key + "\" = " + it->dump() + " is not a number; " + fix);
  return it->get<double>();
}

// `key` of object `j` as type T (bool, a string, a vector of them...): an Error naming the file,
// the key and the type expected otherwise.
template <class T>
T json_field(const nlohmann::json& j, const char* key, const std::string& file,
             const std::string& fix) {
  const auto it = j.is_object() ? j.find(key) : j.end();
  if (!j.is_object() || it == j.end()) throw Error(file + ": \"" + key + "\" is missing; " + fix);
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(file + ": \"" + key + "\" = " + it->dump() + ": " + json_problem(e) + "; " + fix);
  }
}

// The inverse of json_float: a number, or "nan", "inf", "-inf".
inline double json_float_of(const nlohmann::json& j, const char* key, const std::string& file,
                            const std::string& fix) {
  const auto it = j.is_object() ? j.find(key) : j.end();
  if (it != j.end() && it->is_string()) {
    if (*it == "nan") return std::nan("");
    if (*it == "inf") return HUGE_VAL;
    if (*it == "-inf") return -HUGE_VAL;
  }
  return json_number(j, key, file, fix);
}

}  // namespace keel::io
