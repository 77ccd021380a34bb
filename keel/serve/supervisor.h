// Child processes of keel serve: each run is `keel train CONFIG` in its own process (the very
// binary that serves, /proc/self/exe), so a crash, an out-of-memory kill or a non-finite stop ends
// the child, never the server. A waiter thread per child reports its exit.
//
// Children are forked by one thread of the supervisor's own (made with it, by the thread that
// makes the service), not by the request thread that asked: the server's request threads run at a
// lower priority (server.cpp), a child inherits its forking thread's, and an unprivileged process
// cannot raise it back. The training run keeps the priority the server was started with.
#pragma once
#include <sys/types.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace keel::serve {

// How a child ended (from waitpid's status).
struct ChildExit {
  int code = -1;   // exit code; -1 when it was killed by a signal
  int signal = 0;  // the signal that killed it; 0 when it exited
};

// The start time of process `pid` (field 22 of /proc/PID/stat, clock ticks since boot); "" when no
// such process. A pid and its start time name one process: pids are reused, start times are not.
std::string process_start_time(pid_t pid);
bool process_alive(pid_t pid, const std::string& start_time);

class Supervisor {
 public:
  using OnExit = std::function<void(pid_t, ChildExit)>;
  explicit Supervisor(OnExit on_exit);
  ~Supervisor();  // waits for the waiter threads (the children must have been ended)
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Starts argv[0] with argv, in `cwd`, stdout and stderr appended to the two files, in a process
  // group of its own (a Ctrl-C meant for the server does not reach it twice) and with SIGTERM as
  // its parent-death signal: a server killed with SIGKILL still has its run checkpoint and stop.
  // Throws Error when the process cannot be started.
  pid_t start(const std::vector<std::string>& argv, const std::string& cwd,
              const std::string& stdout_path, const std::string& stderr_path);

 private:
  void on_spawner(const std::function<void()>& f);  // runs f on spawner_, waits for it
  OnExit on_exit_;
  std::mutex mu_;
  std::vector<std::thread> waiters_;
  std::mutex spawn_mu_;
  std::condition_variable spawn_cv_;
  std::deque<std::function<void()>> spawn_jobs_;
  bool spawner_stop_ = false;
  std::thread spawner_;  // forks the children (and, by PR_SET_PDEATHSIG, outlives them)
};

}  // namespace keel::serve
