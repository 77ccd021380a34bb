// JSON parsing that notes a key given twice: nlohmann::json keeps the last value of a repeated key
// without a word ({"train": {"max_steps": 2, "max_steps": 5}} ran 5 steps), so a reader of user
// input (keel serve's request bodies, JSONL datasets) refuses it, naming where it is.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace keel {

// `text` parsed (throwing as nlohmann::json::parse does), and in `duplicate` the path of the first
// key an object of it holds twice ("train.max_steps", "x[2].b"; "" when none). Levels hold no
// paths (a text may be nested a million deep): the path is built when a key repeats.
nlohmann::json parse_json_noting_duplicates(std::string_view text, std::string& duplicate);

}  // namespace keel
