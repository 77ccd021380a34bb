// cpp-httplib's Server, with a keep-alive connection that sleeps between its requests.
//
// cpp-httplib (0.11, and later versions alike) waits for a keep-alive connection's next request
// by polling the socket every 10 ms and sleeping 1 ms in between: 90 wake-ups a second for every
// idle connection. 100 status clients that poll every 100 ms are idle 99% of the time, so the
// server woke ~9,000 times a second, on the cores the run trains on, to find nothing. This
// subclass serves each connection the same way (the same request processing, limits and
// timeouts: Server::process_request), but waits for its next request in one poll() on the socket
// and on a stop descriptor, so an idle connection costs nothing until it speaks, closes, or its
// keep-alive time runs out. Requests are read through a buffered stream of our own (httplib's is
// not in its header).
#pragma once
#include <httplib.h>

namespace keel::serve {

// httplib's thread pool, whose threads serve requests at a lower priority than the process's:
// `nice` above the server's own (capped at 19). keel serve shares the machine with the run it
// trains, and the training is what the user is there for: when the cores are short, a status
// request waits a little rather than the run. Children are not forked by these threads
// (supervisor.h), so the run keeps the server's priority.
class RequestThreadPool : public httplib::ThreadPool {
 public:
  RequestThreadPool(size_t threads, int nice_above_process);
  void enqueue(std::function<void()> fn) override;

 private:
  int nice_;  // the threads' nice value
};

class HttpServer : public httplib::Server {
 public:
  HttpServer();
  ~HttpServer() override;
  // Wakes the connections waiting for a request (they close) and stops the server.
  void stop_serving();
  // Makes `res` its connection's last response, for a handler (the pre-routing one included) that
  // answers before the request's body was read: the unread body would otherwise be read as the
  // next request. The connection says "Connection: close", drains what the client still sends
  // for a moment (so that closing with unread bytes does not reset it before it reads the
  // answer), and closes. Called on the thread that serves the request.
  static void close_after_response(httplib::Response& res);

 private:
  bool process_and_close_socket(socket_t sock) override;  // Server's, overridden
  int stop_fd_ = -1;                                      // an eventfd, readable once stopped
};

}  // namespace keel::serve
