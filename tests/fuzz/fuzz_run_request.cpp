// The body of the service's POST /v1/runs (keel/serve/run_request): read by the config loader,
// its paths confined to the server's data root, and the accepted config written as the run's
// run.toml and read back as its `keel train` child does. A refusal is an HttpError of 400 or 403
// with a message; an accepted config that its child cannot read back is a finding too.
#include "keel/serve/http_error.h"
#include "keel/serve/run_request.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const keel::serve::PathPolicy paths({keel::fuzz::work_dir()});
  const std::string body(reinterpret_cast<const char*>(data), size);
  keel::Config cfg;
  try {
    cfg = keel::serve::run_config_of_request(body, paths, keel::fuzz::work_dir() + "/runs/r1");
  } catch (const keel::serve::HttpError& e) {
    if ((e.status != 400 && e.status != 403) || std::string(e.what()).empty()) __builtin_trap();
    return 0;
  }
  keel::load_config(keel::fuzz::write("run.toml", keel::config_to_toml(cfg)));
  return 0;
}
