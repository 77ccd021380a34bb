#include "apps/keel/input_text.h"

#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"

namespace keel::cli {

std::string read_input_text(bool has_text, const std::string& text, const std::string& file,
                            const std::string& flag) {
  if (has_text && !file.empty())
    throw Error("give the text either as the argument or with " + flag + " " + file + ", not both",
                Error::kUsage);
  if (has_text) return text;
  if (!file.empty()) {
    if (const std::string problem = input_file_problem(file); !problem.empty())
      throw Error(flag + " " + file + ": " + problem + "; give a text file", Error::kUsage);
    std::ifstream in(file, std::ios::binary);
    if (!in)
      throw Error(flag + " " + file + ": cannot open the file; check the path", Error::kUsage);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::ostringstream all;
  all << std::cin.rdbuf();
  return all.str();
}

}  // namespace keel::cli
