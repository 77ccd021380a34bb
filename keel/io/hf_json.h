// Reading the fields of Hugging Face JSON files (config.json, adapter_config.json) so that every
// problem is an Error naming the file and the field. Internal to keel/io.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "keel/io/atomic_file.h"
#include "keel/numerics/error.h"
#include "keel/numerics/text.h"

namespace keel::io {

// The JSON of `path`; an Error naming the file when it is not JSON.
inline nlohmann::json read_json(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": invalid JSON: " + json_error_detail(e.what()));
  }
}

// Fields of an object read from `file`; the first of several names present wins (config.json's
// aliases such as n_layer / num_hidden_layers), errors name the first. The file is the user's:
// each error is a usage error (exit 2), as the readers' own refusals are.
struct ConfigReader {
  using json = nlohmann::json;
  const json& j;
  std::string file;

  const json* find(std::initializer_list<const char*> names) const {
    for (const char* n : names)
      if (j.contains(n) && !j[n].is_null()) return &j[n];
    return nullptr;
  }
  int64_t integer(std::initializer_list<const char*> names, std::optional<int64_t> def = {}) const {
    const json* v = find(names);
    if (!v) {
      if (def) return *def;
      throw Error(file + ": missing field '" + *names.begin() + "'", Error::kUsage);
    }
    if (!v->is_number_integer() || v->get<int64_t>() < 0)
      throw Error(file + ": field '" + *names.begin() + "' must be a non-negative integer, got " +
                      v->dump(),
                  Error::kUsage);
    return v->get<int64_t>();
  }
  double number(std::initializer_list<const char*> names, double def) const {
    const json* v = find(names);
    if (!v) return def;
    if (!v->is_number())
      throw Error(file + ": field '" + *names.begin() + "' must be a number, got " + v->dump(),
                  Error::kUsage);
    return v->get<double>();
  }
  std::string string(const char* name, const std::string& def) const {
    const json* v = find({name});
    if (!v) return def;
    if (!v->is_string())
      throw Error(file + ": field '" + name + "' must be a string, got " + v->dump(),
                  Error::kUsage);
    return v->get<std::string>();
  }
  bool boolean(const char* name, bool def) const {
    const json* v = find({name});
    if (!v) return def;
    if (!v->is_boolean())
      throw Error(file + ": field '" + name + "' must be true or false, got " + v->dump(),
                  Error::kUsage);
    return v->get<bool>();
  }
};

}  // namespace keel::io
