// Checks of a numeric flag's text (CLI::Option::check), run before CLI11 converts it. CLI11 2.1
// reads integers with strtoll/strtoull in base 0 and never tests ERANGE: 99999999999999999999
// became INT64_MAX, -1 in a uint64 2^64 - 1, 0x10 16 and 010 8, "" 0; its floats took "nan",
// "inf", hex and 1e999 (inf). Past these checks only a plain decimal value within the flag's
// range is converted, and a refusal reads "--flag: VALUE: use ... in [LO, HI]" (exit 2).
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <string>

namespace keel::cli {

using FlagCheck = std::function<std::string(const std::string&)>;

// A whole number in decimal digits (an optional leading '-') from lo to hi; `note` is appended
// to the refusal.
FlagCheck whole_check(int64_t lo, uint64_t hi, const std::string& note = "");

// A finite decimal number (digits, '.', an exponent; no nan, inf or hex) from lo to hi, each
// end excluded when open.
FlagCheck real_check(double lo = std::numeric_limits<double>::lowest(),
                     double hi = std::numeric_limits<double>::max(), bool lo_open = false,
                     bool hi_open = false, const std::string& note = "");

// A flag that sets what config key `key` would (init-model --n-layer is model.n_layer), whose
// range the command checks after parsing: text that would not reach it as typed (12abc, 0x10,
// "", past int64, 1e999) is refused here with the key's range.
FlagCheck config_check(const std::string& key, bool whole);

// The same for a flag whose command checks the range itself: text that would not reach it as
// typed is refused as "VALUE: use " + range.
FlagCheck spelled_check(bool whole, const std::string& range);

// A day written YYYY-MM-DD (--chat-date, as data.chat_date).
FlagCheck chat_date_check();

}  // namespace keel::cli
