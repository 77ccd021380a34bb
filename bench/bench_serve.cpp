// keel serve under load, on loopback: the same tiny run trained twice, once with no clients and
// once while STATUS clients poll GET /v1/runs/{id} (each every PERIOD ms, keep-alive) and EVENTS
// clients follow its events stream. Prints the status latency percentiles, what the events
// clients received, and the run's tokens/s in both cases (their ratio is the cost of the load).
// Bounded: the runs have a fixed number of steps and the clients end with the run. Each run also
// reports where the CPU went: the server's own CPU time and the run child's (from the server's
// /proc/PID/stat: utime+stime, and cutime+cstime once the child is reaped), and the clients'
// (this process's getrusage), so a slowdown can be told apart from the machine running out of
// cores.
//
//   OMP_NUM_THREADS=1 ./build/bench/bench_serve [STEPS=600] [STATUS=100] [EVENTS=100] [PERIOD=100]
//   [PAIRS=3]
#include <httplib.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kBenchKey = "keel-bench-key-0123456789";  // >= ApiKeys::kMinKeyChars

std::string slurp(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Server {
  pid_t pid = -1;
  int port = -1;
  Server(const std::string& keel, const std::string& dir) {
    std::ofstream(dir + "/keys") << kBenchKey << "\n";
    const std::string log = dir + "/serve.log";
    pid = fork();
    if (pid == 0) {
      if (!std::freopen(log.c_str(), "w", stdout)) _exit(127);
      execl(keel.c_str(), keel.c_str(), "serve", "--listen", "127.0.0.1:0", "--root",
            (dir + "/root").c_str(), "--api-key-file", (dir + "/keys").c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    static const std::regex kPort(R"(127\.0\.0\.1:(\d+))");
    for (int i = 0; i < 600 && port < 0; ++i) {
      std::smatch m;
      const std::string out = slurp(log);
      if (std::regex_search(out, m, kPort)) port = std::stoi(m[1]);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ~Server() {
    kill(pid, SIGTERM);
    waitpid(pid, nullptr, 0);
  }
};

httplib::Headers auth() { return {{"Authorization", std::string("Bearer ") + kBenchKey}}; }

std::string create(int port, int steps) {
  httplib::Client c("127.0.0.1", port);
  const json cfg = {{"run", {{"threads", 1}}},
                    {"data", {{"num_examples", 4000}, {"eval_examples", 8}}},
                    {"train", {{"max_steps", steps}, {"batch_size", 8}}},
                    {"log", {{"tensorboard", false}, {"every", 100}}}};
  auto r = c.Post("/v1/runs", auth(), cfg.dump(), "application/json");
  if (!r || r->status != 201) {
    std::fprintf(stderr, "create failed: %s\n", r ? r->body.c_str() : "no response");
    std::exit(1);
  }
  return json::parse(r->body)["id"];
}

std::string state_of(int port, const std::string& id) {
  httplib::Client c("127.0.0.1", port);
  auto r = c.Get(("/v1/runs/" + id).c_str(), auth());
  return r && r->status == 200 ? json::parse(r->body)["state"].get<std::string>() : "?";
}

// Mean tokens/s of a finished run's step records (the trainer's own figure, skipping the first
// steps' warm-up).
double mean_tokens_per_s(const std::string& run_dir) {
  std::ifstream f(run_dir + "/metrics.jsonl");
  double sum = 0;
  int n = 0;
  for (std::string line; std::getline(f, line);) {
    const json r = json::parse(line, nullptr, false);
    if (!r.is_object() || !r.contains("grad_norm") || r["step"].get<int>() <= 20) continue;
    sum += r["tokens_per_s"].get<double>();
    ++n;
  }
  return n ? sum / n : 0;
}

// CPU seconds of process `pid` (/proc/PID/stat): its own threads', and its reaped children's.
struct ProcCpu {
  double self = 0, children = 0;
};
ProcCpu proc_cpu(pid_t pid) {
  const std::string s = slurp("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = s.rfind(')');  // the command name may hold spaces
  if (paren == std::string::npos) return {};
  std::istringstream in(s.substr(paren + 2));
  std::vector<std::string> f;  // f[0] is field 3 (state); utime is field 14
  for (std::string w; in >> w;) f.push_back(w);
  if (f.size() < 15) return {};
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  return {(std::stod(f[11]) + std::stod(f[12])) / tick,
          (std::stod(f[13]) + std::stod(f[14])) / tick};
}

// CPU seconds of this process (the clients' threads, and the main thread's state polls).
double own_cpu() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec);
  };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

std::string loadavg() {
  std::string s = slurp("/proc/loadavg");
  return s.substr(0, s.find(' ', s.find(' ', s.find(' ') + 1) + 1));
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 600;
  const int n_status = argc > 2 ? std::atoi(argv[2]) : 100;
  const int n_events = argc > 3 ? std::atoi(argv[3]) : 100;
  const int period_ms = argc > 4 ? std::atoi(argv[4]) : 100;
  const int reps = argc > 5 ? std::atoi(argv[5]) : 3;
  const std::string keel = (fs::read_symlink("/proc/self/exe").parent_path() / "../keel").string();
  const std::string dir =
      (fs::temp_directory_path() / ("keel-bench-serve-" + std::to_string(getpid()))).string();
  fs::create_directories(dir);
  Server srv(keel, dir);
  if (srv.port < 0) {
    std::fprintf(stderr, "keel serve did not start (%s)\n", keel.c_str());
    return 1;
  }
  auto wait_done = [&](const std::string& id) {
    while (state_of(srv.port, id) == "running")
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  };
  struct Load {
    std::vector<double> latency_ms;
    long errors = 0, events = 0, streams_ended = 0;
    // Per run: CPU seconds of the server, of the clients (this process), of the run's child.
    std::vector<double> server_cpu, client_cpu, child_cpu, wall;
  };
  std::printf("load average at start: %s\n", loadavg().c_str());
  // One run of `steps` steps, under `n_status` + `n_events` clients; returns its mean tokens/s.
  auto run_once = [&](int n_status, int n_events, Load* load, double* wall_s) {
    const ProcCpu srv0 = proc_cpu(srv.pid);
    const double own0 = own_cpu();
    const auto t0 = Clock::now();
    const std::string id = create(srv.port, steps);
    std::atomic<bool> done{false};
    std::mutex mu;
    std::vector<std::thread> clients;
    for (int i = 0; i < n_status; ++i)
      clients.emplace_back([&, i] {
        httplib::Client c("127.0.0.1", srv.port);
        c.set_keep_alive(true);
        std::this_thread::sleep_for(
            std::chrono::milliseconds(i * period_ms / std::max(1, n_status)));
        std::vector<double> mine;
        long errors = 0;
        while (!done) {
          const auto a = Clock::now();
          auto r = c.Get(("/v1/runs/" + id).c_str(), auth());
          const auto b = Clock::now();
          if (!r || r->status != 200)
            ++errors;
          else
            mine.push_back(std::chrono::duration<double, std::milli>(b - a).count());
          std::this_thread::sleep_until(a + std::chrono::milliseconds(period_ms));
        }
        std::lock_guard<std::mutex> lock(mu);
        load->latency_ms.insert(load->latency_ms.end(), mine.begin(), mine.end());
        load->errors += errors;
      });
    for (int i = 0; i < n_events; ++i)
      clients.emplace_back([&] {
        httplib::Client c("127.0.0.1", srv.port);
        c.set_read_timeout(std::chrono::seconds(120));
        long mine = 0;
        auto r =
            c.Get(("/v1/runs/" + id + "/events").c_str(), auth(), [&](const char* d, size_t n) {
              for (size_t k = 0; k + 6 <= n; ++k) mine += std::string_view(d + k, 6) == "event:";
              return true;
            });
        std::lock_guard<std::mutex> lock(mu);
        if (!r || r->status != 200)
          ++load->errors;
        else
          ++load->streams_ended;
        load->events += mine;
      });
    wait_done(id);
    *wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
    done = true;
    for (auto& t : clients) t.join();
    const ProcCpu srv1 = proc_cpu(srv.pid);  // the child was reaped before its state changed
    load->server_cpu.push_back(srv1.self - srv0.self);
    load->child_cpu.push_back(srv1.children - srv0.children);
    load->client_cpu.push_back(own_cpu() - own0);
    load->wall.push_back(*wall_s);
    return mean_tokens_per_s(dir + "/root/runs/" + id);
  };
  // Quiet and loaded runs alternate (Q L, L Q, Q L, ...), so a drift in the machine's load
  // (other processes) falls on both alike; the ratio is taken per pair.
  Load load, none;
  std::vector<double> ratios, wall_ratios;
  for (int rep = 0; rep < reps; ++rep) {
    double q, l, qw, lw;
    if (rep % 2 == 0) {
      q = run_once(0, 0, &none, &qw);
      l = run_once(n_status, n_events, &load, &lw);
    } else {
      l = run_once(n_status, n_events, &load, &lw);
      q = run_once(0, 0, &none, &qw);
    }
    ratios.push_back(l / q);
    wall_ratios.push_back(lw / qw);
    std::printf(
        "pair %d: tokens/s %.0f with no clients, %.0f under load (ratio %.3f); run wall %.2f s vs "
        "%.2f s (ratio %.3f)\n",
        rep + 1, q, l, l / q, qw, lw, lw / qw);
    std::printf(
        "  CPU s (cores = CPU s / wall s): loaded: server %.2f (%.2f), clients %.2f (%.2f), run "
        "%.2f (%.2f); no clients: server %.2f (%.2f), run %.2f (%.2f)\n",
        load.server_cpu.back(), load.server_cpu.back() / lw, load.client_cpu.back(),
        load.client_cpu.back() / lw, load.child_cpu.back(), load.child_cpu.back() / lw,
        none.server_cpu.back(), none.server_cpu.back() / qw, none.child_cpu.back(),
        none.child_cpu.back() / qw);
  }
  std::printf(
      "keel serve load bench: %d steps a run, %d pairs; %d status clients (one GET every %d ms "
      "each, keep-alive), %d events clients\n",
      steps, reps, n_status, period_ms, n_events);
  std::printf("status latency: %zu requests, p50 %.2f ms, p99 %.2f ms, max %.2f ms; %ld errors\n",
              load.latency_ms.size(), percentile(load.latency_ms, 0.5),
              percentile(load.latency_ms, 0.99), percentile(load.latency_ms, 1.0), load.errors);
  std::printf("events: %ld streams followed to the end, %.0f events each\n", load.streams_ended,
              load.streams_ended
                  ? static_cast<double>(load.events) / static_cast<double>(load.streams_ended)
                  : 0.0);
  std::printf(
      "run tokens/s under load / with no clients: median ratio %.3f; run wall time (create to "
      "end) under load / with no clients: median ratio %.3f\n",
      percentile(ratios, 0.5), percentile(wall_ratios, 0.5));
  // Cores each side kept busy, over all runs of a kind (CPU seconds / wall seconds).
  auto cores = [](const std::vector<double>& cpu, const std::vector<double>& wall) {
    double c = 0, w = 0;
    for (size_t i = 0; i < cpu.size(); ++i) c += cpu[i], w += wall[i];
    return w > 0 ? c / w : 0.0;
  };
  std::printf(
      "CPU (cores busy, CPU s / wall s over the runs): under load: server %.3f, clients %.3f, run "
      "%.3f; with no clients: server %.3f, run %.3f\n",
      cores(load.server_cpu, load.wall), cores(load.client_cpu, load.wall),
      cores(load.child_cpu, load.wall), cores(none.server_cpu, none.wall),
      cores(none.child_cpu, none.wall));
  std::printf("load average at end: %s\n", loadavg().c_str());
  fs::remove_all(dir);
  return 0;
}
