#include "keel/io/base_reference.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include "keel/io/atomic_file.h"
#include "keel/io/checkpoint.h"
#include "keel/io/hf_weights.h"
#include "keel/numerics/error.h"
#include "keel/numerics/file_fingerprint.h"
#include "keel/numerics/hash.h"
#include "keel/numerics/input_file.h"

namespace keel::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// FNV-1a of `n` bytes of `path` from `offset` (fewer when the file is shorter), continuing `h`.
uint64_t hash_range(const std::string& path, uint64_t offset, uint64_t n, uint64_t h) {
  std::ifstream f(path, std::ios::binary);
  fnv1a_file_range(f, static_cast<int64_t>(offset), static_cast<int64_t>(n), h);
  return h;
}

// The bytes of the weights sampled beside the header: the first and the last 64 KiB, so that a
// base replaced by another of the same shapes (a fine-tuned copy) differs too.
constexpr uint64_t kSample = 64 << 10;

// A safetensors file's header: its 8-byte little-endian length and the JSON after it.
uint64_t header_bytes(const std::string& path, uint64_t size) {
  unsigned char len[8] = {};
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(len), 8);
  if (f.gcount() != 8) return size;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  return std::min<uint64_t>(size, n > size ? size : 8 + n);
}

json entry(const std::string& dir, const std::string& name, bool whole) {
  const std::string path = dir + "/" + name;
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) return {{"file", name}, {"bytes", nullptr}, {"fnv1a64", nullptr}};
  uint64_t h = 0;
  if (whole) {
    h = hash_range(path, 0, size, kFnvOffsetBasis);
  } else {
    const uint64_t head = header_bytes(path, size);
    h = hash_range(path, 0, std::min(size, head + kSample), kFnvOffsetBasis);
    if (size > head + kSample)
      h = hash_range(path, std::max(head + kSample, size - kSample), kSample, h);
  }
  return {{"file", name}, {"bytes", size}, {"fnv1a64", hash_hex(h)}};
}

// The files that make up the HF directory `dir`'s model, in a fixed order.
json fingerprint(const std::string& dir) {
  json files = json::array();
  files.push_back(entry(dir, "config.json", true));
  if (path_exists(dir + "/" + kSafetensorsSingle) || !path_exists(dir + "/" + kSafetensorsIndex)) {
    files.push_back(entry(dir, kSafetensorsSingle, false));
    return files;
  }
  files.push_back(entry(dir, kSafetensorsIndex, true));
  std::vector<std::string> shards;
  try {
    const json j = json::parse(read_file(dir + "/" + kSafetensorsIndex));
    for (auto& [name, file] : j.at("weight_map").items())
      if (file.is_string()) shards.push_back(file.get<std::string>());
  } catch (const std::exception&) {  // a damaged index differs in its own hash already
  }
  std::sort(shards.begin(), shards.end());
  shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
  for (const std::string& s : shards)
    if (s.find('/') == std::string::npos) files.push_back(entry(dir, s, false));
  return files;
}

// A field of a fingerprint entry (null when absent: the entry is read from a checkpoint's file).
json field(const json& e, const char* key) {
  return e.is_object() && e.contains(key) ? e[key] : json(nullptr);
}

std::string describe(const json& e) {
  const json bytes = field(e, "bytes"), hash = field(e, "fnv1a64");
  if (!bytes.is_number_unsigned() || !hash.is_string()) return "missing";
  return std::to_string(bytes.get<uint64_t>()) + " bytes, hash " + hash.get<std::string>();
}

}  // namespace

json base_reference(const std::string& base_dir, const std::string& dtype) {
  return {{"path", base_dir},
          {"resolved", fs::weakly_canonical(fs::absolute(base_dir)).string()},
          {"dtype", dtype},
          {"files", fingerprint(base_dir)}};
}

json checkpoint_base_reference(const std::string& checkpoint_dir) {
  const std::string file = checkpoint_dir + "/config.json";
  if (!path_exists(file)) return nullptr;
  json ref = nullptr;
  try {
    const json j = json::parse(read_file(file));
    if (j.contains("keel_checkpoint") && j["keel_checkpoint"].is_object() &&
        j["keel_checkpoint"].contains("base") && j["keel_checkpoint"]["base"].is_object())
      ref = j["keel_checkpoint"]["base"];
  } catch (const json::exception&) {
  }
  // Its readers take these as strings (json::value threw nlohmann's raw "type must be string").
  if (ref.is_object())
    for (const char* key : {"path", "resolved", "dtype"})
      if (ref.contains(key) && !ref[key].is_string())
        throw Error(file + ": keel_checkpoint.base." + key + " must be a string, got " +
                        ref[key].dump() + " (" + kDamagedCheckpointUseFix + ")",
                    Error::kUsage);
  return ref;
}

void check_base_reference(const json& ref, const std::string& checkpoint_dir,
                          const std::string& base_dir, const std::string& fix,
                          const std::string& what) {
  const bool capture = what == "capture";
  const std::string head = what + " " + checkpoint_dir +
                           " holds only the trained tensors of an adapter run; its frozen base is "
                           "the model directory " +
                           ref.value("path", std::string("?")) + " (" +
                           ref.value("resolved", std::string("?")) + "), but ";
  if (!ref.contains("files") || !ref["files"].is_array())
    throw Error(checkpoint_dir +
                    (capture ? "/capture.json: \"base\" has no \"files\" array (the capture is "
                               "corrupt: re-run the training to write a new one)"
                             : "/config.json: keel_checkpoint.base has no \"files\" array (" +
                                   std::string(kDamagedCheckpointUseFix) + ")"),
                Error::kUsage);
  if (!directory_exists(base_dir))
    throw Error(head + base_dir + " is not a directory; " + fix, Error::kUsage);
  const json now = fingerprint(base_dir);
  for (const json& want : ref["files"]) {
    const json file = field(want, "file");
    const std::string name = file.is_string() ? file.get<std::string>() : "?";
    json have = nullptr;
    for (const json& e : now)
      if (e["file"] == name) have = e;
    if (have.is_null()) have = entry(base_dir, name, name.find(".json") != std::string::npos);
    if (have["bytes"] != field(want, "bytes") || have["fnv1a64"] != field(want, "fnv1a64"))
      throw Error(head + base_dir + "/" + name + " differs (now " + describe(have) + ", when the " +
                      what + " was written " + describe(want) + "); " + fix,
                  Error::kUsage);
  }
  for (const json& e : now) {
    bool known = false;
    for (const json& want : ref["files"]) known = known || field(want, "file") == e["file"];
    if (!known && !e["bytes"].is_null())
      throw Error(head + base_dir + "/" + e["file"].get<std::string>() +
                      " is not one of its files (the directory holds another model); " + fix,
                  Error::kUsage);
  }
}

std::string find_referenced_base(const json& ref, const std::string& checkpoint_dir,
                                 const std::string& moved_to) {
  const std::string path = ref.value("path", std::string()),
                    resolved = ref.value("resolved", std::string());
  const std::string where = resolved.empty() ? path : resolved;
  if (!moved_to.empty()) {
    check_base_reference(ref, checkpoint_dir, moved_to,
                         "give --base the directory of the base model the run was trained on");
    return moved_to;
  }
  const std::string fix = "put the base model the run was trained on back at " + where +
                          ", or name its new place with --base DIR (a checkpoint of an adapter "
                          "run does not copy its base)";
  for (const std::string& d : {resolved, path})
    if (!d.empty() && directory_exists(d)) {
      check_base_reference(ref, checkpoint_dir, d, fix);
      return d;
    }
  throw Error("checkpoint " + checkpoint_dir +
                  " holds only the trained tensors of an adapter run; its frozen base, the model "
                  "directory " +
                  path + " (" + resolved + "), does not exist any more; " + fix,
              Error::kUsage);
}

}  // namespace keel::io
