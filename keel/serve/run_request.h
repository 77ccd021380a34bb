// The body of POST /v1/runs: a JSON object with the sections and keys of docs/config.md. It is
// read by the same loader as `keel train` (load_config_json), so a bad key or value gets the same
// message; then the server's own rules: it chooses run.out_dir and run.resume, runs one process,
// and every path must lie inside its data roots (path_policy.h).
#pragma once
#include <string>

#include "keel/serve/path_policy.h"
#include "keel/train/config.h"

namespace keel::serve {

// The config a run is started with (throws HttpError: 400 bad JSON or config, 403 a path outside
// the roots). `out_dir` is where the server puts the run.
Config run_config_of_request(const std::string& body, const PathPolicy& paths,
                             const std::string& out_dir);

// Confines the config's paths (model.path, data.path, data.eval_path, the tokenizer's) to the
// roots, making them canonical: HttpError 403 outside, 400 missing. A resume asks again (a
// directory may have been replaced by a link out of the roots since the run was created).
void confine_run_paths(Config& cfg, const PathPolicy& paths);

}  // namespace keel::serve
