// Running the built `keel` binary from end-to-end tests (tests/cli/): one helper for every CLI
// test, so they all capture output, exit codes and peak memory the same way.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace keel::test {

struct KeelRun {
  int code = -1;         // exit status; -1 when the child did not exit normally
  std::string out, err;  // its stdout and stderr
  std::string output;    // out + err (for "does the run mention X" checks)
  long max_rss_kb = 0;   // the child's own peak resident set (getrusage via wait4)
};

// Runs keel with `args` as its argv (no shell: arguments need no quoting), with extra environment
// entries "NAME=value" set in the child. stdout and stderr go to files under a temp directory and
// are read back, so a chatty child never blocks on a full pipe.
KeelRun run_keel(const std::vector<std::string>& args, const std::vector<std::string>& env = {});

// Runs any program: argv[0] is its path (mpirun, or keel itself), the rest as run_keel.
KeelRun run_command(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});

// The same through /bin/sh: `args` is one command line after the binary's path, with shell quoting
// (e.g. "train --set 'model.adapter.target_modules=[\"qkv\"]'").
KeelRun run_keel_sh(const std::string& args, const std::vector<std::string>& env = {});

// Appends "--set S" for every S in `sets` to `args`.
std::vector<std::string> with_sets(std::vector<std::string> args,
                                   const std::vector<std::string>& sets);

// The step records of OUT_DIR/metrics.jsonl (the lines with a "loss"), in order.
std::vector<nlohmann::json> step_records(const std::string& out_dir);
// The records of OUT_DIR/metrics.jsonl that hold `key` ("eval_loss": evaluations), in order.
std::vector<nlohmann::json> records_with(const std::string& out_dir, const std::string& key);

// The whole file as a string ("" when it cannot be read).
std::string slurp(const std::string& path);

// A tiny Llama written by init-model (1 layer, 32 wide, 2 heads) as DIR/llama, and an HF
// tokenizer directory DIR/tok: tests/data/tokenizer_parity/tiny/`tokenizer_json` with `config` as
// its tokenizer_config.json (bos/eos, a chat template).
struct TinyChatModel {
  std::string model, tokenizer;
};
TinyChatModel tiny_chat_model(const std::string& dir, int64_t vocab_size, int64_t max_seq_len,
                              const std::string& tokenizer_json, const nlohmann::json& config);

// A published chat template as tests/fixtures/chat_templates.json holds it (gen_chat_templates.py),
// by the name of one of its cases ("qwen3/alternating/gen=False").
std::string published_chat_template(const std::string& case_name);

}  // namespace keel::test
