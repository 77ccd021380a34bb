#include "keel/serve/server.h"

#include <httplib.h>
#include <pthread.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "keel/io/out_dir.h"
#include "keel/numerics/error.h"
#include "keel/numerics/text.h"
#include "keel/serve/auth.h"
#include "keel/serve/dashboard.h"
#include "keel/serve/events.h"
#include "keel/serve/http_error.h"
#include "keel/serve/http_server.h"
#include "keel/serve/run_service.h"

namespace keel::serve {

namespace fs = std::filesystem;
using json = nlohmann::json;

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

namespace {

// Errors in the shape of OpenAI-compatible servers: {"error": {"message", "type", "param",
// "code", "status"}}, every key in every error (param: the query parameter or header at fault,
// else null; code: invalid_api_key for a wrong key, else null), so a client reads one shape;
// `extra` sets param or code and adds fields (active_run).
void send_error(httplib::Response& res, int status, const std::string& message,
                const json& extra = json::object()) {
  const char* type = status == 401   ? "authentication_error"
                     : status == 403 ? "permission_error"
                     : status == 404 ? "not_found"
                     : status == 409 ? "conflict"
                     : status >= 500 ? "server_error"
                                     : "invalid_request_error";
  json err = {{"message", message},
              {"type", type},
              {"param", nullptr},
              {"code", nullptr},
              {"status", status}};
  for (auto& [k, v] : extra.items()) err[k] = v;
  res.status = status;
  res.set_content(json{{"error", err}}.dump(-1, ' ', false, json::error_handler_t::replace),
                  "application/json");
}

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

// The byte ranges of the request's Range header, as httplib parsed them. httplib cuts whatever a
// route answers to them, errors and JSON included (a 401 sent as its first two bytes, `{"`, under
// a Content-Range; an events stream called 206): only an artifact's bytes are served in ranges,
// so every other answer clears them. Handlers are given the request const, but it is httplib's
// own object for this one request (a local of Server::process_request), free to change.
httplib::Ranges& ranges_of(const httplib::Request& req) {
  return const_cast<httplib::Request&>(req).ranges;
}

// A route whose errors (HttpError, keel::Error, anything else) become JSON error responses, sent
// whole whatever the Range header asked.
httplib::Server::Handler guarded(
    std::function<void(const httplib::Request&, httplib::Response&)> f) {
  return [f = std::move(f)](const httplib::Request& req, httplib::Response& res) {
    try {
      f(req, res);
      return;
    } catch (const HttpError& e) {
      send_error(res, e.status, e.what(), e.extra);
    } catch (const Error& e) {
      send_error(res, e.kind == Error::kUsage ? 400 : 500, e.what());
    } catch (const std::exception& e) {
      send_error(res, 500, std::string("internal error: ") + e.what());
    }
    ranges_of(req).clear();
  };
}

// keel's out_dir lock is bookkeeping, not an artifact; `real` is canonical, so a link to it is too.
bool internal_file(const fs::path& real) { return real.filename() == io::kOutDirLockFile; }

// The file P of a run's directory (artifacts): relative, no "..", resolving inside the run.
fs::path artifact_path(const std::string& run_dir, const std::string& rel) {
  const fs::path p(rel);
  bool bad = rel.empty() || p.is_absolute() || rel.find('\0') != std::string::npos;
  for (const auto& part : p) bad |= part == "..";
  std::error_code ec;
  const fs::path dir = fs::canonical(run_dir, ec);
  if (bad || ec)
    throw HttpError(403, "artifact path \"" + visible(rel) + "\" is outside the run",
                    permission_error());
  const fs::path real = fs::canonical(dir / p, ec);
  if (ec || internal_file(real))
    throw HttpError(404, "no artifact " + rel + " (GET .../artifacts lists them)");
  if (!path_within(real.string(), dir.string()))
    throw HttpError(403, "artifact path \"" + visible(rel) + "\" resolves outside the run",
                    permission_error());
  if (!fs::is_regular_file(real))
    throw HttpError(404, rel + " is not a file (GET .../artifacts lists the files)");
  return real;
}

json list_artifacts(const std::string& run_dir) {
  json files = json::array();
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(run_dir, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    const std::string rel = fs::relative(it->path(), run_dir, ec).string();
    if (rel.find(".tmp") != std::string::npos) continue;  // a checkpoint being written
    std::error_code gone;  // a file removed meanwhile is not listed either way
    if (internal_file(fs::canonical(it->path(), gone))) continue;
    files.push_back({{"path", rel}, {"bytes", it->file_size(ec)}});
  }
  return {{"object", "list"}, {"data", files}};
}

void send_file(const httplib::Request& req, httplib::Response& res, const fs::path& path) {
  const uint64_t size = fs::file_size(path);
  // cpp-httplib 0.11 answers a range that starts past the end with a 206 whose Content-Length
  // wrapped around (2^64 - n) and no body, and the client waits for bytes that never come: such
  // a range is 416 here (RFC 9110 15.5.17), with the size the client can ask within.
  for (const auto& [first, last] : req.ranges)
    if ((first >= 0 && static_cast<uint64_t>(first) >= size) || (first < 0 && last == 0)) {
      res.set_header("Content-Range", "bytes */" + std::to_string(size));
      throw HttpError(416, "Range: bytes " + std::to_string(first) + "-" +
                               (last >= 0 ? std::to_string(last) : std::string()) +
                               " is not within the artifact's " + std::to_string(size) + " bytes");
    }
  // A range that ends past the file ends with it (RFC 9110 14.1.2): a download in fixed-size
  // pieces asks for more than is left in its last one. httplib took the end as given, promising
  // a Content-Length of bytes that never came, and the client waited for them.
  for (auto& [first, last] : ranges_of(req))
    if (first >= 0 && last >= 0 && static_cast<uint64_t>(last) >= size)
      last = static_cast<ssize_t>(size - 1);
  // Several ranges are answered with the whole file (RFC 9110 14.2 lets a server ignore Range):
  // httplib's multipart/byteranges answer gives each part's file size as 0 ("bytes 0-4/0").
  if (req.ranges.size() > 1) ranges_of(req).clear();
  auto in = std::make_shared<std::ifstream>(path, std::ios::binary);
  if (!*in) throw HttpError(500, "cannot read " + path.filename().string());
  const std::string ext = path.extension().string();
  const char* type = ext == ".json" || ext == ".jsonl" ? "application/json"
                     : ext == ".log" || ext == ".toml" || ext == ".txt"
                         ? "text/plain; charset=utf-8"
                         : "application/octet-stream";
  res.set_header("Content-Disposition",
                 "attachment; filename=\"" + path.filename().string() + "\"");
  res.set_content_provider(size, type, [in](size_t offset, size_t length, httplib::DataSink& sink) {
    char buf[1 << 16];
    in->seekg(static_cast<std::streamoff>(offset));
    const size_t n = std::min(length, sizeof buf);
    in->read(buf, static_cast<std::streamsize>(n));
    const auto got = static_cast<size_t>(in->gcount());
    return got > 0 && sink.write(buf, got);
  });
}

// The methods each path takes (httplib keeps its routes out of reach): a path that a route
// matches with another method is 405 with the methods it takes, not 404 as if it did not exist.
class RouteTable {
 public:
  void add(const std::string& method, const std::string& pattern) {
    routes_.push_back({method == "GET", std::regex(pattern)});
  }
  // The methods that `path` takes, as an Allow header lists them ("GET, HEAD, POST"; HEAD with
  // GET, whose route httplib answers it with); "" when no route matches the path.
  std::string allowed(const std::string& path) const {
    bool get = false, post = false;
    for (const auto& [is_get, pattern] : routes_)
      if (std::regex_match(path, pattern)) (is_get ? get : post) = true;
    return std::string(get ? "GET, HEAD" : "") + (get && post ? ", " : "") + (post ? "POST" : "");
  }
  static bool takes(const std::string& allowed, const std::string& method) {
    return (", " + allowed + ",").find(", " + method + ",") != std::string::npos;
  }

 private:
  std::vector<std::pair<bool, std::regex>> routes_;  // {a GET route (else POST), its path}
};

std::string too_large(size_t max_body) {
  return "request body too large: more than " + std::to_string(max_body) +
         " bytes (keel serve --max-body-bytes)";
}

bool chunked(const httplib::Request& req) {
  std::string te = req.get_header_value("Transfer-Encoding");
  for (char& c : te) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return te.find("chunked") != std::string::npos;
}

// Whether bytes of the request's body may wait unread after its head: a handler that answers
// before the body is read must close the connection (HttpServer::close_after_response).
bool may_have_body(const httplib::Request& req) {
  if (chunked(req)) return true;
  if (!req.has_header("Content-Length"))
    return req.method == "POST" || req.method == "PUT" || req.method == "PATCH";
  return req.get_header_value("Content-Length") != "0";
}

}  // namespace

int run_server(const ServeOptions& opt) {
  const size_t colon = opt.listen.rfind(':');
  // Digits only: stoi read "80abc" as 80 (keel bound port 80) and "0x50" as 0 (any port).
  const std::string digits = colon == std::string::npos ? "" : opt.listen.substr(colon + 1);
  const int port = !digits.empty() && digits.size() <= 5 &&
                           digits.find_first_not_of("0123456789") == std::string::npos
                       ? std::stoi(digits)
                       : -1;
  if (port < 0 || port > 65535)
    throw Error("--listen " + opt.listen +
                    ": expected HOST:PORT, PORT a whole number from 0 to 65535 (0: any free "
                    "port; e.g. 127.0.0.1:8080)",
                Error::kUsage);
  std::string host = opt.listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  ApiKeys keys;
  if (!opt.api_key_file.empty()) keys = ApiKeys::load(opt.api_key_file);
  if (keys.empty() && !opt.insecure_open)
    throw Error(
        "keel serve needs --api-key-file FILE (one key per line); --insecure-open runs it "
        "without keys, on a loopback address only",
        Error::kUsage);
  if (keys.empty() && !is_loopback_host(host))
    throw Error(
        "--insecure-open serves without API keys and is allowed on a loopback address only "
        "(127.0.0.1, ::1); " +
            host + " is not one: give --api-key-file",
        Error::kUsage);
  if (opt.root.empty())
    throw Error("keel serve needs --root DIR (runs and their registry)", Error::kUsage);
  // A root that is a file, or that cannot be created, is named here: the registry's constructor
  // would end in std::filesystem's own message.
  std::error_code root_error;
  fs::create_directories(fs::path(opt.root) / "runs", root_error);
  if (root_error || !fs::is_directory(fs::path(opt.root) / "runs"))
    throw Error("--root " + opt.root + ": cannot create " + opt.root + "/runs (" +
                    (root_error ? root_error.message() : std::string("not a directory")) +
                    "); give a directory keel serve may write (it holds the runs and "
                    "keel-serve.db)",
                Error::kUsage);
  if (opt.max_body_bytes < 1024)
    throw Error("--max-body-bytes " + std::to_string(opt.max_body_bytes) +
                    ": use at least 1024 (every POST /v1/runs would be refused with 413)",
                Error::kUsage);

  // SIGINT/SIGTERM are waited for by one thread (blocked everywhere else, threads inherit the
  // mask); a closed connection must not kill the server with SIGPIPE.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  RunServiceOptions so;
  so.root = fs::absolute(opt.root).lexically_normal().string();
  so.data_roots = opt.data_roots;
  so.keel_binary = opt.keel_binary;
  // One server a root, for the server's life: a second one's recovery marked the first one's
  // running run interrupted and its run stopped, each server then reporting it its own way.
  io::OutDirLock root_lock(so.root, "--root", "keel serve");
  RunService service(so);
  service.recover();

  std::atomic<bool> closing{false};
  std::atomic<int> streams{0};  // events streams open (before svr: their connections end first)
  HttpServer svr;  // httplib's, with idle keep-alive connections asleep (http_server.h)
  // A thread per connection: a keep-alive connection holds one while it waits for its next
  // request (asleep in poll), an events stream while it streams (asleep on its run's feed). The
  // pool's idle threads sleep on its queue. They run 10 nice levels below the server (about a
  // tenth of a core's share against the run, when both want one; http_server.h).
  const int threads = opt.threads;
  // Events streams may hold at most this many of them: the rest serve every other request.
  const int max_streams = threads - std::max(2, threads / 4);
  svr.new_task_queue = [threads] {
    return new RequestThreadPool(static_cast<size_t>(threads), /*nice_above_process=*/10);
  };
  // httplib closes a keep-alive connection after 5 requests by default: a client polling every
  // 100 ms would reconnect twice a second.
  svr.set_keep_alive_max_count(1000);
  svr.set_payload_max_length(opt.max_body_bytes);
  svr.set_read_timeout(30);
  const size_t max_body = opt.max_body_bytes;
  RouteTable routes;  // filled as the routes are added, below
  // Answered from the request's head, before httplib reads its body: the API key, the route and
  // method, and a body's length.
  auto refusal = [&](const httplib::Request& req, httplib::Response& res) {
    if (req.path.rfind("/v1/", 0) == 0 && !keys.empty()) {  // none: --insecure-open
      const int status = keys.check(req.get_header_value("Authorization"));
      // A key that is none of ours is 401 too (invalid_api_key), as OpenAI and llama.cpp's
      // server answer it and RFC 6750's invalid_token is: its 403 read to an OpenAI client as
      // PermissionDeniedError, a right key without the right, not a wrong key.
      if (status != 200) {
        const bool wrong = status == 403;
        res.set_header("WWW-Authenticate", wrong ? "Bearer error=\"invalid_token\"" : "Bearer");
        send_error(res, 401,
                   wrong ? "the API key is not valid (none of the keys in keel serve's "
                           "--api-key-file)"
                         : "missing or malformed Authorization header (Authorization: Bearer KEY)",
                   wrong ? json{{"code", "invalid_api_key"}} : json::object());
        return true;
      }
    }
    // A known path asked with a method it does not take was 404, as if the path did not exist.
    const std::string allowed = routes.allowed(req.path);
    if (allowed.empty()) {
      send_error(res, 404,
                 "no route " + req.method + " " + visible(req.path) + " (see GET /v1/runs)");
      return true;
    }
    if (!RouteTable::takes(allowed, req.method)) {
      res.set_header("Allow", allowed);
      send_error(res, 405,
                 req.method + " " + visible(req.path) + " is not a method this path takes; it " +
                     "takes " + allowed);
      return true;
    }
    // A query parameter no route reads (?limt=5, ?state=running) was ignored without a word:
    // only GET /v1/runs takes any (limit, after).
    for (const auto& [name, value] : req.params) {
      const bool listing = req.method != "POST" && req.path == "/v1/runs";
      if (req.path.rfind("/v1/", 0) == 0 && !(listing && (name == "limit" || name == "after"))) {
        send_error(res, 400,
                   "unknown query parameter " + visible(name) + " for " + req.method + " " +
                       visible(req.path) +
                       (listing ? " (it takes limit and after)" : " (it takes none)"),
                   {{"param", name}});
        return true;
      }
    }
    // A Content-Length that is not a byte count: httplib read "abc" as 0, leaving the body to be
    // read as the connection's next request, and "-5" as 2^64 - 5, waited the read timeout (30 s)
    // for it and answered that the body was too large. One past --max-body-bytes is refused now,
    // not once the body was read (or waited for).
    if (req.has_header("Content-Length")) {
      const std::string length = req.get_header_value("Content-Length");
      bool count = !length.empty() && length.find_first_not_of("0123456789") == std::string::npos;
      for (size_t i = 1; i < req.get_header_value_count("Content-Length"); ++i)
        count &= req.get_header_value("Content-Length", i) == length;
      if (!count) {
        send_error(res, 400,
                   req.get_header_value_count("Content-Length") > 1
                       ? "Content-Length is given more than once, with different values; send "
                         "one, the body's size in bytes (HTTP clients do)"
                       : "Content-Length \"" + visible(length) +
                             "\" is not a byte count; send the body's size in bytes (HTTP "
                             "clients do)");
        return true;
      }
      if (length.size() > 19 || std::stoull(length) > max_body) {
        send_error(res, 413, too_large(max_body));
        return true;
      }
    }
    // A multipart form (curl -F) reaches a route with its body taken apart into files and fields
    // and req.body empty: creating a run from one answered "not JSON (at byte 1)".
    if (req.get_header_value("Content-Type").rfind("multipart/form-data", 0) == 0) {
      send_error(res, 415,
                 "the body is a multipart form (Content-Type: multipart/form-data, curl -F); "
                 "send JSON as the body itself (Content-Type: application/json; with curl: -H "
                 "'Content-Type: application/json' -d @config.json)");
      return true;
    }
    // cpp-httplib reads a body without a length until the client closes or the read timeout
    // (30 s) runs out, and then answered 400: the client waited half a minute for a refusal.
    if ((req.method == "POST" || req.method == "PUT" || req.method == "PATCH") &&
        !req.has_header("Content-Length") && !chunked(req)) {
      send_error(res, 411,
                 "a " + req.method +
                     " needs a Content-Length header (or Transfer-Encoding: chunked): a body "
                     "without one is not read; send its length (curl -d and HTTP clients do), "
                     "or Content-Length: 0 for no body (with curl: -d '')");
      return true;
    }
    return false;
  };
  const std::regex artifact_file("/v1/runs/[^/]+/artifacts/.+");
  svr.set_pre_routing_handler([&](const httplib::Request& req, httplib::Response& res) {
    if (!std::regex_match(req.path, artifact_file)) ranges_of(req).clear();  // JSON goes whole
    if (!refusal(req, res)) return httplib::Server::HandlerResponse::Unhandled;
    ranges_of(req).clear();
    // Its body is not read: it must not be read as the connection's next request.
    if (may_have_body(req)) HttpServer::close_after_response(res);
    return httplib::Server::HandlerResponse::Handled;
  });
  svr.set_error_handler([max_body](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    // cpp-httplib limits a body sent as a form (curl -d's default type) to 8 KiB, below
    // --max-body-bytes: say which limit it was and how to send JSON.
    const bool form =
        req.get_header_value("Content-Type").rfind("application/x-www-form-urlencoded", 0) == 0;
    if (res.status == 413 && form)
      send_error(res, 413,
                 "request body too large for a form (Content-Type: "
                 "application/x-www-form-urlencoded, curl -d's default, is limited to 8192 bytes)"
                 "; send it as Content-Type: application/json (curl -H 'Content-Type: "
                 "application/json'), up to " +
                     std::to_string(max_body) + " bytes");
    else if (res.status == 413)
      send_error(res, 413, too_large(max_body));
    else if (res.status == 404)
      send_error(res, 404, "no route " + req.method + " " + req.path + " (see GET /v1/runs)");
    // The refusals cpp-httplib makes before a route is found said only "request refused (HTTP
    // 414)": what was refused, and why, is named.
    else if (res.status == 414)
      send_error(res, 414,
                 "the request's URL is longer than 8192 bytes (cpp-httplib's limit); the routes' "
                 "URLs are far shorter (see GET /v1/runs)");
    else if (res.status == 416)
      send_error(res, 416,
                 "Range: " + visible(req.get_header_value("Range")) +
                     " is not a byte range; ask for bytes=FIRST-LAST (FIRST <= LAST), "
                     "bytes=FIRST- or bytes=-COUNT, or send no Range for the whole file");
    else if (res.status == 400)
      send_error(res, 400,
                 "the request could not be read: a malformed request line or header, a header "
                 "line longer than 8192 bytes (cpp-httplib's limit), or a body that is not what "
                 "its Content-Length or chunked encoding says; send a well-formed HTTP/1.1 "
                 "request");
    else
      send_error(res, res.status, "request refused (HTTP " + std::to_string(res.status) + ")");
  });
  svr.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        send_error(res, 500, "internal error: " + what);
      });

  // Every route through these, so that RouteTable knows the methods of each path.
  auto get = [&](const std::string& pattern, httplib::Server::Handler h) {
    routes.add("GET", pattern);
    svr.Get(pattern, std::move(h));
  };
  auto post = [&](const std::string& pattern, httplib::Server::Handler h) {
    routes.add("POST", pattern);
    svr.Post(pattern, std::move(h));
  };
  get("/health", [](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"status", "ok"}});
  });
  get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(dashboard_html(), "text/html; charset=utf-8");
  });
  post("/v1/runs", guarded([&](const httplib::Request& req, httplib::Response& res) {
         auto [status, run] = service.create(req.body, req.get_header_value("Idempotency-Key"));
         send_json(res, status, run);
       }));
  // Pages as OpenAI's lists: ?limit=N (1 to 100) and ?after=ID (the last run of the previous
  // page); no limit lists every run (the dashboard's table). Both were ignored: limit=0, limit=-1
  // and limit=5 each listed every run, after=ID started from the newest.
  get("/v1/runs", guarded([&](const httplib::Request& req, httplib::Response& res) {
        size_t limit = 0;
        if (req.has_param("limit")) {
          const std::string v = req.get_param_value("limit");
          int n = 0;
          const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
          if (ec != std::errc() || end != v.data() + v.size() || n < 1 || n > 100)
            throw HttpError(400,
                            "limit=" + visible(v) +
                                " is not a page size: give a whole number from 1 to 100 (or no "
                                "limit for every run)",
                            {{"param", "limit"}});
          limit = static_cast<size_t>(n);
        }
        send_json(res, 200, service.list(limit, req.get_param_value("after")));
      }));
  const std::string id = "/v1/runs/([A-Za-z0-9_-]{1,64})";
  get(id, guarded([&](const httplib::Request& req, httplib::Response& res) {
        send_json(res, 200, service.get(req.matches[1]));
      }));
  // Stop and resume take no settings: a body asking for some ({"force": true}, {"train":
  // {"max_steps": 5}}) was accepted and ignored.
  auto no_settings = [](const httplib::Request& req, const char* why) {
    const auto first = req.body.find_first_not_of(" \t\r\n");
    const auto last = req.body.find_last_not_of(" \t\r\n");
    if (first != std::string::npos && req.body.substr(first, last - first + 1) != "{}")
      throw HttpError(400, std::string(why) + ": send no body (or {})");
  };
  post(id + "/stop", guarded([&](const httplib::Request& req, httplib::Response& res) {
         no_settings(req, "a stop takes no settings (it checkpoints the run, then stops it)");
         send_json(res, 202, service.stop(req.matches[1]));
       }));
  post(id + "/resume", guarded([&](const httplib::Request& req, httplib::Response& res) {
         no_settings(req,
                     "a resume continues the run with the config it was created with (for "
                     "other settings start a new run)");
         send_json(res, 202, service.resume(req.matches[1]));
       }));
  get(id + "/events", guarded([&](const httplib::Request& req, httplib::Response& res) {
        const std::string run = req.matches[1];
        std::shared_ptr<RunFeed> feed = service.feed(run);  // 404 before the stream starts
        int64_t last = 0;
        const std::string h = req.get_header_value("Last-Event-ID");
        // The whole header is the id, a line number: "5abc" was read as 5, and 2^63 - 1 wrapped
        // to a stream from the start when the next id was formed.
        if (!h.empty()) {
          const auto [end, ec] = std::from_chars(h.data(), h.data() + h.size(), last);
          if (ec != std::errc() || end != h.data() + h.size() || last < 0 ||
              last > (int64_t{1} << 53))
            throw HttpError(400,
                            "Last-Event-ID \"" + visible(h) +
                                "\" is not an event id: send the id of the last event "
                                "received (a line number of the run's metrics, 0 or more)",
                            {{"param", "Last-Event-ID"}});
        }
        // An id past the run's last event (another run's, or one from before the root was
        // wiped): a stream of an active run waited, silent, until its metrics reached that line,
        // and lost every event before it. The client learns it now, with the id to send; as an
        // OpenAI error, it names the parameter. A run that is done has no event past any id: its
        // stream ends at once with `state` and `end` (the run), which is also what an
        // EventSource reconnecting by itself after the last event needs to stop.
        if (const int64_t have = feed->last_event_id();
            last > have && is_active_state(service.state(run)))
          throw HttpError(400,
                          "Last-Event-ID " + std::to_string(last) + " is past run " + run +
                              "'s last event, id " + std::to_string(have) +
                              ": send the id of the last event received from this run's stream "
                              "(or no Last-Event-ID for all of them)",
                          {{"param", "Last-Event-ID"}, {"last_event_id", have}});
        // A stream holds its thread for the run's life: once streams held every one, no request
        // was served at all (not a status, not the stop of the run), until a stream ended.
        if (streams.fetch_add(1) >= max_streams) {
          --streams;
          res.set_header("Retry-After", "10");
          throw HttpError(503, std::to_string(max_streams) +
                                   " events streams are open, as many as this server keeps (keel "
                                   "serve --threads " +
                                   std::to_string(threads) + " keeps " +
                                   std::to_string(threads - max_streams) +
                                   " threads for the other requests, so that a status or a stop "
                                   "still gets through); close a stream, poll GET /v1/runs/" +
                                   run + ", or restart the server with more --threads");
        }
        std::shared_ptr<void> slot(nullptr, [&streams](void*) { --streams; });
        stream_run_events(
            res, std::move(feed),
            [&service, run] {
              return service.get(run).dump(-1, ' ', false, json::error_handler_t::replace);
            },
            last, std::move(slot));
      }));
  get(id + "/artifacts", guarded([&](const httplib::Request& req, httplib::Response& res) {
        service.get(req.matches[1]);
        send_json(res, 200, list_artifacts(service.run_dir(req.matches[1])));
      }));
  get(id + "/artifacts/(.+)", guarded([&](const httplib::Request& req, httplib::Response& res) {
        service.get(req.matches[1]);
        send_file(req, res, artifact_path(service.run_dir(req.matches[1]), req.matches[2]));
      }));

  // cpp-httplib listens with a backlog of 5 (compiled into Debian's library): a burst of clients
  // beyond that would see connections dropped. Linux lets listen() be called again on the socket
  // to raise it, so keep the socket's descriptor (this replaces httplib's default options, which
  // set SO_REUSEADDR).
  int listen_fd = -1;
  svr.set_socket_options([&listen_fd](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    listen_fd = sock;
  });
  const int bound =
      port == 0 ? svr.bind_to_any_port(host) : (svr.bind_to_port(host, port) ? port : -1);
  if (bound < 0)
    throw Error("cannot listen on " + opt.listen + " (in use, or not an address of this machine)");
  if (listen_fd >= 0) ::listen(listen_fd, 1024);
  std::printf("keel serve | listening on http://%s:%d | root %s | %s | data roots: %zu\n",
              host.c_str(), bound, so.root.c_str(),
              keys.empty() ? "OPEN (no API key, loopback only)"
                           : count_of(static_cast<long long>(keys.size()), "API key").c_str(),
              opt.data_roots.size());
  std::fflush(stdout);

  std::thread signals([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    if (sig == 0) return;
    std::printf("keel serve | signal %d: stopping the active run (checkpoint) and shutting down\n",
                sig);
    std::fflush(stdout);
    closing = true;
    service.shutdown();  // ends the events streams too
    svr.stop_serving();
  });
  svr.listen_after_bind();
  // listen returned without a signal (a listen error): wake the signal thread.
  if (!closing) pthread_kill(signals.native_handle(), SIGTERM);
  signals.join();
  std::printf("keel serve | stopped\n");
  return 0;
}

}  // namespace keel::serve
