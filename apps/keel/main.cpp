// keel: the command line. One file per subcommand; this file wires them and maps errors to the
// exit codes of DESIGN §6 (0 done, 1 error, 2 bad usage or config, 3 stopped on a non-finite step).
#include <CLI/CLI.hpp>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "apps/keel/commands.h"
#include "keel/numerics/error.h"
#include "keel/tensor/host_memory.h"

int main(int argc, char** argv) {
  // A file past the size limit (ulimit -f) is a write error keel reports, not a silent SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  // A closed pipe likewise (`keel train | head`): SIGPIPE killed a run mid-step, its steps since
  // the last checkpoint lost; as EPIPE the command sees it and stops as it does on any write error.
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"keel: mixed-precision training with trustworthy numerics"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("keel ") + KEEL_VERSION);
  keel::cli::register_commands(app);
  // An unknown command got CLI11's "A subcommand is required", as if none had been given (`keel
  // bisect DIR`, whose work is `keel replay DIR --bisect`): name it and the commands there are.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string given = argv[1];
    std::string names;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      known |= sub->get_name() == given;
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "error: `keel %s` is no command; the commands are %s%s\n", given.c_str(),
                   names.c_str(),
                   given == "bisect" ? " (bisect a capture with keel replay DIR --bisect)"
                                     : " (keel --help says what each does)");
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    const int code = keel::cli::run_selected(app);
    // What was printed is the output of eval, doctor, tokenize, generate: lost to a full disk
    // (> /dev/full) or a closed pipe, it ended in exit 0 as if read.
    const bool flushed = std::fflush(stdout) == 0;
    const int err = flushed ? 0 : errno;  // an earlier failure's errno is gone
    if (!flushed || std::ferror(stdout)) {
      std::fprintf(stderr, "error: %s\n", keel::cli::stdout_lost(err).c_str());
      return code == 0 ? 1 : code;
    }
    return code;
  } catch (const keel::host_memory::OutOfMemory& e) {
    std::fprintf(stderr, "error: %s\n", keel::cli::out_of_memory(app, e).c_str());
    return 1;
  } catch (const keel::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.kind == keel::Error::kUsage ? 2 : 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: %s\n", keel::cli::kOutOfMemory);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
