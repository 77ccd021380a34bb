#include "keel/serve/http_server.h"

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace keel::serve {

namespace {

int ms_of(time_t sec, time_t usec) { return static_cast<int>(sec * 1000 + usec / 1000); }

// poll() on one descriptor for `events`, retried on EINTR: > 0 ready, 0 timed out, < 0 error.
int poll_one_fd(int fd, short events, int timeout_ms) {
  pollfd p{fd, events, 0};
  int r;
  while ((r = ::poll(&p, 1, timeout_ms)) < 0 && errno == EINTR) {
  }
  return r;
}

void ip_and_port_of(const sockaddr_storage& a, socklen_t len, std::string& ip, int& port) {
  char host[NI_MAXHOST] = {};
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, host, sizeof host, nullptr, 0,
                  NI_NUMERICHOST) == 0)
    ip = host;
  if (a.ss_family == AF_INET)
    port = ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port);
  else if (a.ss_family == AF_INET6)
    port = ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port);
}

// One request's view of a connection, as httplib's SocketStream: reads buffered (httplib reads a
// request's head a byte at a time), reads and writes bounded by the server's timeouts.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(int sock, int read_ms, int write_ms)
      : sock_(sock), read_ms_(read_ms), write_ms_(write_ms) {}

  bool is_readable() const override { return poll_one_fd(sock_, POLLIN, read_ms_) > 0; }
  bool is_writable() const override {
    return poll_one_fd(sock_, POLLOUT, write_ms_) > 0 && peer_open();
  }
  ssize_t read(char* ptr, size_t size) override {
    if (off_ < len_) {
      const size_t n = std::min(size, len_ - off_);
      std::memcpy(ptr, buf_ + off_, n);
      off_ += n;
      return static_cast<ssize_t>(n);
    }
    if (!is_readable()) return -1;
    if (size >= sizeof buf_) return recv_some(ptr, size);
    const ssize_t n = recv_some(buf_, sizeof buf_);
    if (n <= 0) return n;
    off_ = std::min(size, static_cast<size_t>(n));
    len_ = static_cast<size_t>(n);
    std::memcpy(ptr, buf_, off_);
    return static_cast<ssize_t>(off_);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    while ((n = ::send(sock_, ptr, size, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
    }
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getpeername(sock_, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      ip_and_port_of(a, len, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getsockname(sock_, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      ip_and_port_of(a, len, ip, port);
  }
  socket_t socket() const override { return sock_; }
  // Whether bytes the client sent are read but not yet taken: the start of its next request, when
  // it sent that request without waiting for the answer to this one (HTTP/1.1 pipelining).
  bool has_buffered() const { return off_ < len_; }

 private:
  ssize_t recv_some(char* p, size_t n) const {
    ssize_t r;
    while ((r = ::recv(sock_, p, n, 0)) < 0 && errno == EINTR) {
    }
    return r;
  }
  // Whether the client still has the connection open (as httplib's is_socket_alive: nothing to
  // read, or data waiting; a read of 0 bytes means it closed).
  bool peer_open() const {
    if (poll_one_fd(sock_, POLLIN, 0) == 0) return true;
    char c;
    return ::recv(sock_, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
  }
  int sock_, read_ms_, write_ms_;
  char buf_[4096];
  size_t off_ = 0, len_ = 0;
};

// Set by close_after_response on the thread serving a request, read by its connection's loop.
thread_local bool close_after_this_response = false;

// Reads and drops what the client still sends, until it closes or `ms` pass: a socket closed with
// unread bytes sends a reset, which can discard the response before the client has read it.
void drain(int sock, int ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          until - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0 || poll_one_fd(sock, POLLIN, static_cast<int>(left)) <= 0) return;
    ssize_t n;
    while ((n = ::recv(sock, buf, sizeof buf, 0)) < 0 && errno == EINTR) {
    }
    if (n <= 0) return;
  }
}

}  // namespace

RequestThreadPool::RequestThreadPool(size_t threads, int nice_above_process)
    : httplib::ThreadPool(threads),
      nice_(std::min(19, getpriority(PRIO_PROCESS, 0) + nice_above_process)) {}

void RequestThreadPool::enqueue(std::function<void()> fn) {
  // The pool's threads are made by its constructor, out of reach: each lowers itself at its first
  // job (nice is per thread on Linux).
  httplib::ThreadPool::enqueue([nice = nice_, fn = std::move(fn)] {
    thread_local bool lowered = false;
    if (!lowered) {
      setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), nice);
      lowered = true;
    }
    fn();
  });
}

HttpServer::HttpServer() : stop_fd_(eventfd(0, EFD_CLOEXEC)) {}

HttpServer::~HttpServer() {
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

void HttpServer::close_after_response(httplib::Response& res) {
  res.set_header("Connection", "close");
  close_after_this_response = true;
}

void HttpServer::stop_serving() {
  const uint64_t one = 1;
  if (stop_fd_ >= 0 && ::write(stop_fd_, &one, sizeof one) < 0) {
  }
  stop();
}

bool HttpServer::process_and_close_socket(socket_t sock) {
  bool ret = false;
  // One stream for the connection's life: its buffer may hold the next request's first bytes
  // (read with this one's), which a stream made for each request dropped, and a client that sent
  // two requests at once waited for the second answer until the keep-alive time ran out.
  ConnectionStream strm(sock, ms_of(read_timeout_sec_, read_timeout_usec_),
                        ms_of(write_timeout_sec_, write_timeout_usec_));
  for (size_t count = keep_alive_max_count_; count > 0 && svr_sock_ != INVALID_SOCKET; --count) {
    // Asleep until the client sends its next request, closes, the keep-alive time runs out, or
    // the server stops; not when that request is read already.
    pollfd p[2] = {{sock, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    const int timeout_ms =
        strm.has_buffered() ? 0 : static_cast<int>(keep_alive_timeout_sec_ * 1000);
    int r;
    while ((r = ::poll(p, stop_fd_ >= 0 ? 2 : 1, timeout_ms)) < 0 && errno == EINTR) {
    }
    if (p[1].revents & POLLIN) break;
    if (!strm.has_buffered() && (r <= 0 || !(p[0].revents & (POLLIN | POLLHUP | POLLERR)))) break;
    bool closed = false;
    close_after_this_response = false;
    ret = process_request(strm, /*close_connection=*/count == 1, closed, nullptr);
    if (close_after_this_response) {
      close_after_this_response = false;
      ::shutdown(sock, SHUT_WR);  // the response is all the client gets: say so (FIN) at once
      drain(sock, 1000);
      break;
    }
    if (!ret || closed) break;
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ret;
}

}  // namespace keel::serve
