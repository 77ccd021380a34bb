// keel serve's connections (serve/http_server.h): a keep-alive connection serves many requests
// (httplib's default closed it after 5), waits asleep for the next one however long the client
// pauses (within the keep-alive time), closes when that time runs out, and a server stopping with
// idle connections open closes them at once instead of waiting out their keep-alive time.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "tests/serve/serve_process.h"
#include "tests/support/check.h"

namespace keel::test {
namespace {

// One TCP connection to the server, spoken to by hand (so the test knows it is one connection).
class RawConnection {
 public:
  explicit RawConnection(int port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    timeval tv{10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~RawConnection() { ::close(fd_); }
  bool connected() const { return connected_; }
  // Sends GET /health and reads one response; "" when the connection was closed.
  std::string health() {
    const std::string req = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    if (::send(fd_, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size()))
      return "";
    std::string got;
    char buf[4096];
    // The body is {"status":"ok"}: read until it has come.
    while (got.find("\"ok\"}") == std::string::npos) {
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return "";
      got.append(buf, static_cast<size_t>(n));
    }
    return got;
  }
  // Whether the server closed the connection (a read returns 0) within `s` seconds.
  bool closed_by_server(int s) {
    timeval tv{s, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char c;
    return ::recv(fd_, &c, 1, 0) == 0;
  }

 private:
  int fd_;
  bool connected_ = false;
};

struct OpenServer {
  std::string dir = temp_dir("serve-http");
  ServeProcess srv{{"--root", dir + "/root", "--insecure-open"}};
};

TEST(ServeHttp, AKeepAliveConnectionServesManyRequestsAcrossPauses) {
  OpenServer s;
  ASSERT_TRUE(s.srv.started()) << s.srv.output();
  RawConnection c(s.srv.port());
  ASSERT_TRUE(c.connected());
  for (int i = 0; i < 30; ++i) {
    const std::string r = c.health();
    ASSERT_NE(r, "") << "the server closed the connection after " << i << " requests";
    EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
    EXPECT_EQ(r.find("Connection: close"), std::string::npos) << "request " << i << ": " << r;
    // Pauses longer than httplib's 10 ms polling step, far shorter than the keep-alive time.
    if (i % 10 == 9) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
}

TEST(ServeHttp, AnIdleConnectionClosesWhenItsKeepAliveTimeRunsOut) {
  OpenServer s;
  ASSERT_TRUE(s.srv.started()) << s.srv.output();
  RawConnection c(s.srv.port());
  ASSERT_NE(c.health(), "");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(c.closed_by_server(30));  // httplib's keep-alive time: 5 s
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4));
}

TEST(ServeHttp, StoppingClosesIdleConnectionsAtOnce) {
  OpenServer s;
  ASSERT_TRUE(s.srv.started()) << s.srv.output();
  std::vector<std::unique_ptr<RawConnection>> idle;
  for (int i = 0; i < 20; ++i) {
    idle.push_back(std::make_unique<RawConnection>(s.srv.port()));
    ASSERT_NE(idle.back()->health(), "");
  }
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(s.srv.stop(SIGTERM), 0) << s.srv.output();
  // Not the 5 s keep-alive time: the connections were woken to close.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
}

}  // namespace
}  // namespace keel::test
