#include "apps/keel/commands.h"

#include <cerrno>
#include <cstdlib>
#include <vector>

namespace keel::cli {

static std::vector<Command>& commands() {
  static std::vector<Command> c;
  return c;
}

void register_commands(CLI::App& app) {
  commands().push_back(add_train(app));
  commands().push_back(add_init_model(app));
  commands().push_back(add_selfcheck(app));
  commands().push_back(add_numerics(app));
  commands().push_back(add_replay(app));
  commands().push_back(add_doctor(app));
  commands().push_back(add_memory(app));
  commands().push_back(add_serve(app));
  commands().push_back(add_tokenize(app));
  commands().push_back(add_generate(app));
  commands().push_back(add_export(app));
  commands().push_back(add_eval(app));
}

std::function<std::string(const std::string&)> seed_check(uint64_t max, const std::string& note) {
  return [max, note](const std::string& v) {
    const bool digits = !v.empty() && v.find_first_not_of("0123456789") == std::string::npos;
    errno = 0;
    const unsigned long long n = digits ? std::strtoull(v.c_str(), nullptr, 10) : 0;
    return digits && errno != ERANGE && n <= max
               ? std::string()
               : v + ": use a whole number from 0 to " + std::to_string(max) + note;
  };
}

int run_selected(CLI::App&) {
  for (auto& c : commands())
    if (c.app->parsed()) return c.run();
  return 2;
}

}  // namespace keel::cli
