#include "apps/keel/commands.h"

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

int run_selected(CLI::App&) {
  for (auto& c : commands())
    if (c.app->parsed()) return c.run();
  return 2;
}

}  // namespace keel::cli
