// `keel doctor CONFIG` (DESIGN §4): checks a configuration before training.
//
// Static checks: precision vs device, f16 without a loss scaler, hard-cast (-true) policies,
// adapter dtypes, a learning rate whose decoupled weight decay flips weights (lr·wd >= 1), a pad
// token that collides with a real token, accumulation windows vs the dataset (a window larger than
// the epoch, a remainder window), and the memory estimate vs MemAvailable. Then a one-batch sanity
// pass: forward and backward of the first micro-batch under the configured precision, under
// 32-true, and under each attention backend, with losses and grad norms side by side.
//
// Severity: "error" blocks training (exit 1), "warning" and "info" do not.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/data/tokenizer_base.h"
#include "keel/monitor/memory_estimate.h"
#include "keel/train/config.h"

namespace keel::monitor {

struct DoctorCheck {
  std::string severity;  // "error" | "warning" | "info" | "ok"
  std::string check;     // "precision", "scaler", "adapter", "optimizer", "pad-token", "windows",
                         // "memory", "data", "sanity"
  std::string message;   // what is wrong (or right) and the fix
};

// What the pad check needs to know about a tokenizer, so that it runs on any tokenizer and on a
// synthetic description in tests: ids in [0, vocab_size), the special ids (-1 = none), which ids
// are special, and each id's spelling ("" for a hole in the vocabulary).
struct TokenizerFacts {
  std::string name;
  int64_t vocab_size = 0;
  int64_t pad_id = -1, bos_id = -1, eos_id = -1;
  std::function<bool(int64_t)> is_special;
  std::function<std::string(int64_t)> token_text;
};
// A view of `tok` (which must outlive the result).
TokenizerFacts tokenizer_facts(const data::Tokenizer& tok, const std::string& name);

// The tokenizer's pad against the real tokens: a dedicated pad is fine (an error only when it lies
// outside the model's `embedding_rows`); no pad, a pad that is bos/eos, or a pad that is an
// ordinary token (Llama-3's id 0 is '!') collides, and the result says what keel pads with instead
// under data.pad = `pad_mode` ("add": a new id, info; "eos": a warning, as a mask built from ids
// would hide the real eos; "eos" without an eos token: an error). `packed` (rows_are_packed,
// train/run.h): no pad is needed, ok.
DoctorCheck check_pad_token(const TokenizerFacts& tok, const std::string& pad_mode,
                            int64_t embedding_rows, bool packed = false);

// Accumulation windows vs the dataset: `examples` rows, micro-batch `batch_size`, `grad_accum`
// micro-batches per window and rank, `ranks` data-parallel ranks (a step's window is
// grad_accum x ranks micro-batches). `row` names a row: "example", or "packed row" (data.pack
// with JSONL, whose rows hold several examples).
std::vector<DoctorCheck> check_windows(int64_t examples, int64_t batch_size, int64_t grad_accum,
                                       int64_t ranks = 1, const std::string& row = "example");

// Precision vs device, scaler, -true policies, adapters, learning rate (config only).
std::vector<DoctorCheck> check_config(const Config& cfg);

DoctorCheck check_memory(const MemoryEstimate& e, int64_t available_bytes,
                         const std::string& advice = "");

struct SanityRun {
  std::string label;  // "configured", "32-true", "attention=math", ...
  std::string precision, attention;
  bool ran = false;
  double loss = 0, grad_norm = 0;  // grad norm unscaled
  bool finite = false;
  double seconds = 0;
  std::string error;
};

struct DoctorOptions {
  bool sanity = true;
  std::string out_dir;  // where sanity runs may write ("" = a temporary directory, removed after)
  // The ranks `keel train` will run (mpirun -np N's N; the CLI reads it from the launcher): the
  // windows are checked for them. 0 = unknown (not launched by mpirun): one rank's, with a note
  // when dist.backend asks for several.
  int64_t ranks = 0;
  // Told before each one-batch sanity pass of a model of at least `progress_params` parameters
  // ("sanity pass 2 of 5 (32-true): ..."): at 1B each pass builds the run and takes minutes, and
  // the doctor said nothing until the end. The CLI prints it to stderr.
  std::function<void(const std::string&)> progress;
  int64_t progress_params = 100'000'000;
};

struct DoctorReport {
  std::vector<DoctorCheck> checks;
  std::vector<SanityRun> sanity;
  MemoryEstimate memory;
  int64_t available_bytes = -1;
  bool blocking = false;  // any check is an error
};

DoctorReport run_doctor(const Config& cfg, const DoctorOptions& opt = {});
std::string format_doctor(const DoctorReport& r);
nlohmann::json doctor_to_json(const DoctorReport& r);

}  // namespace keel::monitor
