#include "keel/serve/run_request.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "keel/io/base_reference.h"
#include "keel/io/trained_model.h"
#include "keel/numerics/input_file.h"
#include "keel/numerics/json_duplicates.h"
#include "keel/numerics/text.h"
#include "keel/serve/http_error.h"

namespace keel::serve {

using json = nlohmann::json;

namespace {
constexpr const char* kSource = "request body";

// The path part of a data.tokenizer spec ("byte" has none).
std::string tokenizer_path(const std::string& spec, std::string* prefix) {
  for (const char* p : {"gpt2:", "hf:"})
    if (spec.rfind(p, 0) == 0) {
      *prefix = p;
      return spec.substr(std::string(p).size());
    }
  prefix->clear();
  return spec == "byte" ? "" : spec;
}

}  // namespace

Config run_config_of_request(const std::string& body, const PathPolicy& paths,
                             const std::string& out_dir) {
  json j;
  std::string duplicate;
  try {
    j = parse_json_noting_duplicates(body, duplicate);
  } catch (const json::parse_error& e) {
    throw HttpError(400, std::string(kSource) + ": not JSON (at byte " + std::to_string(e.byte) +
                             "); send an object with the sections of docs/config.md, e.g. " +
                             "{\"train\": {\"max_steps\": 100}}");
  } catch (const json::exception& e) {  // out_of_range: a number beyond a double
    throw HttpError(400, std::string(kSource) + ": not JSON (" + json_error_detail(e.what()) +
                             "); numbers must fit a double");
  }
  if (!duplicate.empty())
    throw HttpError(400, std::string(kSource) + ": " + visible(duplicate) +
                             " is given more than once (JSON would keep the last without a "
                             "word); give each key once");
  if (j.is_object() && j.contains("run") && j["run"].is_object())
    for (const char* key : {"out_dir", "resume", "overwrite"})
      if (j["run"].contains(key))
        throw HttpError(400,
                        std::string(kSource) + ": run." + key +
                            " is chosen by the server (each run gets a new ROOT/runs/ID; resume " +
                            "with POST /v1/runs/ID/resume); leave it out");
  Config cfg;
  try {
    cfg = load_config_json(j, kSource);
    // What keel train refuses is answered here: train.eval_every without a validation split was
    // created (201), and its run failed as it started.
    check_keys_take_effect(cfg);
  } catch (const Error& e) {
    throw HttpError(400, e.what());
  }
  // The run's progress, events and records are read from its metrics.jsonl: without it a run
  // ended "succeeded" at step 0 with no loss.
  if (!cfg.log.metrics)
    throw HttpError(400, std::string(kSource) +
                             ": log.metrics = false: keel serve follows a run through its "
                             "metrics.jsonl; leave it on");
  if (cfg.dist.backend == "mpi" || cfg.dist.backend == "nccl")
    throw HttpError(400, std::string(kSource) + ": dist.backend = \"" + cfg.dist.backend +
                             "\": keel serve runs each run as one process; use \"single\"");
  confine_run_paths(cfg, paths);
  cfg.run.out_dir = out_dir;
  cfg.run.resume = false;
  return cfg;
}

void confine_run_paths(Config& cfg, const PathPolicy& paths) {
  auto confine = [&](const char* key, std::string& path) {
    if (path.empty()) return;
    try {
      path = paths.confine(key, path);
    } catch (const PathDenied& e) {
      throw HttpError(403, e.what(), permission_error());
    } catch (const Error& e) {
      throw HttpError(400, e.what());
    }
  };
  confine("model.path", cfg.model.path);
  // An adapter run's checkpoint as model.path loads its frozen base from where its config.json
  // says it was trained: that directory is the request's path too.
  if (!cfg.model.path.empty() && io::is_keel_checkpoint(cfg.model.path)) {
    nlohmann::json ref;
    try {
      ref = io::checkpoint_base_reference(cfg.model.path);
    } catch (const Error& e) {
      throw HttpError(400, e.what());
    }
    if (ref.is_object() && ref.contains("resolved") && ref["resolved"].is_string()) {
      std::string base = ref["resolved"].get<std::string>();
      confine("model.path's base (keel_checkpoint.base in its config.json)", base);
    }
  }
  confine("data.path", cfg.data.path);
  confine("data.eval_path", cfg.data.eval_path);
  // Answered here rather than by a run that fails as it starts (201, then "failed"). A pipe is
  // refused too: `keel train` reads one its user writes into (<(zcat ...)), but no one writes
  // into a pipe named in a request, and the run waited for a writer until it was stopped.
  for (const auto& [key, path] :
       {std::pair<const char*, const std::string&>{"data.path", cfg.data.path},
        {"data.eval_path", cfg.data.eval_path}})
    if (!path.empty())
      if (const std::string why = input_file_problem(path, /*pipes=*/false); !why.empty())
        throw HttpError(400, std::string(key) + " = \"" + visible(path) + "\" " + why + "; " + key +
                                 " must name a regular file (keel serve reads no pipes)");
  std::string prefix;
  // (An "hf:" or "gpt2:" with no path never gets here: the config loader refuses it first.)
  std::string tok = tokenizer_path(cfg.data.tokenizer, &prefix);
  if (!tok.empty()) {
    confine("data.tokenizer", tok);
    cfg.data.tokenizer = prefix + tok;
    // A tokenizer is a directory or a file (read whole): not a pipe, as data.path above.
    if (std::error_code ec; !std::filesystem::is_directory(tok, ec))
      if (const std::string why = input_file_problem(tok, /*pipes=*/false);
          !why.empty() && why != "does not exist")  // the loader's error names the forms
        throw HttpError(400, "data.tokenizer = \"" + visible(cfg.data.tokenizer) +
                                 "\": " + visible(tok) + " " + why +
                                 "; name a tokenizer file or directory (keel serve reads no "
                                 "pipes)");
    // An HF tokenizer named by its file: the loader also reads tokenizer_config.json and
    // chat_template.jinja beside it.
    namespace fs = std::filesystem;
    for (const char* name : {"tokenizer_config.json", "chat_template.jinja"}) {
      std::string beside = (fs::path(tok).parent_path() / name).string();
      if (!fs::is_directory(tok) && fs::exists(fs::symlink_status(beside)))
        confine("data.tokenizer", beside);
    }
  }
}

}  // namespace keel::serve
