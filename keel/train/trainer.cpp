#include "keel/train/trainer.h"

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>

#include "keel/amp/autocast.h"
#include "keel/amp/grad_pass.h"
#include "keel/amp/precision.h"
#include "keel/autograd/node.h"
#include "keel/backend/monitor.h"
#include "keel/io/checkpoint.h"
#include "keel/io/hf_model.h"
#include "keel/io/trained_model.h"
#include "keel/models/llama.h"
#include "keel/nn/layers.h"
#include "keel/numerics/format_info.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/numerics/text.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/shape.h"
#include "keel/optim/clip.h"
#include "keel/tensor/random.h"
#include "keel/train/grad_fingerprint.h"
#include "keel/train/stop_request.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

bool all_finite(const Tensor& t) {
  return monitor_kernels(t.device()).stats(t.data(), t.dtype(), t.numel(), t.dtype()).all_finite();
}

// Loss scales are powers of two: whole when they are (65536, not 6.55e+04).
std::string log_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.8g", v);
  return buf;
}

}  // namespace

// What to do about a scaler that cannot settle. The learning rate is a suspect only once an update
// was applied: before that the weights are as initialized or loaded.
// `scale`: the one the last step overflowed at.
std::string scaler_unsettled_action(bool ever_updated, double init_scale, double scale) {
  // Backing off from a start far above PyTorch's 65536 and still above it: the start is the cause
  // ("lower scaler.init_scale if the scale started far above 65536" was said to a run the stop
  // knew began at 1e30, beside "switch train.precision to bf16-mixed").
  if (init_scale > 65536 && scale > 65536)
    return "lower scaler.init_scale (now " + log_number(init_scale) +
           "; PyTorch's default 65536): every step overflowed at a scale still above 65536; or "
           "switch train.precision to bf16-mixed (f32's range, no scaler needed)";
  std::string a =
      "find the module whose f16 gradients overflow with debug.underflow_overflow.enabled = true "
      "(or keel replay on the capture), or switch train.precision to bf16-mixed (f32's range, no "
      "scaler needed)";
  if (ever_updated) a += "; the updates may have grown the weights: lower optim.lr";
  return a;
}

Trainer::Trainer(const Config& cfg, TrainerHooks hooks, std::shared_ptr<Collective> collective)
    : Trainer(build_run(cfg, RunOptions{collective ? collective->world_size() : 1, false,
                                        hooks.on_message}),
              hooks, collective) {}

Trainer::Trainer(Run run, TrainerHooks hooks, std::shared_ptr<Collective> collective)
    : run_(std::move(run)),
      hooks_(std::move(hooks)),
      coll_(collective ? std::move(collective) : std::make_shared<SingleCollective>()) {
  if (run_.cfg.run.resume) {
    const std::string last = run_.out_dir + "/checkpoints/last";
    // A save that crashed may have left `last` moved aside: recover before deciding.
    if (coll_->rank() == 0) io::recover_checkpoints(run_.out_dir + "/checkpoints");
    // The other ranks look only once rank 0 has put it back: they read from the directory it was
    // renaming (a 2-rank resume after a crash mid-save failed in 3 of 5 tries, on rank 1).
    if (coll_->world_size() > 1) coll_->wait_for_rank_zero("recovery of checkpoints/last");
    if (const std::string dir = resume_checkpoint_dir(run_.out_dir); !dir.empty()) {
      load_checkpoint(dir);
      message("resumed from " + last + " at step " + std::to_string(step_));
    } else {
      message(resume_from_scratch_message(run_.out_dir));
    }
  }
}

Trainer::~Trainer() = default;

void Trainer::message(const std::string& m) {
  if (hooks_.on_message)
    hooks_.on_message(m);
  else
    std::fprintf(stderr, "%s\n", m.c_str());
}

std::vector<data::Batch> Trainer::window_at(int64_t epoch, int64_t first,
                                            int64_t* global_count) const {
  const int W = coll_->world_size();
  const int64_t count =
      std::min(run_.cfg.train.grad_accum * W, run_.loader->batches_per_epoch() - first);
  if (global_count) *global_count = count;
  std::vector<data::Batch> w;
  for (int64_t i : rank_micro_batches(first, count, coll_->rank(), W))
    w.push_back(run_.loader->batch(epoch, i));
  return w;
}

void Trainer::count_unselected(const std::vector<data::Batch>& window) {
  unselected_.assign(run_.trainable.size(), 0);
  for (const models::CausalLM::LookupTable& t : run_.model->lookup_tables()) {
    size_t k = 0;
    while (k < run_.trainable.size() && run_.trainable[k].first != t.param) ++k;
    if (k == run_.trainable.size()) continue;  // frozen (an adapter run): no gradient
    const Tensor& w = run_.trainable[k].second;
    const int64_t V = w.size(0);
    // A position reaches the loss only through itself and later positions of its example
    // (causal attention, within the example in a packed row): an input after its example's last
    // target (padding, the last token) passes no gradient.
    std::vector<double> selected(static_cast<size_t>(V), 0.0);  // doubles: one all-reduce max
    for (const data::Batch& b : window) {
      const int64_t B = b.input_ids.size(0), T = b.input_ids.size(1);
      const std::vector<int64_t> ids = b.input_ids.to_ints(), labels = b.labels.to_ints();
      const std::vector<int64_t> pos =
          b.position_ids.defined() ? b.position_ids.to_ints() : std::vector<int64_t>();
      for (int64_t i = 0; i < B; ++i) {
        bool reaches = false;  // a target at or after j in j's example
        for (int64_t j = T - 1; j >= 0; --j) {
          const int64_t at = pos.empty() ? j : pos[i * T + j];
          reaches = reaches || labels[i * T + j] != -100;
          if (const int64_t row = t.by_position ? at : ids[i * T + j];
              reaches && row >= 0 && row < V)
            selected[static_cast<size_t>(row)] = 1;
          if (at == 0) reaches = false;  // the example before j's is another
        }
      }
    }
    if (coll_->world_size() > 1) {  // the gradients are summed over the ranks: so are the rows
      coll_->set_purpose("agreeing on the embedding rows the step selected");
      coll_->all_reduce_max(selected.data(), selected.size());
    }
    int64_t unused = V;
    for (double s : selected) unused -= s != 0;
    unselected_[k] = unused * (w.numel() / std::max<int64_t>(V, 1));
  }
}

void Trainer::check_ranks(int64_t step) {
  std::vector<Tensor> params, opt;
  for (auto& [name, p] : run_.model->named_parameters()) params.push_back(p);
  for (auto& [name, t] : run_.optimizer->state()) opt.push_back(t);
  // The check before step 1 (or every dist.check_every steps) and the final one after the last.
  coll_->set_purpose(step > step_
                         ? "checking that the ranks agree before step " + std::to_string(step)
                         : "running the final rank check after step " + std::to_string(step));
  check_rank_consistency(*coll_, step,
                         {{"step", static_cast<double>(step_)},
                          {"lr_schedule_step", static_cast<double>(sched_step_)},
                          {"lr", run_.schedule.lr(sched_step_)},
                          {"loss_scale", run_.scaler ? run_.scaler->get_scale() : 1.0},
                          {"scaler_growth_tracker",
                           run_.scaler ? static_cast<double>(run_.scaler->growth_tracker()) : 0.0},
                          {"epoch", static_cast<double>(epoch_)},
                          {"next_batch", static_cast<double>(next_batch_)},
                          {"skipped_steps", static_cast<double>(skipped_steps_)},
                          {"parameters_checksum", tensors_checksum(params), true},
                          {"optimizer_state_checksum", tensors_checksum(opt), true}});
}

bool Trainer::captures_here(const std::vector<int>& saw_nonfinite) const {
  const int me = coll_->rank();
  if (saw_nonfinite.empty()) return me == 0;
  return std::find(saw_nonfinite.begin(), saw_nonfinite.end(), me) != saw_nonfinite.end();
}

bool Trainer::local_capture_needed(const std::vector<int>& saw_nonfinite, bool loss_finite,
                                   double sum_of_norms) const {
  if (run_.cfg.train.on_nonfinite != "capture" || !run_.cfg.debug.nan_capture ||
      !hooks_.on_capture || !captures_here(saw_nonfinite))
    return false;
  if (saw_nonfinite.empty()) {
    // Every rank's gradients are finite: only their sum can overflow, which needs an element
    // (bounded by the sum of the ranks' norms) beyond the gradient dtype's range, or a sum of
    // squares beyond f32's (2x margins for the rounding of the sums).
    double max = std::numeric_limits<float>::max();
    for (auto& [name, p] : run_.trainable)
      if (p.grad().defined()) max = std::min(max, format_info(p.grad().dtype()).max);
    if (!(sum_of_norms >= max / 2 || sum_of_norms * sum_of_norms >= FLT_MAX / 4.0)) return false;
  }
  // A finite loss whose gradients overflowed is the scaler's to skip unless it cannot settle (the
  // conditions of step 6 below): no capture then.
  if (run_.scaler && loss_finite) {
    const GradScalerOptions& so = run_.cfg.scaler;
    const bool at_min = so.min_scale > 0 && run_.scaler->get_scale() <= so.min_scale;
    const bool too_many = so.max_consecutive_skips > 0 &&
                          static_cast<int64_t>(skip_scales_.size()) + 1 >= so.max_consecutive_skips;
    if (!at_min && !too_many) return false;
  }
  return true;
}

StepResult Trainer::train_step(const std::vector<data::Batch>& window, int64_t epoch) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const int W = coll_->world_size();
  if (W > 1 && run_.cfg.dist.check_every > 0 &&
      (!ranks_checked_ || (step_ + 1) % run_.cfg.dist.check_every == 0)) {
    check_ranks(step_ + 1);  // before the step: every rank must enter it in the same state
    ranks_checked_ = true;
  }
  StepResult r;
  r.step = ++step_;
  r.epoch = epoch;
  r.micro_batches = static_cast<int64_t>(window.size());
  r.loss_scale = run_.scaler ? run_.scaler->get_scale() : 1.0;
  r.lr = run_.schedule.lr(sched_step_);
  if (hooks_.on_step_begin) hooks_.on_step_begin(r.step);
  models::reset_expert_load(*run_.model);  // (a mixture's routing, counted per step)

  // 1. Zero grads; the step's dropout seeds derive from (run seed, step).
  run_.optimizer->zero_grad();
  const uint64_t seed = step_seed(r.step);
  int64_t tokens = 0;
  for (auto& b : window) {
    tokens += b.n_targets;
    r.example_ids.insert(r.example_ids.end(), b.example_ids.begin(), b.example_ids.end());
  }
  const int64_t local_tokens = tokens;
  if (W > 1) {  // the loss weights divide by the GLOBAL window's tokens (exact in a double)
    double t = static_cast<double>(tokens);
    coll_->set_purpose("summing the step's token count at step " + std::to_string(r.step));
    coll_->all_reduce_sum(&t, 1);
    tokens = static_cast<int64_t>(t);
  }
  r.tokens = tokens;

  // 2. Forward and backward per micro-batch.
  run_.model->train(true);
  double loss_sum = forward_backward(window, seed, r.loss_scale, tokens, coll_->rank(), W);
  count_unselected(window);
  // 3. Distributed: every rank checks its own loss and gradients BEFORE the all-reduce (so the
  // rank that produced a non-finite value knows it and writes the capture), then one all-gather
  // of [loss, saw non-finite, which parameters hold a gradient]: every rank sums the losses in
  // rank order (same bits everywhere), gives a zero gradient to any parameter another rank has
  // one for (a rank without data in a remainder window), and so joins the bucketed sum of the
  // same tensors.
  std::vector<int> saw_nonfinite;  // ranks whose own loss or gradients were non-finite
  const double local_loss_sum = loss_sum;
  std::string
      local_fingerprint;  // this rank's gradients before the all-reduce, when it may capture
  if (W > 1) {
    // The rows of this rank's micro-batches ride along (batch_size slots per micro-batch, -1
    // unused), so that every rank's StepResult names the global window's examples: rank 0's advisor
    // probed and listed only its own half of a spiking window, and blamed the optimizer for a
    // garbage row rank 1 trained on.
    const size_t T = run_.trainable.size();
    const auto rows = static_cast<size_t>(run_.cfg.train.batch_size);
    const auto most = static_cast<size_t>(run_.cfg.train.grad_accum);
    const size_t n = 3 + T + most * rows;
    std::vector<double> mine(n, -1.0), all(n * static_cast<size_t>(W));
    std::vector<Tensor> local;
    std::vector<std::pair<std::string, Tensor>> with_local_grad;
    for (auto& [name, p] : run_.trainable)
      if (p.grad().defined()) local.push_back(p.grad()), with_local_grad.emplace_back(name, p);
    const amp::GradPass local_pass = amp::grad_pass(local);
    mine[0] = loss_sum;
    mine[1] = std::isfinite(loss_sum) && local_pass.finite() ? 0 : 1;
    mine[2] = local_pass.norm();
    for (size_t i = 0; i < T; ++i) mine[3 + i] = run_.trainable[i].second.grad().defined();
    for (size_t k = 0; k < window.size() && k < most; ++k)
      for (size_t j = 0; j < window[k].example_ids.size() && j < rows; ++j)
        mine[3 + T + k * rows + j] = static_cast<double>(window[k].example_ids[j]);  // exact
    coll_->set_purpose("gathering the ranks' losses and example rows at step " +
                       std::to_string(r.step));
    coll_->all_gather(mine.data(), n, all.data());
    // Global micro-batch k * W + q is rank q's k-th: the 1-rank run's order.
    r.example_ids.clear();
    for (size_t k = 0; k < most; ++k)
      for (int q = 0; q < W; ++q)
        for (size_t j = 0; j < rows; ++j) {
          const double id = all[static_cast<size_t>(q) * n + 3 + T + k * rows + j];
          if (id >= 0) r.example_ids.push_back(static_cast<int64_t>(id));
        }
    loss_sum = 0;
    double norms = 0;  // the sum of the ranks' norms bounds every element of the sum and its norm
    for (int q = 0; q < W; ++q) {
      const double* o = &all[static_cast<size_t>(q) * n];
      loss_sum += o[0];
      norms += o[2];
      if (o[1] != 0) saw_nonfinite.push_back(q);
    }
    // Before the all-reduce replaces them: the gradients one rank's replay reproduces, taken only
    // when this rank would write a capture of this step (hashing them costs a pass).
    if (local_capture_needed(saw_nonfinite, std::isfinite(loss_sum), norms))
      local_fingerprint = gradient_fingerprint(with_local_grad);
    for (int q = 0; q < W; ++q) {
      const double* o = &all[static_cast<size_t>(q) * n];
      for (size_t i = 0; i < T; ++i) {
        Tensor& p = run_.trainable[i].second;
        if (o[3 + i] != 0 && !p.grad().defined()) run_.optimizer->zero_grad_of(p);
      }
    }
  }
  r.loss = tokens > 0 ? loss_sum / static_cast<double>(tokens) : 0.0;
  const bool loss_finite = std::isfinite(r.loss);

  if (W > 1) {
    // When every gradient lives in its flat home (use_flat_grads), the buckets are offset ranges
    // of the flat buffers: an f32 bucket is summed in place, never staged, and the buckets are
    // full. The buffers also hold the 64-byte gaps and the homes of parameters no rank has a
    // gradient for: summed, never read. Element-wise sums either way: with two ranks the same
    // bits (MPI may pick its algorithm, and so the order of more than two addends, by size).
    std::vector<Tensor> reduced = run_.optimizer->flat_grad_buffers();
    if (!run_.optimizer->grads_in_flat_buffers()) {
      reduced.clear();
      for (auto& [name, p] : run_.trainable)
        if (p.grad().defined()) reduced.push_back(p.grad());
    }
    coll_->set_purpose("at step " + std::to_string(r.step));  // after "gradient bucket k of n"
    coll_->all_reduce_grads(reduced);
  }

  // 4-5. One pass over the gradients (amp/grad_pass.h): unscale, the finite check, and the sums
  // of squares of the global norm and of each gradient (the per-layer norms read those). The
  // list is aligned with trainable(); a parameter without a gradient is skipped by the pass.
  std::vector<Tensor> grads;
  for (auto& [name, p] : run_.trainable) grads.push_back(p.grad());
  bool found_inf = false;
  last_pass_ = amp::GradPass{};
  if (grad_norm_check_) {
    // The zero/subnormal counts judge each gradient value in the compute dtype that carried it.
    const DType fmt = run_.policy.compute_dtype;
    last_pass_ =
        run_.scaler ? run_.scaler->unscale_pass(grads, fmt) : amp::grad_pass(grads, 1.f, fmt);
    r.grad_norm = last_pass_.norm();
    found_inf = !last_pass_.finite();
  } else if (run_.scaler) {
    found_inf = run_.scaler->unscale(grads);
  }
  if (!loss_finite) found_inf = true;
  if (W > 1) {  // MAX over ranks: every rank takes the same branch below
    // A stop request (SIGTERM/SIGINT, signalled to one rank or to all at slightly different
    // times) rides along: the ranks agree on the step after which they all save and stop.
    double f[2] = {found_inf ? 1.0 : 0.0, stop_requested() ? 1.0 : 0.0};
    coll_->set_purpose("agreeing on non-finite gradients and stop requests at step " +
                       std::to_string(r.step));
    coll_->all_reduce_max(f, 2);
    found_inf = f[0] != 0;
    stop_agreed_ = f[1] != 0;
  }
  r.found_inf = found_inf;
  if (hooks_.on_grads) hooks_.on_grads(r);

  if (found_inf) {
    // 6. A scaler handles an overflow of a finite loss: skip, back off, keep the LR clock.
    // It cannot settle when the scale is already at min_scale (backing off no longer helps) or
    // after max_consecutive_skips overflows in a row: then the step is the run's problem, not the
    // scaler's, and on_nonfinite acts. Either way a step counts once: skipped or nan.
    bool handled = false;
    std::string unsettled;
    if (run_.scaler && loss_finite) {
      auto u = run_.scaler->update(true);
      r.loss_scale_after = u.scale_after;
      skip_scales_.push_back(r.loss_scale);
      skip_scale_after_ = u.scale_after;
      const GradScalerOptions& so = run_.cfg.scaler;
      const auto skips = static_cast<int64_t>(skip_scales_.size());
      if (u.at_min_scale)
        unsettled =
            "the gradients overflowed f16 at scaler.min_scale = " + log_number(so.min_scale) +
            ", the lowest scale allowed";
      else if (so.max_consecutive_skips > 0 && skips >= so.max_consecutive_skips)
        unsettled = count_of(skips, "step") +
                    " in a row overflowed f16 (scaler.max_consecutive_skips = " +
                    std::to_string(so.max_consecutive_skips) + ")";
      if (!unsettled.empty()) {
        unsettled = "the loss scaler could not settle: " + unsettled + "; scale " + scale_trace();
        unsettled_ = unsettled;
      }
      handled = unsettled.empty();
      if (handled) ++skipped_steps_;
    }
    if (!handled) {
      ++nan_steps_;
      ++epoch_unhandled_;
      NonfiniteEvent ev;
      ev.step = r.step;
      ev.epoch = epoch;
      ev.loss = r.loss;
      ev.loss_finite = loss_finite;
      ev.grad_norm = r.grad_norm;
      ev.window = &window;
      ev.step_seed = seed;
      ev.loss_scale = r.loss_scale;
      ev.world_size = W;
      ev.rank = coll_->rank();
      ev.window_tokens = tokens;
      ev.local_tokens = local_tokens;
      ev.local_loss =
          local_tokens > 0 ? local_loss_sum / static_cast<double>(local_tokens) : local_loss_sum;
      ev.local_grads_fingerprint = local_fingerprint;
      for (auto& [name, p] : run_.trainable)
        if (p.grad().defined() && !all_finite(p.grad())) ev.nonfinite_params.push_back(name);
      if (!ev.nonfinite_params.empty())
        ev.first_nonfinite_param = in_backward_order(run_.trainable, ev.nonfinite_params).front();
      const std::string& mode = run_.cfg.train.on_nonfinite;
      if (mode == "capture" || mode == "abort") {
        // One message: the step, what went non-finite, the first such parameter, and where the
        // capture is with the command that replays it.
        std::string path, why_none;
        // Which rank saw it, said by every rank: rank 0's stop under on_nonfinite = abort did not
        // say, and rank 1's, when no rank's own gradients were non-finite, said "on this rank;
        // saw the non-finite value" with no rank named.
        std::string who;
        for (int q : saw_nonfinite) who += (who.empty() ? "rank " : ", rank ") + std::to_string(q);
        who = !who.empty() ? who + " saw the non-finite value"
                           : "every rank's own gradients were finite, their sum across ranks "
                             "overflowed";
        const std::string where = W > 1 ? "; " + who : "";
        if (mode == "abort") {
          why_none = "on_nonfinite = abort" + where;
        } else if (!run_.cfg.debug.nan_capture) {
          why_none = "[debug] nan_capture = false" + where;
        } else if (!hooks_.on_capture) {
          why_none = "no capture handler is attached" + where;
        } else if (W > 1 && !captures_here(saw_nonfinite)) {
          // The rank(s) that saw it write the capture (rank 0 when none did: the sum overflowed).
          why_none = "on this rank; " + who + (saw_nonfinite.empty() ? ": rank 0" : " and") +
                     " wrote it under " + run_.out_dir + "/debug/nan_capture/";
        } else {
          try {
            path = hooks_.on_capture(ev);
          } catch (const std::exception& e) {
            why_none = std::string("writing it failed: ") + e.what();
          }
        }
        // "nan", never std::to_string's "-nan": a NaN's sign bit says nothing to the user.
        const char* loss_text = std::isnan(r.loss) ? "nan" : r.loss > 0 ? "inf" : "-inf";
        std::string what = loss_finite ? std::string("non-finite gradients")
                                       : "non-finite loss (" + std::string(loss_text) + ")";
        if (!unsettled.empty())
          what =
              unsettled + "; " +
              scaler_unsettled_action(sched_step_ > 0, run_.cfg.scaler.init_scale, r.loss_scale) +
              "; last step's " + what;
        if (loss_finite && ev.nonfinite_params.empty())
          what = "non-finite gradient norm (" + std::to_string(r.grad_norm) +
                 ": its f32 sum of squares overflowed; every gradient element is finite but some "
                 "exceed ~1.8e19)";
        // Backward from a non-finite loss carries it into every gradient it reaches: the first
        // of them is no producer. "non-finite loss (nan) and gradients in 28 of 28 parameters
        // (first produced by backward: transformer.ln_f.weight)" sent the user to a LayerNorm
        // for a forward that had made the NaN (optim.lr 1000, 16-true's flushed moments).
        if (!ev.nonfinite_params.empty())
          what += std::string(loss_finite ? "" : " and gradients") + " in " +
                  std::to_string(ev.nonfinite_params.size()) + " of " +
                  std::to_string(run_.trainable.size()) + " parameters " +
                  (loss_finite ? "(first produced by backward: " + ev.first_nonfinite_param + ")"
                               : std::string("(the loss's own ") + loss_text +
                                     ", carried back: the forward produced it, not backward)");
        // Values that are already non-finite are the cause, whatever the gradients say: an
        // update overflowed them (a load refuses them, io/weight_check.h).
        if (!loss_finite || !ev.nonfinite_params.empty()) {
          const std::vector<std::string> bad = nonfinite_parameters();
          if (!bad.empty())
            what += "; parameter values already non-finite in " + std::to_string(bad.size()) +
                    " (first: " + bad.front() + ")";
        }
        // A fault debug.inject put in at this step is the cause (the advice said so, the stop
        // line did not).
        if (const InjectConfig& inj = run_.cfg.debug.inject;
            !inj.module.empty() && inj.step == r.step &&
            (inj.only_rank < 0 || inj.only_rank == coll_->rank()))
          what += "; debug.inject put " + inj.what() + " at this step";
        stop_message_ = "step " + std::to_string(r.step) + ": " + what;
        if (!path.empty())
          stop_message_ +=
              "; capture written to " + path + "; replay with: keel replay " + shell_word(path);
        else
          stop_message_ += "; no capture written (" + why_none + ")";
      }
    }
    r.stepped = false;
    if (run_.scaler && !loss_finite) run_.scaler->discard_step();  // not the scaler's to handle
    if (!run_.scaler || !loss_finite) r.loss_scale_after = r.loss_scale;
  } else {
    // 7. Clip after unscale (the coefficient goes to the optimizer, which AdamW fuses into its one
    // pass over each parameter), update, advance the schedule, let the scaler grow.
    float clip = 1.f;
    if (run_.cfg.train.max_grad_norm > 0)
      clip = optim::clip_coefficient(run_.cfg.train.max_grad_norm, r.grad_norm);
    r.clipped = clip != 1.f;
    run_.optimizer->step(r.lr, clip);
    r.update_elements = run_.optimizer->last_update().elements;
    r.rounded_away = run_.optimizer->last_update().rounded_away;
    ++sched_step_;
    r.loss_scale_after = run_.scaler ? run_.scaler->update(false).scale_after : 1.0;
    r.stepped = true;
    skip_scales_.clear();
    epoch_loss_sum_ += loss_sum;
    epoch_tokens_ += tokens;
    ++epoch_updates_;
  }
  ++epoch_steps_;
  r.skipped_steps = skipped_steps_;
  r.nan_steps = nan_steps_;
  r.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  r.tokens_per_s = r.seconds > 0 ? tokens / r.seconds : 0;
  if (const models::ExpertLoad load = models::expert_load(*run_.model); load.layers) {
    r.moe_layers = load.layers;
    r.moe_unused_experts = load.unused;
    r.moe_aux_loss = load.balance_loss;
    r.moe_max_load = load.max_load;
  }
  if (hooks_.on_step) hooks_.on_step(r);
  return r;
}

double forward_backward(Run& run, const std::vector<data::Batch>& window, uint64_t step_seed,
                        double loss_scale, int64_t window_tokens, int64_t mb_first,
                        int64_t mb_stride) {
  // Each micro-batch's loss is weighted by its share of the window's target tokens, so the
  // window's loss is the token mean whatever the window size (a remainder window included).
  int64_t tokens = 0;
  for (auto& b : window) tokens += b.n_targets;
  if (window_tokens >= 0) tokens = window_tokens;  // data-parallel: the global window's
  double loss_sum = 0;
  // A mixture's load-balancing loss (model.router_aux_loss_coef): each micro-batch's, weighted as
  // its loss is by its share of the window's tokens, so that one micro-batch's window gives HF's
  // loss + router_aux_loss_coef * aux. Its gradient enters at the routers' logits (ops/moe.h).
  const double aux_coef = run.model->spec().moe.aux_coef;
  ops::MoeBalance* balance = aux_coef > 0 ? models::router_balance(*run.model) : nullptr;
  for (size_t i = 0; i < window.size() && tokens > 0; ++i) {
    const data::Batch b = window[i].to(run.device);
    if (b.n_targets == 0) continue;
    // One autocast scope a micro-batch: its weight casts are graph nodes of this forward (the
    // next micro-batch reuses their values under nodes of its own). Shared over the window, a
    // later micro-batch's casts were nodes of the first forward, which its backward runs last:
    // every weight's gradient waited at them until the end, a second set of gradients.
    amp::AutocastGuard autocast(run.policy.autocast, run.policy.compute_dtype);
    nn::Dropout::set_step_seed(
        mix_seed(step_seed, static_cast<uint64_t>(mb_first + static_cast<int64_t>(i) * mb_stride)));
    // The loss's graph holds the only handle to the logits: their buffer takes the gradient.
    Tensor mb_loss = batch_loss_sum(*run.model, b);
    const double seed = loss_scale / static_cast<double>(tokens);
    // (Summed a micro-batch at a time: ranks that each hold one add up as one rank's window does.)
    double mb_sum = mb_loss.item();
    if (balance) {
      const double weight = aux_coef * static_cast<double>(b.n_targets);
      mb_sum += weight * balance->forward.loss();
      balance->grad = weight * seed;
    }
    loss_sum += mb_sum;
    backward(ops::scale(mb_loss, static_cast<float>(seed)));
    if (balance) balance->grad = 0;
  }
  return loss_sum;
}

Tensor batch_loss_sum(models::CausalLM& model, const data::Batch& b,
                      std::vector<double>* row_sums) {
  Tensor logits = model.forward(b.input_ids, b.attention_mask, b.position_ids);  // [B, T, V]
  const int64_t T = logits.size(1), V = logits.size(-1);
  auto loss_sum = [&](const Tensor& l, const Tensor& labels) {
    Tensor flat = amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(l, {-1, V}));
    return ops::cross_entropy(flat, ops::reshape(labels, {-1}), data::kIgnoreLabel,
                              ops::Reduction::kSum);
  };
  if (row_sums) {
    row_sums->clear();
    for (int64_t r = 0; r < logits.size(0); ++r)
      row_sums->push_back(
          loss_sum(logits.slice_rows(r, r + 1).view({T, V}), b.labels.slice_rows(r, r + 1)).item());
  }
  return loss_sum(logits, b.labels);
}

std::vector<std::string> in_backward_order(
    const std::vector<std::pair<std::string, Tensor>>& params, std::vector<std::string> names) {
  std::map<std::string, uint64_t> order;
  for (auto& [name, p] : params) order[name] = grad_production_order(p);
  auto key = [&](const std::string& n) {
    auto it = order.find(n);
    return it == order.end() || it->second == 0 ? UINT64_MAX : it->second;
  };
  std::stable_sort(names.begin(), names.end(),
                   [&](const std::string& a, const std::string& b) { return key(a) < key(b); });
  return names;
}

uint64_t step_seed(const Config& cfg, int64_t step) {
  return mix_seed(cfg.run.seed, static_cast<uint64_t>(step));
}

std::string Trainer::scale_trace() const {
  // A long back-off prints its first and last scales: the start says whether init_scale was sane,
  // the end where it gave up.
  std::string t;
  const size_t n = skip_scales_.size();
  for (size_t i = 0; i < n; ++i) {
    if (n > 10 && i == 4) {
      t += " -> ... (" + std::to_string(n - 7) + " more)";
      i = n - 4;
      continue;
    }
    t += (t.empty() ? "" : " -> ") + log_number(skip_scales_[i]);
  }
  return t + " -> " + log_number(skip_scale_after_);
}

std::vector<std::string> Trainer::nonfinite_parameters(bool trainable_only) const {
  std::vector<std::string> bad;
  for (auto& [name, p] : trainable_only ? run_.trainable : run_.model->named_parameters())
    if (!all_finite(p)) bad.push_back(name);
  return bad;
}

void Trainer::end_epoch() {
  if (epoch_steps_ == 0) return;  // reported already (after its last step, before a resume)
  EpochResult e;
  e.epoch = epoch_;
  e.step = step_;
  e.loss = epoch_tokens_ > 0 ? epoch_loss_sum_ / static_cast<double>(epoch_tokens_) : 0.0;
  e.tokens = epoch_tokens_;
  e.updates = epoch_updates_;
  e.skipped_steps = skipped_steps_;
  e.nan_steps = nan_steps_;
  const int64_t steps = epoch_steps_, unhandled = epoch_unhandled_;
  epoch_steps_ = 0;
  epoch_unhandled_ = 0;
  if (hooks_.on_epoch && (e.updates > 0 || unhandled == 0)) hooks_.on_epoch(e);
  // Scaler skips are calibration: an epoch made only of them (one step per epoch, the first skip
  // of a 16-mixed start) goes on. Non-finite steps the scaler did not handle stop it.
  if (e.updates > 0 || unhandled == 0) return;
  std::string m = "every step produced non-finite gradients in epoch " + std::to_string(epoch_) +
                  " (no update was applied; " + std::to_string(unhandled) + " of " +
                  count_of(steps, "step") + " non-finite with no scaler able to handle them)";
  if (!unsettled_.empty()) m += "; " + unsettled_;
  // A wider policy is worth naming only below 32-true: there, precision is not the cause.
  const std::string wider = wider_precisions(run_.policy.name());
  if (sched_step_ == 0)
    m += "; no update was ever applied, so the learning rate is not the cause: the model as "
         "initialized or loaded produces them under train.precision = " +
         run_.policy.name() +
         "; run `keel doctor` on this config, find the producing module with "
         "debug.underflow_overflow.enabled = true" +
         (wider.empty() ? std::string(" (under 32-true the weights or the data are the suspects)")
                        : ", or switch train.precision to " + wider);
  else
    m += "; run `keel doctor` on this config, or lower the learning rate" +
         (wider.empty() ? std::string() : " / switch train.precision to " + wider);
  throw Error(m);
}

int Trainer::fit() {
  fs::create_directories(run_.out_dir);
  const int64_t nb = run_.loader->batches_per_epoch();
  // Data-parallel: rank 0 alone evaluates and writes checkpoints (the ranks hold the same state).
  const bool rank0 = coll_->rank() == 0;
  auto checkpoint = [&] {
    if (rank0) save_checkpoint(run_.out_dir + "/checkpoints/last");
  };
  const int64_t every = run_.cfg.log.checkpoint_every;
  auto save_step_n = [&] {  // log.checkpoint_every's step-N, on its steps
    if (!rank0 || every <= 0 || step_ % every != 0) return;
    save_checkpoint(run_.out_dir + "/checkpoints/step-" + std::to_string(step_));
    io::prune_step_checkpoints(run_.out_dir + "/checkpoints", run_.cfg.log.keep_checkpoints);
  };
  auto save_adapter = [&] {
    if (run_.cfg.model.adapter.kind == "none") return;
    // The PEFT adapter directory, loadable by PEFT on the base model.path.
    io::save_peft_adapter(
        *run_.model, run_.cfg.model.adapter, run_.out_dir + "/adapter", run_.cfg.model.path,
        {run_.policy.name(),
         run_.policy.param_dtype == DType::F32 ? io::stored_base_dtype(*run_.model) : DType::F32,
         io::absolute_tokenizer_spec(run_.cfg.data.tokenizer)});
    message("adapter (PEFT " + run_.cfg.model.adapter.kind + ") written to " + run_.out_dir +
            "/adapter");
  };
  // A resume of a run already complete (or past a lowered train.max_steps): each such resume
  // evaluated again and appended the same eval and epoch records to metrics.jsonl, rewriting the
  // checkpoint it had just read, and its header announced steps it would not take.
  if (step_ > 0 && step_ >= run_.total_steps) {
    message(nothing_left_to_train_message(step_, run_.total_steps));
    return 0;
  }
  int64_t evaluated_at = -1;  // the step the loop last evaluated
  while (step_ < run_.total_steps) {
    if (next_batch_ >= nb) {  // end of an epoch
      end_epoch();
      ++epoch_;
      next_batch_ = 0;
      epoch_loss_sum_ = 0;
      epoch_tokens_ = 0;
      epoch_updates_ = 0;
    }
    int64_t global_count = 0;
    std::vector<data::Batch> window = window_at(epoch_, next_batch_, &global_count);
    next_batch_ += global_count;
    StepResult r = train_step(window, epoch_);
    if (!stop_message_.empty()) return 3;
    // The epoch's record before this step's checkpoint: a resume from that checkpoint takes the
    // epoch as reported (end_epoch), so a run stopped or killed after it had lost the record.
    if (next_batch_ >= nb) end_epoch();
    const bool evaluates = run_.cfg.train.eval_every > 0 && step_ % run_.cfg.train.eval_every == 0;
    const bool saves = every > 0 && step_ % every == 0 && step_ < run_.total_steps;  // last: below
    if (rank0 && evaluates) {
      evaluate();
      evaluated_at = step_;
    }
    if (saves) {
      checkpoint();
      save_step_n();
    }
    // Rank 0 alone did them: the others wait for it here, not in the next step's collectives,
    // whose deadline (dist.timeout_s) ended the job when they took longer, naming rank 0 as
    // stopped or hung.
    if (evaluates || saves)
      coll_->wait_for_rank_zero(std::string(evaluates && saves ? "evaluation and checkpoint"
                                            : evaluates        ? "evaluation"
                                                               : "checkpoint") +
                                " at step " + std::to_string(step_));
    // SIGTERM/SIGINT (train/stop_request.h): save and return, resumable. Several ranks stop
    // after the step they agreed on (train_step); a multi-rank run was killed by mpirun's
    // SIGTERM without a checkpoint.
    const bool stop = coll_->world_size() == 1 ? stop_requested() : stop_agreed_;
    if (step_ < run_.total_steps && stop) {
      checkpoint();
      if (rank0) save_adapter();  // what was trained so far, usable without resuming
      if (coll_->world_size() > 1)
        coll_->wait_for_rank_zero("checkpoint at the requested stop after step " +
                                  std::to_string(step_));
      stopped_by_request_ = true;
      return 0;
    }
  }
  if (coll_->world_size() > 1) {
    if (run_.cfg.dist.check_every > 0)
      check_ranks(step_);  // the final state is the same everywhere
    if (!rank0 && run_.cfg.dist.rank_weights)
      save_checkpoint(run_.out_dir + "/debug/rank" + std::to_string(coll_->rank()) + "/checkpoint");
  }
  if (!rank0) return 0;
  // Once a step: an eval_every that divides the last step has evaluated it already (its record
  // was written twice).
  if (evaluated_at != step_) evaluate();
  // checkpoints/last at the final step is written last: a resume that finds it has nothing left
  // to do. Saved before the evaluation and the adapter, a kill between them (a long evaluation)
  // left a run that no resume would finish: "nothing left to train", no adapter, no final eval.
  save_adapter();
  save_step_n();
  checkpoint();
  return 0;
}

}  // namespace keel
