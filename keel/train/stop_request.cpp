#include "keel/train/stop_request.h"

#include <atomic>
#include <csignal>

namespace keel {

namespace {
std::atomic<bool> g_stop{false};
static_assert(std::atomic<bool>::is_always_lock_free, "the signal handler needs a lock-free flag");

extern "C" void on_stop_signal(int sig) {
  // A second Ctrl-C means now: the default action. SIGTERM repeated (a supervisor making sure)
  // keeps asking for the same graceful stop.
  if (g_stop.exchange(true) && sig == SIGINT) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}
}  // namespace

void install_stop_handlers() {
  struct sigaction sa = {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

bool stop_requested() { return g_stop.load(std::memory_order_relaxed); }
void request_stop() { g_stop.store(true); }
void clear_stop_request() { g_stop.store(false); }

}  // namespace keel
