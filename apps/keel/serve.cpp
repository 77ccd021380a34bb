// `keel serve --listen HOST:PORT --root DIR --api-key-file FILE [--data-root DIR ...]`: the
// training service (keel/serve/server.h). Each run is `keel train` in a child process.
#include "apps/keel/commands.h"
#include "keel/serve/server.h"

namespace keel::cli {

Command add_serve(CLI::App& app) {
  auto opt = std::make_shared<serve::ServeOptions>();
  CLI::App* sub =
      app.add_subcommand("serve", "Run the training service (HTTP/JSON API, dashboard)");
  sub->add_option("--listen", opt->listen, "HOST:PORT to listen on (PORT 0: any free port)")
      ->capture_default_str();
  sub->add_option("--root", opt->root, "directory of the runs and their registry (keel-serve.db)")
      ->required();
  sub->add_option("--api-key-file", opt->api_key_file,
                  "file with the API keys, one per line (Authorization: Bearer KEY)");
  sub->add_flag("--insecure-open", opt->insecure_open,
                "serve without API keys (refused unless --listen is a loopback address)");
  sub->add_option("--data-root", opt->data_roots,
                  "directory that paths in run configs may point into (repeatable)");
  sub->add_option("--max-body-bytes", opt->max_body_bytes, "largest request body (413 above)")
      ->check(whole_check(1024, INT64_MAX))  // -1 wrapped to SIZE_MAX
      ->capture_default_str();
  sub->add_option("--threads", opt->threads,
                  "connections served at once (each events stream holds one)")
      ->capture_default_str()
      ->check(whole_check(4, 4096));
  return {sub, [opt] { return serve::run_server(*opt); }};
}

}  // namespace keel::cli
