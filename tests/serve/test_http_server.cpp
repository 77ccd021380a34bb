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
#include <tuple>

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
  // Sends `bytes` as they are and reads until `answers` responses to GET /health have come (each
  // ends with its body, {"status":"ok"}); returns what came, short when the connection closed or
  // the read timed out.
  std::string exchange(const std::string& bytes, size_t answers) {
    if (::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(bytes.size()))
      return "";
    std::string got;
    char buf[4096];
    auto count = [&] {
      size_t n = 0;
      for (size_t at = 0; (at = got.find("\"ok\"}", at)) != std::string::npos; ++at) ++n;
      return n;
    };
    while (count() < answers) {
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) break;
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

// HTTP/1.1 pipelining: requests sent together, before any answer, are each answered, in order.
// The second was read into the first one's buffer and dropped with it: the client waited for its
// answer until the keep-alive time (5 s) closed the connection.
TEST(ServeHttp, RequestsSentTogetherAreEachAnswered) {
  OpenServer s;
  ASSERT_TRUE(s.srv.started()) << s.srv.output();
  RawConnection c(s.srv.port());
  ASSERT_TRUE(c.connected());
  const std::string health = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  const auto t0 = std::chrono::steady_clock::now();
  const std::string got = c.exchange(health + health + health, 3);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  size_t answers = 0;
  for (size_t at = 0; (at = got.find("HTTP/1.1 200 OK", at)) != std::string::npos; ++at) ++answers;
  EXPECT_EQ(answers, 3u) << got;
  // The connection goes on as before.
  EXPECT_EQ(c.health().rfind("HTTP/1.1 200", 0), 0u);
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

// One request written by hand on a fresh connection; its response read until the server closes
// the connection or the Content-Length of the body has come, within `timeout_s` (the socket's
// own timeout: a server that waits for more never hangs the test). `seconds`: how long the
// response took.
struct RawAnswer {
  std::string text;
  double seconds = 0;
  bool closed = false;  // the server closed the connection after it
};
RawAnswer raw_exchange(int port, const std::string& request, int timeout_s = 10) {
  RawAnswer a;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const auto t0 = std::chrono::steady_clock::now();
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(request.size())) {
    char buf[4096];
    for (;;) {
      const size_t head_end = a.text.find("\r\n\r\n");
      const size_t length_at = a.text.find("Content-Length: ");
      if (head_end != std::string::npos && length_at != std::string::npos && length_at < head_end &&
          a.text.size() >= head_end + 4 + std::stoul(a.text.substr(length_at + 16))) {
        // The whole response: does the server close the connection after it (at once; a
        // keep-alive connection stays open for 5 s)?
        a.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        timeval second{1, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &second, sizeof second);
        a.closed = ::recv(fd, buf, sizeof buf, 0) == 0;
        ::close(fd);
        return a;
      }
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) {
        a.closed = n == 0;
        break;
      }
      a.text.append(buf, static_cast<size_t>(n));
    }
  }
  a.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  return a;
}

// A path that exists, asked with a method it does not take, was 404 as if it did not exist: it
// is 405 with the methods it takes (Allow) and the usual JSON error; an unknown path stays 404.
TEST(ServeHttp, AMethodAPathDoesNotTakeIs405WithAllow) {
  const std::string dir = temp_dir("serve-405");
  std::ofstream(dir + "/keys") << kTestKey << "\n";
  ServeProcess srv({"--root", dir + "/root", "--api-key-file", dir + "/keys"});
  ASSERT_TRUE(srv.started()) << srv.output();
  httplib::Client c("127.0.0.1", srv.port());
  c.set_read_timeout(std::chrono::seconds(10));
  const httplib::Headers auth = {{"Authorization", std::string("Bearer ") + kTestKey}};
  struct Case {
    const char* method;
    const char* path;
    const char* allow;
  };
  for (const Case& k : {Case{"DELETE", "/v1/runs", "GET, HEAD, POST"},
                        Case{"PUT", "/v1/runs/run-000000000000", "GET, HEAD"},
                        Case{"DELETE", "/v1/runs/run-000000000000", "GET, HEAD"},
                        Case{"PATCH", "/v1/runs/run-000000000000/artifacts/x.log", "GET, HEAD"},
                        Case{"GET", "/v1/runs/run-000000000000/stop", "POST"},
                        Case{"PUT", "/health", "GET, HEAD"}}) {
    httplib::Request req;
    req.method = k.method;
    req.path = k.path;
    req.headers = auth;
    if (std::string(k.method) != "GET") req.body = "{}";
    req.headers.emplace("Content-Type", "application/json");
    const auto r = c.send(req);
    ASSERT_TRUE(r) << k.method << " " << k.path;
    EXPECT_EQ(r->status, 405) << k.method << " " << k.path << ": " << r->body;
    EXPECT_EQ(r->get_header_value("Allow"), k.allow) << k.method << " " << k.path;
    const auto err = nlohmann::json::parse(r->body, nullptr, false);
    ASSERT_TRUE(err.is_object() && err.contains("error")) << r->body;
    EXPECT_EQ(err["error"]["status"], 405);
    EXPECT_EQ(err["error"]["type"], "invalid_request_error");
    EXPECT_CONTAINS(err["error"]["message"].get<std::string>(),
                    std::string(k.method) + " " + k.path +
                        " is not a method this path takes; it takes " + k.allow);
  }
  // Unknown paths stay 404, with any method.
  for (const char* method : {"GET", "DELETE"}) {
    httplib::Request req;
    req.method = method;
    req.path = "/v1/nothing";
    req.headers = auth;
    const auto r = c.send(req);
    ASSERT_TRUE(r) << method;
    EXPECT_EQ(r->status, 404) << method << ": " << r->body;
    EXPECT_EQ(r->get_header_value("Allow"), "") << method;
  }
  // The API key still comes first: no key, no list of methods.
  httplib::Request anonymous;
  anonymous.method = "DELETE";
  anonymous.path = "/v1/runs";
  const auto r = c.send(anonymous);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401) << r->body;
  // HEAD comes with GET, and the routes that take the method still answer.
  EXPECT_EQ(c.Head("/health")->status, 200);
  EXPECT_EQ(c.Get("/v1/runs", auth)->status, 200);
  // A 405 whose body was left unread closes its connection: the body (here a request itself) is
  // not read as the connection's next request.
  const std::string inner = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  const RawAnswer a =
      raw_exchange(srv.port(), "PUT /health HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                                   std::to_string(inner.size()) + "\r\n\r\n" + inner);
  EXPECT_EQ(a.text.rfind("HTTP/1.1 405", 0), 0u) << a.text;
  EXPECT_TRUE(a.closed) << a.text;
}

// A POST with a body but no Content-Length (nor Transfer-Encoding: chunked): cpp-httplib read it
// until the read timeout (30 s) and then answered 400. It is 411 at once; a chunked body is
// still read, and a POST without a body says so with Content-Length: 0.
TEST(ServeHttp, APostWithoutALengthIs411AtOnce) {
  OpenServer s;
  ASSERT_TRUE(s.srv.started()) << s.srv.output();
  for (const std::string& request :
       {std::string("POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "\r\n{\"train\": {\"max_steps\": 2}}"),
        std::string("POST /v1/runs/run-000000000000/stop HTTP/1.1\r\nHost: x\r\n\r\n")}) {
    const RawAnswer a = raw_exchange(s.srv.port(), request);
    EXPECT_LT(a.seconds, 5.0) << request;
    EXPECT_EQ(a.text.rfind("HTTP/1.1 411", 0), 0u) << request << "\n-> " << a.text;
    EXPECT_CONTAINS(a.text, "\"status\":411");
    EXPECT_CONTAINS(a.text, "a POST needs a Content-Length header (or Transfer-Encoding: chunked)");
    EXPECT_CONTAINS(a.text, "Content-Length: 0 for no body (with curl: -d '')");
    EXPECT_TRUE(a.closed) << a.text;  // what the client sent after the head is not a request
  }
  // With a length, or chunked, the body is read and judged as before.
  RawAnswer a = raw_exchange(s.srv.port(),
                             "POST /v1/runs/run-000000000000/stop HTTP/1.1\r\nHost: x\r\n"
                             "Content-Length: 0\r\n\r\n");
  EXPECT_EQ(a.text.rfind("HTTP/1.1 404", 0), 0u) << a.text;
  EXPECT_FALSE(a.closed) << a.text;
  a = raw_exchange(s.srv.port(),
                   "POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   "Transfer-Encoding: chunked\r\n\r\n4\r\nnull\r\n0\r\n\r\n");
  EXPECT_LT(a.seconds, 5.0);
  EXPECT_EQ(a.text.rfind("HTTP/1.1 400", 0), 0u) << a.text;
  EXPECT_CONTAINS(a.text, "expected a JSON object");
}

// A Content-Length that is not a byte count, or is past --max-body-bytes, is refused from the head
// at once, naming it, and the connection closes (the body is not read). httplib read "abc" as 0
// (the body then read as the next request) and "-5" as 2^64 - 5: it waited 30 s for that body,
// and then called it too large; a declared 2 MB body was refused only after the same wait.
TEST(ServeHttp, AContentLengthThatIsNotAByteCountOrTooLargeIsRefusedAtOnce) {
  OpenServer s;
  ASSERT_TRUE(s.srv.started()) << s.srv.output();
  const std::string head =
      "POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";
  for (const auto& [length, status, says] :
       {std::tuple<std::string, int, std::string>{"-5", 400,
                                                  "Content-Length \\\"-5\\\" is not a byte count"},
        {"abc", 400, "Content-Length \\\"abc\\\" is not a byte count"},
        {"2\r\nContent-Length: 3", 400, "Content-Length is given more than once"},
        {"2000000", 413, "more than 1048576 bytes (keel serve --max-body-bytes)"},
        {"99999999999999999999999", 413, "more than 1048576 bytes"}}) {
    const RawAnswer a =
        raw_exchange(s.srv.port(), head + "Content-Length: " + length + "\r\n\r\n{}");
    EXPECT_LT(a.seconds, 2.0) << length;
    EXPECT_EQ(a.text.rfind("HTTP/1.1 " + std::to_string(status), 0), 0u)
        << length << ": " << a.text;
    EXPECT_CONTAINS(a.text, says);
    EXPECT_TRUE(a.closed) << length << ": " << a.text;
  }
}

// The refusals httplib makes before any route (a URL or header line too long, a Range that is not
// one) name what was refused; they said "request refused (HTTP 414)".
TEST(ServeHttp, RefusalsBeforeARouteNameWhatWasRefused) {
  OpenServer s;
  ASSERT_TRUE(s.srv.started()) << s.srv.output();
  const Api api{s.srv.port(), ""};
  auto r = api.get("/v1/runs/" + std::string(9000, 'a'));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 414);
  EXPECT_CONTAINS(r->body, "the request's URL is longer than 8192 bytes");
  r = api.get("/v1/runs", {{"X-Big", std::string(9000, 'a')}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_CONTAINS(r->body, "a header line longer than 8192 bytes");
  r = api.get("/v1/runs", {{"Range", "bytes=5-2"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 416);
  EXPECT_CONTAINS(r->body, "Range: bytes=5-2 is not a byte range");
}

}  // namespace
}  // namespace keel::test
