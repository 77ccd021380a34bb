// Text helpers shared by the layers that suggest a valid name for a mistyped one (config keys,
// module paths).
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace keel {

// Levenshtein distance: the fewest single-character insertions, deletions and substitutions that
// turn `a` into `b` (bytes, not Unicode characters).
size_t edit_distance(std::string_view a, std::string_view b);

// An nlohmann::json exception's text without its "[json.exception.parse_error.101] " prefix, for a
// message that names the user's file first ("parse error at line 3, column 7: ...", "number
// overflow parsing '1e400'"). A parse can throw out_of_range (406: a number beyond a double) as
// well as parse_error, so a reader catches json::exception, the base of both. The token a parse
// error quotes ("last read: '...'") is cut to its last 40 bytes.
std::string json_error_detail(std::string_view what);

// `s` with its control bytes spelled out (\x00 ... \x1f, \x7f), for a message that quotes user
// input: an Error's text is a C string, so a NUL cut it short ("unknown key train.max_steps" for
// the key "train.max_steps\0x" named a valid key).
std::string visible(std::string_view s);

// `s` as one word of a POSIX shell command that a message suggests ("replay with: keel replay
// DIR"): as it is when it holds only characters no shell treats specially, else in single quotes
// (a ' inside written '\''). An out_dir with a space made the command two words.
std::string shell_word(std::string_view s);

// "1 step", "3 steps": a count and its noun, the plural `nouns` (default: `noun` + "s") unless n
// is 1. A one-step run said "1 steps" in its header and its done line.
std::string count_of(long long n, std::string_view noun, std::string_view nouns = {});

}  // namespace keel
