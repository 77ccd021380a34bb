// Mutated and garbage requests get a 4xx with a JSON error, never a crash or a 5xx: bodies
// mutated byte by byte from a valid config (seeded, so a failure reproduces), hostile shapes
// (deep nesting, huge numbers, wrong types), oversized bodies (413), bad headers and ids. The
// server must still answer /health and train afterwards. Under ASan (scripts/test.sh) this is
// also a memory-safety test of the request path.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <thread>

#include "tests/serve/serve_process.h"
#include "tests/support/check.h"

namespace keel::test {
namespace {

using json = nlohmann::json;

std::string mutate(std::string s, std::mt19937& rng) {
  const char* junk = "{}[]\":,.-+eE0123456789tfn\\ \x01\xff\xc3";
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits && !s.empty(); ++e) {
    const size_t at = rng() % s.size();
    switch (rng() % 4) {
      case 0:
        s[at] = junk[rng() % 24];
        break;  // replace
      case 1:
        s.insert(at, 1, junk[rng() % 24]);
        break;  // insert
      case 2:
        s.erase(at, 1 + rng() % 8);
        break;  // delete a few
      default:
        s.resize(at);
        break;  // truncate
    }
  }
  return s;
}

TEST(ServeBadRequests, MutatedAndHostileBodiesGet4xxAndTheServerCarriesOn) {
  const std::string dir = temp_dir("serve-fuzz");
  std::ofstream(dir + "/keys") << kTestKey << "\n";
  ServeProcess srv({"--root", dir + "/root", "--api-key-file", dir + "/keys", "--data-root", dir});
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  json base = tiny_config(1);
  base["model"] = {{"n_layer", 1}, {"adapter", {{"kind", "lora"}, {"target_modules", {"c_attn"}}}}};
  base["data"]["tokenizer"] = "byte";
  const std::string valid = base.dump();
  std::vector<std::string> bodies;
  std::mt19937 rng(20261201);
  for (int i = 0; i < 300; ++i) bodies.push_back(mutate(valid, rng));
  bodies.push_back("");
  bodies.push_back("null");
  bodies.push_back("\"train\"");
  bodies.push_back(std::string(100000, '['));  // deep arrays, unclosed
  bodies.push_back(std::string(20000, '[') + std::string(20000, ']'));
  std::string deep;
  for (int i = 0; i < 5000; ++i) deep += "{\"a\":";
  deep += "1" + std::string(5000, '}');
  bodies.push_back(deep);  // deep objects
  bodies.push_back(R"({"train": {"max_steps": 1e999}})");
  bodies.push_back(R"({"train": {"max_steps": -1}})");
  bodies.push_back(R"({"train": {"max_steps": 99999999999999999999999}})");
  bodies.push_back(R"({"train": {"max_steps": [1, 2]}})");
  bodies.push_back(R"({"train": {"max_steps": {"a": 1}}})");
  bodies.push_back(R"({"model": {"adapter": {"target_modules": [[1]]}}})");
  bodies.push_back(R"({"model": {"adapter": {"target_modules": [""]}}})");
  bodies.push_back(R"({"optim": {"lr": -0.0}, "sched": {"name": "\u0000"}})");
  bodies.push_back("{\"data\": {\"path\": \"\xff\xfe\"}}");  // not UTF-8
  bodies.push_back(R"({"data": {"task": "text", "path": "/dev/zero"}})");
  bodies.push_back(R"({"model": {"path": "/proc/self/root/etc"}})");
  bodies.push_back(R"({"data": {"tokenizer": "hf:../../../../etc/passwd"}})");
  int created = 0;
  for (const std::string& body : bodies) {
    auto r = api.post("/v1/runs", body, {{"Idempotency-Key", "\xff\x01 weird"}});
    ASSERT_TRUE(r) << "no response (crash?) to body: " << body.substr(0, 200);
    if (r->status == 201) {  // a mutation that is still a valid config: let it finish
      ++created;
      const std::string id = json::parse(r->body)["id"];
      api.wait_run(id,
                   [](const json& j) { return j["state"] != "running" && j["state"] != "queued"; });
      continue;
    }
    // 200: the same Idempotency-Key and body as an earlier accepted mutation
    if (r->status == 200) continue;
    EXPECT_GE(r->status, 400) << body.substr(0, 200);
    EXPECT_LT(r->status, 500) << body.substr(0, 200) << " -> " << r->body;
    const json err = json::parse(r->body, nullptr, false);
    EXPECT_TRUE(err.is_object() && err.contains("error")) << r->body;
  }
  // Oversized bodies: 413 before any parsing.
  auto r = api.post("/v1/runs", std::string((1 << 20) + 10, ' '));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_CONTAINS(r->body, "more than 1048576 bytes (keel serve --max-body-bytes)");
  // A form-typed body (curl -d's default) is limited to 8 KiB by cpp-httplib: its 413 says so
  // and how to send JSON (it said only "too large", under a limit of 1 MiB).
  httplib::Client form("127.0.0.1", api.port);
  r = form.Post("/v1/runs", {{"Authorization", "Bearer " + api.key}}, std::string(9000, ' '),
                "application/x-www-form-urlencoded");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_CONTAINS(r->body, "send it as Content-Type: application/json");
  // A multipart form (curl -F) reached the route with an empty body: "not JSON (at byte 1)".
  r = form.Post("/v1/runs", {{"Authorization", "Bearer " + api.key}},
                "--b\r\nContent-Disposition: form-data; name=\"config\"\r\n\r\n{}\r\n--b--\r\n",
                "multipart/form-data; boundary=b");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 415);
  EXPECT_CONTAINS(r->body, "the body is a multipart form");
  EXPECT_CONTAINS(r->body, "send JSON as the body itself");
  // Bad ids, routes and headers.
  for (const char* path :
       {"/v1/runs/..", "/v1/runs/%2e%2e", "/v1/runs/x%00y", "/v1/runs/run-1/stop",
        "/v1/runs/"
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}) {
    r = api.get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_GE(r->status, 400) << path;
    EXPECT_LT(r->status, 500) << path;
  }
  r = api.post("/v1/runs/run-000000000000/resume", "{}");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  // A resume with settings was accepted and the settings ignored: 400 naming the rule.
  r = api.post("/v1/runs/run-000000000000/resume", R"({"train": {"max_steps": 5}})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_CONTAINS(r->body, "send no body (or {})");
  // So does a stop with settings ({"force": true} was accepted and dropped).
  r = api.post("/v1/runs/run-000000000000/stop", R"({"force": true})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_CONTAINS(r->body, "a stop takes no settings");
  // The service follows a run through its metrics.jsonl: a run without it ended "succeeded" at
  // step 0 with no loss.
  json no_metrics = tiny_config(5);
  no_metrics["log"]["metrics"] = false;
  r = api.post("/v1/runs", no_metrics.dump());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_CONTAINS(r->body, "log.metrics = false");
  // So is what keel train refuses as keys that would never act: a run with train.eval_every and
  // no validation split was created (201) and failed as it started.
  json no_split = tiny_config(5);
  no_split["data"]["eval_examples"] = 0;
  no_split["train"]["eval_every"] = 2;
  r = api.post("/v1/runs", no_split.dump());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_CONTAINS(r->body, "train.eval_every = 2 evaluates the run's validation split");
  const json runs = api.get_json("/v1/runs")["data"];
  if (!runs.empty()) {
    // The whole header is the id: "5abc" was read as 5, 2^63 - 1 wrapped to the stream's start.
    for (const char* id : {"not-a-number", "5abc", "-1", "9223372036854775807", "5 6"}) {
      r = api.get("/v1/runs/" + runs[0]["id"].get<std::string>() + "/events",
                  {{"Last-Event-ID", id}});
      ASSERT_TRUE(r) << id;
      EXPECT_EQ(r->status, 400) << id;
      EXPECT_CONTAINS(r->body, "is not an event id: send the id of the last event received");
    }
  }
  // Still serving, and still training.
  const Api anonymous{srv.port(), ""};
  EXPECT_EQ(anonymous.get("/health")->status, 200);
  r = api.post("/v1/runs", valid);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 201) << r->body;
  std::cout << created << " of " << bodies.size() << " mutated bodies were valid configs\n";
}

// Every refusal is one JSON shape, OpenAI's error object {message, type, param, code} plus the
// HTTP status, whoever made it (the key check, the route table, httplib, a route): "param" and
// "code" were missing from all of them, and a client reading error.param found it only in some.
TEST(ServeBadRequests, EveryErrorIsOneShapeNamingTheParameterAtFault) {
  const std::string dir = temp_dir("serve-error-shape");
  std::ofstream(dir + "/keys") << kTestKey << "\n";
  ServeProcess srv({"--root", dir + "/root", "--api-key-file", dir + "/keys", "--data-root", dir});
  ASSERT_TRUE(srv.started()) << srv.output();
  const Api api{srv.port(), kTestKey}, none{srv.port(), ""},
      wrong{srv.port(), "wrong-key-0123456789"};
  httplib::Client c("127.0.0.1", srv.port());
  const httplib::Headers key = {{"Authorization", std::string("Bearer ") + kTestKey}};
  struct Case {
    const char* what;
    httplib::Result r;
    int status;
    json param;
  };
  std::vector<Case> cases;
  cases.push_back({"no key", none.get("/v1/runs"), 401, nullptr});
  cases.push_back({"wrong key", wrong.get("/v1/runs"), 401, nullptr});
  cases.push_back({"no route", api.get("/v1/nothing"), 404, nullptr});
  cases.push_back({"no run", api.get("/v1/runs/run-000000000000"), 404, nullptr});
  cases.push_back({"method", c.Delete("/v1/runs", key), 405, nullptr});
  cases.push_back({"not JSON", api.post("/v1/runs", "{"), 400, nullptr});
  cases.push_back({"outside the roots",
                   api.post("/v1/runs", R"({"data": {"task": "text", "path": "/etc/passwd"}})"),
                   403, nullptr});
  cases.push_back(
      {"too large", api.post("/v1/runs", std::string((1 << 20) + 1, ' ')), 413, nullptr});
  cases.push_back(
      {"multipart",
       c.Post("/v1/runs", key, "--b\r\n\r\n{}\r\n--b--\r\n", "multipart/form-data; boundary=b"),
       415, nullptr});
  cases.push_back({"long URL", api.get("/v1/runs/" + std::string(9000, 'a')), 414, nullptr});
  cases.push_back({"limit", api.get("/v1/runs?limit=0"), 400, "limit"});
  cases.push_back({"unknown parameter", api.get("/v1/runs?sort=asc"), 400, "sort"});
  for (Case& k : cases) {
    ASSERT_TRUE(k.r) << k.what;
    EXPECT_EQ(k.r->status, k.status) << k.what << ": " << k.r->body;
    EXPECT_EQ(k.r->get_header_value("Content-Type"), "application/json") << k.what;
    const json body = json::parse(k.r->body, nullptr, false);
    ASSERT_TRUE(body.is_object() && body.contains("error")) << k.what << ": " << k.r->body;
    const json& e = body["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << k.what;
    EXPECT_EQ(e["type"], k.status == 401   ? "authentication_error"
                         : k.status == 403 ? "permission_error"
                         : k.status == 404 ? "not_found"
                                           : "invalid_request_error")
        << k.what;
    EXPECT_TRUE(e.contains("param") && e.contains("code")) << k.what << ": " << k.r->body;
    EXPECT_EQ(e["param"], k.param) << k.what;
    EXPECT_EQ(e["status"], k.status) << k.what;
  }
}

}  // namespace
}  // namespace keel::test
