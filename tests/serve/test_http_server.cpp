// keel serve's connections (serve/http_server.h): a keep-alive connection serves many requests
// (httplib's default closed it after 5), waits asleep for the next one however long the client
// pauses (within the keep-alive time), closes when that time runs out, and a server stopping with
// idle connections open closes them at once instead of waiting out their keep-alive time. The
// threads that serve requests run 10 nice levels below the server; the training run it starts
// keeps the server's own priority.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
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

// Field `n` (1-based, as in proc(5)) of /proc/PATH/stat; "" when unreadable.
std::string stat_field(const std::string& path, int n) {
  std::ifstream in("/proc/" + path + "/stat");
  std::string s;
  std::getline(in, s);
  const size_t paren = s.rfind(')');
  if (paren == std::string::npos) return "";
  std::istringstream fields(s.substr(paren + 2));
  std::string f;
  for (int i = 3; i <= n && fields >> f; ++i) {
  }
  return f;
}

TEST(ServeHttp, RequestThreadsRunBelowTheServerAndTheRunKeepsItsPriority) {
  OpenServer s;
  ASSERT_TRUE(s.srv.started()) << s.srv.output();
  Api api{s.srv.port(), ""};
  auto r = api.post("/v1/runs", tiny_config(2000).dump());
  ASSERT_TRUE(r && r->status == 201) << (r ? r->body : "no response");
  const std::string id = nlohmann::json::parse(r->body)["id"];
  const std::string server = std::to_string(s.srv.pid());
  const int server_nice = std::stoi(stat_field(server, 19));  // its main thread's
  // The run: the server's child.
  std::string child;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = e.path().filename().string();
    if (pid.find_first_not_of("0123456789") == std::string::npos && stat_field(pid, 4) == server)
      child = pid;
  }
  ASSERT_NE(child, "") << "no child process of the server";
  EXPECT_EQ(std::stoi(stat_field(child, 19)), server_nice) << "the run's nice value";
  // The thread that served the POST (and every request thread that served one) runs lower.
  int lowered = 0;
  for (const auto& t : std::filesystem::directory_iterator("/proc/" + server + "/task")) {
    const std::string nice = stat_field(server + "/task/" + t.path().filename().string(), 19);
    if (!nice.empty() && std::stoi(nice) == std::min(19, server_nice + 10)) ++lowered;
  }
  EXPECT_GE(lowered, 1) << "no request thread at nice " << server_nice + 10;
  r = api.post("/v1/runs/" + id + "/stop", "");
  ASSERT_TRUE(r);
  api.wait_run(id, [](const nlohmann::json& j) {
    return j["state"] != "stopping" && j["state"] != "running";
  });
}

}  // namespace
}  // namespace keel::test
