// The frozen base of an adapter run, referenced instead of copied (issue 25): a checkpoint of a
// LoRA/DoRA/LoKr run whose base came from an HF directory (`model.path`) holds only the trainable
// tensors, and in its config.json's "keel_checkpoint" object a "base" reference:
//   {"path": model.path as given, "resolved": its absolute path, "dtype": the base's stored dtype
//    in the run, "files": [{"file", "bytes", "fnv1a64"}, ...]}
// The fingerprint covers config.json and the weight index (whole contents) and every safetensors
// file (its size, a hash of its header — the 8-byte length plus the JSON naming every tensor's
// dtype, shape and offsets — and of the first and last 64 KiB of its data), so that checking it
// reads about 128 KiB per file, never the whole weights.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace keel::io {

// The reference to the HF directory `base_dir` (as given) with its fingerprint; `dtype` is the
// name of the dtype the run holds the base in (the base's bits are the files' rounded into it).
nlohmann::json base_reference(const std::string& base_dir, const std::string& dtype);

// The reference in CHECKPOINT_DIR/config.json, or null when the checkpoint holds its whole model.
nlohmann::json checkpoint_base_reference(const std::string& checkpoint_dir);

// Checks `base_dir` against the reference of the checkpoint at `checkpoint_dir`: an Error (kUsage)
// naming the checkpoint, the base directory and the first file that is missing or differs, with
// the fix in `fix`. `what`: "checkpoint", or "capture" for a NaN capture's reference (a replay
// said "checkpoint CAPTURE_DIR" and "when the checkpoint was written").
void check_base_reference(const nlohmann::json& ref, const std::string& checkpoint_dir,
                          const std::string& base_dir, const std::string& fix,
                          const std::string& what = "checkpoint");

// Where the referenced base is: `moved_to` when given (the base's new place, from `--base DIR`),
// else `resolved` when it exists, else `path` as given (relative to the current directory);
// checked as check_base_reference does. An Error naming both when neither holds the base.
std::string find_referenced_base(const nlohmann::json& ref, const std::string& checkpoint_dir,
                                 const std::string& moved_to = "");

}  // namespace keel::io
