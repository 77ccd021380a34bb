// The dashboard in a real browser: Debian's chromium, headless, driven over WebDriver by
// chromedriver. The key is typed into the page, a run is picked from the list and watched while
// it trains (state, step, charted points), then a run stopped by a non-finite step shows its
// marked step and replay command. A screenshot is kept at BUILD/serve-dashboard.png. Skips (with
// the reason) where chromium or chromedriver is not installed (scripts/install-deps.sh installs
// both).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "tests/serve/serve_process.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel::test {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string base64_decode(const std::string& in) {
  static const std::string chars =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  unsigned acc = 0;
  int bits = 0;
  for (char c : in) {
    const size_t v = chars.find(c);
    if (v == std::string::npos) continue;  // '=' and whitespace
    acc = (acc << 6) | static_cast<unsigned>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

// chromedriver on an ephemeral port, and one headless chromium session through it.
class Browser {
 public:
  Browser() {
    log_ = temp_dir("serve-chromedriver") + "/chromedriver.log";
    std::fflush(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      if (!std::freopen(log_.c_str(), "w", stdout) || !std::freopen(log_.c_str(), "a", stderr))
        _exit(127);
      execl("/usr/bin/chromedriver", "chromedriver", "--port=0", static_cast<char*>(nullptr));
      _exit(127);
    }
    static const std::regex kPort(R"(started successfully on port (\d+))");
    for (int i = 0; i < 300 && port_ < 0; ++i) {
      std::smatch m;
      const std::string out = slurp(log_);
      if (std::regex_search(out, m, kPort)) port_ = std::stoi(m[1]);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (port_ < 0) return;
    const json caps = {{"capabilities",
                        {{"alwaysMatch",
                          {{"goog:chromeOptions",
                            {{"binary", "/usr/bin/chromium"},
                             {"args",
                              {"--headless=new", "--no-sandbox", "--disable-gpu",
                               "--disable-dev-shm-usage", "--window-size=1400,1000"}}}}}}}}};
    const json r = call("POST", "/session", caps);
    session_ = r["value"].value("sessionId", "");
  }
  ~Browser() {
    if (!session_.empty()) call("DELETE", "/session/" + session_, json());
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool ok() const { return !session_.empty(); }
  std::string log() const { return slurp(log_); }

  json call(const std::string& method, const std::string& path, const json& body) {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(std::chrono::seconds(60));
    httplib::Result r = method == "POST"     ? c.Post(path.c_str(), body.dump(), "application/json")
                        : method == "DELETE" ? c.Delete(path.c_str())
                                             : c.Get(path.c_str());
    if (!r) return json();
    return json::parse(r->body, nullptr, false);
  }
  json session(const std::string& method, const std::string& path,
               const json& body = json::object()) {
    return call(method, "/session/" + session_ + path, body)["value"];
  }
  void open(const std::string& url) { session("POST", "/url", {{"url", url}}); }
  std::string element(const std::string& css) {
    const json v = session("POST", "/element", {{"using", "css selector"}, {"value", css}});
    return v.is_object() && !v.empty() ? v.begin().value().get<std::string>() : "";
  }
  void type(const std::string& css, const std::string& text) {
    session("POST", "/element/" + element(css) + "/value", {{"text", text}});
  }
  void click(const std::string& css) { session("POST", "/element/" + element(css) + "/click"); }
  json script(const std::string& js) {
    return session("POST", "/execute/sync", {{"script", js}, {"args", json::array()}});
  }
  // Polls the page's `js` (an expression) until `done` holds or `timeout` passes.
  json wait_for(const std::string& js, const std::function<bool(const json&)>& done,
                std::chrono::seconds timeout = std::chrono::seconds(60)) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    json v;
    while (std::chrono::steady_clock::now() < end) {
      v = script("return " + js + ";");
      if (done(v)) return v;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ADD_FAILURE() << "the page never satisfied the condition on `" << js << "`; last: " << v.dump();
    return v;
  }
  void screenshot(const std::string& path) {
    const json v = session("GET", "/screenshot");
    if (v.is_string()) std::ofstream(path, std::ios::binary) << base64_decode(v.get<std::string>());
  }

 private:
  pid_t pid_ = -1;
  int port_ = -1;
  std::string log_, session_;
};

TEST(ServeDashboard, ShowsARunLiveInAHeadlessChromium) {
  if (!fs::exists("/usr/bin/chromium") || !fs::exists("/usr/bin/chromedriver"))
    GTEST_SKIP() << "chromium and chromedriver are not installed (apt-get install chromium "
                    "chromium-driver, as scripts/install-deps.sh does): the dashboard is not "
                    "tested in a browser here";
  const std::string dir = temp_dir("serve-dashboard");
  std::ofstream(dir + "/keys") << kTestKey << "\n";
  ServeProcess srv({"--root", dir + "/root", "--api-key-file", dir + "/keys"});
  ASSERT_TRUE(srv.started()) << srv.output();
  Api api{srv.port(), kTestKey};
  Browser b;
  ASSERT_TRUE(b.ok()) << "no WebDriver session: " << b.log();
  const std::string url = "http://127.0.0.1:" + std::to_string(srv.port()) + "/";
  b.open(url);
  EXPECT_EQ(b.script("return document.title;"), "keel serve");
  // A wrong key: the page says so.
  b.type("#key", "wrong");
  b.click("#connect");
  b.wait_for("document.getElementById('status').textContent", [](const json& v) {
    return v.is_string() && v.get<std::string>().find("401") != std::string::npos &&
           v.get<std::string>().find("not valid") != std::string::npos;
  });
  b.script("document.getElementById('key').value = '';");
  b.type("#key", kTestKey);
  b.click("#connect");
  b.wait_for("document.getElementById('status').textContent",
             [](const json& v) { return v == "connected"; });

  // Starts a run through the API, waits for the page to list it, and clicks its row.
  auto start_and_pick = [&](const json& cfg) {
    auto r = api.post("/v1/runs", cfg.dump());
    EXPECT_TRUE(r && r->status == 201) << (r ? r->body : "no response");
    const std::string id = r ? json::parse(r->body).value("id", "") : "";
    const std::string row = "tr[data-id='" + id + "']";
    b.wait_for("document.querySelector(\"" + row + "\") !== null",
               [](const json& v) { return v == true; });
    b.click(row);
    return id;
  };
  // A few seconds: watched while it trains (each step is several times slower under ASan).
  const int steps = std::getenv("KEEL_TEST_SANITIZED") ? 250 : 800;
  const std::string id = start_and_pick(tiny_config(steps));
  // While it trains: the page shows it running, with points arriving from the events stream.
  const json live = b.wait_for(
      "[document.getElementById('run-state') && document.getElementById('run-state').textContent, "
      "+document.getElementById('points').dataset.points]",
      [](const json& v) { return v[0] == "running" && v[1].get<int>() >= 5; });
  EXPECT_EQ(live[0], "running");
  // It really was mid-run: the page had charted some of the steps, not all. (Asking the API here
  // raced the run's end under ASan: 250 steps of the 1-layer config can finish in between.)
  EXPECT_LT(live[1].get<int>(), steps);
  b.screenshot(std::string(KEEL_BINARY_DIR) + "/serve-dashboard.png");
  const json done = b.wait_for(
      "[document.getElementById('run-state').textContent, "
      "+document.getElementById('points').dataset.points]",
      [](const json& v) { return v[0] == "succeeded"; }, std::chrono::seconds(120));
  // Every step charted. The state may reach the page (its poll of the run) before the events
  // stream's last steps: 796 of 800 were charted at that moment in a loaded fresh-clone run.
  const json charted = b.wait_for(
      "+document.getElementById('points').dataset.points",
      [&](const json& v) { return v.get<int>() == steps; }, std::chrono::seconds(20));
  EXPECT_EQ(charted.get<int>(), steps) << "at the state's change: " << done.dump();
  EXPECT_CONTAINS(
      b.script("return document.getElementById('runs').textContent;").get<std::string>(), id);

  // A non-finite stop: its step is marked and the replay command shown.
  json bad = tiny_config(20);
  bad["debug"] = {{"inject", {{"module", "transformer.h.0.attn"}, {"step", 4}, {"kind", "nan"}}}};
  start_and_pick(bad);
  const json shown = b.wait_for(
      "[document.getElementById('run-state') && document.getElementById('run-state').textContent, "
      "document.getElementById('replay') && document.getElementById('replay').textContent, "
      "+document.getElementById('points').dataset.nonfinite]",
      [](const json& v) {
        return v[0] == "nonfinite" && v[1].is_string() && v[2].get<int>() >= 1;
      });
  EXPECT_CONTAINS(shown[1].get<std::string>(), "keel replay ");
  EXPECT_CONTAINS(
      b.script("return document.getElementById('error').textContent;").get<std::string>(),
      "step 4");
  b.screenshot(std::string(KEEL_BINARY_DIR) + "/serve-dashboard-nonfinite.png");
  EXPECT_GT(fs::file_size(std::string(KEEL_BINARY_DIR) + "/serve-dashboard.png"), 1000u);
}

}  // namespace
}  // namespace keel::test
