#include "apps/keel/input_text.h"

#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"

namespace keel::cli {

std::unique_ptr<std::istream, void (*)(std::istream*)> open_input_text(bool has_text,
                                                                       const std::string& text,
                                                                       const std::string& file,
                                                                       const std::string& flag) {
  if (has_text && !file.empty())
    throw Error("give the text either as the argument or with " + flag + " " + file + ", not both",
                Error::kUsage);
  auto owned = [](std::istream* s) { delete s; };
  if (has_text) return {new std::istringstream(text), owned};
  if (!file.empty()) {
    if (const std::string problem = input_file_problem(file); !problem.empty())
      throw Error(flag + " " + file + ": " + problem + "; give a text file", Error::kUsage);
    auto in = std::make_unique<std::ifstream>(file, std::ios::binary);
    if (!*in)
      throw Error(flag + " " + file + ": cannot open the file; check the path", Error::kUsage);
    return {in.release(), owned};
  }
  return {&std::cin, [](std::istream*) {}};
}

std::string read_input_text(bool has_text, const std::string& text, const std::string& file,
                            const std::string& flag) {
  if (has_text && file.empty()) return text;
  const auto in = open_input_text(has_text, text, file, flag);
  std::ostringstream all;
  all << in->rdbuf();
  return all.str();
}

}  // namespace keel::cli
