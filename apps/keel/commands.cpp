#include "apps/keel/commands.h"

#include <cerrno>
#include <cstring>
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
  commands().push_back(add_chat(app));
  commands().push_back(add_export(app));
  commands().push_back(add_eval(app));
}

int run_selected(CLI::App&) {
  for (auto& c : commands())
    if (c.app->parsed()) return c.run();
  return 2;
}

std::string out_of_memory(const CLI::App& app, const Error& e) {
  std::string name;
  for (const CLI::App* sub : app.get_subcommands()) name = sub->get_name();
  if (name == "train" || name == "memory") return e.what();
  const std::string what = e.what();
  const std::string head = what.substr(0, what.find(';'));  // "out of memory allocating ... bytes"
  if (name == "generate")
    return head +
           " while generating: the model and its key/value cache (the prompt's tokens and "
           "--max-new-tokens) need more memory than is available; lower --max-new-tokens, or "
           "free memory (a limit such as ulimit -v counts too)";
  if (name == "init-model")
    return head +
           ": the model's sizes need more memory than is available; lower --n-layer, --n-embd "
           "or --vocab-size (`keel memory` estimates a configuration's memory)";
  return head + " while loading or converting the model (keel " + name +
         "): it needs more memory than is available; free memory or use a machine with more "
         "(a limit such as ulimit -v counts too)";
}

std::string stdout_lost(int err, const std::string& fix) {
  const std::string why = err == EPIPE ? "the pipe was closed (its reader, e.g. head, exited)"
                          : err != 0   ? std::strerror(err)
                                       : "a write failed (a closed pipe or a full disk)";
  return "cannot write standard output: " + why + "; " +
         (fix.empty() ? "what keel printed there is incomplete: send it to a file with space "
                        "(> out.txt) or to a reader that reads it all"
                      : fix);
}

void write_stdout(std::string_view s, const std::function<std::string()>& fix) {
  if (s.empty()) return;
  if (std::fwrite(s.data(), 1, s.size(), stdout) != s.size() || std::fflush(stdout) != 0) {
    const int err = errno;
    std::clearerr(stdout);
    throw Error(stdout_lost(err, fix()));
  }
}

}  // namespace keel::cli
