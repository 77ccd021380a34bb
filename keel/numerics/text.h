// Text helpers shared by the layers that suggest a valid name for a mistyped one (config keys,
// module paths).
#pragma once
#include <cstddef>
#include <string_view>

namespace keel {

// Levenshtein distance: the fewest single-character insertions, deletions and substitutions that
// turn `a` into `b` (bytes, not Unicode characters).
size_t edit_distance(std::string_view a, std::string_view b);

}  // namespace keel
