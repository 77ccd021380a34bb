#include "keel/numerics/json_duplicates.h"

#include <cstdint>
#include <unordered_set>
#include <vector>

namespace keel {

namespace {

// One level of a JSON text being parsed: an object (its keys so far, the latest) or an array (its
// latest element).
struct JsonLevel {
  bool object = true;
  std::unordered_set<std::string> keys;  // an object's keys so far
  std::string key;                       // an object's latest key
  int64_t index = -1;                    // an array's latest element
};

// Where the latest key is ("train.max_steps", "x[2].b").
std::string key_path(const std::vector<JsonLevel>& levels) {
  std::string path;
  for (const JsonLevel& l : levels)
    path += l.object ? (path.empty() ? "" : ".") + l.key : "[" + std::to_string(l.index) + "]";
  return path;
}

}  // namespace

nlohmann::json parse_json_noting_duplicates(std::string_view text, std::string& duplicate) {
  using json = nlohmann::json;
  std::vector<JsonLevel> levels;
  const json::parser_callback_t note = [&](int, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    switch (event) {
      case E::object_start:
      case E::array_start:
        if (!levels.empty() && !levels.back().object) ++levels.back().index;
        levels.push_back({});
        levels.back().object = event == E::object_start;
        break;
      case E::key:
        levels.back().key = parsed.get<std::string>();
        if (!levels.back().keys.insert(levels.back().key).second && duplicate.empty())
          duplicate = key_path(levels);
        break;
      case E::value:
        if (!levels.empty() && !levels.back().object) ++levels.back().index;
        break;
      case E::object_end:
      case E::array_end:
        levels.pop_back();
        break;
    }
    return true;
  };
  return json::parse(text, note);
}

}  // namespace keel
