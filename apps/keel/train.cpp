// `keel train [CONFIG.toml] [--set section.key=value ...]`: trains a model. With no config it
// trains the built-in arithmetic task, which visibly learns in about a minute on two cores.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <optional>
#include <thread>

#include "apps/keel/commands.h"
#include "keel/dist/config_check.h"
#include "keel/dist/mpi_group.h"
#include "keel/dist/process_group.h"
#include "keel/io/atomic_file.h"
#include "keel/io/checkpoint.h"
#include "keel/io/out_dir.h"
#include "keel/log/console.h"
#include "keel/log/loggers.h"
#include "keel/models/llama.h"
#include "keel/monitor/advisor.h"
#include "keel/monitor/grad_norms.h"
#include "keel/monitor/inject.h"
#include "keel/monitor/memory_estimate.h"
#include "keel/monitor/nan_capture.h"
#include "keel/monitor/replay_step.h"
#include "keel/monitor/tracer.h"
#include "keel/numerics/text.h"
#include "keel/ops/elementwise.h"
#include "keel/train/eval_loss.h"
#include "keel/train/stop_request.h"
#include "keel/train/trainer.h"

namespace keel::cli {

namespace {

// What an evaluation with a non-finite loss says: the model after step e.step's update produces
// NaN/inf on the held-out data. `value` ("nan at step 3"), `beside` the training loss when it was
// finite, `fix` the weights or the precision's range and what to change.
struct EvalNonfinite {
  std::string value, beside, fix;
};
EvalNonfinite eval_nonfinite_advice(const Trainer& trainer, const EvalResult& e, double step_loss) {
  const std::string step = std::to_string(e.step);
  EvalNonfinite r;
  r.value = log::format_number(e.loss, 4) + " at step " + step;
  const std::string lr =
      "lower optim.lr (now " + log::format_number(trainer.config().optim.lr, 4) + ")";
  const std::vector<std::string> bad = trainer.nonfinite_parameters(true);
  const std::string wider = wider_precisions(trainer.policy().name());
  if (!bad.empty())
    r.fix = "the updates overflowed the weights (" + bad[0] +
            (bad.size() > 1 ? " and " + std::to_string(bad.size() - 1) + " more" : "") +
            " hold NaN/inf); " + lr;
  else if (wider.empty())
    r.fix =
        "under 32-true the weights themselves produce it (values large enough to overflow f32 "
        "in a product): the updates grew them; " +
        lr;
  else
    r.fix = "the model as it stands overflows " +
            std::string(dtype_name(trainer.policy().compute_dtype)) +
            "'s range on the held-out data; try train.precision = " + wider + ", or " + lr +
            " (the last updates may have grown the weights)";
  if (std::isfinite(step_loss))
    r.beside = ", while the training loss was finite (" + log::format_number(step_loss, 4) +
               " at step " + step + ", before its update)";
  return r;
}
// Data-parallel runs (`mpirun -np N keel train CONFIG`, dist.backend = auto|mpi|nccl): an error on
// one rank must end every rank (the others would wait in a collective forever).
//
// Who says it. The ranks run one config on the same inputs, so most errors (a bad key, a resume
// refusal, a data file missing from a shared file system) are hit by every rank alike, and each
// printed it: N copies of one message. Others are one rank's own (a file missing on one node, a
// write error, a deadline) and must never be lost. A rank cannot tell which from its message
// alone, and guessing from the launcher's rank (rank 0 speaks for a "config error") loses the
// error of a node whose copy of the config file differs. So the ranks that failed compare: each
// gives a hash of its message and its time on a communicator of its own
// (ProcessGroup::gather_errors). When every rank arrives within a short wait, the lowest rank of
// each distinct message says it once, naming the ranks that share it; a deadline that expired
// after another rank had failed stays quiet (that failure is why it waited in vain: rank 0 ran
// into the final check's deadline after rank 1 gave up waiting for its evaluation). When a rank
// does not arrive (it did not fail), this rank's error is its own: said with its rank, then the
// job is aborted. An error before the group exists (a config that does not load) starts MPI only
// to compare, unless the config asked for no MPI.
int fail_ranked(std::shared_ptr<dist::ProcessGroup> pg, const std::string& backend,
                double timeout_s, const std::string& msg, int code) {
  const double failed_at =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  if (!pg && dist::launched_by_mpirun() && dist::launcher_world_size() > 1 && backend != "single") {
    try {
      pg = dist::make_mpi_group(25000000);  // only to compare: nothing is reduced
    } catch (const std::exception&) {
      pg.reset();
    }
  }
  const int rank = pg ? pg->rank() : dist::launcher_rank();
  const int world = pg ? pg->world_size() : dist::launcher_world_size();
  if (world <= 1 || (!pg && !dist::launched_by_mpirun())) {
    std::fprintf(stderr, "error: %s\n", msg.c_str());
    return code;
  }
  auto say = [&](const std::string& who) {
    std::fprintf(stderr, "error (%s of %d): %s\n", who.c_str(), world, msg.c_str());
    std::fflush(stderr);
  };
  // Ranks failing alike get there within moments of each other; a rank that did not fail never
  // does, and the job's end waits this long for it.
  const std::vector<dist::ProcessGroup::RankError> all =
      pg ? pg->gather_errors(dist::error_hash(msg), failed_at, std::min(timeout_s, 5.0))
         : std::vector<dist::ProcessGroup::RankError>{};
  if (all.size() != static_cast<size_t>(world)) {
    say("rank " + std::to_string(rank));
    if (pg) pg->abort(code);
    return code;
  }
  auto consequence = [&](size_t q) {
    if (!all[q].stuck) return false;
    for (const auto& e : all)
      if (e.time < all[q].time && e.hash != all[q].hash) return true;
    return false;
  };
  const auto me = static_cast<size_t>(rank);
  std::vector<size_t> alike;  // the ranks said with this rank's message
  bool first = true;
  for (size_t q = 0; q < all.size(); ++q)
    if (all[q].hash == all[me].hash && !consequence(q)) {
      first = first && (q >= me);
      alike.push_back(q);
    }
  if (!consequence(me) && first) {
    std::string who = alike.size() == all.size() ? "every rank"
                      : alike.size() > 1         ? "ranks "
                                                 : "rank ";
    if (alike.size() < all.size())
      for (size_t i = 0; i < alike.size(); ++i) who += (i ? ", " : "") + std::to_string(alike[i]);
    say(who);
  }
  // Every rank failed and none is left inside a collective: each ends normally with the code.
  for (const auto& e : all)
    if (e.stuck) pg->abort(code);
  return code;
}

struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
};

int run_ranked(Config cfg, const std::shared_ptr<dist::ProcessGroup>& pg);

int run_train(const TrainArgs& a) {
  std::shared_ptr<dist::ProcessGroup> pg;
  std::string backend = "auto";  // until the config says
  double timeout_s = 5;
  auto fail = [&](const std::string& msg, int code) {
    return fail_ranked(pg, backend, timeout_s, msg, code);
  };
  try {
    Config cfg = load_config(a.config, a.sets);
    backend = cfg.dist.backend;
    timeout_s = cfg.dist.timeout_s;
    check_keys_take_effect(cfg);
    // The run's memory, estimated from its sizes before anything large is allocated: a run that
    // cannot fit stops here with the options that would make it fit, instead of being killed by
    // the OOM killer minutes into loading the model.
    monitor::check_run_memory(
        cfg, [](const std::string& m) { std::fprintf(stderr, "%s\n", m.c_str()); });
    pg = dist::make_process_group(cfg.dist.backend, cfg.dist.bucket_mb);
    pg->set_timeout(cfg.dist.timeout_s);
    // SIGTERM/SIGINT: checkpoint, then stop (keel serve's stop, a scheduler's preemption, Ctrl-C;
    // under mpirun the ranks agree on the step first, see Trainer::fit).
    install_stop_handlers();
    if (pg->world_size() > 1) dist::check_config_agrees(cfg, *pg);
    return run_ranked(cfg, pg);
  } catch (const Error& e) {
    return fail(e.what(), e.kind == Error::kUsage ? 2 : 1);
  } catch (const std::bad_alloc&) {
    return fail(kOutOfMemory, 1);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
}

int run_ranked(Config cfg, const std::shared_ptr<dist::ProcessGroup>& pg) {
  const int rank = pg->rank(), world = pg->world_size();
  // No run.out_dir: a new out/<UTC time>[-N] (io::create_run_dir), made by rank 0 and named alike
  // on every rank (each took its own clock's time, which could differ by a second).
  if (cfg.run.out_dir.empty()) {
    double made[2] = {0, 0};  // rank 0's time and N
    if (rank == 0) {
      const std::time_t now = std::time(nullptr);
      made[0] = static_cast<double>(now);
      made[1] = io::create_run_dir(now);
    }
    if (world > 1) {
      pg->set_purpose("agreeing on the name of the new run directory");
      pg->all_reduce_max(made, 2);
    }
    cfg.run.out_dir =
        io::run_dir_name(static_cast<std::time_t>(made[0]), static_cast<int>(made[1]));
  }
  std::unique_ptr<log::RunLoggers> loggers;
  Trainer* trainer_ptr = nullptr;
  // Instability toolkit (DESIGN §4), attached once the trainer has built the model.
  std::unique_ptr<monitor::FaultInjector> injector;
  std::unique_ptr<monitor::UnderflowOverflowTracer> tracer;
  std::unique_ptr<monitor::TrendAdvisor> advisor;
  nlohmann::json step_extra = nlohmann::json::object();  // per-layer grad norms of this step
  std::vector<monitor::BlockGradNorm> layers;  // this step's per-layer statistics (the advisor's)
  static const std::vector<monitor::Finding> kNoFindings;
  // Whether rank 0's advisor may run forward passes in on_step (AdvisorOptions::batch_loss below;
  // the config is the same on every rank, so every rank knows).
  const bool advisor_probes =
      !cfg.debug.underflow_overflow.enabled && cfg.debug.inject.module.empty();
  TrainerHooks hooks;
  hooks.on_step_begin = [&](int64_t step) {
    if (injector) injector->begin_step(step);
    if (tracer) tracer->begin_batch(step);
  };
  // Always on: the per-layer norms and underflow counts come from the step's own gradient pass.
  hooks.on_grads = [&](const StepResult&) {
    layers.clear();
    if (!advisor && !cfg.log.per_layer_grad_norm) return;
    if (trainer_ptr->last_grad_pass().sum_squares_of.size() != trainer_ptr->trainable().size())
      return;  // no pass this step (the bench's switch)
    layers = monitor::per_layer_grad_norms(trainer_ptr->trainable(), &trainer_ptr->last_grad_pass(),
                                           &trainer_ptr->last_unselected());
    if (!cfg.log.per_layer_grad_norm) return;
    for (const auto& b : layers) {
      step_extra["grad_norm/" + b.block] = b.norm;
      step_extra["grad_underflow/" + b.block] = b.underflow_share();
    }
  };
  // The last step's loss, and the advice given for an evaluation whose loss was not finite
  // (repeated at the end when no later evaluation was finite).
  double last_step_loss = 0;
  int64_t stdout_failed_at = 0;  // the step after which standard output was found failed
  int stdout_errno = 0;
  std::optional<EvalNonfinite> nonfinite_eval;
  hooks.on_step = [&](const StepResult& result) {
    StepResult r = result;
    last_step_loss = r.loss;
    // A module that did not run at the injection's step corrupted nothing: a mixture's expert no
    // token was routed to (the run went on as if no fault had been asked for, without a word).
    if (injector && r.step == cfg.debug.inject.step && injector->injections() == 0)
      std::fprintf(stderr,
                   "note: debug.inject: %s did not run at step %lld (an expert no token was routed "
                   "to runs nothing), so nothing was injected; name the layer that holds it, or "
                   "another step\n",
                   cfg.debug.inject.module.c_str(), static_cast<long long>(r.step));
    if (advisor) advisor->observe(r, &layers);
    // A mixture of experts' routing this step (this rank's tokens): experts no token reached,
    // the busiest over a layer's mean, and HF's load-balancing loss of the step's tokens (logged
    // whether or not model.router_aux_loss_coef adds it to the loss).
    if (r.moe_layers) {
      step_extra["moe/unused_experts"] = r.moe_unused_experts;
      step_extra["moe/max_load"] = r.moe_max_load;
      step_extra["moe/aux_loss"] = r.moe_aux_loss;
    }
    loggers->log(r, step_extra);
    // Standard output gone (a closed pipe: `keel train | head`, a full disk under > train.log):
    // stop as on SIGTERM, with the checkpoint saved, rather than train on unseen or be killed.
    if (std::ferror(stdout) && !stdout_failed_at) {
      stdout_errno = errno;
      stdout_failed_at = r.step;
      request_stop();
    }
    // Each finding as a record of its own: kind, step, trend, cause, action (+ examples, layers,
    // share).
    for (const monitor::Finding& f : advisor ? advisor->findings() : kNoFindings) {
      nlohmann::json rec = {{"kind", "advisor"},
                            {"step", f.step},
                            {"trend", f.trend},
                            {"cause", f.cause},
                            {"action", f.action}};
      if (!f.examples.empty()) rec["examples"] = f.examples;
      if (!f.layers.empty()) rec["layers"] = f.layers;
      if (f.share >= 0) rec["share"] = f.share;
      loggers->log_record(rec, false);
    }
    step_extra = nlohmann::json::object();
    layers.clear();
    // A finding the step survived (the capture did not stop it): stop now, as the tracer does;
    // with several ranks, every rank stops when any tracer found something (MAX), so none waits.
    bool stop = tracer && tracer->finding().found && trainer_ptr->stop_message().empty();
    if (tracer && world > 1) {
      double any = stop ? 1 : 0;
      pg->set_purpose("agreeing on the tracers' findings at step " + std::to_string(r.step));
      pg->all_reduce_max(&any, 1);
      if (any != 0 && !stop) {
        monitor::TracerFinding f;
        f.message = "another rank's tracer found a non-finite value at step " +
                    std::to_string(r.step) + " (see " + trainer_ptr->out_dir() +
                    "/debug/underflow_overflow_rank*.log)";
        throw monitor::TracerStop(f);
      }
    }
    if (stop) throw monitor::TracerStop(tracer->finding());
    // Rank 0's advisor may probe a loss spike with forward passes over the step's whole global
    // window (about 2W/3 step-times): the other ranks wait for it here, under a deadline that
    // names it, not in the next step's first collective, whose deadline ended the job saying that
    // rank 0 "did not arrive". One 8-byte all-reduce a step (the probe is off with the tracer,
    // whose all-reduce above then meets rank 0 after its logging).
    if (world > 1 && advisor_probes)
      pg->wait_for_rank_zero("trend advisor's checks at step " + std::to_string(r.step) +
                             " (a loss spike's first sighting runs forward passes over the "
                             "step's whole window)");
  };
  hooks.on_eval = [&](const EvalResult& e) {
    std::printf("eval step %lld | loss %.4f", static_cast<long long>(e.step), e.loss);
    if (e.accuracy >= 0)
      std::printf(" | exact-match %s of %lld held-out problems",
                  log::format_percent(std::llround(e.accuracy * static_cast<double>(e.examples)),
                                      e.examples)
                      .c_str(),
                  static_cast<long long>(e.examples));
    std::printf("\n");
    std::fflush(stdout);
    nlohmann::json rec = {{"step", e.step}, {"eval_loss", e.loss}, {"eval_tokens", e.tokens}};
    if (e.accuracy >= 0) rec["eval_accuracy"] = e.accuracy;
    loggers->log_record(rec);  // metrics.jsonl and TensorBoard
    // A 16-true run whose last update overflowed ended "eval step 3 | loss nan", then "done", with
    // no word: its checkpoint is that model.
    nonfinite_eval.reset();
    if (std::isfinite(e.loss) || rank != 0) return;
    nonfinite_eval = eval_nonfinite_advice(*trainer_ptr, e, last_step_loss);
    std::printf("  advice: the eval loss is %s%s: %s\n", nonfinite_eval->value.c_str(),
                nonfinite_eval->beside.c_str(), nonfinite_eval->fix.c_str());
    std::fflush(stdout);
  };
  hooks.on_epoch = [&](const EpochResult& e) { loggers->log_epoch(e); };
  hooks.on_capture = [&](const NonfiniteEvent& ev) {
    return monitor::write_nan_capture(*trainer_ptr, ev, rank);
  };
  if (rank > 0) hooks.on_message = [](const std::string&) {};  // rank 0 says it once
  hooks.advisor_state = [&advisor] { return advisor ? advisor->state() : nlohmann::json(); };
  // Rank 0 owns the out_dir for the run's life (the ranks share it): locked before anything in it
  // is read or written, and a previous run in it is never silently overwritten.
  std::optional<io::OutDirLock> lock;
  std::vector<std::string> previous_run;
  if (rank == 0) {
    lock.emplace(cfg.run.out_dir);
    previous_run =
        io::claim_out_dir(cfg.run.out_dir, cfg.run.resume, cfg.run.overwrite, input_paths(cfg));
  }
  Trainer trainer(cfg, hooks, pg);
  io::remove_previous_run(previous_run);  // run.overwrite, once this run is built
  // The other ranks write into debug/ (rank weights, tracer logs, captures) only once rank 0 has
  // removed the previous run's.
  // (rank 0's removal of a large previous run can take long: a wait that names it).
  if (world > 1)
    pg->wait_for_rank_zero(
        "setup of the run directory (with run.overwrite, removing the previous "
        "run's files)");
  // A resumed run logs the steps after its checkpoint again: drop the interrupted run's records.
  if (rank == 0 && cfg.run.resume) log::drop_metrics_after(trainer.out_dir(), trainer.steps_done());
  trainer_ptr = &trainer;
  // The tracer and the injector hook into the trainer's model: detach them before the trainer is
  // destroyed (they were declared before it, so they would outlive it).
  struct Detach {
    std::unique_ptr<monitor::UnderflowOverflowTracer>& tracer;
    std::unique_ptr<monitor::FaultInjector>& injector;
    ~Detach() {
      tracer.reset();
      injector.reset();
    }
  } detach{tracer, injector};
  monitor::AdvisorOptions advisor_opt;
  advisor_opt.num_params = trainer.model().num_parameters(/*trainable_only=*/true);
  advisor_opt.precision = trainer.policy().name();
  advisor_opt.tracer_on = cfg.debug.underflow_overflow.enabled;
  advisor_opt.stochastic_rounding = cfg.optim.stochastic_rounding;
  advisor_opt.max_grad_norm = cfg.train.max_grad_norm;
  if (trainer.scaler()) {
    advisor_opt.init_scale = cfg.scaler.init_scale;
    advisor_opt.growth_interval = cfg.scaler.growth_interval;
  }
  if (const InjectConfig& inj = cfg.debug.inject; !inj.module.empty() && inj.step >= 1) {
    advisor_opt.inject_step = inj.step;
    advisor_opt.inject_what = inj.what();
  }
  // The uniform guess is over the logits the model produces (model.vocab_size), which may be far
  // wider than the tokenizer's ids (a byte tokenizer over Llama-3's 128,256 rows): a random model
  // starts near ln 128256 = 11.8, not ln 259 = 5.6, and is no divergence there.
  advisor_opt.uniform_loss = std::log(static_cast<double>(trainer.model().spec().vocab_size));
  // What "stalled" measures an update against: the trainable matrices as they start (not their
  // norm gains and biases, whose 1s and 0s say nothing of a weight's scale).
  advisor_opt.peak_lr = cfg.optim.lr;
  // The schedule as resolved (sched.warmup_ratio becomes steps): warmup advice needs both.
  advisor_opt.warmup_steps = trainer.run().schedule.warmup_steps;
  advisor_opt.total_steps = trainer.run().total_steps;
  advisor_opt.adaptive = cfg.optim.name != "sgd";
  advisor_opt.adapter = cfg.model.adapter.kind;
  advisor_opt.experts = trainer.model().spec().moe.experts;
  advisor_opt.experts_per_token = trainer.model().spec().moe.per_token;
  advisor_opt.router_aux_loss_coef = trainer.model().spec().moe.aux_coef;
  if (rank == 0 && trainer.steps_done() == 0) {
    double sum_sq = 0;
    int64_t n = 0;
    for (const auto& [name, p] : trainer.run().trainable)
      if (p.dim() >= 2) {
        sum_sq += ops::sum_squares(p);
        n += p.numel();
      }
    if (n > 0) advisor_opt.weight_rms = std::sqrt(sum_sq / static_cast<double>(n));
  }
  advisor_opt.describe_example = [&trainer](int64_t id) {
    return trainer.run().data.train->where(id);
  };
  // Two forwards without gradients, on a loss spike's first sighting only; the next step sets
  // train mode again, and no random draw is taken (dropout is off), so the run is unchanged. Not
  // with the tracer or the injector: their hooks would take the probe for the step's forward.
  if (advisor_probes)
    advisor_opt.batch_loss = [&trainer, &cfg](const std::vector<int64_t>& ids) {
      // Testing only: KEEL_TEST_SLOW_PROBE_S=S makes each probe forward S seconds longer, so that
      // a test sees rank 0's probe outlast dist.timeout_s without depending on the machine's speed.
      if (const char* slow = std::getenv("KEEL_TEST_SLOW_PROBE_S"))
        std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(slow)));
      const RunData& d = trainer.run().data;
      const LossTotal t =
          examples_loss(trainer.model(), *d.train, ids, cfg.train.batch_size, cfg.data.seq_len,
                        d.pad_id, trainer.policy(), trainer.device());
      return t.tokens > 0 ? t.loss() : std::nan("");
    };
  // 16-true / bf16-true keep AdamW's moments in 16 bits: a squared gradient flushed to 0 makes an
  // update of lr * m / eps that blows the weights up, at any learning rate.
  if (cfg.optim.name == "adamw" && trainer.policy().param_dtype != DType::F32)
    advisor_opt.state_underflow = [&trainer, &cfg] {
      return monitor::optimizer_state_underflow(trainer.run().optimizer->state(),
                                                trainer.model().named_parameters(), cfg);
    };
  advisor_opt.largest_weight = [&trainer] { return monitor::largest_weight(trainer.trainable()); };
  advisor_opt.tracer_log =
      trainer.out_dir() + "/debug/underflow_overflow_rank" + std::to_string(rank) + ".log";
  if (rank == 0) advisor = std::make_unique<monitor::TrendAdvisor>(advisor_opt);
  // A resumed run carries on with the advisor's state at its checkpoint: its findings are then
  // those of the run that was not interrupted.
  if (advisor && !trainer.resumed_advisor_state().is_null())
    advisor->restore(trainer.resumed_advisor_state(), trainer.resumed_trainer_json(),
                     io::kDamagedCheckpointResumeFix);
  else if (advisor && trainer.steps_done() > 0)
    std::fprintf(stderr,
                 "note: %s holds no advisor state (written by an older keel): the trend advisor "
                 "starts over at step %lld, and its findings may differ from an uninterrupted "
                 "run's\n",
                 trainer.resumed_trainer_json().c_str(),
                 static_cast<long long>(trainer.steps_done() + 1));
  // The injector's post hook goes first: the tracer must see the corrupted output to name the
  // module that produced it.
  if (!cfg.debug.inject.module.empty() &&
      (cfg.debug.inject.only_rank < 0 || cfg.debug.inject.only_rank == rank))
    injector = std::make_unique<monitor::FaultInjector>(trainer.model(), cfg.debug.inject);
  if (cfg.debug.underflow_overflow.enabled) {
    monitor::TracerOptions topt{cfg.debug.underflow_overflow};
    topt.format = trainer.policy().compute_dtype;
    topt.scaler_handles_backward = trainer.scaler() != nullptr;
    tracer = std::make_unique<monitor::UnderflowOverflowTracer>(
        trainer.model(), topt,
        trainer.out_dir() + "/debug/underflow_overflow_rank" + std::to_string(rank) + ".log");
    // With a NaN capture to write, let the step finish so the trainer captures it (the tracer's
    // log names the module, the capture replays the step); otherwise stop at the finding. With
    // several ranks always finish the step: a rank stopping mid-step would leave the others
    // waiting in its collectives (on_step stops them all together).
    tracer->set_stop_on_finding(world == 1 &&
                                !(cfg.debug.nan_capture && cfg.train.on_nonfinite == "capture"));
  }
  std::filesystem::create_directories(trainer.out_dir());
  // Rank 0 alone writes the config, metrics, TensorBoard and the console line.
  LogConfig log_cfg = cfg.log;
  if (rank == 0)
    io::write_file_atomic(trainer.out_dir() + "/config.toml", config_to_toml(trainer.config()));
  else
    log_cfg.console = log_cfg.metrics = log_cfg.tensorboard = false;
  loggers = std::make_unique<log::RunLoggers>(log_cfg, trainer.out_dir(), trainer.total_steps(),
                                              trainer.scaler() != nullptr, stdout,
                                              cfg.run.resume ? trainer.steps_done() : -1);
  const auto& spec = trainer.model().spec();
  const std::string ranks =
      world > 1 ? " | " + std::to_string(world) + " ranks (" + pg->backend() + ")" : "";
  // precision = auto says what it chose, and that it was a choice.
  std::string precision = trainer.policy().name();
  if (cfg.train.precision == "auto")
    precision += " (precision = auto's choice on " + trainer.device().str() + ")";
  if (rank == 0)
    std::printf(
        "keel train | %s %lldL %lld-wide %s | %.2fM params | %s | attention %s | "
        "%s%s | out %s\n",
        spec.architecture().c_str(), static_cast<long long>(spec.n_layer),
        static_cast<long long>(spec.n_embd), count_of(spec.n_head, "head").c_str(),
        trainer.model().num_parameters() / 1e6, precision.c_str(),
        ops::attention_backend_name(spec.attention),
        count_of(trainer.total_steps(), "step").c_str(), ranks.c_str(), trainer.out_dir().c_str());
  std::fflush(stdout);
  // Examples longer than a row are cut to it by the loader, their tokens past it never trained on:
  // a paragraph of 100 MB trained as its first data.seq_len tokens without a word.
  if (rank == 0) {
    const RunData& d = trainer.run().data;
    const DataConfig& dc = cfg.data;
    for (const auto& [set, key] :
         {std::pair{d.train.get(), "data.path"}, std::pair{d.eval.get(), "data.eval_path"}}) {
      if (!set || dc.task == "arith") continue;
      const int64_t cut = data::truncated_examples(*set, dc.task, dc.pack, dc.seq_len);
      if (cut == 0) continue;
      const bool training = std::string(key) == "data.path";
      // A split validation part (data.eval_fraction) is a part of data.path.
      const bool own_file = training || dc.eval_path.empty();
      std::fprintf(stderr,
                   "note: %lld of %lld %sexamples of %s (%s) are longer than data.seq_len = %lld "
                   "tokens and are cut to it: their tokens past it are not %s; raise "
                   "data.seq_len%s\n",
                   static_cast<long long>(cut), static_cast<long long>(set->examples()),
                   training ? "" : "validation ", own_file ? dc.path.c_str() : dc.eval_path.c_str(),
                   own_file ? "data.path" : "data.eval_path", static_cast<long long>(dc.seq_len),
                   training ? "trained on" : "evaluated",
                   dc.task == "text" ? ", or set data.pack = true to train on the whole text in "
                                       "rows of data.seq_len"
                                     : " or split the long lines");
    }
    // Packed JSONL: how full the rows are (what packing bought: the padding it saved).
    for (const auto& [set, what] :
         {std::pair{d.train.get(), "training"}, std::pair{d.eval.get(), "validation"}}) {
      if (!set || set->examples() == set->size()) continue;
      int64_t tokens = 0;
      for (int64_t i = 0; i < set->size(); ++i)
        tokens += std::min<int64_t>(static_cast<int64_t>(set->get(i).size()), dc.seq_len);
      std::fprintf(stderr,
                   "data: %s packed into %s of at most data.seq_len = %lld tokens (%s full)\n",
                   count_of(set->examples(), std::string(what) + " example").c_str(),
                   count_of(set->size(), "row").c_str(), static_cast<long long>(dc.seq_len),
                   log::format_percent(tokens, set->size() * dc.seq_len).c_str());
    }
    // Replies that are rows of their own (a template that rewrites earlier turns) and would start
    // past data.seq_len: left out whole, not cut.
    for (const auto& [set, key] :
         {std::pair{d.train.get(), "data.path"}, std::pair{d.eval.get(), "data.eval_path"}}) {
      const bool training = std::string(key) == "data.path";
      if (!set || set->left_out() == 0 || (!training && dc.eval_path.empty())) continue;
      std::fprintf(stderr,
                   "note: %lld conversation replies of %s (%s) start past data.seq_len = %lld "
                   "tokens in the text that prompts them (the chat template renders earlier turns "
                   "otherwise once later ones follow, so each reply is a row of its own) and are "
                   "left out; raise data.seq_len or shorten the conversations\n",
                   static_cast<long long>(set->left_out()),
                   training ? dc.path.c_str() : dc.eval_path.c_str(), key,
                   static_cast<long long>(dc.seq_len));
    }
  }
  // "stopped:" on one rank, "stopped (rank R):" when there are several.
  const std::string stopped =
      world > 1 ? "stopped (rank " + std::to_string(rank) + "): " : std::string("stopped: ");
  // Rank 0's setup above (config.toml, the logs, the scan of every example for the note on
  // truncation, which reads the whole data set) is its alone: the others wait for it here, not in
  // step 1's first collective, whose deadline said that rank 0 "did not arrive".
  if (world > 1)
    pg->wait_for_rank_zero(
        "setup before step 1 (writing config.toml and the logs, scanning the "
        "data for examples longer than data.seq_len)");
  int code = 0;
  const auto t_fit = std::chrono::steady_clock::now();
  try {
    code = trainer.fit();
  } catch (const monitor::TracerStop& stop) {
    std::fprintf(stderr, "%s%s\n", stopped.c_str(), stop.what());
    return 3;
  }
  if (code != 0) {
    if (tracer && tracer->finding().found)
      std::fprintf(stderr, "%s\n", tracer->finding().message.c_str());
    std::fprintf(stderr, "%s%s\n", stopped.c_str(), trainer.stop_message().c_str());
    // 16-true / bf16-true keep AdamW's moments in 16 bits: a squared gradient flushed to 0 makes
    // an update of lr * m / eps that blows the weights up. keel replay --bisect found it from the
    // capture; the run's own advice said only "lower optim.lr or switch precision".
    // Said here unless the advisor's finding of the step said it already; by rank 0 alone (the
    // advisor's rank; the ranks hold the same optimizer state), rank 1 repeated it.
    if (rank == 0 && cfg.optim.name == "adamw" && trainer.policy().param_dtype != DType::F32 &&
        !(advisor && advisor->state_underflow_said())) {
      const std::string why = monitor::optimizer_state_underflow(
          trainer.run().optimizer->state(), trainer.model().named_parameters(), cfg);
      if (!why.empty()) std::fprintf(stderr, "cause: %s\n", why.c_str());
    }
    return code;
  }
  if (trainer.stopped_by_request()) {
    if (stdout_failed_at > 0) {
      std::clearerr(stdout);  // said here, with what the run kept
      throw Error(stdout_lost(stdout_errno, "the run stopped after step " +
                                                std::to_string(trainer.steps_done()) +
                                                " with its checkpoint in " + trainer.out_dir() +
                                                "/checkpoints/last: continue it with --set "
                                                "run.resume=true, its output sent to a file (> "
                                                "train.log) or a reader that stays"));
    }
    if (rank == 0)  // the ranks stopped after the same step; one line says so
      std::printf(
          "stopped by request at step %lld; checkpoint in %s/checkpoints/last (continue with "
          "--set run.resume=true)\n",
          static_cast<long long>(trainer.steps_done()), trainer.out_dir().c_str());
    return 0;
  }
  if (rank == 0 && world > 1) {
    // What overlapping the gradient all-reduce with backward could save at most.
    const double fit_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_fit).count();
    std::printf(
        "dist: %s (%.1f MB) summed over %d ranks in %.3f s, %.1f%% of %.1f s "
        "of training (rank 0, waiting for other ranks included)\n",
        count_of(pg->buckets_reduced(), "gradient bucket").c_str(), pg->bytes_reduced() / 1e6,
        world, pg->grad_reduce_seconds(), fit_s > 0 ? 100 * pg->grad_reduce_seconds() / fit_s : 0.0,
        fit_s);
  }
  if (rank == 0) {
    // A step is not an update: a 16-mixed run started at scaler.init_scale = 1e30 skipped all of
    // its 20 steps and ended with "done: 20 steps", its one finding 16 lines up.
    const int64_t steps = trainer.steps_done(), applied = trainer.updates_applied();
    std::string tally;
    if (applied < steps) {
      std::vector<std::string> why;
      if (trainer.scaler_skipped_steps() > 0)
        why.push_back(std::to_string(trainer.scaler_skipped_steps()) +
                      " skipped by the loss scaler");
      if (trainer.nonfinite_steps() > 0)
        why.push_back(std::to_string(trainer.nonfinite_steps()) +
                      " non-finite, passed over (train.on_nonfinite = \"skip\")");
      tally = " (" + count_of(applied, "update") + " applied";
      for (size_t i = 0; i < why.size(); ++i) tally += (i ? ", " : ": ") + why[i];
      tally += ")";
    }
    std::printf("done: %s%s, checkpoint in %s/checkpoints/last\n", count_of(steps, "step").c_str(),
                tally.c_str(), trainer.out_dir().c_str());
    // Every step skipped: the run's outcome is the model it started from, which the scaler's
    // finding (if any) said many lines up.
    if (steps > 0 && applied == 0 && trainer.scaler_skipped_steps() == steps)
      std::printf(
          "  advice: no update was applied, every step's gradients overflowed f16 at its "
          "loss scale (now %.8g): %s\n",
          trainer.scaler()->get_scale(),
          scaler_unsettled_action(false, cfg.scaler.init_scale, trainer.scaler()->get_scale())
              .c_str());
  }
  // A verdict that still holds at the end is the run's outcome: a run at optim.lr 1 diverged at
  // step 3 ended at a loss of 24 (4x ln V) with only "done: 40 steps", its finding 40 lines up.
  if (nonfinite_eval)
    std::printf(
        "  advice: the run ends with a non-finite eval loss (%s), so its checkpoint is not "
        "a model to use as it is: %s\n",
        nonfinite_eval->value.c_str(), nonfinite_eval->fix.c_str());
  if (advisor && (advisor->trend() == monitor::Trend::kExploding ||
                  advisor->trend() == monitor::Trend::kVanishing ||
                  advisor->trend() == monitor::Trend::kScaleCollapsing)) {
    const monitor::Finding& f = advisor->trend_finding();
    std::printf("  advice: the run ends %s, as found at step %lld and not resolved since: %s\n",
                f.trend.c_str(), static_cast<long long>(f.step), f.action.c_str());
  }
  return 0;
}
}  // namespace

Command add_train(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* sub =
      app.add_subcommand("train", "Train a model (no CONFIG: the built-in arithmetic task)");
  sub->add_option("CONFIG", args->config, "TOML config (every key: docs/config.md)");
  sub->add_option("--set", args->sets, "override a key: section.key=value (repeatable)")
      ->allow_extra_args(false);
  return {sub, [args] { return run_train(*args); }};
}

}  // namespace keel::cli
