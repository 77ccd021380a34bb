#include "tests/support/run_keel.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/support/check.h"

namespace keel::test {

// fork + exec of argv[0] with stdout/stderr redirected to files; waits with wait4 for the
// child's rusage.
KeelRun run_command(const std::vector<std::string>& argv_in, const std::vector<std::string>& env) {
  static int counter = 0;
  static const std::string dir = temp_dir("run-keel");
  const std::string base = dir + "/run" + std::to_string(counter++);
  const std::string out_path = base + ".out", err_path = base + ".err";
  KeelRun r;
  std::vector<char*> argv;
  for (const std::string& a : argv_in) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(nullptr);  // nothing buffered in the parent is written twice by the child
  const pid_t pid = fork();
  if (pid == 0) {
    if (!std::freopen(out_path.c_str(), "w", stdout) ||
        !std::freopen(err_path.c_str(), "w", stderr))
      _exit(127);
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  struct rusage ru {};
  if (pid > 0 && wait4(pid, &status, 0, &ru) == pid) {
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.max_rss_kb = ru.ru_maxrss;
  }
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  r.output = r.out + r.err;
  return r;
}

KeelRun run_keel(const std::vector<std::string>& args, const std::vector<std::string>& env) {
  std::vector<std::string> argv = {keel_binary()};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_command(argv, env);
}

KeelRun run_keel_sh(const std::string& args, const std::vector<std::string>& env) {
  return run_command({"/bin/sh", "-c", keel_binary() + " " + args}, env);
}

std::vector<std::string> with_sets(std::vector<std::string> args,
                                   const std::vector<std::string>& sets) {
  for (const std::string& s : sets) {
    args.push_back("--set");
    args.push_back(s);
  }
  return args;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<nlohmann::json> records_with(const std::string& out_dir, const std::string& key) {
  std::vector<nlohmann::json> out;
  std::ifstream f(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains(key)) out.push_back(j);
    }
  return out;
}

std::vector<nlohmann::json> step_records(const std::string& out_dir) {
  return records_with(out_dir, "loss");
}

TinyChatModel tiny_chat_model(const std::string& dir, int64_t vocab_size, int64_t max_seq_len,
                              const std::string& tokenizer_json, const nlohmann::json& config) {
  TinyChatModel m{dir + "/llama", dir + "/tok"};
  const KeelRun r =
      run_keel({"init-model", "--family", "llama", "--out", m.model, "--n-layer", "1", "--n-embd",
                "32", "--n-head", "2", "--vocab-size", std::to_string(vocab_size), "--max-seq-len",
                std::to_string(max_seq_len)});
  EXPECT_EQ(r.code, 0) << r.output;
  std::filesystem::create_directories(m.tokenizer);
  std::filesystem::copy_file(
      std::string(KEEL_SOURCE_DIR) + "/tests/data/tokenizer_parity/tiny/" + tokenizer_json,
      m.tokenizer + "/tokenizer.json");
  std::ofstream(m.tokenizer + "/tokenizer_config.json") << config.dump();
  return m;
}

std::string published_chat_template(const std::string& case_name) {
  std::ifstream in(std::string(KEEL_FIXTURES_DIR) + "/chat_templates.json");
  for (const nlohmann::json& c : nlohmann::json::parse(in))
    if (c.at("name") == case_name) return c.at("template").get<std::string>();
  ADD_FAILURE() << "chat_templates.json has no case " << case_name;
  return "";
}

}  // namespace keel::test
