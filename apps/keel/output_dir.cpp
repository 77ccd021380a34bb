#include "apps/keel/output_dir.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <system_error>

#include "keel/io/atomic_file.h"
#include "keel/numerics/error.h"
#include "keel/numerics/input_file.h"

namespace keel::cli {

namespace fs = std::filesystem;

const std::vector<std::string> kTokenizerFiles = {"tokenizer.json",
                                                  "tokenizer_config.json",
                                                  "special_tokens_map.json",
                                                  "chat_template.jinja",
                                                  "vocab.json",
                                                  "merges.txt",
                                                  "encoder.json",
                                                  "vocab.bpe"};

namespace {

// DIR as an absolute path with links and dots resolved as far as it exists.
fs::path resolved(const std::string& dir) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(dir), ec);
  return ec ? fs::absolute(dir).lexically_normal() : p;
}

// Whether `inner` is `outer` or lies below it (both absolute and normal).
bool within(const fs::path& inner, const fs::path& outer) {
  const fs::path rel = inner.lexically_relative(outer);
  return !rel.empty() && *rel.begin() != "..";
}

bool is_model_dir_file(const std::string& name) {
  static const std::regex shard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  if (name == "model.safetensors" || name == "model.safetensors.index.json") return true;
  for (const std::string& t : kTokenizerFiles)
    if (name == t) return true;
  return std::regex_match(name, shard);
}

// `what` with the staging directory's name replaced by --out's: the user's path in messages.
std::string named_as_out(std::string what, const fs::path& stage, const fs::path& out) {
  const std::string from = stage.string(), to = out.string();
  for (size_t at = what.find(from); at != std::string::npos; at = what.find(from, at + to.size()))
    what.replace(at, from.size(), to);
  return what;
}

}  // namespace

void check_output_file(const std::string& flag, const std::string& file,
                       const std::string& input_flag, const std::string& input,
                       const std::string& replaced) {
  std::error_code ec;
  if (fs::equivalent(file, input, ec))
    throw Error(flag + " " + file + " is the " + input_flag + " file: writing it would replace " +
                    replaced + "; give another path",
                Error::kUsage);
  if (const std::string why = replaced_file_problem(file); !why.empty())
    throw Error(flag + " " + file + ": " + why, Error::kUsage);
  const fs::path parent = fs::absolute(fs::path(file)).parent_path();
  if (!fs::is_directory(parent, ec))
    throw Error(flag + " " + file + ": the directory " + parent.string() +
                    " does not exist; create it or give a path in an existing one",
                Error::kUsage);
}

void check_output_dir(const std::string& flag, const std::string& dir,
                      const std::vector<std::pair<std::string, std::string>>& inputs,
                      ModelDirKind writes) {
  auto refuse = [&](const std::string& why) {
    throw Error(flag + " " + dir + ": " + why, Error::kUsage);
  };
  if (dir.empty()) throw Error(flag + ": give the directory to write", Error::kUsage);
  const fs::path out = resolved(dir);
  std::error_code ec;
  if (fs::exists(out, ec) && !fs::is_directory(out, ec))
    refuse("exists and is not a directory; give a new directory or an existing one");
  fs::path up = out.parent_path();
  while (!up.empty() && !fs::exists(up, ec) && up != up.root_path()) up = up.parent_path();
  if (!fs::is_directory(up, ec))
    refuse("cannot be created: " + up.string() + " is not a directory");
  if (::access(up.c_str(), W_OK) != 0)
    refuse("cannot be created: " + up.string() + " is not writable");
  for (const auto& [what, path] : inputs) {
    if (path.empty()) continue;
    const fs::path in = resolved(path);
    if (within(in, out))
      refuse(std::string(out == in ? "is " : "holds ") + what + ", " + in.string() +
             ", which this command reads: writing there would replace it; give another "
             "directory");
  }
  if (fs::exists(out / "trainer.json", ec) || fs::is_directory(out / "checkpoints", ec))
    refuse("holds a keel run (" +
           std::string(fs::exists(out / "trainer.json", ec) ? "a checkpoint's trainer.json"
                                                            : "an out_dir's checkpoints/") +
           "): a model directory written there would lose its training state; give another "
           "directory");
  const bool adapter = writes == ModelDirKind::kPeftAdapter;
  const char* other = adapter ? "config.json" : "adapter_config.json";
  if (fs::exists(out / other, ec))
    refuse(std::string("holds ") +
           (adapter ? "a model (config.json): a PEFT adapter written beside it"
                    : "a PEFT adapter (adapter_config.json): a model written beside it") +
           " would make transformers' from_pretrained apply the adapter to that model (or load "
           "the adapter's base instead): give another directory, or remove its " +
           (adapter ? "model files" : "adapter files") + " first");
}

std::vector<std::string> write_model_dir(const std::string& flag, const std::string& dir,
                                         const std::function<void(const std::string&)>& write) {
  const fs::path out = resolved(dir);
  const fs::path stage =
      out.parent_path() / ("." + out.filename().string() + ".tmp-" + std::to_string(::getpid()));
  std::vector<std::string> names;
  try {
    // An export killed while writing left .OUT.tmp-PID, a whole model's weights, for good.
    io::remove_dead_temps(out.parent_path().string(), "." + out.filename().string() + ".tmp-");
    fs::remove_all(stage);
    fs::create_directories(stage);
    write(stage.string());
    fs::create_directories(out);
    for (const auto& e : fs::directory_iterator(stage)) names.push_back(e.path().filename());
    for (const std::string& n : names) fs::rename(stage / n, out / n);
    // A model written (config.json) replaces the model there; an adapter beside one leaves it.
    const bool model = std::find(names.begin(), names.end(), "config.json") != names.end();
    for (const auto& e : fs::directory_iterator(out)) {
      if (!model) break;
      const std::string n = e.path().filename();
      if (is_model_dir_file(n) && std::find(names.begin(), names.end(), n) == names.end())
        fs::remove(e.path());
    }
    fs::remove(stage);
    io::fsync_dir(out.string());
  } catch (const fs::filesystem_error& e) {
    std::error_code ec;
    fs::remove_all(stage, ec);
    // The file written: path2 where there are two (copy, rename: path1 is the source, so a full
    // disk was reported as "cannot write" the tokenizer file copied from).
    const fs::path& written = e.path2().empty() ? e.path1() : e.path2();
    throw Error(flag + " " + dir + ": cannot write " + named_as_out(written.string(), stage, out) +
                ": " + write_failure(e.code().value()));
  } catch (const Error& e) {  // named in the staging directory: say which --out it was for
    std::error_code ec;
    fs::remove_all(stage, ec);
    throw Error(flag + " " + dir + ": " + named_as_out(e.what(), stage, out), e.kind);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(stage, ec);
    throw;
  }
  return names;
}

}  // namespace keel::cli
