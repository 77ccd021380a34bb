// The commands the docs show work as written: a new user copies them literally.
//  - DocumentedCommandsUseRealFlagsAndKeys: every `keel SUB ... --flag` in a shell block or inline
//    code of README.md, docs/, bench/README.md and examples/*/README.md names a flag that
//    `keel SUB --help` lists, and every `--set section.key=...` a key the config loader knows.
//  - ServeWalkthroughStartsAsWritten: the README's `keel serve` walkthrough, its lines up to and
//    including the server's start run as they are (only the port changes), starts the server.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "keel/train/config.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel::cli_docs {  // its own name: the CLI tests build as one unity unit
namespace {

namespace fs = std::filesystem;
const std::string kSrc = KEEL_SOURCE_DIR;

// The text of every ```sh (or unlabelled) block with backslash continuations joined, and every
// inline `...keel ...` span: where the docs show a command.
std::vector<std::string> command_lines(const std::string& md) {
  std::vector<std::string> out;
  std::istringstream in(md);
  bool open = false, shell = false;
  std::string pending;
  for (std::string line; std::getline(in, line);) {
    const auto b = line.find_first_not_of(" \t");
    if (b != std::string::npos && line.compare(b, 3, "```") == 0) {
      const std::string info = line.substr(b + 3);
      shell = !open && (info.empty() || info == "sh" || info == "bash");
      open = !open;
      continue;
    }
    if (open && shell) {
      if (!line.empty() && line.back() == '\\') {
        pending += line.substr(0, line.size() - 1) + " ";
        continue;
      }
      out.push_back(pending + line);
      pending.clear();
    } else if (!open) {
      static const std::regex span("`([^`]*keel [^`]*)`");
      for (auto it = std::sregex_iterator(line.begin(), line.end(), span);
           it != std::sregex_iterator(); ++it)
        out.push_back((*it)[1]);
    }
  }
  return out;
}

struct Invocation {
  std::string sub;                 // "generate", "numerics cast", ...
  std::vector<std::string> words;  // its arguments, up to a comment or the next command
};

std::vector<Invocation> invocations(const std::string& line) {
  static const std::set<std::string> subs = {"train",    "init-model", "selfcheck", "numerics",
                                             "replay",   "doctor",     "memory",    "serve",
                                             "tokenize", "generate",   "export",    "eval"};
  std::vector<Invocation> out;
  std::istringstream in(line);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  for (size_t i = 0; i + 1 < words.size(); ++i) {
    const std::string& w = words[i];
    if (!(w == "keel" || (w.size() > 5 && w.compare(w.size() - 5, 5, "/keel") == 0))) continue;
    if (!subs.count(words[i + 1])) continue;
    Invocation inv{words[i + 1], {}};
    size_t j = i + 2;
    if (inv.sub == "numerics" && j < words.size() && words[j].rfind("-", 0) != 0)
      inv.sub += " " + words[j++];
    for (; j < words.size(); ++j) {
      const std::string& a = words[j];
      if (a[0] == '#' || a == ";" || a == "|" || a == "&&" || a == "&" || a == "||") break;
      inv.words.push_back(a);
    }
    out.push_back(inv);
  }
  return out;
}

// What is wrong with the commands of one document, given each subcommand's --help text and the
// config keys.
std::vector<std::string> command_problems(const std::string& doc, const std::string& md,
                                          const std::map<std::string, std::string>& helps,
                                          const std::set<std::string>& keys) {
  std::vector<std::string> problems;
  for (const std::string& line : command_lines(md)) {
    for (const Invocation& inv : invocations(line)) {
      const auto h = helps.find(inv.sub);
      if (h == helps.end()) {
        problems.push_back(doc + ": `keel " + inv.sub + "` is no subcommand: " + line);
        continue;
      }
      for (size_t k = 0; k < inv.words.size(); ++k) {
        const std::string w = inv.words[k];
        if (w.rfind("--", 0) != 0 || w.size() < 3) continue;
        const std::string flag = w.substr(0, w.find('='));
        if (!std::regex_search(h->second, std::regex("(^|[ ,])" + flag + "([ =,\n]|$)")))
          problems.push_back(doc + ": `keel " + inv.sub + " " + flag + "` is not a flag of `keel " +
                             inv.sub + " --help`: " + line);
        if (flag == "--set" && k + 1 < inv.words.size()) {
          std::string kv = inv.words[k + 1];
          kv.erase(0, kv.find_first_not_of("'\""));
          const std::string key = kv.substr(0, kv.find('='));
          if (kv.find('=') != std::string::npos && !keys.count(key))
            problems.push_back(doc + ": --set " + key + " is no config key: " + line);
        }
      }
    }
  }
  return problems;
}

std::string help_of(const std::string& sub) {
  std::vector<std::string> args;
  std::istringstream in(sub);
  for (std::string w; in >> w;) args.push_back(w);
  args.push_back("--help");
  return test::run_keel(args).out;
}

std::set<std::string> config_key_names() {
  std::set<std::string> keys;
  for (const ConfigKeyInfo& k : config_keys()) keys.insert(k.key);
  return keys;
}

// `keel bisect DIR` (bisect is `keel replay DIR --bisect`) and any other unknown command said
// "A subcommand is required", as if none had been given.
TEST(CliDocs, AnUnknownCommandIsNamedWithTheCommands) {
  const test::KeelRun r = test::run_keel({"bisect", "out/RUN/debug/nan_capture/rank1"});
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "error: `keel bisect` is no command; the commands are train, ");
  EXPECT_CONTAINS(r.err, "replay");
  EXPECT_CONTAINS(r.err, "(bisect a capture with keel replay DIR --bisect)");
  EXPECT_NOT_CONTAINS(r.err, "A subcommand is required");
  const test::KeelRun typo = test::run_keel({"trian"});
  EXPECT_EQ(typo.code, 2) << typo.output;
  EXPECT_CONTAINS(typo.err, "error: `keel trian` is no command; the commands are train, ");
  // A known command still parses as before.
  EXPECT_EQ(test::run_keel({"numerics", "formats"}).code, 0);
}

TEST(CliDocs, DocumentedCommandsUseRealFlagsAndKeys) {
  std::vector<std::string> docs = {"README.md", "bench/README.md"};
  for (const char* dir : {"docs", "examples"})
    for (const auto& e : fs::recursive_directory_iterator(kSrc + "/" + dir))
      if (e.path().extension() == ".md") docs.push_back(fs::relative(e.path(), kSrc).string());
  std::map<std::string, std::string> helps;
  for (const char* sub : {"train", "init-model", "selfcheck", "numerics", "numerics formats",
                          "numerics cast", "numerics scaler", "replay", "doctor", "memory", "serve",
                          "tokenize", "generate", "export", "eval"})
    helps[sub] = help_of(sub);
  const std::set<std::string> keys = config_key_names();
  int commands = 0;
  for (const std::string& doc : docs) {
    const std::string md = test::slurp(kSrc + "/" + doc);
    ASSERT_FALSE(md.empty()) << doc;
    for (const std::string& l : command_lines(md)) commands += invocations(l).size();
    for (const std::string& p : command_problems(doc, md, helps, keys)) ADD_FAILURE() << p;
  }
  EXPECT_GE(commands, 60) << "the docs' commands were not found: is the extractor broken?";
}

// The check itself catches a renamed flag, a renamed key and a subcommand that does not exist.
TEST(CliDocs, CommandCheckCatchesDrift) {
  const std::map<std::string, std::string> helps = {
      {"generate", "  --max-new-tokens INT=64     at most\n  --top-k INT=0\n"},
      {"train", "  --set TEXT ...              override\n"}};
  const std::set<std::string> keys = {"optim.lr", "model.adapter.target_modules"};
  const std::string md =
      "```sh\n./build/keel generate out/RUN \"17+05=\" --max-new-tokens 8   # --top-q in a "
      "comment\n./build/keel train my.toml --set optim.lr=1e-3 \\\n"
      "    --set 'model.adapter.target_modules=[\"q\"]'\n```\n";
  EXPECT_TRUE(command_problems("d.md", md, helps, keys).empty());
  EXPECT_EQ(
      command_problems("d.md", "```sh\nkeel generate M --max-tokens 8\n```\n", helps, keys).size(),
      1u);
  EXPECT_EQ(command_problems("d.md", "Run `keel train --set optim.learning_rate=1`.\n", helps, keys)
                .size(),
            1u);
  EXPECT_EQ(command_problems("d.md", "```\nkeel train --sett x=1\n```\n", helps, keys).size(), 1u);
  EXPECT_EQ(
      command_problems("d.md", "```sh\nkeel generate M --top-k 2 --top-kk 3\n```\n", helps, keys)
          .size(),
      1u);
  // Output blocks (```text) and prose are not commands.
  EXPECT_TRUE(
      command_problems("d.md", "```text\nkeel train --nope\n```\nkeel train --nope\n", helps, keys)
          .empty());
}

// README.md's service walkthrough, from its first line through `keel serve ... &`, run in an
// empty directory as a new user would (the binary's path and the port aside): the server starts.
TEST(CliDocs, ServeWalkthroughStartsAsWritten) {
  const std::string readme = test::slurp(kSrc + "/README.md");
  const auto at = readme.find("## Training service");
  ASSERT_NE(at, std::string::npos);
  const auto open = readme.find("```sh\n", at);
  ASSERT_NE(open, std::string::npos);
  std::string script;
  std::istringstream in(readme.substr(open + 6));
  bool serve = false;
  for (std::string line; !serve && std::getline(in, line);) {
    if (line.rfind("```", 0) == 0) break;
    std::string joined = line;
    while (!joined.empty() && joined.back() == '\\' && std::getline(in, line))
      joined += "\n" + line;
    serve = joined.find("keel serve ") != std::string::npos;
    if (serve) {  // in the foreground, for a second, on a free port
      joined = std::regex_replace(joined, std::regex("\\./build/keel"),
                                  "timeout -s TERM 1 '" + test::keel_binary() + "'");
      joined = std::regex_replace(joined, std::regex("127\\.0\\.0\\.1:[0-9]+"), "127.0.0.1:0");
      joined = std::regex_replace(joined, std::regex("&\\s*$"), "");
    }
    script += joined + "\n";
  }
  ASSERT_TRUE(serve) << "no `keel serve` line in README.md's walkthrough";
  const std::string dir = test::temp_dir("readme-serve");
  const test::KeelRun r = test::run_command({"/bin/sh", "-c", "cd '" + dir + "' && " + script}, {});
  EXPECT_NE(r.output.find("keel serve | listening on http://127.0.0.1:"), std::string::npos)
      << "README.md's walkthrough:\n"
      << script << "printed:\n"
      << r.output;
}

}  // namespace
}  // namespace keel::cli_docs
