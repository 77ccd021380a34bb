#include "keel/serve/supervisor.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <future>
#include <sstream>

#include "keel/numerics/error.h"

namespace keel::serve {

std::string process_start_time(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!in || !std::getline(in, stat)) return "";
  // "PID (COMM) STATE ..." and COMM may hold spaces and parentheses: fields start after the last
  // ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return "";
  std::istringstream fields(stat.substr(close + 2));
  std::string f;
  for (int i = 3; i <= 22 && fields >> f; ++i)
    if (i == 3 && f == "Z") return "";  // a zombie is gone already
  return f;
}

bool process_alive(pid_t pid, const std::string& start_time) {
  return pid > 0 && !start_time.empty() && process_start_time(pid) == start_time;
}

Supervisor::Supervisor(OnExit on_exit) : on_exit_(std::move(on_exit)) {
  spawner_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(spawn_mu_);
    for (;;) {
      spawn_cv_.wait(lock, [&] { return spawner_stop_ || !spawn_jobs_.empty(); });
      if (spawn_jobs_.empty()) return;
      std::function<void()> job = std::move(spawn_jobs_.front());
      spawn_jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  });
}

void Supervisor::on_spawner(const std::function<void()>& f) {
  std::promise<void> done;
  {
    std::lock_guard<std::mutex> lock(spawn_mu_);
    spawn_jobs_.push_back([&] {
      f();
      done.set_value();
    });
  }
  spawn_cv_.notify_one();
  done.get_future().wait();
}

pid_t Supervisor::start(const std::vector<std::string>& argv, const std::string& cwd,
                        const std::string& stdout_path, const std::string& stderr_path) {
  // Everything the child needs is prepared before fork: between fork and exec a multithreaded
  // process may only make async-signal-safe calls.
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int out = open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const int err = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (out < 0 || err < 0) {
    const std::string why = std::strerror(errno);
    if (out >= 0) close(out);
    if (err >= 0) close(err);
    throw Error("cannot open the run's logs under " + cwd + ": " + why);
  }
  const pid_t parent = getpid();
  std::lock_guard<std::mutex> lock(mu_);
  pid_t pid = -1;
  int fork_errno = 0;
  on_spawner([&] {
    pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(111);  // the server died before prctl
      setpgid(0, 0);
      // The server blocks SIGINT/SIGTERM (a thread sigwaits them) and ignores SIGPIPE; a child
      // inherits both across exec, so reset them.
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      signal(SIGPIPE, SIG_DFL);
      dup2(out, 1);
      dup2(err, 2);
      const int devnull = open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, 0);
      // Not one of the server's descriptors (the listening socket, clients' connections, the
      // registry) may live on in the run: a killed server could not be restarted on its port.
      close_range(3, ~0u, 0);
      if (chdir(cwd.c_str()) != 0) _exit(112);
      execv(args[0], args.data());
      _exit(113);
    }
    fork_errno = errno;
  });
  close(out);
  close(err);
  if (pid < 0)
    throw Error(std::string("cannot start a run: fork failed: ") + std::strerror(fork_errno));
  waiters_.emplace_back([this, pid] {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    ChildExit e;
    if (WIFEXITED(status)) e.code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) e.signal = WTERMSIG(status);
    on_exit_(pid, e);
  });
  return pid;
}

Supervisor::~Supervisor() {
  {
    std::lock_guard<std::mutex> lock(spawn_mu_);
    spawner_stop_ = true;
  }
  spawn_cv_.notify_all();
  spawner_.join();
  std::vector<std::thread> w;
  {
    std::lock_guard<std::mutex> lock(mu_);
    w.swap(waiters_);
  }
  for (std::thread& t : w) t.join();
}

}  // namespace keel::serve
