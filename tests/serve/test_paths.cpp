// Path safety: every path of a run's config must resolve (symlinks followed) inside the server's
// data roots, the server owns run.out_dir, and a request body is read by keel train's own config
// loader (same messages: the key and the nearest valid one).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "keel/serve/http_error.h"
#include "keel/serve/path_policy.h"
#include "keel/serve/run_request.h"
#include "tests/serve/serve_process.h"
#include "tests/support/check.h"

namespace keel::test {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// root/data/{train.txt, sub/}, root/secret.txt, and root/data/escape -> root (a symlink out).
struct Tree {
  std::string top = temp_dir("serve-paths");
  std::string data = top + "/data";
  Tree() {
    fs::create_directories(data + "/sub");
    std::ofstream(data + "/train.txt") << "hello\n";
    std::ofstream(top + "/secret.txt") << "no\n";
    fs::create_directory_symlink(top, data + "/escape");
    fs::create_symlink(data + "/train.txt", data + "/link.txt");  // a link that stays inside
  }
};

// The status and message run_config_of_request answers for `body`.
std::pair<int, std::string> refusal(const std::string& body, const serve::PathPolicy& p) {
  try {
    serve::run_config_of_request(body, p, "/srv/runs/x");
  } catch (const serve::HttpError& e) {
    return {e.status, e.what()};
  }
  return {200, ""};
}

TEST(ServePaths, ConfineFollowsSymlinksAndRefusesWhatLeavesTheRoots) {
  Tree t;
  serve::PathPolicy p({t.data});
  const std::string real_data = fs::canonical(t.data).string();
  EXPECT_EQ(p.confine("data.path", t.data + "/train.txt"), real_data + "/train.txt");
  EXPECT_EQ(p.confine("data.path", "train.txt"), real_data + "/train.txt");  // under the 1st root
  EXPECT_EQ(p.confine("data.path", t.data + "/link.txt"), real_data + "/train.txt");
  EXPECT_EQ(p.confine("data.path", t.data + "/sub/../train.txt"), real_data + "/train.txt");
  for (const std::string& bad :
       {t.data + "/../secret.txt", std::string("../secret.txt"), t.top + "/secret.txt",
        std::string("/etc/passwd"), t.data + "/escape/secret.txt", t.data + "/escape"}) {
    try {
      p.confine("data.path", bad);
      ADD_FAILURE() << bad << " was allowed";
    } catch (const serve::PathDenied& e) {
      EXPECT_CONTAINS(e.what(), "data.path = \"" + bad + "\"");
      EXPECT_CONTAINS(e.what(), "outside the server's data roots");
    }
  }
  // Inside but missing: a config error (400), not a refusal; outside and missing: refused.
  EXPECT_CONTAINS(error_of([&] { p.confine("data.path", "nope.txt"); }), "does not exist");
  EXPECT_THROW(p.confine("data.path", t.top + "/nope.txt"), serve::PathDenied);
  serve::PathPolicy none({});
  EXPECT_THROW(none.confine("model.path", t.data), serve::PathDenied);
  EXPECT_CONTAINS(error_of([&] { serve::PathPolicy({t.top + "/missing"}); }), "--data-root");
}

// The files a loader opens inside a confined directory are confined too: a tokenizer directory
// inside the root whose vocab.bpe linked to a file outside had that file's first line quoted in
// the run's error, and a tokenizer.json linked out trained a run on it. A resume asks again.
TEST(ServePaths, FilesInsideAConfinedDirectoryAreConfinedToo) {
  Tree t;
  serve::PathPolicy p({t.data});
  const std::string real_data = fs::canonical(t.data).string();
  fs::create_directories(t.data + "/gpt2");
  std::ofstream(t.data + "/gpt2/encoder.json") << "{}";
  fs::create_symlink(t.top + "/secret.txt", t.data + "/gpt2/vocab.bpe");
  auto [status, msg] = refusal(json{{"data", {{"tokenizer", "gpt2:gpt2"}}}}.dump(), p);
  EXPECT_EQ(status, 403);
  EXPECT_CONTAINS(msg, "data.tokenizer: " + real_data + "/gpt2/vocab.bpe resolves to " +
                           fs::canonical(t.top).string() + "/secret.txt, outside");
  // hf:FILE reads tokenizer_config.json beside the file.
  fs::create_directories(t.data + "/hf");
  std::ofstream(t.data + "/hf/tokenizer.json") << "{}";
  fs::create_symlink(t.top + "/secret.txt", t.data + "/hf/tokenizer_config.json");
  std::tie(status, msg) =
      refusal(json{{"data", {{"tokenizer", "hf:hf/tokenizer.json"}}}}.dump(), p);
  EXPECT_EQ(status, 403);
  EXPECT_CONTAINS(msg, "/hf/tokenizer_config.json\" resolves to");
  // ... and chat_template.jinja, whose text becomes the conversations' tokens.
  fs::remove(t.data + "/hf/tokenizer_config.json");
  fs::create_symlink(t.top + "/secret.txt", t.data + "/hf/chat_template.jinja");
  std::tie(status, msg) =
      refusal(json{{"data", {{"tokenizer", "hf:hf/tokenizer.json"}}}}.dump(), p);
  EXPECT_EQ(status, 403);
  EXPECT_CONTAINS(msg, "/hf/chat_template.jinja\" resolves to");
  fs::remove(t.data + "/hf/chat_template.jinja");
  // A model directory with a link out; one whose link stays inside is accepted.
  fs::create_directories(t.data + "/model");
  fs::create_symlink(t.top + "/secret.txt", t.data + "/model/config.json");
  std::tie(status, msg) = refusal(json{{"model", {{"path", "model"}}}}.dump(), p);
  EXPECT_EQ(status, 403);
  EXPECT_CONTAINS(msg, "model.path: " + real_data + "/model/config.json resolves to");
  fs::remove(t.data + "/model/config.json");
  fs::create_symlink(t.data + "/train.txt", t.data + "/model/config.json");
  std::tie(status, msg) = refusal(json{{"model", {{"path", "model"}}}}.dump(), p);
  EXPECT_NE(status, 403) << msg;
  // An adapter run's checkpoint as model.path: its frozen base, loaded from where the checkpoint
  // says it was trained, is confined too.
  fs::create_directories(t.data + "/ckpt");
  std::ofstream(t.data + "/ckpt/trainer.json") << "{}";
  fs::create_directories(t.top + "/outside-base");
  std::ofstream(t.data + "/ckpt/config.json")
      << json{{"keel_checkpoint",
               {{"layout", "keel"},
                {"base", {{"path", "b"}, {"resolved", t.top + "/outside-base"}}}}}}
             .dump();
  std::tie(status, msg) = refusal(json{{"model", {{"path", "ckpt"}}}}.dump(), p);
  EXPECT_EQ(status, 403);
  EXPECT_CONTAINS(msg, "model.path's base (keel_checkpoint.base in its config.json)");
  // Resume: the confined config is judged again after its directory became a link out.
  Config c;
  c.data.path = t.data + "/sub/x.txt";
  std::ofstream(c.data.path) << "x\n";
  serve::confine_run_paths(c, p);
  fs::rename(t.data + "/sub", t.data + "/sub.real");
  fs::create_directory_symlink(t.top, t.data + "/sub");
  std::ofstream(t.top + "/x.txt") << "outside\n";
  try {
    serve::confine_run_paths(c, p);
    ADD_FAILURE() << "a path that now leaves the roots was allowed";
  } catch (const serve::HttpError& e) {
    EXPECT_EQ(e.status, 403);
    EXPECT_CONTAINS(e.what(), "outside the server's data roots");
  }
}

TEST(ServePaths, RequestBodiesAreReadByTheConfigLoader) {
  Tree t;
  serve::PathPolicy p({t.data});
  auto [status, msg] = refusal(R"({"train": {"max_step": 5}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "unknown key train.max_step");
  EXPECT_CONTAINS(msg, "did you mean train.max_steps?");
  // A top-level name that is no section: the sections, not a distant key (it said "did you mean
  // model.adapter.r?").
  std::tie(status, msg) = refusal(R"({"x": 1})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "unknown key x (request body); every key belongs to a section");
  EXPECT_CONTAINS(msg, "the sections are run, model, data, train,");
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
  std::tie(status, msg) = refusal(R"({"train": {"batch_size": 0}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "train.batch_size must be in [1, 65536], got 0");
  // A NUL in a key cut the message short: "unknown key train.max_steps" named a valid key.
  std::tie(status, msg) = refusal(R"({"train": {"max_steps\u0000x": 5}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "unknown key train.max_steps\\x00x");
  std::tie(status, msg) = refusal(R"({"optim": {"lr": "fast"}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "optim.lr must be a number");
  std::tie(status, msg) = refusal(R"({"optimizer": {"lr": 1}})", p);
  EXPECT_CONTAINS(msg, "unknown section [optimizer]");
  std::tie(status, msg) = refusal(R"({"train": {"max_steps": null}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "train.max_steps is null");
  std::tie(status, msg) = refusal(R"({"run": {"seed": 18446744073709551615}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "run.seed");
  std::tie(status, msg) = refusal("[1, 2]", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "expected a JSON object");
  std::tie(status, msg) = refusal("{\"train\": ", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "not JSON");
  // nlohmann throws out_of_range, not parse_error, for a number beyond a double (tests/fuzz).
  std::tie(status, msg) = refusal(R"({"optim": {"lr": 1e400}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "request body: not JSON (number overflow parsing '1e400')");
  std::tie(status, msg) = refusal(R"({"run": {"out_dir": "/tmp/mine"}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "run.out_dir is chosen by the server");
  std::tie(status, msg) = refusal(R"({"run": {"resume": true}})", p);
  EXPECT_CONTAINS(msg, "run.resume is chosen by the server");
  // Each run has a new directory: nothing to overwrite, and a resume with it would be refused.
  std::tie(status, msg) = refusal(R"({"run": {"overwrite": true}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "run.overwrite is chosen by the server");
  std::tie(status, msg) = refusal(R"({"dist": {"backend": "mpi"}})", p);
  EXPECT_EQ(status, 400);
  // Paths: refused outside the roots (403), rewritten to their real path inside.
  std::tie(status, msg) = refusal(
      json{{"data", {{"task", "text"}, {"path", t.data + "/escape/secret.txt"}}}}.dump(), p);
  EXPECT_EQ(status, 403);
  EXPECT_CONTAINS(msg, t.data + "/escape/secret.txt");
  // A directory as data.path, an hf: with no path: 400 now, not a run that fails as it starts.
  std::tie(status, msg) = refusal(json{{"data", {{"task", "text"}, {"path", "sub"}}}}.dump(), p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "data.path = \"" + fs::canonical(t.data).string() + "/sub\" is a directory");
  // Refused by the config loader, naming the key (serve's own check after it was unreachable).
  std::tie(status, msg) = refusal(json{{"data", {{"tokenizer", "hf:"}}}}.dump(), p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg,
                  "data.tokenizer = \"hf:\": give the path after hf: (e.g. "
                  "hf:tokenizer.json, or its directory)");
  std::tie(status, msg) = refusal(json{{"data", {{"tokenizer", "gpt2:"}}}}.dump(), p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg,
                  "data.tokenizer = \"gpt2:\": give the path after gpt2: (e.g. "
                  "gpt2:gpt2-tokenizer-dir, GPT-2's vocabulary directory)");
  std::tie(status, msg) = refusal(json{{"model", {{"path", "../"}}}}.dump(), p);
  EXPECT_EQ(status, 403);
  EXPECT_CONTAINS(msg, "model.path");
  std::tie(status, msg) = refusal(json{{"data", {{"tokenizer", "hf:/etc/hostname"}}}}.dump(), p);
  EXPECT_EQ(status, 403);
  EXPECT_CONTAINS(msg, "data.tokenizer");
  const Config c = serve::run_config_of_request(
      json{{"data", {{"task", "text"}, {"path", "link.txt"}}}}.dump(), p, "/srv/runs/x");
  EXPECT_EQ(c.data.path, fs::canonical(t.data).string() + "/train.txt");
  EXPECT_EQ(c.run.out_dir, "/srv/runs/x");
}

TEST(ServePaths, AKeyGivenTwiceIsRefusedNamingItsPath) {
  Tree t;
  serve::PathPolicy p({t.data});
  int status = 0;
  std::string msg;
  // A key given twice: nlohmann::json kept the last without a word (the run trained 5 steps).
  std::tie(status, msg) = refusal(R"({"train": {"max_steps": 2, "max_steps": 5}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "request body: train.max_steps is given more than once");
  EXPECT_CONTAINS(msg, "give each key once");
  std::tie(status, msg) = refusal(R"({"train": {"max_steps": 2}, "train": {"max_steps": 5}})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "request body: train is given more than once");
  std::tie(status, msg) = refusal(R"({"x": [1, {"a": 1}, {"b": 1, "b": 2}]})", p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "request body: x[2].b is given more than once");
  std::tie(status, msg) = refusal(R"({"train": {"max_steps\u0000": 2, "max_steps\u0000": 5}})", p);
  EXPECT_CONTAINS(msg, "request body: train.max_steps\\x00 is given more than once");
  // The same key in two objects is no repeat.
  std::tie(status, msg) =
      refusal(R"({"model": {"adapter": {"kind": "lora"}}, "data": {"task": "arith"}})", p);
  EXPECT_EQ(msg.find("more than once"), std::string::npos) << msg;
}

TEST(ServePaths, PipesAndDevicesAreRefusedBeforeTheRunStarts) {
  Tree t;
  serve::PathPolicy p({t.data});
  int status = 0;
  std::string msg;
  // A pipe as data.path (or data.eval_path, or a tokenizer file) is refused before the run
  // starts: no one writes into it, and the run waited for a writer until it was stopped.
  const std::string fifo = t.data + "/pipe.txt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string real_fifo = fs::canonical(fifo).string();
  std::tie(status, msg) =
      refusal(json{{"data", {{"task", "text"}, {"path", "pipe.txt"}}}}.dump(), p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "data.path = \"" + real_fifo +
                           "\" is a pipe (FIFO), not a regular file; data.path must name a "
                           "regular file");
  std::tie(status, msg) = refusal(
      json{{"data", {{"task", "text"}, {"path", "train.txt"}, {"eval_path", "pipe.txt"}}}}.dump(),
      p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "data.eval_path = \"" + real_fifo + "\" is a pipe (FIFO)");
  std::tie(status, msg) = refusal(json{{"data", {{"tokenizer", "hf:pipe.txt"}}}}.dump(), p);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "data.tokenizer = \"hf:" + real_fifo + "\": " + real_fifo +
                           " is a pipe (FIFO), not a regular file");
  // A device was refused already.
  serve::PathPolicy dev({"/dev"});
  std::tie(status, msg) =
      refusal(json{{"data", {{"task", "text"}, {"path", "/dev/zero"}}}}.dump(), dev);
  EXPECT_EQ(status, 400);
  EXPECT_CONTAINS(msg, "data.path = \"/dev/zero\" is a character device");
}

TEST(ServePaths, TraversalAttemptsOverHttpGet403AndArtifactsStayInTheRun) {
  Tree t;
  const std::string dir = temp_dir("serve-paths-http");
  std::ofstream(dir + "/keys") << kTestKey << "\n";
  ServeProcess srv(
      {"--root", dir + "/root", "--api-key-file", dir + "/keys", "--data-root", t.data});
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  for (const std::string& path : {std::string("../secret.txt"), t.top + "/secret.txt",
                                  t.data + "/escape/secret.txt", std::string("/etc/passwd")}) {
    json body = tiny_config(5);
    body["data"]["task"] = "text";
    body["data"]["path"] = path;
    auto r = api.post("/v1/runs", body.dump());
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 403) << path << ": " << r->body;
    EXPECT_CONTAINS(r->body, path);
  }
  EXPECT_EQ(api.get_json("/v1/runs")["data"].size(), 0u);  // nothing was created
  // Artifacts: a finished run's files, and nothing outside its directory.
  auto r = api.post("/v1/runs", tiny_config(3).dump());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 201) << r->body;
  const std::string id = json::parse(r->body)["id"];
  api.wait_run(id, [](const json& j) { return j["state"] == "succeeded"; });
  const json files = api.get_json("/v1/runs/" + id + "/artifacts");
  bool has_metrics = false;
  for (const json& f : files["data"]) has_metrics |= f["path"] == "metrics.jsonl";
  EXPECT_TRUE(has_metrics) << files.dump();
  // keel's out_dir lock is bookkeeping, not an artifact: it was listed and served.
  ASSERT_TRUE(fs::exists(dir + "/root/runs/" + id + "/.keel.lock"));
  EXPECT_EQ(files.dump().find(".keel.lock"), std::string::npos) << files.dump();
  fs::create_symlink(".keel.lock", dir + "/root/runs/" + id + "/lock-link");
  for (const char* internal : {".keel.lock", "./.keel.lock", "lock-link"}) {
    r = api.get("/v1/runs/" + id + "/artifacts/" + std::string(internal));
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 404) << internal << ": " << r->body;
    EXPECT_CONTAINS(r->body, "no artifact");
  }
  EXPECT_EQ(api.get_json("/v1/runs/" + id + "/artifacts").dump().find("lock-link"),
            std::string::npos);
  fs::remove(dir + "/root/runs/" + id + "/lock-link");
  r = api.get("/v1/runs/" + id + "/artifacts/metrics.jsonl");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_CONTAINS(r->body, "\"loss\"");
  // Byte ranges: within the file, 206 with those bytes; from past its end, 416 with the size
  // (cpp-httplib answered 206 with a Content-Length of 2^64 - n and no body: the client hung).
  const std::string whole = r->body;
  r = api.get("/v1/runs/" + id + "/artifacts/metrics.jsonl", {{"Range", "bytes=2-9"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 206);
  EXPECT_EQ(r->body, whole.substr(2, 8));
  for (const std::string& range :
       {"bytes=" + std::to_string(whole.size()) + "-", std::string("bytes=999999-1000000")}) {
    r = api.get("/v1/runs/" + id + "/artifacts/metrics.jsonl", {{"Range", range}});
    ASSERT_TRUE(r) << range;
    EXPECT_EQ(r->status, 416) << range;
    EXPECT_EQ(r->get_header_value("Content-Range"), "bytes */" + std::to_string(whole.size()));
  }
  fs::create_symlink(t.top + "/secret.txt", dir + "/root/runs/" + id + "/leak.txt");
  for (const char* bad : {"../../keel-serve.db", "..%2F..%2Fkeel-serve.db", "leak.txt",
                          "%2Fetc%2Fpasswd", "checkpoints/../../../keel-serve.db"}) {
    r = api.get("/v1/runs/" + id + "/artifacts/" + std::string(bad));
    ASSERT_TRUE(r);
    EXPECT_TRUE(r->status == 403 || r->status == 404) << bad << ": " << r->status;
    EXPECT_EQ(r->body.find("no\n"), std::string::npos) << bad;
    // A path refusal is not about the key: OpenAI's permission_error, not authentication_error.
    if (r->status == 403) {
      EXPECT_CONTAINS(r->body, "\"type\":\"permission_error\"");
    }
  }
}

// A Range header is for an artifact's bytes. One that ends past the file is cut at its end: httplib
// promised the bytes asked for (Content-Length: 100000000 for a file of a few KB) and the client
// waited for them. Any other answer goes whole: httplib cut errors and JSON to the range too (a
// 401 or 404 sent as `{"`, a 416's error as nothing, an events stream called 206).
TEST(ServePaths, AnArtifactRangePastItsEndEndsWithItAndOtherAnswersAreWhole) {
  const std::string dir = temp_dir("serve-ranges");
  std::ofstream(dir + "/keys") << kTestKey << "\n";
  ServeProcess srv({"--root", dir + "/root", "--api-key-file", dir + "/keys"});
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  auto r = api.post("/v1/runs", tiny_config(2).dump());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 201) << r->body;
  const std::string id = json::parse(r->body)["id"];
  api.wait_run(id, [](const json& j) { return j["state"] == "succeeded"; });
  const std::string file = "/v1/runs/" + id + "/artifacts/metrics.jsonl";
  const std::string whole = api.get(file)->body;
  ASSERT_GT(whole.size(), 10u);
  const std::string size = std::to_string(whole.size());
  for (const auto& [range, first] :
       {std::pair<std::string, size_t>{"bytes=0-99999999", 0}, {"bytes=5-99999999", 5}}) {
    r = api.get(file, {{"Range", range}});
    ASSERT_TRUE(r) << range;
    EXPECT_EQ(r->status, 206) << range;
    EXPECT_EQ(r->body, whole.substr(first)) << range;
    EXPECT_EQ(
        r->get_header_value("Content-Range"),
        "bytes " + std::to_string(first) + "-" + std::to_string(whole.size() - 1) + "/" + size);
  }
  // Several ranges at once: the whole file (httplib's multipart answer said the file held 0 bytes).
  r = api.get(file, {{"Range", "bytes=0-4,8-99999999"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, whole);
  auto expect_whole_error = [](const httplib::Result& res, int status, const std::string& says) {
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, status);
    const json err = json::parse(res->body, nullptr, false);
    ASSERT_TRUE(err.is_object() && err.contains("error")) << res->body;
    EXPECT_CONTAINS(err["error"]["message"].get<std::string>(), says);
  };
  expect_whole_error(api.get(file, {{"Range", "bytes=" + size + "-"}}), 416,
                     "is not within the artifact's " + size + " bytes");
  expect_whole_error(api.get("/v1/runs/" + id + "/artifacts/nothing.txt", {{"Range", "bytes=0-1"}}),
                     404, "no artifact nothing.txt");
  expect_whole_error(Api{srv.port(), ""}.get(file, {{"Range", "bytes=0-1"}}), 401, "Authorization");
  r = api.get("/v1/runs/" + id, {{"Range", "bytes=0-10"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_FALSE(r->has_header("Content-Range"));
  EXPECT_EQ(json::parse(r->body, nullptr, false).value("id", ""), id) << r->body;
  r = api.get("/v1/runs/" + id + "/events", {{"Range", "bytes=0-10"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_CONTAINS(r->body, "event: end");
}

}  // namespace
}  // namespace keel::test
