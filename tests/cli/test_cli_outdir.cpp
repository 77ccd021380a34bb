// An out_dir is owned by its run and a resume never restarts silently (issue 22, items 2 and 3):
//   - a second run on a locked out_dir is refused naming the holder; reusing an out_dir without
//     run.resume is refused unless run.overwrite; log.keep_checkpoints keeps the newest step-N;
//   - a failing fsync (KEEL_TEST_FAIL_FSYNC) and a file-size limit (SIGXFSZ ignored) end the run
//     with exit 1 and an error, the last good checkpoint intact;
//   - a crash at every stage of a save (KEEL_TEST_CRASH_AT) resumes from a checkpoint, never from
//     scratch, with no leftovers, no duplicate step records and the uninterrupted run's weights;
//   - a resume that changes what the checkpoint fixes is refused naming each difference unless
//     run.resume_force; a damaged trainer.json names the file and the key.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/time.h>
#include <unistd.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "keel/io/checkpoint.h"
#include "keel/numerics/utc_time.h"
#include "tests/support/check.h"
#include "tests/support/run_keel.h"
#include "tests/support/tb_events.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::run_keel;
using test::slurp;
using test::step_records;

std::vector<std::string> train(const std::string& out, std::vector<std::string> more = {}) {
  std::vector<std::string> sets = {
      "run.out_dir=" + out,  "run.threads=1",         "model.n_layer=1",       "model.n_embd=32",
      "model.n_head=2",      "data.num_examples=64",  "data.eval_examples=0",  "data.seq_len=16",
      "train.batch_size=8",  "train.max_steps=4",     "log.tensorboard=false", "log.every=1",
      "sched.name=constant", "log.checkpoint_every=1"};
  sets.insert(sets.end(), more.begin(), more.end());
  return test::with_sets({"train"}, sets);
}

int64_t saved_step(const std::string& out) {
  return json::parse(slurp(out + "/checkpoints/last/trainer.json")).at("step").get<int64_t>();
}

std::vector<std::string> leftovers(const std::string& out) {
  std::vector<std::string> l;
  for (auto& e : fs::directory_iterator(out + "/checkpoints")) {
    const std::string n = e.path().filename().string();
    if (n.find(".tmp-") != std::string::npos || n.find(".old-") != std::string::npos)
      l.push_back(n);
  }
  return l;
}

TEST(CliOutDir, ASecondRunOnALockedOutDirIsRefusedNamingTheHolder) {
  const std::string out = test::temp_dir("outdir-lock");
  const int fd = ::open((out + "/.keel.lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const std::string holder = "pid 4242 on trainer-host, started 2026-12-01T20:00:00Z\n";
  ASSERT_EQ(::write(fd, holder.data(), holder.size()), static_cast<ssize_t>(holder.size()));
  auto r = run_keel(train(out));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "run.out_dir " + out + " is in use by another run (pid 4242 on trainer-host");
  EXPECT_FALSE(fs::exists(out + "/checkpoints")) << "the refused run wrote into the out_dir";
  ::close(fd);  // released: the next run takes the lock and records itself
  r = run_keel(train(out, {"train.max_steps=1"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(slurp(out + "/.keel.lock"), "pid ");
}

// An out_dir that is a file (or lies under one) read "cannot create run.out_dir X: Not a
// directory": the file is named as such, and left as it was.
TEST(CliOutDir, AnOutDirThatIsAFileIsNamedAsAFile) {
  const std::string file = test::temp_dir("outdir-file") + "/notes.txt";
  std::ofstream(file) << "keep me\n";
  auto r = run_keel(train(file, {"train.max_steps=1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "run.out_dir " + file + " is a file, not a directory; give a directory path");
  r = run_keel(train(file + "/run", {"train.max_steps=1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "run.out_dir " + file + "/run: " + file + " is a file, not a directory");
  EXPECT_EQ(slurp(file), "keep me\n");
}

TEST(CliOutDir, ReuseWithoutResumeIsRefusedUnlessOverwrite) {
  const std::string out = test::temp_dir("outdir-reuse");
  auto r = run_keel(train(out, {"train.max_steps=2", "log.checkpoint_every=0"}));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel(train(out, {"train.max_steps=3", "log.checkpoint_every=0"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "holds a previous run");
  EXPECT_CONTAINS(r.err, "run.resume = true");
  EXPECT_CONTAINS(r.err, "run.overwrite = true");
  EXPECT_EQ(step_records(out).size(), 2u);  // untouched
  // An overwriting run that fails on its data removes nothing (it removed the previous run's
  // checkpoints and metrics before loading the data).
  std::ofstream(out + "/../empty.txt").flush();
  r = run_keel(train(out, {"train.max_steps=3", "run.overwrite=true", "data.task=text",
                           "data.path=" + out + "/../empty.txt"}));
  EXPECT_EQ(r.code, 2) << r.output;  // bad input
  EXPECT_CONTAINS(r.err, "no text");
  EXPECT_EQ(step_records(out).size(), 2u);
  EXPECT_EQ(saved_step(out), 2);
  r = run_keel(train(out, {"train.max_steps=3", "log.checkpoint_every=0", "run.overwrite=true"}));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(step_records(out).size(), 3u);  // the new run alone
  EXPECT_EQ(saved_step(out), 3);
}

// A run that starts from its out_dir's own checkpoint with run.overwrite removed the weights it
// started from once it was built: the previous run's checkpoint was lost.
TEST(CliOutDir, OverwriteThatWouldRemoveTheRunsOwnModelPathIsRefused) {
  const std::string out = test::temp_dir("outdir-overwrite-input");
  auto r = run_keel(train(out, {"train.max_steps=2"}));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel(train(
      out, {"train.max_steps=2", "run.overwrite=true", "model.path=" + out + "/checkpoints/last"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "run.overwrite = true would remove model.path = " + out +
                             "/checkpoints/last (in " + out +
                             "/checkpoints, the previous run's), which this run reads");
  EXPECT_EQ(saved_step(out), 2);
  EXPECT_EQ(step_records(out).size(), 2u);
}

// run.overwrite replaced the previous run's checkpoints, metrics and TensorBoard files but kept
// its adapter/ and debug/: a full fine-tune's out_dir held the LoRA run's PEFT adapter it
// replaced, as if it were its own.
TEST(CliOutDir, OverwriteRemovesThePreviousRunsAdapterAndDebugFiles) {
  const std::string out = test::temp_dir("outdir-overwrite-all");
  auto r = run_keel(train(out, {"train.max_steps=1", "model.adapter.kind=lora",
                                "model.adapter.target_modules=[\"c_attn\"]"}));
  ASSERT_EQ(r.code, 0) << r.output;
  ASSERT_TRUE(fs::exists(out + "/adapter/adapter_model.safetensors"));
  fs::create_directories(out + "/debug/nan_capture/rank0");
  r = run_keel(train(out, {"train.max_steps=1", "run.overwrite=true"}));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(out + "/adapter")) << "the replaced run's adapter is still there";
  EXPECT_FALSE(fs::exists(out + "/debug")) << "the replaced run's debug files are still there";
  EXPECT_EQ(step_records(out).size(), 1u);
}

// Continue the run or replace it: with both asked for, the resume went ahead and run.overwrite
// was ignored without a word.
TEST(CliOutDir, ResumeWithOverwriteIsRefusedNamingBothKeys) {
  const std::string out = test::temp_dir("outdir-resume-overwrite");
  auto r = run_keel(train(out, {"train.max_steps=2"}));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel(train(out, {"train.max_steps=3", "run.resume=true", "run.overwrite=true"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "run.resume = true and run.overwrite = true contradict each other");
  EXPECT_CONTAINS(r.err, "set run.overwrite = false to resume, or run.resume = false");
  EXPECT_EQ(step_records(out).size(), 2u);  // untouched
  EXPECT_EQ(saved_step(out), 2);
}

TEST(CliOutDir, KeepCheckpointsKeepsTheNewestStepDirectories) {
  const std::string out = test::temp_dir("outdir-keep");
  auto r = run_keel(train(out, {"train.max_steps=5", "log.keep_checkpoints=2"}));
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<std::string> steps;
  for (auto& e : fs::directory_iterator(out + "/checkpoints"))
    if (e.path().filename().string().rfind("step-", 0) == 0)
      steps.push_back(e.path().filename().string());
  std::sort(steps.begin(), steps.end());
  EXPECT_EQ(steps, (std::vector<std::string>{"step-4", "step-5"}));
}

TEST(CliOutDir, AFailingFsyncIsAnErrorAndKeepsTheLastGoodCheckpoint) {
  const std::string out = test::temp_dir("outdir-fsync");
  // config.toml and the first saves succeed; a later fsync fails with EIO.
  auto r = run_keel(train(out), {"KEEL_TEST_FAIL_FSYNC=20"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "fsync");
  EXPECT_CONTAINS(r.err, "Input/output error");
  EXPECT_EQ(r.out.find("done:"), std::string::npos) << r.out;
  const io::Checkpoint c = io::load_checkpoint(out + "/checkpoints/last");
  EXPECT_GE(c.trainer_state.at("step").get<int64_t>(), 1);
  EXPECT_LT(c.trainer_state.at("step").get<int64_t>(), 4);
}

TEST(CliOutDir, AFileSizeLimitIsAWriteErrorNotASignal) {
  const std::string out = test::temp_dir("outdir-fsize");
  // 64 KB: config.toml and metrics fit, the ~400 KB optimizer state does not.
  std::string cmd = "ulimit -f 128; exec " + test::keel_binary();
  for (const std::string& a : train(out)) cmd += " '" + a + "'";
  auto r = test::run_command({"/bin/sh", "-c", cmd});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, "File too large");
  EXPECT_CONTAINS(r.err, "cannot write");
}

// `keel train | head`: the closed pipe's SIGPIPE killed the run at its next progress line, every
// step since the last checkpoint lost (here all: none was due). Now the run stops as on SIGTERM,
// with checkpoints/last saved, says so with exit 1, and resumes to the end.
TEST(CliOutDir, AClosedPipeOnStdoutStopsTheRunWithItsCheckpoint) {
  const std::string out = test::temp_dir("outdir-pipe");
  std::string cmd = test::keel_binary();
  for (const std::string& a : train(out, {"train.max_steps=40", "log.checkpoint_every=1000"}))
    cmd += " '" + a + "'";
  // `true` has exited before keel writes its first line.
  auto r = test::run_command(
      {"/bin/sh", "-c", "{ sleep 0.3; " + cmd + "; echo \"exit $?\" >&2; } | true"});
  EXPECT_CONTAINS(r.err, "exit 1");
  EXPECT_CONTAINS(r.err, "cannot write standard output: the pipe was closed");
  EXPECT_CONTAINS(r.err, "the run stopped after step 1");
  EXPECT_CONTAINS(r.err, "run.resume=true");
  EXPECT_EQ(saved_step(out), 1);
  r = run_keel(train(out, {"train.max_steps=40", "log.checkpoint_every=1000", "run.resume=true"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(saved_step(out), 40);
  EXPECT_EQ(step_records(out).size(), 40u);
}

// A crash at each stage of the 2nd save of checkpoints/last (step 2), then a resume: the run
// continues from step 1 or 2 (never from scratch), cleans the leftovers, logs every step once and
// ends with the uninterrupted run's weights.
TEST(CliOutDir, ACrashAtEveryPointOfASaveResumes) {
  const std::string root = test::temp_dir("outdir-crash");
  auto r = run_keel(train(root + "/straight"));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string want = slurp(root + "/straight/checkpoints/last/model.safetensors");
  // Stage occurrences: step 1 saves last then step-1 (tmp_written, renamed, done each), step 2
  // saves last with a previous one to move aside.
  for (const char* at : {"tmp_written:3", "moved_aside:1", "renamed:3", "done:3"}) {
    SCOPED_TRACE(at);
    const std::string out = root + "/" + std::string(at).substr(0, std::string(at).find(':'));
    r = run_keel(train(out), {std::string("KEEL_TEST_CRASH_AT=") + at});
    ASSERT_EQ(r.code, 86) << r.output;
    r = run_keel(train(out, {"run.resume=true"}));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output.find("starting from scratch"), std::string::npos) << r.output;
    EXPECT_CONTAINS(r.output, "resumed from");
    EXPECT_TRUE(leftovers(out).empty()) << leftovers(out).front();
    const auto recs = step_records(out);
    ASSERT_EQ(recs.size(), 4u);
    for (size_t i = 0; i < recs.size(); ++i)
      EXPECT_EQ(recs[i].at("step").get<int64_t>(), static_cast<int64_t>(i + 1));
    EXPECT_TRUE(slurp(out + "/checkpoints/last/model.safetensors") == want);
  }
}

// A run killed while saving step 4 (its last checkpoint holds step 2) logged steps 3 and 4 to
// TensorBoard; the resumed run logs them again. TensorBoard shows each step once, the resumed
// run's value, as metrics.jsonl does.
TEST(CliOutDir, TensorBoardShowsEachStepOnceAfterAResume) {
  const std::string out = test::temp_dir("outdir-tb");
  const std::vector<std::string> sets = {"log.tensorboard=true", "log.checkpoint_every=2"};
  // Saves: step 2 writes last then step-2 (tmp_written 1, 2); step 4 writes last (3).
  auto r = run_keel(train(out, sets), {"KEEL_TEST_CRASH_AT=tmp_written:3"});
  ASSERT_EQ(r.code, 86) << r.output;
  ASSERT_EQ(saved_step(out), 2);
  auto resumed = sets;
  resumed.push_back("run.resume=true");
  r = run_keel(train(out, resumed));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto recs = step_records(out);
  const auto view = test::tensorboard_view(out + "/tb", "loss");
  ASSERT_EQ(view.size(), 4u);
  ASSERT_EQ(recs.size(), 4u);
  for (size_t i = 0; i < view.size(); ++i) {
    EXPECT_EQ(view[i].first, static_cast<int64_t>(i + 1));
    EXPECT_EQ(view[i].second, recs[i].at("loss").get<float>()) << "step " << i + 1;
  }
}

// 8 batches in windows of 3: steps 3 and 6 end epochs 0 and 1. A run killed after the checkpoint
// of step 3 (its epoch's record not yet written) resumed with the epoch taken as reported: epoch
// 0's record was missing from metrics.jsonl.
TEST(CliOutDir, AKillAfterAnEpochsLastCheckpointKeepsTheEpochRecord) {
  const std::string root = test::temp_dir("outdir-epoch-end");
  const std::vector<std::string> sets = {"train.grad_accum=3", "train.max_steps=5"};
  auto r = run_keel(train(root + "/straight", sets));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto want = test::records_with(root + "/straight", "epoch_loss");
  ASSERT_EQ(want.size(), 1u);
  // Saves: each step writes last then step-N; done:6 is step 3's step-3.
  const std::string out = root + "/killed";
  r = run_keel(train(out, sets), {"KEEL_TEST_CRASH_AT=done:6"});
  ASSERT_EQ(r.code, 86) << r.output;
  ASSERT_EQ(saved_step(out), 3);
  auto resumed = sets;
  resumed.push_back("run.resume=true");
  r = run_keel(train(out, resumed));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(test::records_with(out, "epoch_loss"), want);
  // Killed after the record was written (step 4's save): it is not written twice.
  const std::string later = root + "/killed-later";
  r = run_keel(train(later, sets), {"KEEL_TEST_CRASH_AT=done:7"});
  ASSERT_EQ(r.code, 86) << r.output;
  r = run_keel(train(later, resumed));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(test::records_with(later, "epoch_loss"), want);
}

// The last step's checkpoints/last was written before the run's final evaluation and its PEFT
// adapter: a run killed between them (in a long evaluation) resumed to "nothing left to train",
// with no adapter and no final eval record, and no resume would ever write them.
TEST(CliOutDir, AKillBetweenTheLastStepAndTheRunsEndFinishesOnResume) {
  const std::string root = test::temp_dir("outdir-run-end");
  const std::vector<std::string> sets = {"model.adapter.kind=lora",
                                         "model.adapter.target_modules=[\"c_attn\"]",
                                         "train.max_steps=2", "data.eval_examples=8"};
  auto r = run_keel(train(root + "/straight", sets));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string adapter = "/adapter/adapter_model.safetensors";
  const std::string want = slurp(root + "/straight" + adapter);
  const auto evals = test::records_with(root + "/straight", "eval_loss");
  ASSERT_EQ(evals.size(), 1u);
  // Saves: step 1 writes last then step-1; done:4 is the 4th save, the last step's.
  const std::string out = root + "/killed";
  r = run_keel(train(out, sets), {"KEEL_TEST_CRASH_AT=done:4"});
  ASSERT_EQ(r.code, 86) << r.output;
  auto resumed = sets;
  resumed.push_back("run.resume=true");
  r = run_keel(train(out, resumed));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NOT_CONTAINS(r.err, "nothing left to train");
  EXPECT_TRUE(fs::exists(out + adapter) && slurp(out + adapter) == want);
  EXPECT_EQ(test::records_with(out, "eval_loss"), evals);
  EXPECT_EQ(step_records(out).size(), 2u);
  EXPECT_EQ(saved_step(out), 2);
}

// A run that names no run.out_dir gets a new out/<UTC time>: runs started in the same second
// shared one, a later one appending its records to the earlier's metrics.jsonl and replacing its
// checkpoints (a concurrent one was refused as "in use" by the run.out_dir it never set).
TEST(CliOutDir, ARunWithoutAnOutDirNeverSharesOneStartedInTheSameSecond) {
  const std::string cwd = test::temp_dir("outdir-default");
  // An earlier run in each of the next 30 seconds: this run starts in one of them.
  const std::string earlier = "{\"step\": 1, \"earlier\": true}\n";
  const std::time_t now = std::time(nullptr);
  for (int i = 0; i < 30; ++i) {
    const std::string d = cwd + "/out/" + utc_time(kUtcDirName, now + i);
    fs::create_directories(d);
    std::ofstream(d + "/metrics.jsonl") << earlier;
  }
  std::vector<std::string> args = train("", {"train.max_steps=2"});
  args.erase(args.begin() + 1, args.begin() + 3);  // --set run.out_dir=
  std::string cmd = "cd '" + cwd + "' && exec " + test::keel_binary();
  for (const std::string& a : args) cmd += " '" + a + "'";
  auto r = test::run_command({"/bin/sh", "-c", cmd});
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<std::string> runs;
  for (auto& e : fs::directory_iterator(cwd + "/out"))
    if (slurp(e.path().string() + "/metrics.jsonl") != earlier)
      runs.push_back(e.path().filename().string());
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].substr(15), "-2") << runs[0];  // the second run of its second
  EXPECT_EQ(step_records(cwd + "/out/" + runs[0]).size(), 2u);
  EXPECT_CONTAINS(r.out, "out out/" + runs[0]);
}

// Without run.out_dir a run writes to a new out/<UTC time>/: a resume (a run's own config.toml
// holds out_dir = "") found nothing there and trained from scratch, exit 0.
TEST(CliOutDir, ResumeWithoutAnOutDirIsRefused) {
  auto r = run_keel(test::with_sets(
      {"train"}, {"run.resume=true", "train.max_steps=1", "model.n_layer=1", "run.threads=1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "run.resume = true but run.out_dir is not set");
  EXPECT_CONTAINS(r.err, "set run.out_dir to the directory of the run to continue");
  EXPECT_NOT_CONTAINS(r.output, "starting from scratch");
}

TEST(CliOutDir, ResumeThatChangesWhatTheCheckpointFixesIsRefused) {
  const std::string out = test::temp_dir("outdir-fixed");
  auto r = run_keel(train(out, {"train.max_steps=2"}));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel(train(
      out, {"run.resume=true", "train.batch_size=4", "run.seed=7", "train.precision=bf16-mixed"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, out + "/checkpoints/last/trainer.json: this resume changes");
  EXPECT_CONTAINS(r.err, "train.batch_size: 8 in the checkpoint, 4 now");
  EXPECT_CONTAINS(r.err, "run.seed: 1337 in the checkpoint, 7 now");
  EXPECT_CONTAINS(r.err, "train.precision: \"32-true\" in the checkpoint, \"bf16-mixed\" now");
  EXPECT_CONTAINS(r.err, "run.resume_force = true");
  // Parameters of another dtype do not carry over even when forced: it failed with "tensor ... is
  // [259, 64] f32, the model expects [259, 64] f16 (was it written by another config?)".
  r = run_keel(train(out, {"run.resume=true", "train.precision=16-true", "run.resume_force=true"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err,
                  "a resume cannot change the parameters' dtype, even with "
                  "run.resume_force");
  // ... and the fix it names works: a new run from the checkpoint's weights.
  r = run_keel(train(out + "-from-checkpoint", {"model.path=" + out + "/checkpoints/last",
                                                "train.precision=16-true", "train.max_steps=1"}));
  EXPECT_EQ(r.code, 0) << r.output;
  r = run_keel(train(out, {"run.resume=true", "train.batch_size=4", "run.resume_force=true"}));
  EXPECT_EQ(r.code, 0) << r.output;
  // max_steps is not fixed: a longer run continues.
  r = run_keel(train(out, {"run.resume=true", "train.batch_size=4", "train.max_steps=5"}));
  EXPECT_EQ(r.code, 0) << r.output;
}

// The batch position a checkpoint saved counts batches of the file it trained on: a resume on a
// file changed since (cut, appended to, regenerated; the eval file too) is refused naming the key
// and both fingerprints, unless run.resume_force. A file only touched resumes.
// run.resume_force cannot load a checkpoint into other tensors: another optimizer, or an adapter
// dropped, failed as "the checkpoint is damaged: resume from another one", and an adapter added
// on its first missing tensor.
TEST(CliOutDir, ResumeForceThatChangesTheTensorsIsRefusedNamingTheKeys) {
  const std::string out = test::temp_dir("outdir-force-tensors");
  auto r = run_keel(train(out, {"train.max_steps=2"}));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel(
      train(out, {"run.resume=true", "run.resume_force=true", "optim.name=sgd",
                  "model.adapter.kind=lora", "model.adapter.target_modules=[\"c_attn\"]"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, out +
                             "/checkpoints/last/trainer.json: run.resume_force = true, but this "
                             "resume changes which tensors the model or the optimizer holds:");
  EXPECT_CONTAINS(r.err, "optim.name: \"adamw\" in the checkpoint, \"sgd\" now");
  EXPECT_CONTAINS(r.err, "model.adapter.kind: \"none\" in the checkpoint, \"lora\" now");
  EXPECT_CONTAINS(r.err, "(model.path = \"" + out + "/checkpoints/last\", without run.resume)");
  EXPECT_NOT_CONTAINS(r.err, "damaged");
  EXPECT_EQ(saved_step(out), 2);
  // What does not change the tensors still resumes under it.
  r = run_keel(train(out, {"run.resume=true", "run.resume_force=true", "run.seed=7"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(saved_step(out), 4);
}

TEST(CliOutDir, ResumeOnChangedDataIsRefusedNamingTheFile) {
  const std::string out = test::temp_dir("outdir-data");
  const std::string txt = out + "-corpus.txt", val = out + "-val.txt";
  auto write = [](const std::string& path, int lines) {
    std::ofstream f(path);
    for (int i = 0; i < lines; ++i) f << "line " << i << " of the corpus, the quick brown fox\n";
  };
  write(txt, 80);
  write(val, 8);
  const std::vector<std::string> text = {"data.task=text",    "data.pack=true",
                                         "data.path=" + txt,  "data.eval_path=" + val,
                                         "train.max_steps=2", "data.seq_len=16"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), text.begin(), text.end());
    return train(out, more);
  };
  auto r = run_keel(with({}));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto fp = json::parse(slurp(out + "/checkpoints/last/trainer.json")).at("data_files");
  EXPECT_EQ(fp.at("data.path").at("bytes").get<int64_t>(),
            static_cast<int64_t>(fs::file_size(txt)));
  ASSERT_TRUE(fp.contains("data.eval_path")) << fp.dump();
  ::utimes(txt.c_str(), nullptr);  // the same bytes, a new mtime
  r = run_keel(with({"run.resume=true", "train.max_steps=3"}));
  ASSERT_EQ(r.code, 0) << r.output;

  write(txt, 60);  // cut
  r = run_keel(with({"run.resume=true", "train.max_steps=4"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "trainer.json: the data changed since this checkpoint was written");
  EXPECT_CONTAINS(r.err, "data.path = " + txt + ": " +
                             std::to_string(fp.at("data.path").at("bytes").get<int64_t>()) +
                             " bytes, hash ");
  EXPECT_CONTAINS(r.err, std::to_string(fs::file_size(txt)) + " bytes, hash ");
  EXPECT_NOT_CONTAINS(r.err, "data.eval_path = ");
  EXPECT_CONTAINS(r.err, "run.resume_force = true");
  EXPECT_EQ(saved_step(out), 3);  // nothing written over
  write(txt, 80);                 // restored: the interrupted run continues
  std::ofstream(val, std::ios::app) << "one more held-out line\n";
  r = run_keel(with({"run.resume=true", "train.max_steps=4"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "data.eval_path = " + val + ": ");
  r = run_keel(with({"run.resume=true", "train.max_steps=4", "run.resume_force=true"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(saved_step(out), 4);
  // A checkpoint without its "data_files" record resumed on any data.
  const std::string tj = out + "/checkpoints/last/trainer.json";
  json st = json::parse(slurp(tj));
  st.erase("data_files");
  std::ofstream(tj) << st.dump();
  r = run_keel(with({"run.resume=true", "train.max_steps=5"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "data.path = " + txt + ": unrecorded in the checkpoint");
}

TEST(CliOutDir, ADamagedTrainerJsonNamesTheFileAndTheKey) {
  const std::string out = test::temp_dir("outdir-trainer-json");
  auto r = run_keel(train(out, {"train.max_steps=2", "log.checkpoint_every=0"}));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string path = out + "/checkpoints/last/trainer.json";
  const json good = json::parse(slurp(path));
  for (const char* bad : {"-5", "18446744073709551615", "1.5", "\"two\""}) {
    json j = good;
    j["step"] = json::parse(bad);
    std::ofstream(path) << j.dump();
    r = run_keel(train(out, {"train.max_steps=3", "log.checkpoint_every=0", "run.resume=true"}));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_CONTAINS(r.err,
                    path + ": \"step\" = " + std::string(bad) + " is not an integer in [0, ");
    EXPECT_EQ(r.err.find("json.exception"), std::string::npos) << r.err;
  }
  json j = good;
  j.erase("epoch");
  std::ofstream(path) << j.dump();
  r = run_keel(train(out, {"train.max_steps=3", "log.checkpoint_every=0", "run.resume=true"}));
  EXPECT_CONTAINS(r.err, path + ": \"epoch\" is missing");
  // A batch position past the epoch's batches continued in another epoch without a word.
  j = good;
  j["next_batch"] = 1000000000000;
  std::ofstream(path) << j.dump();
  r = run_keel(train(out, {"train.max_steps=3", "log.checkpoint_every=0", "run.resume=true"}));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_CONTAINS(r.err, path + ": \"next_batch\" = 1000000000000 is not an integer in [0, ");
  // Without its "config" record the checks of what a checkpoint fixes were skipped: a changed
  // seed and batch size resumed.
  for (const json& config : {json(), json::array({1})}) {
    j = good;
    if (config.is_null())
      j.erase("config");
    else
      j["config"] = config;
    std::ofstream(path) << j.dump();
    r = run_keel(train(
        out, {"train.max_steps=3", "log.checkpoint_every=0", "run.resume=true", "run.seed=7"}));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_CONTAINS(r.err, "run.seed: unrecorded in the checkpoint");
    EXPECT_CONTAINS(r.err, "run.resume_force = true");
  }
  // A key newer than the keel that wrote the checkpoint (model.attention_dropout) resumes at its
  // default, as that keel ran; set to another value, it is a change.
  j = good;
  ASSERT_TRUE(j["config"].contains("model.attention_dropout"));
  j["config"].erase("model.attention_dropout");
  std::ofstream(path) << j.dump();
  r = run_keel(train(out, {"train.max_steps=3", "log.checkpoint_every=0", "run.resume=true",
                           "model.attention_dropout=0.1"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "model.attention_dropout: unrecorded in the checkpoint");
  r = run_keel(train(out, {"train.max_steps=3", "log.checkpoint_every=0", "run.resume=true"}));
  EXPECT_EQ(r.code, 0) << r.output;
}

// A resume whose checkpoints/last lacks a file (optimizer.safetensors removed) took the checkpoint
// as absent: "run.resume = true but .../last does not exist: starting from scratch", exit 0, and
// the fresh run's first save replaced the step-2 weights and trainer.json that were there.
TEST(CliOutDir, ResumingFromAnIncompleteCheckpointIsRefusedAndKeepsIt) {
  const std::string out = test::temp_dir("outdir-incomplete");
  auto r = run_keel(train(out, {"train.max_steps=2", "log.checkpoint_every=0"}));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string last = out + "/checkpoints/last";
  const std::string weights = slurp(last + "/model.safetensors");
  for (const char* file : {"optimizer.safetensors", "model.safetensors", "trainer.json"}) {
    const std::string saved = slurp(last + "/" + file);
    fs::remove(last + "/" + file);
    r = run_keel(train(out, {"train.max_steps=3", "log.checkpoint_every=0", "run.resume=true"}));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_CONTAINS(r.err,
                    "checkpoint " + last + " is incomplete: " + last + "/" + file + " is missing");
    EXPECT_NOT_CONTAINS(r.output, "starting from scratch");
    if (std::string(file) != "trainer.json") {
      EXPECT_EQ(saved_step(out), 2);
    }
    EXPECT_EQ(slurp(last + "/model.safetensors"),
              std::string(file) == "model.safetensors" ? "" : weights);
    std::ofstream(last + "/" + file, std::ios::binary) << saved;
  }
  r = run_keel(train(out, {"train.max_steps=3", "log.checkpoint_every=0", "run.resume=true"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "resumed from " + last + " at step 2");
}

// A resume whose checkpoints/last is gone while step-N checkpoints remain started from scratch
// ("last does not exist") and replaced step-1, step-2, ... one by one with the new run's.
TEST(CliOutDir, ResumingWithoutLastNamesTheNewestStepCheckpoint) {
  const std::string out = test::temp_dir("outdir-no-last");
  auto r = run_keel(train(out, {"train.max_steps=3"}));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string ck = out + "/checkpoints";
  const std::string step1 = slurp(ck + "/step-1/model.safetensors");
  fs::remove_all(ck + "/last");
  r = run_keel(train(out, {"train.max_steps=5", "run.resume=true"}));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_CONTAINS(r.err, "run.resume = true but " + ck + "/last does not exist, while " + ck +
                             "/step-3 does: copy it to " + ck + "/last to resume from step 3");
  EXPECT_EQ(slurp(ck + "/step-1/model.safetensors"), step1);
  EXPECT_FALSE(fs::exists(ck + "/step-4"));
  fs::copy(ck + "/step-3", ck + "/last");
  r = run_keel(train(out, {"train.max_steps=5", "run.resume=true"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "resumed from " + ck + "/last at step 3");
  // With no checkpoint at all a resume still starts from scratch.
  const std::string fresh = test::temp_dir("outdir-no-last-fresh");
  r = run_keel(train(fresh, {"train.max_steps=1", "run.resume=true"}));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "starting from scratch");
}

// A checkpoint's config.json is read by model.path (and generate, eval, export): a hand-edited
// keel_checkpoint field of another type was nlohmann's raw "[json.exception.type_error.302] type
// must be string, but is number".
TEST(CliOutDir, ADamagedCheckpointConfigJsonNamesTheFileAndTheField) {
  const std::string out = test::temp_dir("outdir-config-json");
  auto r = run_keel(train(out, {"train.max_steps=1", "log.checkpoint_every=0"}));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string ck = out + "/checkpoints/last", path = ck + "/config.json";
  const json good = json::parse(slurp(path));
  struct Case {
    const char* key;
    json value;
    const char* expected;
  };
  for (const Case& c :
       {Case{"tokenizer", 5, "keel_checkpoint.tokenizer must be a string, got 5"},
        Case{"base_model", json::array({1}),
             "keel_checkpoint.base_model must be a string, got [1]"},
        Case{"adapter", "no", "keel_checkpoint.adapter must be true or false, got \"no\""},
        Case{"base", {{"path", 3}}, "keel_checkpoint.base.path must be a string, got 3"}}) {
    json j = good;
    j["keel_checkpoint"][c.key] = c.value;
    std::ofstream(path) << j.dump();
    for (const auto& args :
         {train(test::temp_dir("outdir-config-json-from"), {"model.path=" + ck}),
          std::vector<std::string>{"generate", ck, "12+", "--max-new-tokens", "1"}}) {
      r = run_keel(args);
      EXPECT_EQ(r.code, 2) << r.output;
      EXPECT_CONTAINS(r.err, path + ": " + c.expected);
      EXPECT_CONTAINS(r.err, "the checkpoint is damaged");
      EXPECT_NOT_CONTAINS(r.err, "json.exception");
    }
  }
}

// Resuming a run that is complete (or past a lowered train.max_steps) evaluated again and
// appended the same eval and epoch records each time, rewriting the checkpoint it had read. Now
// it says there is nothing left to train and changes nothing.
TEST(CliOutDir, ResumingACompleteRunTrainsNothingAndWritesNothing) {
  const std::string out = test::temp_dir("outdir-complete");
  test::KeelRun r = run_keel(train(out, {"data.eval_examples=8", "train.eval_every=2"}));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string metrics = slurp(out + "/metrics.jsonl");
  const auto written = fs::last_write_time(out + "/checkpoints/last/trainer.json");
  for (const char* steps : {"train.max_steps=4", "train.max_steps=3"}) {
    r = run_keel(train(out, {"data.eval_examples=8", "train.eval_every=2", "run.resume=true",
                             "log.checkpoint_every=0", steps}));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_CONTAINS(r.err, "nothing left to train: the checkpoint is at step 4");
    EXPECT_CONTAINS(r.err, "raise train.max_steps (or train.epochs) to train further");
    EXPECT_EQ(slurp(out + "/metrics.jsonl"), metrics) << steps;
    EXPECT_EQ(fs::last_write_time(out + "/checkpoints/last/trainer.json"), written) << steps;
  }
  EXPECT_CONTAINS(r.err, "past the run's 3 steps");
}

// A resume may change what the checkpoint does not fix (optim.lr, train.max_grad_norm, ...): it
// did so without a word, and the run was no longer the one it continued. Each change is named;
// a longer run and other logging are no change of its numbers.
TEST(CliOutDir, AResumeThatChangesASettingNamesEachChange) {
  const std::string out = test::temp_dir("outdir-settings");
  test::KeelRun r = run_keel(train(out, {"train.max_steps=2"}));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel(train(
      out, {"train.max_steps=3", "run.resume=true", "log.every=2", "log.checkpoint_every=0"}));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NOT_CONTAINS(r.err, "changes settings");
  r = run_keel(train(
      out, {"train.max_steps=4", "run.resume=true", "optim.lr=0.01", "train.max_grad_norm=0.5"}));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err,
                  "this resume changes settings of the checkpoint's run (allowed; from step 4 on "
                  "the run differs from an uninterrupted one):\n"
                  "  optim.lr: 0.003 in the checkpoint, 0.01 now\n"
                  "  train.max_grad_norm: 1.0 in the checkpoint, 0.5 now\n");
}

// A resume with another train.max_steps lays a decaying schedule over the new total, so the
// learning rate jumps (a 4-step cosine run ends near 0 and resumes for 8 at half of optim.lr):
// said with both rates. A constant schedule has nothing to say.
TEST(CliOutDir, AResumeThatRelaysTheScheduleSaysHowTheLearningRateJumps) {
  const std::string out = test::temp_dir("outdir-relaid");
  test::KeelRun r = run_keel(train(out, {"sched.name=cosine"}));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_keel(train(out, {"sched.name=cosine", "run.resume=true", "train.max_steps=8"}));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_CONTAINS(r.err,
                  "the learning-rate schedule (sched.name = cosine) was laid over 4 steps in the "
                  "checkpoint's run and is over 8 now (train.max_steps or train.epochs changed): "
                  "step 5 runs at lr 0.0015 where the old schedule had 0");
  const std::string same = test::temp_dir("outdir-relaid-constant");
  ASSERT_EQ(run_keel(train(same)).code, 0);
  r = run_keel(train(same, {"run.resume=true", "train.max_steps=8"}));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NOT_CONTAINS(r.err, "learning-rate schedule");
}

}  // namespace
}  // namespace keel
