// A graceful stop on SIGTERM or SIGINT (keel serve's stop, a scheduler's preemption, Ctrl-C): the
// handler only sets a flag, and Trainer::fit checks it after each step, saves checkpoints/last and
// returns, so the run can be resumed with run.resume = true. A second SIGINT ends the process at
// once (the default action), so Ctrl-C twice still kills a run that is stuck in a step; SIGTERM may
// be repeated (keel serve sends it again to a run of a server that died).
#pragma once

namespace keel {

// Installs the handlers for SIGTERM and SIGINT (once per process).
void install_stop_handlers();
// Whether a stop was requested (by a signal or request_stop()).
bool stop_requested();
void request_stop();
void clear_stop_request();

}  // namespace keel
