// The text a subcommand works on (`keel tokenize`, `keel generate`): the positional argument, the
// file named by a flag, or stdin when neither is given.
#pragma once
#include <istream>
#include <memory>
#include <string>

namespace keel::cli {

// `text` when `has_text`; else the bytes of `file` when it is not empty (an Error naming `flag`
// and the file when it cannot be read); else all of stdin. Both given is a usage error.
std::string read_input_text(bool has_text, const std::string& text, const std::string& file,
                            const std::string& flag);

// The same text as a stream, for a reader that does not hold it whole (stdin is not owned: the
// deleter leaves it open).
std::unique_ptr<std::istream, void (*)(std::istream*)> open_input_text(bool has_text,
                                                                       const std::string& text,
                                                                       const std::string& file,
                                                                       const std::string& flag);

}  // namespace keel::cli
