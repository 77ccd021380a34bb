// `--out DIR` of the commands that write a model directory (`keel export`, `keel init-model`):
// what DIR may be, and writing it so that a failure changes nothing there.
#pragma once
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace keel::cli {

// The tokenizer files an HF model directory may hold (transformers' and GPT-2's own names).
extern const std::vector<std::string> kTokenizerFiles;

// Refuses (a usage Error naming `flag`, DIR and the fix) a DIR that
// - is empty, or exists and is not a directory, or cannot be created (its nearest existing
//   ancestor is not a directory);
// - is one of `inputs` ((what, path) pairs; empty paths are skipped), or a folder holding one:
//   writing there replaces what the command reads (`keel export RUN --out RUN/checkpoints/last`
//   overwrote the checkpoint it was exporting, and `--out BASE` the frozen base of an adapter run);
// - holds a keel run (trainer.json: a checkpoint; checkpoints/: an out_dir), whose training state a
//   model directory would not keep;
// - holds the other kind of model directory than `writes`: a PEFT adapter (adapter_config.json)
//   beside a model (config.json) makes transformers' from_pretrained apply that adapter to the
//   model it loads (older versions load the adapter's base instead), whichever was written
//   second.
enum class ModelDirKind { kModel, kPeftAdapter };
void check_output_dir(const std::string& flag, const std::string& dir,
                      const std::vector<std::pair<std::string, std::string>>& inputs,
                      ModelDirKind writes = ModelDirKind::kModel);

// Refuses (a usage Error naming `flag`) an output FILE that a command writes after loading a model
// (minutes), before it loads: FILE is `input` (the file `input_flag` names: writing it would
// replace `replaced`, as "the data with its losses"), or it cannot be replaced by a renamed file
// (a device, a pipe, a directory: replaced_file_problem), or its directory does not exist.
void check_output_file(const std::string& flag, const std::string& file,
                       const std::string& input_flag, const std::string& input,
                       const std::string& replaced);

// Writes a model directory at DIR: `write` fills a new sibling staging directory (its argument);
// only when it returns are its files moved into DIR (created if missing), and then, when it wrote a
// model (config.json), the files of the kinds a model directory holds (weights, their index,
// tokenizer files) that it did not write are removed from DIR, so that a loader never sees an
// earlier layout or tokenizer beside the new one. Other files in DIR are left as they are (and all
// of them under a PEFT adapter directory: `export --adapter-only` removed every file of DIR). If
// `write` throws, the staging directory is removed and DIR is untouched. Returns the names of the
// files moved into DIR.
std::vector<std::string> write_model_dir(const std::string& flag, const std::string& dir,
                                         const std::function<void(const std::string&)>& write);

}  // namespace keel::cli
