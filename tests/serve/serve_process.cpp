#include "tests/serve/serve_process.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <regex>
#include <thread>

#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel::test {

using json = nlohmann::json;

namespace {
pid_t spawn_serve(const std::vector<std::string>& args, const std::string& log) {
  std::vector<std::string> argv = {keel_binary(), "serve"};
  if (std::find(args.begin(), args.end(), "--listen") == args.end())
    argv.insert(argv.end(), {"--listen", "127.0.0.1:0"});
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> a;
  for (const std::string& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    if (!std::freopen(log.c_str(), "w", stdout) || !std::freopen(log.c_str(), "a", stderr))
      _exit(127);
    execv(a[0], a.data());
    _exit(127);
  }
  return pid;
}

// waitpid with a bound; false when it did not end in time.
bool wait_bounded(pid_t pid, int* status, std::chrono::milliseconds bound) {
  const auto end = std::chrono::steady_clock::now() + bound;
  while (std::chrono::steady_clock::now() < end) {
    if (waitpid(pid, status, WNOHANG) == pid) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}
}  // namespace

ServeProcess::ServeProcess(const std::vector<std::string>& args) {
  static int n = 0;
  log_ = temp_dir("serve-log") + "/serve" + std::to_string(n++) + ".log";
  pid_ = spawn_serve(args, log_);
  static const std::regex kListening(R"(listening on http://127\.0\.0\.1:(\d+))");
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < end) {
    std::smatch m;
    const std::string out = output();
    if (std::regex_search(out, m, kListening)) {
      port_ = std::stoi(m[1]);
      return;
    }
    int st;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      status_ = st;
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

ServeProcess::~ServeProcess() { stop(SIGTERM); }

std::string ServeProcess::output() const { return slurp(log_); }

int ServeProcess::stop(int sig) {
  if (pid_ > 0) {
    kill(pid_, sig);
    int st = 0;
    if (!wait_bounded(pid_, &st, std::chrono::seconds(60))) {
      ADD_FAILURE() << "keel serve did not stop within 60 s of signal " << sig;
      kill(pid_, SIGKILL);
      waitpid(pid_, &st, 0);
    }
    status_ = st;
    pid_ = -1;
  }
  if (status_ < 0) return -1;
  return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
}

std::pair<int, std::string> serve_refusal(const std::vector<std::string>& args) {
  ServeProcess p(args);
  EXPECT_FALSE(p.started()) << "keel serve started with: " << p.output();
  const std::string out = p.output();
  return {p.stop(), out};
}

httplib::Result Api::get(const std::string& path, httplib::Headers h) const {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(std::chrono::seconds(60));
  if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
  return c.Get(path.c_str(), h);
}

httplib::Result Api::post(const std::string& path, const std::string& body,
                          httplib::Headers h) const {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(std::chrono::seconds(60));
  if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
  return c.Post(path.c_str(), h, body, "application/json");
}

json Api::get_json(const std::string& path) const {
  auto r = get(path);
  if (!r) {
    ADD_FAILURE() << "GET " << path << ": no response";
    return json();
  }
  EXPECT_EQ(r->status, 200) << path << ": " << r->body;
  return json::parse(r->body, nullptr, false);
}

json Api::wait_run(const std::string& id, const std::function<bool(const json&)>& done,
                   std::chrono::seconds timeout) const {
  const auto end = std::chrono::steady_clock::now() + timeout;
  json run;
  while (std::chrono::steady_clock::now() < end) {
    run = get_json("/v1/runs/" + id);
    if (run.is_object() && done(run)) return run;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ADD_FAILURE() << "run " << id << " did not reach the expected state in " << timeout.count()
                << " s; last: " << run.dump();
  return run;
}

json tiny_config(int steps) {
  json cfg = {{"run", {{"threads", 1}}},
              {"data", {{"num_examples", 8000}, {"eval_examples", 8}}},
              {"train", {{"max_steps", steps}, {"batch_size", 32}}},
              {"log", {{"tensorboard", false}, {"every", 50}}}};
  // Batches of 32 rows (8000 examples: 250 a epoch, as 2000 at 8 were): a batch is padded to its
  // longest row (arith's 10 tokens), and 8 rows a step took 1.2 ms, too quick for a stop, a kill or
  // a browser to land mid-run; 32 take about the 6 ms that 8 rows padded to data.seq_len took.
  // Under the sanitizers a step of the default model is 5x slower: a 1-layer, 32-wide model is
  // still slower than release's, so a stop or kill still lands mid-run, and the restart tests,
  // which train 800 steps, take 10 s instead of 32.
  if (std::getenv("KEEL_TEST_SANITIZED"))
    cfg["model"] = {{"n_layer", 1}, {"n_embd", 32}, {"n_head", 2}};
  return cfg;
}

std::vector<double> losses_by_step(const std::string& out_dir) {
  std::map<int64_t, double> by_step;
  for (const json& r : step_records(out_dir))
    if (r.contains("grad_norm")) by_step[r["step"].get<int64_t>()] = r["loss"].get<double>();
  std::vector<double> out;
  for (const auto& [step, loss] : by_step) out.push_back(loss);
  return out;
}

}  // namespace keel::test
