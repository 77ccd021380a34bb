// Runs end to end: one active run (50 concurrent creates), idempotent creates, an events stream
// followed to the end, stop = checkpoint then resume bit-identically, a server killed with SIGKILL
// and restarted (interrupted, resumable), a non-finite stop with its capture.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>
#include <tuple>

#include "keel/serve/registry.h"
#include "tests/serve/serve_process.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel::test {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kLongSteps = 400;  // a few seconds: long enough to stop or kill it midway

struct Service {
  std::string dir = temp_dir("serve-runs");
  std::string root = dir + "/root";
  std::vector<std::string> args;
  Service() {
    std::ofstream(dir + "/keys") << kTestKey << "\n";
    args = {"--root", root, "--api-key-file", dir + "/keys"};
  }
  std::string run_dir(const std::string& id) const { return root + "/runs/" + id; }
};

std::string create(const Api& api, const json& config, int expect = 201) {
  auto r = api.post("/v1/runs", config.dump());
  if (!r) {
    ADD_FAILURE() << "POST /v1/runs: no response";
    return "";
  }
  EXPECT_EQ(r->status, expect) << r->body;
  return json::parse(r->body).value("id", "");
}

// EXPECTs the loss of every step of a run that was stopped and resumed to be bit for bit the loss
// of an uninterrupted `keel train` of the same config (the run's run.toml).
void expect_losses_of_an_uninterrupted_run(const std::string& run_dir) {
  const std::string out = temp_dir("serve-reference");
  const KeelRun r = run_keel({"train", run_dir + "/run.toml", "--set", "run.out_dir=" + out},
                             {"OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.code, 0) << r.output;
  const std::vector<double> losses = losses_by_step(run_dir), ref = losses_by_step(out);
  ASSERT_EQ(losses.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(losses[i], ref[i]) << "step " << i + 1;
}

TEST(ServeRuns, FiftyConcurrentCreatesAcceptExactlyOne) {
  Service s;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  std::atomic<int> created{0}, conflicts{0}, other{0};
  std::vector<std::string> active_ids(50);
  std::vector<std::thread> clients;
  for (int i = 0; i < 50; ++i)
    clients.emplace_back([&, i] {
      auto r = api.post("/v1/runs", tiny_config(kLongSteps).dump());
      if (r && r->status == 201)
        ++created;
      else if (r && r->status == 409) {
        ++conflicts;
        active_ids[i] = json::parse(r->body)["error"]["active_run"];
      } else {
        ++other;
        ADD_FAILURE() << "create " << i << ": "
                      << (r ? std::to_string(r->status) + " " + r->body
                            : "no response: " + httplib::to_string(r.error()));
      }
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(created.load(), 1);
  EXPECT_EQ(conflicts.load(), 49);
  EXPECT_EQ(other.load(), 0);
  const json runs = api.get_json("/v1/runs")["data"];
  ASSERT_EQ(runs.size(), 1u);
  for (const std::string& id : active_ids)
    if (!id.empty()) {
      EXPECT_EQ(id, runs[0]["id"]);  // each 409 names the active run
    }
  const std::string id = runs[0]["id"];
  auto r = api.post("/v1/runs/" + id + "/stop", "");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 202) << r->body;
  api.wait_run(id,
               [](const json& j) { return j["state"] == "stopped" || j["state"] == "succeeded"; });
  create(api, tiny_config(3));  // no run active: accepted again
}

TEST(ServeRuns, IdempotencyKeyReturnsTheSameRun) {
  Service s;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  const std::string body = tiny_config(3).dump();
  auto a = api.post("/v1/runs", body, {{"Idempotency-Key", "job-17"}});
  auto b = api.post("/v1/runs", body, {{"Idempotency-Key", "job-17"}});
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->status, 201);
  EXPECT_EQ(b->status, 200);
  const std::string id = json::parse(a->body)["id"];
  EXPECT_EQ(json::parse(b->body)["id"], id);
  auto c = api.post("/v1/runs", tiny_config(4).dump(), {{"Idempotency-Key", "job-17"}});
  ASSERT_TRUE(c);
  EXPECT_EQ(c->status, 422);
  EXPECT_CONTAINS(c->body, id);
  api.wait_run(id, [](const json& j) { return j["state"] == "succeeded"; });
  EXPECT_EQ(api.get_json("/v1/runs")["data"].size(), 1u);
}

// The events of a stream read to its end: (type, data) in order, and the last id seen.
struct Events {
  std::vector<std::pair<std::string, json>> list;
  int64_t last_id = 0;
  int count(const std::string& type) const {
    int n = 0;
    for (auto& [t, d] : list) n += t == type;
    return n;
  }
};

Events read_events(const Api& api, const std::string& id, int64_t last_event_id = -1) {
  httplib::Client c("127.0.0.1", api.port);
  c.set_read_timeout(std::chrono::seconds(60));
  httplib::Headers h = {{"Authorization", "Bearer " + api.key}};
  if (last_event_id >= 0) h.emplace("Last-Event-ID", std::to_string(last_event_id));
  Events ev;
  std::string buf;
  auto r = c.Get(("/v1/runs/" + id + "/events").c_str(), h, [&](const char* data, size_t n) {
    buf.append(data, n);
    size_t end;
    while ((end = buf.find("\n\n")) != std::string::npos) {
      std::string type, payload;
      std::istringstream block(buf.substr(0, end));
      buf.erase(0, end + 2);
      for (std::string line; std::getline(block, line);) {
        if (line.rfind("event: ", 0) == 0) type = line.substr(7);
        if (line.rfind("data: ", 0) == 0) payload = line.substr(6);
        if (line.rfind("id: ", 0) == 0) ev.last_id = std::stoll(line.substr(4));
      }
      if (!type.empty()) ev.list.emplace_back(type, json::parse(payload));
    }
    return true;
  });
  EXPECT_TRUE(r) << "events stream of " << id << " failed";
  if (r) {
    EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  }
  return ev;
}

TEST(ServeRuns, EventsStreamFollowsARunToItsEndAndResumesWithLastEventId) {
  Service s;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  const int steps = 120;
  const std::string id = create(api, tiny_config(steps));
  const Events ev = read_events(api, id);  // returns when the run ends
  EXPECT_EQ(ev.count("step"), steps);
  EXPECT_EQ(ev.count("eval"), 1);
  ASSERT_FALSE(ev.list.empty());
  ASSERT_FALSE(ev.list.empty());
  EXPECT_EQ(ev.list.back().first, "end");
  EXPECT_EQ(ev.list.back().second["state"], "succeeded");
  EXPECT_EQ(ev.list.back().second["step"], steps);
  int64_t step = 0;
  for (auto& [type, data] : ev.list)
    if (type == "step") {
      EXPECT_EQ(data["step"].get<int64_t>(), ++step);  // in order, none lost
    }
  EXPECT_EQ(ev.last_id, steps + 1);  // one id per metrics.jsonl line (the eval record last)
  // Reconnecting after event 100 gets exactly the rest.
  const Events rest = read_events(api, id, 100);
  EXPECT_EQ(rest.count("step"), steps - 100);
  EXPECT_EQ(rest.list.front().second["step"], 101);
  const json run = api.get_json("/v1/runs/" + id);
  EXPECT_EQ(run["total_steps"], steps);
  EXPECT_EQ(run["exit_code"], 0);
  for (const char* k : {"loss", "grad_norm", "loss_scale", "learning_rate", "tokens_per_s"})
    EXPECT_TRUE(run[k].is_number()) << k << ": " << run.dump();
  auto r = api.get("/v1/runs/run-000000000000/events");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
}

// GET /v1/runs pages as OpenAI's lists (limit 1 to 100, after = the previous page's last id,
// has_more). limit and after were ignored (limit=0, limit=-1 and limit=2 each listed every run),
// and so was a misspelt parameter. The runs are written to the registry before the server starts:
// no training needed.
TEST(ServeRuns, ListPagesWithLimitAndAfterAndRefusesWhatItCannotRead) {
  Service s;
  fs::create_directories(s.root);
  {
    serve::Registry reg(s.root + "/keel-serve.db");
    for (int i = 0; i < 5; ++i) {
      serve::RunRecord r;
      r.id = "run-00000000000" + std::to_string(i);
      r.state = "succeeded";
      r.created_at = r.updated_at = "2026-01-01T00:00:0" + std::to_string(i) + ".000Z";
      r.request = "{}";
      reg.insert(r);
    }
  }
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  auto ids = [](const json& page) {
    std::string out;
    for (const json& r : page["data"]) out += r["id"].get<std::string>().back();
    return out;
  };
  json page = api.get_json("/v1/runs");  // every run, newest first
  EXPECT_EQ(ids(page), "43210");
  EXPECT_EQ(page["has_more"], false);
  page = api.get_json("/v1/runs?limit=2");
  EXPECT_EQ(ids(page), "43");
  EXPECT_EQ(page["has_more"], true);
  page = api.get_json("/v1/runs?limit=2&after=run-000000000003");
  EXPECT_EQ(ids(page), "21");
  EXPECT_EQ(page["has_more"], true);
  page = api.get_json("/v1/runs?limit=2&after=run-000000000001");
  EXPECT_EQ(ids(page), "0");
  EXPECT_EQ(page["has_more"], false);
  page = api.get_json("/v1/runs?after=run-000000000000");
  EXPECT_EQ(ids(page), "");
  for (const auto& [query, param, says] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"limit=0", "limit", "limit=0 is not a page size"},
           {"limit=-1", "limit", "from 1 to 100"},
           {"limit=101", "limit", "from 1 to 100"},
           {"limit=2x", "limit", "limit=2x"},
           {"after=run-999999999999", "after", "no run run-999999999999"},
           {"limt=2", "limt", "unknown query parameter limt"}}) {
    auto r = api.get("/v1/runs?" + query);
    ASSERT_TRUE(r) << query;
    EXPECT_EQ(r->status, 400) << query << ": " << r->body;
    const json err = json::parse(r->body)["error"];
    EXPECT_EQ(err["type"], "invalid_request_error") << query;
    EXPECT_EQ(err["param"], param) << query;
    EXPECT_CONTAINS(err["message"].get<std::string>(), says);
  }
  auto r = api.get("/v1/runs/run-000000000001?verbose=1");  // a route that takes none
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_CONTAINS(r->body, "unknown query parameter verbose");
}

// Each events stream holds a request thread for its run's life. With as many streams as threads
// (--threads 4, 4 dashboards), nothing else was answered, not /health, not the run's stop, until
// a stream ended. Streams may hold threads - max(2, threads / 4) of them; one more is a 503 that
// says why, and the stop still gets through.
TEST(ServeRuns, EventsStreamsLeaveThreadsForAStatusAndAStop) {
  Service s;
  std::vector<std::string> args = s.args;
  args.insert(args.end(), {"--threads", "4"});
  ServeProcess srv(args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  const std::string id = create(api, tiny_config(20000));
  std::atomic<int> open{0};
  std::vector<std::thread> streams;
  // A failed ASSERT returns with the streams open: stopping the server ends them (it ends every
  // stream), and nothing waits for the run's 20000 steps.
  struct EndStreams {
    ServeProcess& srv;
    std::vector<std::thread>& streams;
    ~EndStreams() {
      for (auto& t : streams)
        if (t.joinable()) {
          srv.stop();
          t.join();
        }
    }
  } end_streams{srv, streams};
  for (int i = 0; i < 2; ++i)
    streams.emplace_back([&] {
      httplib::Client c("127.0.0.1", api.port);
      c.set_read_timeout(std::chrono::seconds(30));
      bool counted = false;
      c.Get(("/v1/runs/" + id + "/events").c_str(), {{"Authorization", "Bearer " + api.key}},
            [&](const char*, size_t) {
              if (!std::exchange(counted, true)) ++open;
              return true;
            });
    });
  for (int i = 0; i < 500 && open < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(open.load(), 2);
  httplib::Client c("127.0.0.1", api.port);
  c.set_read_timeout(std::chrono::seconds(5));  // the requests below waited for a free thread
  auto r = c.Get(("/v1/runs/" + id + "/events").c_str(), {{"Authorization", "Bearer " + api.key}});
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 503) << r->body;
  EXPECT_CONTAINS(r->body, "2 events streams are open");
  EXPECT_CONTAINS(r->body, "--threads 4");
  EXPECT_EQ(r->get_header_value("Retry-After"), "10");
  r = c.Get("/health");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  r = c.Post(("/v1/runs/" + id + "/stop").c_str(), {{"Authorization", "Bearer " + api.key}}, "",
             "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 202) << r->body;
  for (auto& t : streams) t.join();  // they end with the run
  // Their threads are free again: a stream of the stopped run is served (its end).
  const Events after = read_events(api, id);
  ASSERT_FALSE(after.list.empty());
  EXPECT_EQ(after.list.back().first, "end");
}

// A Last-Event-ID past the run's last event: an active run's stream waited, silent, until its
// metrics reached that line (a 10^6 never), losing every event before it. It is a 400 naming the
// header and the last id; a run that is done ends the stream at once (state, then end).
TEST(ServeRuns, ALastEventIdPastTheEndIs400WhileActiveAndTheEndOnceDone) {
  Service s;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  const std::string id = create(api, tiny_config(20000));
  api.wait_run(id, [](const json& j) { return j["step"].get<int64_t>() >= 2; });
  httplib::Client c("127.0.0.1", api.port);
  c.set_read_timeout(std::chrono::seconds(5));  // the stream sent `state`, then nothing
  auto r = c.Get(("/v1/runs/" + id + "/events").c_str(),
                 {{"Authorization", "Bearer " + api.key}, {"Last-Event-ID", "1000000"}});
  ASSERT_TRUE(r) << "no answer: " << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 400) << r->body;
  const json err = json::parse(r->body)["error"];
  EXPECT_EQ(err["param"], "Last-Event-ID");
  EXPECT_CONTAINS(err["message"].get<std::string>(), "Last-Event-ID 1000000");
  const int64_t have = err["last_event_id"];
  EXPECT_GE(have, 2);
  EXPECT_CONTAINS(err["message"].get<std::string>(), "id " + std::to_string(have));
  auto stop = api.post("/v1/runs/" + id + "/stop", "");
  ASSERT_TRUE(stop);
  api.wait_run(id, [](const json& j) { return j["state"] == "stopped"; });
  const Events done = read_events(api, id, 1000000);
  ASSERT_EQ(done.list.size(), 2u);
  EXPECT_EQ(done.list[0].first, "state");
  EXPECT_EQ(done.list[1].first, "end");
  EXPECT_EQ(done.list[1].second["state"], "stopped");
}

// The advisor's findings (metrics.jsonl records {kind: advisor, step, trend, cause, action}) reach
// the stream as `finding` events of their own, with the same id as their line: at optim.lr = 10
// under bf16-mixed the first update destroys the model and the advisor says so within a few steps.
TEST(ServeRuns, AdvisorFindingsAreFindingEvents) {
  Service s;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  json cfg = tiny_config(12);
  cfg["train"]["precision"] = "bf16-mixed";
  cfg["train"]["on_nonfinite"] = "skip";
  cfg["optim"] = {{"lr", 10.0}};
  cfg["data"]["eval_examples"] = 0;
  const std::string id = create(api, cfg);
  const Events ev = read_events(api, id);
  ASSERT_GE(ev.count("finding"), 1) << "no finding event; metrics.jsonl:\n"
                                    << slurp(s.run_dir(id) + "/metrics.jsonl");
  std::vector<json> in_file;  // the advisor records of metrics.jsonl, in order
  std::ifstream in(s.run_dir(id) + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (json j = json::parse(line, nullptr, false);
        j.is_object() && j.value("kind", "") == "advisor")
      in_file.push_back(j);
  std::vector<json> events;
  for (auto& [type, data] : ev.list) {
    if (type == "finding") events.push_back(data);
    if (type == "record") {
      EXPECT_NE(data.value("kind", ""), "advisor") << data.dump();
    }
  }
  EXPECT_EQ(events, in_file);  // every finding, once, as written
  const json& f = events.front();
  EXPECT_EQ(f.at("trend"), "exploding") << f.dump();
  for (const char* k : {"step", "cause", "action"}) EXPECT_TRUE(f.contains(k)) << k << f.dump();
  EXPECT_CONTAINS(f.at("action").get<std::string>(), "lower optim.lr");
}

// POST .../resume (202), then the run's record once it has ended.
json resume_to_the_end(const Api& api, const std::string& id) {
  auto r = api.post("/v1/runs/" + id + "/resume", "");
  EXPECT_TRUE(r);
  if (r) {
    EXPECT_EQ(r->status, 202) << r->body;
  }
  return api.wait_run(
      id, [](const json& j) { return j["state"] == "succeeded" || j["state"] == "failed"; });
}

TEST(ServeRuns, StopCheckpointsAndResumeContinuesBitIdentically) {
  Service s;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  const std::string id = create(api, tiny_config(kLongSteps));
  api.wait_run(id, [](const json& j) { return j["step"].get<int64_t>() >= 20; });
  auto r = api.post("/v1/runs/" + id + "/stop", "");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 202);
  EXPECT_EQ(json::parse(r->body)["state"], "stopping");
  json run = api.wait_run(id, [](const json& j) { return j["state"] != "stopping"; });
  ASSERT_EQ(run["state"], "stopped") << run.dump();
  EXPECT_TRUE(run["resumable"].get<bool>());
  const int64_t stopped_at = run["step"];
  EXPECT_LT(stopped_at, kLongSteps);
  const json trainer = json::parse(slurp(s.run_dir(id) + "/checkpoints/last/trainer.json"));
  EXPECT_EQ(trainer["step"].get<int64_t>(), stopped_at);  // the checkpoint is of the last step
  EXPECT_CONTAINS(slurp(s.run_dir(id) + "/stdout.log"), "stopped by request at step");
  r = api.post("/v1/runs/" + id + "/stop", "");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 409);  // nothing to stop
  run = resume_to_the_end(api, id);
  EXPECT_EQ(run["state"], "succeeded") << run.dump();
  EXPECT_EQ(run["starts"], 2);
  r = api.post("/v1/runs/" + id + "/resume", "");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 409);  // a finished run does not resume
  // Every step once, with the losses of an uninterrupted run, bit for bit.
  EXPECT_EQ(step_records(s.run_dir(id)).size(), static_cast<size_t>(kLongSteps));
  expect_losses_of_an_uninterrupted_run(s.run_dir(id));
}

TEST(ServeRuns, ServerKilledMidRunRestartsWithTheRunInterruptedAndResumable) {
  Service s;
  std::string id;
  {
    ServeProcess srv(s.args);
    ASSERT_TRUE(srv.started()) << srv.output();
    Api api{srv.port(), kTestKey};
    id = create(api, tiny_config(kLongSteps));
    create(api, tiny_config(3), 409);
    api.wait_run(id, [](const json& j) { return j["step"].get<int64_t>() >= 20; });
    EXPECT_EQ(srv.stop(SIGKILL), 128 + SIGKILL);
  }
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  const json runs = api.get_json("/v1/runs")["data"];
  ASSERT_EQ(runs.size(), 1u);
  json run = runs[0];
  EXPECT_EQ(run["id"], id);
  EXPECT_EQ(run["state"], "interrupted") << run.dump();
  EXPECT_TRUE(run["resumable"].get<bool>());
  EXPECT_CONTAINS(run["error"].get<std::string>(), "/resume");
  // The orphaned child got SIGTERM when the server died (its parent-death signal): it saved a
  // checkpoint, so the resume loses nothing.
  EXPECT_TRUE(fs::exists(s.run_dir(id) + "/checkpoints/last/trainer.json"));
  EXPECT_CONTAINS(slurp(s.run_dir(id) + "/stdout.log"), "stopped by request at step");
  EXPECT_EQ(resume_to_the_end(api, id)["state"], "succeeded");
  // It resumed at the step it checkpointed: every step once.
  EXPECT_EQ(step_records(s.run_dir(id)).size(), static_cast<size_t>(kLongSteps));
  expect_losses_of_an_uninterrupted_run(s.run_dir(id));
}

// The `keel train` process of a run, found by its run directory in its command line.
pid_t child_of(const std::string& run_dir) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "cmdline");
    std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmd.find(run_dir + "/run.toml") != std::string::npos) return std::stoi(name);
  }
  return -1;
}

// POST stop, then the server killed before the child finished the stop: the child completes it
// (checkpoint, "stopped by request", exit 0) unseen, and the restarted server found the run
// `stopping` and called it `interrupted`. It is `stopped`, as the server would have recorded.
// The registry is left as such a server leaves it (a child held with SIGSTOP would not do: the
// server's death orphans its process group, and the kernel ends a stopped one with SIGHUP).
TEST(ServeRuns, ARunStoppingWhenTheServerDiedIsStoppedOnceItsChildFinishedTheStop) {
  Service s;
  std::string id;
  pid_t child = -1;
  {
    ServeProcess srv(s.args);
    ASSERT_TRUE(srv.started()) << srv.output();
    Api api{srv.port(), kTestKey};
    id = create(api, tiny_config(kLongSteps));
    api.wait_run(id, [](const json& j) { return j["step"].get<int64_t>() >= 20; });
    child = child_of(s.run_dir(id));
    ASSERT_GT(child, 0);
    auto r = api.post("/v1/runs/" + id + "/stop", "");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 202);
    api.wait_run(id, [](const json& j) { return j["state"] == "stopped"; });
  }
  {
    serve::Registry reg(s.root + "/keel-serve.db");
    serve::RunRecord r = reg.get(id).value();
    r.state = "stopping";  // the child's exit never recorded
    r.pid = child;
    r.exit_code = -1;
    reg.update(r);
  }
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  EXPECT_CONTAINS(slurp(s.run_dir(id) + "/stdout.log"), "stopped by request at step");
  json run = api.get_json("/v1/runs/" + id);
  EXPECT_EQ(run["state"], "stopped") << run.dump();
  EXPECT_TRUE(run["error"].is_null()) << run.dump();
  EXPECT_TRUE(run["resumable"].get<bool>());
  EXPECT_EQ(resume_to_the_end(api, id)["state"], "succeeded");
  EXPECT_EQ(step_records(s.run_dir(id)).size(), static_cast<size_t>(kLongSteps));
}

// The first list after a restart builds every run's feed (each reads its run's metrics.jsonl:
// 4 s for 50 runs of 20,000 steps); it did so holding the lock every status, events stream and
// the active run's poller take, and they all waited. Here the first feed built waits on a gate
// (the test hook KEEL_SERVE_TEST_FEED_GATE) while another run's status is asked for: it is
// answered while the list still waits.
TEST(ServeRuns, AFeedBeingBuiltHoldsNoLockOtherRequestsWaitOn) {
  Service s;
  std::vector<std::string> ids;
  {
    ServeProcess srv(s.args);
    ASSERT_TRUE(srv.started()) << srv.output();
    Api api{srv.port(), kTestKey};
    for (int i = 0; i < 2; ++i) {
      ids.push_back(create(api, tiny_config(3)));
      api.wait_run(ids.back(), [](const json& j) { return j["state"] == "succeeded"; });
    }
  }
  const std::string gate = s.dir + "/feed-gate";
  ::setenv("KEEL_SERVE_TEST_FEED_GATE", gate.c_str(), 1);
  ServeProcess srv(s.args);
  ::unsetenv("KEEL_SERVE_TEST_FEED_GATE");
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  auto list = std::async(std::launch::async, [&] { return api.get("/v1/runs"); });
  for (int i = 0; i < 1000 && !fs::exists(gate + ".entered"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const std::string building = slurp(gate + ".entered");
  const std::string other = building == ids[0] ? ids[1] : ids[0];
  httplib::Client c("127.0.0.1", srv.port());
  c.set_read_timeout(std::chrono::seconds(10));  // the gate waits 60 s
  auto status =
      c.Get(("/v1/runs/" + other).c_str(), {{"Authorization", std::string("Bearer ") + kTestKey}});
  const bool list_done = list.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  std::ofstream(gate) << "open\n";
  ASSERT_TRUE(status) << "the status waited for the list's feed build";
  EXPECT_EQ(status->status, 200);
  EXPECT_EQ(json::parse(status->body)["state"], "succeeded");
  EXPECT_FALSE(list_done);  // the gate held it
  auto l = list.get();
  ASSERT_TRUE(l);
  ASSERT_EQ(l->status, 200);
  EXPECT_EQ(json::parse(l->body)["data"].size(), 2u);
}

// A run's process killed outright (the OOM killer's SIGKILL) after a checkpoint: the run is
// interrupted and resumable from it. It ended "failed", not resumable, its checkpoint unused.
TEST(ServeRuns, AChildKilledAfterACheckpointIsInterruptedAndResumable) {
  Service s;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  json cfg = tiny_config(kLongSteps);
  cfg["log"]["checkpoint_every"] = 10;
  const std::string id = create(api, cfg);
  const std::string dir = s.run_dir(id);
  api.wait_run(id, [&](const json& j) {
    return j["step"].get<int64_t>() >= 25 && fs::exists(dir + "/checkpoints/last/trainer.json");
  });
  const pid_t child = child_of(dir);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  json run = api.wait_run(id, [](const json& j) { return j["state"] != "running"; });
  EXPECT_EQ(run["state"], "interrupted") << run.dump();
  EXPECT_TRUE(run["resumable"].get<bool>()) << run.dump();
  EXPECT_CONTAINS(run["error"].get<std::string>(), "SIGKILL");
  EXPECT_CONTAINS(run["error"].get<std::string>(), "its last checkpoint is kept");
  EXPECT_EQ(resume_to_the_end(api, id)["state"], "succeeded");
  expect_losses_of_an_uninterrupted_run(dir);
}

TEST(ServeRuns, ANonfiniteStopIsItsOwnStateWithTheCaptureAndReplayCommand) {
  Service s;
  s.root = s.dir + "/serve root";  // a space: the capture's path was cut at it
  s.args[1] = s.root;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  json cfg = tiny_config(30);
  cfg["debug"] = {{"inject", {{"module", "transformer.h.0.attn"}, {"step", 5}, {"kind", "nan"}}}};
  const std::string id = create(api, cfg);
  const json run = api.wait_run(
      id, [](const json& j) { return j["state"] != "running" && j["state"] != "queued"; });
  EXPECT_EQ(run["state"], "nonfinite") << run.dump();
  EXPECT_EQ(run["exit_code"], 3);
  ASSERT_TRUE(run["capture"].is_object()) << run.dump();
  const std::string capture = run["capture"]["path"];
  EXPECT_TRUE(fs::exists(capture)) << capture;
  EXPECT_EQ(capture, s.run_dir(id) + "/debug/nan_capture/rank0");
  EXPECT_EQ(run["capture"]["replay"], "keel replay '" + capture + "'");  // one shell word
  EXPECT_CONTAINS(run["error"].get<std::string>(), "step 5");
  // The server is unharmed, and the capture is an artifact.
  EXPECT_EQ(api.get("/health")->status, 200);
  const std::string rel = fs::relative(capture, s.run_dir(id)).string();
  const json files = api.get_json("/v1/runs/" + id + "/artifacts")["data"];
  bool listed = false;
  for (const json& f : files) listed |= f["path"].get<std::string>().rfind(rel, 0) == 0;
  EXPECT_TRUE(listed) << rel << " in " << files.dump();
}

// keel train explains a non-finite stop over several stderr lines: here the tracer's finding
// (which module produced the first inf) before the "stopped:" line. The run's error kept only the
// "stopped:" line; it is now what keel train printed, the notes aside.
TEST(ServeRuns, ANonfiniteRunsErrorIsTheExplanationKeelTrainPrinted) {
  Service s;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  json cfg = tiny_config(40);  // 16-true's f16 AdamW state: the forward overflows at step 4
  cfg["train"]["precision"] = "16-true";
  cfg["data"] = {{"num_examples", 1280}, {"eval_examples", 0}};
  cfg["debug"] = {{"underflow_overflow", {{"enabled", true}}}};
  const std::string id = create(api, cfg);
  const json run = api.wait_run(
      id, [](const json& j) { return j["state"] != "running" && j["state"] != "queued"; });
  ASSERT_EQ(run["state"], "nonfinite") << run.dump();
  std::string printed;  // stderr.log without its notes
  std::istringstream err(slurp(s.run_dir(id) + "/stderr.log"));
  for (std::string line; std::getline(err, line);)
    if (line.rfind("note: ", 0) != 0) printed += (printed.empty() ? "" : "\n") + line;
  EXPECT_CONTAINS(printed, "underflow/overflow tracer: the first non-finite value was produced by");
  EXPECT_EQ(run["error"], printed);
}

TEST(ServeRuns, AFailedRunSaysWhyAndTheServerCarriesOn) {
  Service s;
  const std::string data = s.dir + "/data";
  fs::create_directories(data);
  std::ofstream(data + "/bad.jsonl") << "{\"text\": \"1+1=2\"}\n{not json\n";
  std::vector<std::string> args = s.args;
  args.insert(args.end(), {"--data-root", data});
  ServeProcess srv(args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  json cfg = tiny_config(5);
  cfg["data"] = {{"task", "jsonl"}, {"path", "bad.jsonl"}};
  const std::string id = create(api, cfg);  // a valid config; the file is bad
  const json run = api.wait_run(
      id, [](const json& j) { return j["state"] != "running" && j["state"] != "queued"; });
  EXPECT_EQ(run["state"], "failed") << run.dump();
  EXPECT_NE(run["exit_code"], 0);
  ASSERT_TRUE(run["error"].is_string()) << run.dump();
  EXPECT_CONTAINS(run["error"].get<std::string>(), "bad.jsonl");
  EXPECT_FALSE(run["resumable"].get<bool>());
  create(api, tiny_config(2));  // not active any more
}

// --root on a disk that fills while a run trains (an 8 MB tmpfs): the run fails on its writes,
// and the registry cannot record its end either. That Error, thrown in the thread that waits for
// the child, was std::terminate: the server aborted. Now the server carries on, answers with the
// run's end, and records it once the disk has space again. Needs root (mount); skipped otherwise.
TEST(ServeRuns, ARootOnAFullDiskKeepsTheServerUpAndRecordsTheRunsEndLater) {
  Service s;
  fs::create_directories(s.root);
  if (::geteuid() != 0 ||
      std::system(("mount -t tmpfs -o size=8M tmpfs '" + s.root + "' 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "needs root and mount (a tmpfs to fill)";
  struct Unmount {
    std::string dir;
    ~Unmount() { std::system(("umount -l '" + dir + "'").c_str()); }
  } unmount{s.root};
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  json cfg = tiny_config(100000);
  cfg["log"]["every"] = 1;  // a page of metrics.jsonl every ~20 steps: a write soon fails
  const std::string id = create(api, cfg);
  api.wait_run(id, [](const json& j) { return j["step"].is_number(); });
  const std::string fill = s.root + "/fill";
  ASSERT_NE(std::system(("dd if=/dev/zero of='" + fill + "' bs=64k 2>/dev/null").c_str()), -1);
  const json run = api.wait_run(
      id, [](const json& j) { return j["state"] != "running" && j["state"] != "queued"; });
  EXPECT_EQ(run["state"], "failed") << run.dump();
  EXPECT_EQ(::kill(srv.pid(), 0), 0) << "keel serve died: " << srv.output();
  EXPECT_CONTAINS(srv.output(), "the registry could not record it");
  fs::remove(fill);
  const std::string next = create(api, tiny_config(2));  // not active, and written now
  EXPECT_FALSE(next.empty());
  srv.stop();
  serve::Registry reg(s.root + "/keel-serve.db");
  ASSERT_TRUE(reg.get(id).has_value());
  EXPECT_EQ(reg.get(id)->state, "failed");
}

// A stopped LoRA run has its adapter so far (not only a finished one): download it.
TEST(ServeRuns, AStoppedAdapterRunsAdapterCanBeDownloaded) {
  Service s;
  ServeProcess srv(s.args);
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  json cfg = tiny_config(20000);
  cfg["model"] = {{"adapter", {{"kind", "lora"}, {"r", 4}, {"target_modules", {"c_attn"}}}}};
  const std::string id = create(api, cfg);
  api.wait_run(id, [](const json& j) { return j["step"].get<int64_t>() >= 5; });
  auto stop = api.post("/v1/runs/" + id + "/stop", "");
  ASSERT_TRUE(stop);
  const json run = api.wait_run(id, [](const json& j) { return j["state"] != "stopping"; });
  ASSERT_EQ(run["state"], "stopped") << run.dump() << slurp(s.run_dir(id) + "/stderr.log");
  auto r = api.get("/v1/runs/" + id + "/artifacts/adapter/adapter_config.json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["r"], 4);
  r = api.get("/v1/runs/" + id + "/artifacts/adapter/adapter_model.safetensors");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, slurp(s.run_dir(id) + "/adapter/adapter_model.safetensors"));
  r = api.get("/v1/runs/" + id + "/artifacts/adapter");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);  // a directory: the listing names its files
}

}  // namespace
}  // namespace keel::test
