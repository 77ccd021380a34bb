// Subcommand registry: each subcommand file defines add_<name>(CLI::App&) returning the
// subcommand and the action to run when it is selected.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "apps/keel/flags.h"
#include "keel/numerics/error.h"

namespace keel::cli {

using Action = std::function<int()>;
struct Command {
  CLI::App* app;
  Action run;
};

Command add_selfcheck(CLI::App& app);
Command add_numerics(CLI::App& app);
Command add_train(CLI::App& app);
Command add_init_model(CLI::App& app);
Command add_replay(CLI::App& app);
Command add_doctor(CLI::App& app);
Command add_memory(CLI::App& app);
Command add_serve(CLI::App& app);
Command add_tokenize(CLI::App& app);
Command add_generate(CLI::App& app);
Command add_chat(CLI::App& app);
Command add_export(CLI::App& app);
Command add_eval(CLI::App& app);

void register_commands(CLI::App& app);

// What the user reads when an allocation fails (std::bad_alloc never reaches them as such).
inline constexpr const char* kOutOfMemory =
    "out of memory: an allocation failed (the run's sizes need more memory than is available); "
    "lower train.batch_size, data.seq_len or the model sizes (model.n_layer, model.n_embd, "
    "model.vocab_size); `keel memory` estimates a configuration's memory";
int run_selected(CLI::App& app);

// A failed tensor allocation as the selected command's user reads it: the allocator's message
// names training's keys (train.batch_size, model.*), a false fix for generate or export.
std::string out_of_memory(const CLI::App& app, const Error& e);

// "cannot write standard output: ..." with the cause (`err`, an errno of the failed write, or 0
// when unknown) and `fix` (by default: where to send the output instead).
std::string stdout_lost(int err, const std::string& fix = "");

// Writes `s` to standard output and flushes it (a streamed reply is read as it comes); a failed
// write is an Error of stdout_lost's with `fix()` (the stream's state is cleared: said here, main's
// check of stdout would say it again).
void write_stdout(std::string_view s, const std::function<std::string()>& fix);

}  // namespace keel::cli
