// Numerics pins (issue 20's constraint): the bit patterns of the loss and the gradient norm of
// short runs that cover every path a refactor can move — the default task in each precision
// policy, the LoRA / DoRA / LoKr fine-tunes on a bf16 base, a 16-mixed run whose scaler skips, a
// 2-rank MPI run, and the replay of a NaN capture. Every run is the `keel` binary end to end, on
// one thread per process, so the pins cover the CLI's wiring too.
//
// The pins live in tests/regression/pins.json, keyed by the machine's kernel set (keel's CPU ISA,
// AVX512_BF16 and AMX pick different kernels whose bits differ). A change that moves a pinned bit
// lands only in its own commit that regenerates the file and says why:
//   KEEL_UPDATE_PINS=1 ./build/tests/test_regression
// On a machine whose kernel set has no pins yet the test fails with that command: it never
// passes without comparing.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "keel/backend/cpu/isa.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kPinFile = std::string(KEEL_SOURCE_DIR) + "/tests/regression/pins.json";

bool update_mode() {
  const char* v = std::getenv("KEEL_UPDATE_PINS");
  return v && std::string(v) == "1";
}

// Which kernels this machine runs: the bits of a loss depend on them, not on the CPU's name.
std::string kernel_set() {
  std::string key = cpu_isa_name(cpu_isa());
  if (cpu_has_avx512_bf16()) key += "+avx512_bf16";
  std::ifstream info("/proc/cpuinfo");
  std::string line;
  while (std::getline(info, line))
    if (line.rfind("flags", 0) == 0) {
      if (line.find(" amx_bf16") != std::string::npos) key += "+amx_bf16";
      break;
    }
  return key;
}

std::string hex_bits(double v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx",
                static_cast<unsigned long long>(std::bit_cast<uint64_t>(v)));
  return buf;
}

// The short default-task run every case starts from: 6 steps of 8 examples, one thread. Rows
// padded to data.seq_len (data.padding = max_length), as when these bits were recorded on each
// kernel set: the default pads a batch to its longest row, which moves every bit, and a kernel
// set is recorded only on a machine that has it.
std::vector<std::string> arith_sets(const std::string& out) {
  return {"run.out_dir=" + out,   "run.threads=1",         "data.num_examples=64",
          "data.eval_examples=8", "train.batch_size=8",    "train.max_steps=6",
          "log.every=1",          "log.tensorboard=false", "data.padding=max_length"};
}

// metrics.jsonl writes a non-finite value as a string ("nan", "inf"): pinned as it is.
json bits_of(const json& v) { return v.is_number() ? json(hex_bits(v.get<double>())) : v; }

// A run's pinned sequences: [loss bits..., grad_norm bits...] of every step record.
json sequences_of(const std::string& out_dir) {
  json loss = json::array(), norm = json::array();
  for (const json& r : test::step_records(out_dir)) {
    loss.push_back(bits_of(r.at("loss")));
    norm.push_back(bits_of(r.at("grad_norm")));
  }
  return {{"loss", loss}, {"grad_norm", norm}};
}

json train_case(const std::string& name, std::vector<std::string> sets,
                const std::vector<std::string>& prefix = {}) {
  const std::string out = test::temp_dir("pins-" + name);
  std::vector<std::string> all = arith_sets(out);
  all.insert(all.end(), sets.begin(), sets.end());
  std::vector<std::string> argv = prefix;
  argv.push_back(std::string(KEEL_BINARY_DIR) + "/keel");
  argv.push_back("train");
  for (auto& s : all) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  test::KeelRun r = test::run_command(argv);
  EXPECT_EQ(r.code, 0) << name << ":\n" << r.output;
  json seq = sequences_of(out);
  EXPECT_FALSE(seq["loss"].empty()) << name << " logged no step";
  fs::remove_all(out);
  return seq;
}

// A small bf16 Llama (GQA) written by init-model, the base of the adapter cases.
const std::string& llama_base() {
  static const std::string dir = [] {
    std::string d = test::temp_dir("pins-llama-base");
    test::KeelRun r = test::run_keel({"init-model",
                                      "--family",
                                      "llama",
                                      "--out",
                                      d,
                                      "--n-layer",
                                      "2",
                                      "--n-embd",
                                      "64",
                                      "--n-head",
                                      "4",
                                      "--n-kv-head",
                                      "2",
                                      "--intermediate-size",
                                      "176",
                                      "--vocab-size",
                                      "259",
                                      "--max-seq-len",
                                      "64",
                                      "--untied",
                                      "--dtype",
                                      "bf16",
                                      "--seed",
                                      "2024"});
    EXPECT_EQ(r.code, 0) << r.output;
    return d;
  }();
  return dir;
}

std::vector<std::string> adapter_sets(const std::string& kind) {
  return {"model.path=" + llama_base(),
          "model.base_dtype=bf16",
          "model.adapter.kind=" + kind,
          "model.adapter.r=4",
          "model.adapter.alpha=8",
          std::string("model.adapter.dropout=") + (kind == "lokr" ? "0" : "0.05"),
          "model.adapter.target_modules=[\"q_proj\",\"v_proj\",\"up_proj\",\"down_proj\"]",
          "train.precision=bf16-mixed",
          "optim.lr=1e-3"};
}

std::string find_mpirun() {
  for (const char* d : {"/usr/bin", "/usr/local/bin", "/bin"})
    if (access((std::string(d) + "/mpirun").c_str(), X_OK) == 0) return std::string(d) + "/mpirun";
  return "";
}

// A NaN capture (an injected inf in the last block's MLP at step 3) and its replay: the replayed
// loss and gradients must be the recorded ones, and both are pinned.
json replay_case() {
  const std::string out = test::temp_dir("pins-capture");
  std::vector<std::string> sets = arith_sets(out);
  for (const char* s :
       {"debug.inject.module=transformer.h.1.mlp", "debug.inject.step=3", "debug.inject.kind=inf"})
    sets.push_back(s);
  test::KeelRun r = test::run_keel(test::with_sets({"train"}, sets));
  EXPECT_EQ(r.code, 3) << r.output;
  test::KeelRun rep = test::run_keel({"replay", out + "/debug/nan_capture/rank0", "--json"});
  EXPECT_EQ(rep.code, 0) << rep.output;
  json j = json::parse(rep.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << rep.output;
  json seq = sequences_of(out);
  if (j.is_object()) {
    EXPECT_TRUE(j.value("bit_exact", false)) << rep.out;
    seq["replay_loss_bits"] = j.value("loss_bits", "");
    seq["replay_grads_fingerprint"] = j.value("grads_fingerprint", "");
    seq["replay_first_module"] = j.value("first_module", "");
  }
  fs::remove_all(out);
  return seq;
}

json all_cases() {
  json c;
  for (const char* p : {"32-true", "bf16-mixed", "16-mixed", "bf16-true"})
    c[std::string("arith/") + p] = train_case(p, {std::string("train.precision=") + p});
  for (const char* kind : {"lora", "dora", "lokr"})
    c[std::string("adapter/") + kind] = train_case(kind, adapter_sets(kind));
  // The scaler starts far too high: its first steps overflow and are skipped (2^20: four skips).
  c["16-mixed/skips"] =
      train_case("skips", {"train.precision=16-mixed", "scaler.init_scale=1048576",
                           "train.max_steps=10", "data.num_examples=256"});
  if (!find_mpirun().empty())
    c["mpi/2-ranks"] =
        train_case("mpi", {"dist.backend=mpi"},
                   {find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "2"});
  c["capture/replay"] = replay_case();
  return c;
}

TEST(Pins, LossAndGradNormBitsOfEveryPathAreUnchanged) {
  const std::string machine = kernel_set();
  const json got = all_cases();
  json pins = json::object();
  if (std::ifstream f(kPinFile); f) pins = json::parse(f, nullptr, false);
  ASSERT_FALSE(pins.is_discarded()) << kPinFile << " is not valid JSON";
  if (update_mode()) {
    pins["machines"][machine] = got;
    pins["comment"] =
        "Numerics pins of tests/regression/test_pins.cpp, per kernel set. Regenerate only in a "
        "commit of its own that says which change moved the bits and why: KEEL_UPDATE_PINS=1 "
        "./build/tests/test_regression";
    std::ofstream(kPinFile) << pins.dump(1) << "\n";
    GTEST_SKIP() << "pins for " << machine << " written to " << kPinFile;
  }
  ASSERT_TRUE(pins.contains("machines") && pins["machines"].contains(machine))
      << "no pins for this machine's kernel set (" << machine << ") in " << kPinFile
      << "; record them in a commit of their own with KEEL_UPDATE_PINS=1 "
         "./build/tests/test_regression";
  const json& want = pins["machines"][machine];
  for (auto& [name, seq] : want.items()) {
    if (name == "mpi/2-ranks" && !got.contains(name)) {
      ADD_FAILURE() << "mpirun is missing, so the pinned 2-rank run cannot be checked";
      continue;
    }
    ASSERT_TRUE(got.contains(name)) << name;
    EXPECT_EQ(got[name], seq) << name << " moved: got " << got[name].dump() << "\npinned "
                              << seq.dump();
  }
  for (auto& [name, seq] : got.items())
    EXPECT_TRUE(want.contains(name)) << name << " has no pin yet: " << seq.dump();
}

}  // namespace
}  // namespace keel
