// A `keel serve` started by a test: the built binary on 127.0.0.1 with an ephemeral port, its
// output in files, ended (SIGTERM, then SIGKILL after a bound) when the object goes. Plus the
// HTTP helpers the serve tests share.
#pragma once
#include <httplib.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace keel::test {

class ServeProcess {
 public:
  // `args` after `keel serve --listen 127.0.0.1:0`; waits (bounded) for the "listening" line.
  explicit ServeProcess(const std::vector<std::string>& args);
  ~ServeProcess();
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  bool started() const { return port_ > 0; }
  std::string output() const;  // its stdout and stderr so far
  // Ends it with `sig` and waits (bounded); returns its exit code, or 128 + signal.
  int stop(int sig = 15);

 private:
  pid_t pid_ = -1;
  int port_ = -1;
  int status_ = -1;
  std::string log_;
};

// Runs `keel serve ARGS` expecting it to refuse to start; returns its exit code and output.
std::pair<int, std::string> serve_refusal(const std::vector<std::string>& args);

// The API key the serve tests write to their key files (ApiKeys::kMinKeyChars or longer).
inline constexpr const char* kTestKey = "keel-test-key-0123456789";

// A client of one server, with the key as a Bearer token ("" = no Authorization header).
struct Api {
  int port;
  std::string key;
  httplib::Result get(const std::string& path, httplib::Headers h = {}) const;
  httplib::Result post(const std::string& path, const std::string& body,
                       httplib::Headers h = {}) const;
  nlohmann::json get_json(const std::string& path) const;  // asserts 200
  // Polls GET /v1/runs/ID until `done` holds (bounded by `timeout`); returns the last JSON.
  nlohmann::json wait_run(const std::string& id,
                          const std::function<bool(const nlohmann::json&)>& done,
                          std::chrono::seconds timeout = std::chrono::seconds(120)) const;
};

// A tiny run of the built-in task (a few ms a step): `steps` steps, one thread.
nlohmann::json tiny_config(int steps);

// The loss of every step of OUT_DIR/metrics.jsonl, by step (a step logged twice, by a run that
// resumed from an earlier checkpoint, keeps its last record).
std::vector<double> losses_by_step(const std::string& out_dir);

}  // namespace keel::test
