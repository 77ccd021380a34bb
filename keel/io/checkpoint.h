// Checkpoint directories (DESIGN §6): `model.safetensors`, `optimizer.safetensors` and
// `trainer.json` (step, epoch, sampler position, RNG, scaler) in one directory, replaced as a
// whole.
//
// save_checkpoint writes everything into a temporary sibling `<dir>.tmp-<pid>`, fsyncs the files
// and the directory, renames an existing `dir` aside to `<dir>.old-<pid>`, renames the temporary
// directory to `dir`, fsyncs the parent and removes the old one. A crash at any point leaves a
// complete checkpoint: the old one (at `dir`, or at `<dir>.old-*` if the crash fell between the two
// renames) or the new one. Leftovers are handled by the next save (an orphaned `.old-*` is moved
// back when `dir` is missing; `.tmp-*` and remaining `.old-*` are deleted) and by load_checkpoint,
// which reads an orphaned `.old-*` when `dir` is missing and ignores `.tmp-*`.
#pragma once
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "keel/tensor/tensor.h"

namespace keel::io {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// The fix for a checkpoint whose files are damaged, said once: when resuming from it, and when
// using it (generate, eval, export, model.path).
inline constexpr const char* kDamagedCheckpointResumeFix =
    "the checkpoint is damaged: resume from another one (checkpoints/step-N) or start without "
    "run.resume";
inline constexpr const char* kDamagedCheckpointUseFix =
    "the checkpoint is damaged; use another one";

struct Checkpoint {
  // In file order: the order they were saved in, except that views of one storage (the optimizer's
  // flat state) come in that storage's order (io/safetensors.h, write_safetensors).
  NamedTensors model;
  NamedTensors optimizer;
  nlohmann::json trainer_state;
  std::string dir;  // the directory actually read (differs from the argument only on recovery)
};

// Tensors must be on the CPU. `trainer_state` is written as pretty-printed JSON; it must hold only
// finite numbers (JSON has no NaN/inf), which is checked, naming the offending path.
// `extra_files` (optional) writes more files into the temporary directory (the model's
// config.json, see io/trained_model.h), so that they are replaced with the rest.
void save_checkpoint(const std::string& dir, const NamedTensors& model,
                     const NamedTensors& optimizer, const nlohmann::json& trainer_state,
                     const std::function<void(const std::string& tmp)>& extra_files = {});

// Reads a checkpoint directory. Every problem is an Error naming the file (and, for safetensors,
// the tensor): a missing file, a truncated or corrupt safetensors file, invalid JSON.
Checkpoint load_checkpoint(const std::string& dir);

// The mechanism save_checkpoint uses, for any directory of files (NaN captures use it too):
// `fill` writes the files into a temporary sibling, which is fsynced and renamed over `dir`; a
// crash at any point leaves either the previous complete directory or the new one.
void write_dir_atomic(const std::string& dir,
                      const std::function<void(const std::string& tmp)>& fill);

// True when `dir` (or an orphaned `<dir>.old-*` left by a crash between the renames) holds a
// checkpoint that load_checkpoint can read.
bool checkpoint_exists(const std::string& dir);

// Recovery of a checkpoints directory after a crash, before a run decides whether it resumes: a
// complete `<name>.old-*` whose `<name>` is missing (the crash fell between the two renames) is
// renamed back; every other `*.tmp-*` and `*.old-*` leftover is removed.
void recover_checkpoints(const std::string& checkpoints_dir);

// Keeps the `keep` newest `step-N` directories of `checkpoints_dir` (by N), removing the others;
// keep <= 0 keeps all.
void prune_step_checkpoints(const std::string& checkpoints_dir, int64_t keep);

// Testing only: called by save_checkpoint after each stage ("tmp_written", "moved_aside",
// "renamed", "done") so that a test can kill the process there and check what a crash leaves.
// nullptr (the default) = no hook.
void set_checkpoint_stage_hook(void (*hook)(const char* stage));

}  // namespace keel::io
