#include "keel/monitor/advisor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "keel/amp/precision.h"
#include "keel/io/json_fields.h"
#include "keel/monitor/replay_step.h"
#include "keel/numerics/text.h"

namespace keel::monitor {

namespace {

// GradScaler's default start (PyTorch's): a scale above it was set so.
constexpr double kPyTorchInitScale = 65536;

std::string num(double v) {
  // "nan", never printf's "-nan": a NaN's sign bit says nothing (a scaler-skipped spike's grad norm
  // read "-nan").
  if (std::isnan(v)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

// Loss scales are powers of two: print them whole (65536, not 6.55e+04).
std::string scale_num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.8g", v);
  return buf;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t m = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + m, v.end());
  if (v.size() % 2) return v[m];
  const double hi = v[m];
  const double lo = *std::max_element(v.begin(), v.begin() + m);
  return 0.5 * (lo + hi);
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

}  // namespace

const char* trend_name(Trend t) {
  switch (t) {
    case Trend::kStable:
      return "stable";
    case Trend::kExploding:
      return "exploding";
    case Trend::kVanishing:
      return "vanishing";
    case Trend::kSpiking:
      return "spiking";
    case Trend::kScaleCollapsing:
      return "loss-scale collapsing";
  }
  return "?";
}

TrendAdvisor::TrendAdvisor(AdvisorOptions opt) : opt_(opt) {
  // The scaler keeps its scale in f32: compared with the f32 it holds (1e-3 is not 1e-3f).
  opt_.init_scale = static_cast<double>(static_cast<float>(opt_.init_scale));
}

std::string TrendAdvisor::observe(StepResult& r, const std::vector<BlockGradNorm>* layers) {
  findings_.clear();
  Finding start;
  if (observe_start(r, &start)) findings_.push_back(start);
  // The layers first: while blocks have vanished in f16, a vanishing trend's fix is theirs.
  Finding scale, under, round;
  const bool scale_due = observe_scale(r, &scale) || observe_regrowth(r, &scale);
  const bool under_due = layers && observe_layers(r, *layers, &under);
  const bool round_due = observe_rounding(r, &round);
  Finding routing;
  const bool routing_due = observe_routing(r, &routing);
  std::string advice = trend_line(r);
  if (!advice.empty()) findings_.push_back(finding_);
  Finding stall;
  const bool stall_due = observe_stall(r, &stall);
  if (under_due) explain_vanished(r, under);
  for (const Finding* f :
       {scale_due ? &scale : nullptr, under_due ? &under : nullptr, round_due ? &round : nullptr,
        stall_due ? &stall : nullptr, routing_due ? &routing : nullptr}) {
    if (!f) continue;
    findings_.push_back(*f);
    advice += (advice.empty() ? "" : "\n") + f->trend + ": " + f->cause + "; " + f->action;
  }
  if (!findings_.empty() && findings_.front().trend == "initialization")
    advice = "initialization: " + start.cause + "; " + start.action + (advice.empty() ? "" : "\n") +
             advice;
  r.advice = advice;
  return advice;
}

nlohmann::json TrendAdvisor::state() const {
  using nlohmann::json;
  json window = json::array();
  for (const StepResult& w : window_)
    window.push_back({{"step", w.step},
                      {"loss", io::json_float(w.loss)},
                      {"grad_norm", io::json_float(w.grad_norm)},
                      {"clipped", w.clipped},
                      {"lr", w.lr},
                      {"loss_scale", w.loss_scale},
                      {"loss_scale_after", w.loss_scale_after},
                      {"stepped", w.stepped},
                      {"found_inf", w.found_inf},
                      {"nan_steps", w.nan_steps},
                      {"example_ids", w.example_ids}});
  return {{"trend", static_cast<int>(trend_)},
          {"window", window},
          {"last_spike", last_spike_},
          {"spike_norm", spike_norm_},
          {"spike_loss", spike_loss_},
          {"nan_steps", nan_steps_},
          {"zeros", zeros_},
          {"state_underflow_said", state_underflow_said_},
          {"updated", updated_},
          {"start_loss", start_loss_},
          {"start_observed", start_observed_},
          {"start_ids", start_ids_},
          {"full_lr_steps", full_lr_steps_},
          {"recent_losses", std::vector<double>(recent_losses_.begin(), recent_losses_.end())},
          {"first_losses", first_losses_},
          {"stall_reported", stall_reported_},
          {"backoffs", backoffs_},
          {"scale_reported", scale_reported_},
          {"regrowth_reported", regrowth_reported_},
          {"best_loss", best_loss_},
          {"best_norm", best_norm_},
          {"spikes", std::vector<int64_t>(spikes_.begin(), spikes_.end())},
          {"probe",
           {{"step", probe_.step},
            {"spike", io::json_float(probe_.spike)},
            {"before", io::json_float(probe_.before)}}},
          {"finding",
           {{"step", finding_.step},
            {"trend", finding_.trend},
            {"cause", finding_.cause},
            {"action", finding_.action}}},
          {"vanished_run", vanished_run_},
          {"reported", reported_},
          {"underflow", underflow_},
          {"round_run", round_run_},
          {"round_reported", round_reported_},
          {"routing_run", routing_run_},
          {"routing_reported", routing_reported_},
          {"first_aux", first_aux_},
          {"first_collapsed", first_collapsed_},
          // Measured before the first update: a resumed process cannot measure it again.
          {"weight_rms", opt_.weight_rms}};
}

void TrendAdvisor::restore(const nlohmann::json& s, const std::string& file,
                           const std::string& fix) {
  using io::json_field;
  using io::json_float_of;
  using nlohmann::json;
  constexpr int64_t kCount = int64_t{1} << 53;
  const std::string f = file + ": \"advisor\"";
  if (!s.is_object()) throw Error(f + " is not a JSON object; " + fix);
  const auto b = [&](const char* k) { return json_field<bool>(s, k, f, fix); };
  const auto i = [&](const char* k) { return io::json_int(s, k, f, -1, kCount, fix); };
  const auto x = [&](const char* k) { return io::json_number(s, k, f, fix); };
  const int64_t t =
      io::json_int(s, "trend", f, 0, static_cast<int64_t>(Trend::kScaleCollapsing), fix);
  std::deque<StepResult> window;
  for (const json& w : json_field<std::vector<json>>(s, "window", f, fix)) {
    const std::string e = f + " window entry";
    StepResult r;
    r.step = io::json_int(w, "step", e, 0, kCount, fix);
    r.loss = json_float_of(w, "loss", e, fix);
    r.grad_norm = json_float_of(w, "grad_norm", e, fix);
    r.clipped = json_field<bool>(w, "clipped", e, fix);
    r.lr = io::json_number(w, "lr", e, fix);
    r.loss_scale = io::json_number(w, "loss_scale", e, fix);
    r.loss_scale_after = io::json_number(w, "loss_scale_after", e, fix);
    r.stepped = json_field<bool>(w, "stepped", e, fix);
    r.found_inf = json_field<bool>(w, "found_inf", e, fix);
    r.nan_steps = io::json_int(w, "nan_steps", e, 0, kCount, fix);
    r.example_ids = json_field<std::vector<int64_t>>(w, "example_ids", e, fix);
    window.push_back(std::move(r));
  }
  const json& probe = s.contains("probe") ? s["probe"] : json();
  // Read whole before any member changes: a damaged state leaves the advisor as it was.
  const SpikeProbe p{io::json_int(probe, "step", f + " probe", -1, kCount, fix),
                     json_float_of(probe, "spike", f + " probe", fix),
                     json_float_of(probe, "before", f + " probe", fix)};
  const json& fj = s.contains("finding") ? s["finding"] : json();
  Finding finding;
  finding.step = io::json_int(fj, "step", f + " finding", 0, kCount, fix);
  finding.trend = json_field<std::string>(fj, "trend", f + " finding", fix);
  finding.cause = json_field<std::string>(fj, "cause", f + " finding", fix);
  finding.action = json_field<std::string>(fj, "action", f + " finding", fix);
  const auto recent = json_field<std::vector<double>>(s, "recent_losses", f, fix);
  // Written since the start-loss baseline: an older checkpoint's advisor lacks it (then unprobed).
  const auto start_ids = s.contains("start_ids")
                             ? json_field<std::vector<int64_t>>(s, "start_ids", f, fix)
                             : std::vector<int64_t>();
  // Written since "stalled" compares medians: an older checkpoint's advisor lacks it (step 1's).
  const auto first = s.contains("first_losses")
                         ? json_field<std::vector<double>>(s, "first_losses", f, fix)
                         : std::vector<double>();
  const auto spikes = json_field<std::vector<int64_t>>(s, "spikes", f, fix);
  auto vanished =
      json_field<std::vector<std::pair<std::string, int64_t>>>(s, "vanished_run", f, fix);
  auto reported = json_field<std::vector<std::string>>(s, "reported", f, fix);
  const bool spike_norm = b("spike_norm"), spike_loss = b("spike_loss"), zeros = b("zeros"),
             updated = b("updated"), state_underflow_said = b("state_underflow_said"),
             start_observed = b("start_observed"), stall_reported = b("stall_reported"),
             scale_reported = b("scale_reported"), regrowth_reported = b("regrowth_reported"),
             underflow = b("underflow"), round_reported = b("round_reported");
  const int64_t last_spike = i("last_spike"), nan_steps = i("nan_steps"),
                full_lr_steps = i("full_lr_steps"), backoffs = i("backoffs"),
                round_run = i("round_run");
  const double start_loss = x("start_loss"), best_loss = x("best_loss"), best_norm = x("best_norm"),
               weight_rms = x("weight_rms");
  // Written since the routing finding: an older checkpoint's advisor lacks them (then unseen).
  const bool routing = s.contains("routing_run");
  const int64_t routing_run = routing ? i("routing_run") : 0;
  const bool routing_reported = routing && b("routing_reported");
  const double first_aux = routing ? x("first_aux") : -1;
  const bool first_collapsed = routing && b("first_collapsed");
  trend_ = static_cast<Trend>(t);
  window_ = std::move(window);
  last_spike_ = last_spike;
  spike_norm_ = spike_norm;
  spike_loss_ = spike_loss;
  nan_steps_ = nan_steps;
  zeros_ = zeros;
  state_underflow_said_ = state_underflow_said;
  updated_ = updated;
  start_loss_ = start_loss;
  start_observed_ = start_observed;
  start_ids_ = start_ids;
  full_lr_steps_ = full_lr_steps;
  recent_losses_.assign(recent.begin(), recent.end());
  first_losses_ = first;
  stall_reported_ = stall_reported;
  backoffs_ = backoffs;
  scale_reported_ = scale_reported;
  regrowth_reported_ = regrowth_reported;
  best_loss_ = best_loss;
  best_norm_ = best_norm;
  spikes_.assign(spikes.begin(), spikes.end());
  probe_ = p;
  finding_ = std::move(finding);
  vanished_run_ = std::move(vanished);
  reported_ = std::move(reported);
  underflow_ = underflow;
  round_run_ = round_run;
  round_reported_ = round_reported;
  routing_run_ = routing_run;
  routing_reported_ = routing_reported;
  first_aux_ = first_aux;
  first_collapsed_ = first_collapsed;
  opt_.weight_rms = weight_rms;
}

bool TrendAdvisor::observe_start(const StepResult& r, Finding* f) {
  // Step 1 only: a resumed run's first step here comes after the checkpoint's updates.
  if (start_observed_ || updated_ || r.step != 1 || !std::isfinite(r.loss)) return false;
  start_observed_ = true;
  start_loss_ = r.loss;
  start_ids_ = r.example_ids;
  const double U = opt_.uniform_loss;
  if (U <= 0 || r.loss <= 1.5 * U) return false;
  f->step = r.step;
  f->trend = "initialization";
  f->cause = "the loss before any update is " + num(r.loss) + ", " + num(r.loss / U) +
             "x the uniform guess ln V = " + num(U) +
             ": the weights as initialized or loaded are far off (no update was applied yet: "
             "not the learning rate)";
  f->action =
      "check the initialization (model.init_std; 0.02 is usual) or the weights of model.path; "
      "training may pull the loss down from there";
  return true;
}

bool TrendAdvisor::scale_as_set(const StepResult& r) const {
  return opt_.init_scale > 0 && backoffs_ == 0 && r.loss_scale == opt_.init_scale;
}

bool TrendAdvisor::observe_scale(const StepResult& r, Finding* f) {
  if (opt_.init_scale <= 0) return false;
  backoffs_ += r.loss_scale_after < r.loss_scale;
  if (scale_reported_) return false;
  // Set below 1: the scale shrinks the gradients towards f16's underflow from the first step on,
  // and no overflow put it there. Said at step 1 (a resumed run's scale is the checkpoint's).
  if (r.step == 1 && opt_.init_scale < 1 && r.loss_scale == opt_.init_scale) {
    scale_reported_ = true;
    f->step = r.step;
    f->trend = "loss scale";
    f->cause = "scaler.init_scale = " + scale_num(opt_.init_scale) +
               " starts the loss scale below 1: it shrinks the gradients towards f16's underflow "
               "(below 6e-08 they are 0) instead of lifting them away; no overflow put it there";
    f->action =
        "raise scaler.init_scale (PyTorch's default 65536: where that overflows, the scaler backs "
        "off by itself), and scaler.max_scale with it if set";
    return true;
  }
  // Far above what f16 carries: every step overflows and is skipped (no update) while the scale
  // backs off towards a usable one. Not a collapse: f16 is fine at the scale it is heading for.
  if (opt_.init_scale > kPyTorchInitScale && backoffs_ >= opt_.collapse_skips &&
      r.loss_scale_after >= kPyTorchInitScale) {
    scale_reported_ = true;
    f->step = r.step;
    f->trend = "loss scale";
    f->cause = "the loss scale started at scaler.init_scale = " + scale_num(opt_.init_scale) +
               " and has backed off " + count_of(backoffs_, "time") + " (now " +
               scale_num(r.loss_scale_after) +
               "), each a skipped step with no update: the gradients " +
               "times that scale overflow f16 (max 65504)";
    f->action =
        "lower scaler.init_scale (PyTorch's default 65536); each overflow only multiplies the "
        "scale by scaler.backoff_factor";
    return true;
  }
  return false;
}

bool TrendAdvisor::observe_regrowth(const StepResult& r, Finding* f) {
  if (regrowth_reported_ || opt_.init_scale <= 0) return false;
  // A full window: this step and the window's newer window - 1 (the window before this step).
  if (static_cast<int64_t>(window_.size()) < opt_.window - 1) return false;
  int64_t skips = 0, growths = 0;
  double lo = r.loss_scale, hi = r.loss_scale;
  auto count = [&](const StepResult& s) {
    skips += s.found_inf && !s.stepped && s.loss_scale_after < s.loss_scale;
    growths += s.loss_scale_after > s.loss_scale;
    lo = std::min(lo, s.loss_scale);
    hi = std::max(hi, s.loss_scale);
  };
  for (const StepResult& s : window_)
    if (r.step - s.step < opt_.window) count(s);
  count(r);
  if (4 * skips < opt_.window || 2 * growths < skips || hi / lo >= opt_.collapse_ratio)
    return false;
  regrowth_reported_ = true;
  const int64_t gi = opt_.growth_interval;
  f->step = r.step;
  f->trend = "loss scale";
  f->cause = std::to_string(skips) + " of the last " + std::to_string(opt_.window) +
             " steps were skipped by the scaler (no update), each an overflow of a scale it had "
             "grown (" +
             std::to_string(growths) + " growths; the scale moves between " + scale_num(lo) +
             " and " + scale_num(hi) + ")" +
             (gi > 0 ? ": it grows after every scaler.growth_interval = " + std::to_string(gi) +
                           " clean update" + (gi == 1 ? "" : "s")
                     : std::string());
  f->action =
      "raise scaler.growth_interval (PyTorch's default 2000): the scale then tries a larger value "
      "once in that many updates, and the steps between are not skipped";
  return true;
}

bool TrendAdvisor::observe_stall(const StepResult& r, Finding* f) {
  if (!r.stepped || !std::isfinite(r.loss)) return false;
  recent_losses_.push_back(r.loss);
  if (recent_losses_.size() > 10) recent_losses_.pop_front();
  if (start_observed_ && first_losses_.size() < 10) first_losses_.push_back(r.loss);
  if (opt_.peak_lr <= 0 || r.lr < 0.5 * opt_.peak_lr) return false;
  ++full_lr_steps_;
  if (stall_reported_ || full_lr_steps_ < opt_.stall_steps || !start_observed_ ||
      start_loss_ <= 0 || opt_.weight_rms <= 0 || trend_ != Trend::kStable ||
      !(r.grad_norm > opt_.vanish_abs) || !std::isfinite(r.grad_norm))
    return false;
  const double now = median({recent_losses_.begin(), recent_losses_.end()});
  // The first losses' median, not step 1's alone: one batch's loss is off the run's by its noise
  // (~5% from batch to batch), more than stall_fall, and a LoRA at optim.lr 1e-7 on a pretrained
  // base whose step 1 drew a hard batch "fell" 4% and was never called stalled. (Older checkpoints
  // hold no first losses: step 1's then.)
  const double before = first_losses_.empty() ? start_loss_ : median(first_losses_);
  if (!(before > 0)) return false;
  const double fall = (before - now) / before;
  // AdamW moves an element by about lr (m / sqrt(v) is at most ~1); SGD by lr times its gradient.
  // SGD moves by the clipped gradient: a tiny train.max_grad_norm stalls it whatever optim.lr is
  // (1e-6 held the loss at 5.5 for 120 steps without a finding; AdamW's update does not scale
  // with the gradient's norm, so clipping cannot stall it).
  const double n = static_cast<double>(std::max<int64_t>(opt_.num_params, 1));
  const bool clip_caps =
      !opt_.adaptive && opt_.max_grad_norm > 0 && r.grad_norm > opt_.max_grad_norm;
  const double applied_norm = clip_caps ? opt_.max_grad_norm : r.grad_norm;
  const double move = opt_.adaptive ? r.lr / opt_.weight_rms
                                    : r.lr * applied_norm / (opt_.weight_rms * std::sqrt(n));
  // A model that starts near the uniform guess knows nothing yet and has everything to learn; one
  // that starts well below it (a pretrained model) may learn slowly at a small lr by design (a
  // full fine-tune at 1e-6 moves its weights 5e-5 of their RMS): only a far smaller move is "far
  // too low" there.
  const bool untrained = opt_.uniform_loss > 0 && start_loss_ >= 0.8 * opt_.uniform_loss;
  const double too_small = untrained ? opt_.stall_move : opt_.stall_move / 10;
  // A fall within the batches' own noise is no fall: a median of 10 losses is still off by
  // ~1.25 sigma / sqrt(10) (sigma from the losses' median absolute deviation). A LoRA on a
  // pretrained base at optim.lr 1e-7 "fell" 1.7% between two medians, a hair under stall_fall:
  // two standard errors of the medians' difference are needed as well.
  double noise = 0;
  if (!first_losses_.empty()) {
    std::vector<double> dev;
    for (double x : first_losses_) dev.push_back(std::abs(x - before));
    for (double x : recent_losses_) dev.push_back(std::abs(x - now));
    const double sigma = 1.4826 * median(dev);
    const double n = static_cast<double>(std::min(first_losses_.size(), recent_losses_.size()));
    noise = 2 * 1.25 * sigma * std::sqrt(2 / n) / before;
  }
  if (fall >= std::max(opt_.stall_fall, noise) || move >= too_small) return false;
  stall_reported_ = true;
  f->step = r.step;
  f->trend = "stalled";
  f->cause =
      (fall > 0 ? "the loss fell " + num(100 * fall) + "% in " : "the loss did not fall in ") +
      std::to_string(full_lr_steps_) + " updates at the full learning rate (median of the first " +
      std::to_string(first_losses_.empty() ? 1 : first_losses_.size()) + " losses " + num(before) +
      ", of the last " + std::to_string(recent_losses_.size()) + " " + num(now) +
      ") while the gradients are finite and non-zero (grad norm " + num(r.grad_norm) +
      "): an update moves the weights by " + (opt_.adaptive ? "at most " : "") + "~" + num(move) +
      " of their RMS (" + num(opt_.weight_rms) + "; " +
      (opt_.adaptive
           ? "AdamW moves each by about lr = " + num(r.lr)
           : "SGD moves them by lr = " + num(r.lr) + " times the gradient" +
                 (clip_caps ? ", clipped to train.max_grad_norm = " + num(opt_.max_grad_norm)
                            : std::string())) +
      ")";
  // Unclipped, the same lr would move them enough: the threshold is the cause, not optim.lr.
  const double unclipped = r.lr * r.grad_norm / (opt_.weight_rms * std::sqrt(n));
  if (clip_caps && unclipped >= too_small)
    f->action = "train.max_grad_norm = " + num(opt_.max_grad_norm) +
                " cuts every gradient to a norm far below its own (" + num(r.grad_norm) +
                " now): raise it (1.0 is usual) or set it to 0 (no clipping)";
  else
    f->action = "optim.lr is far too low: raise it (" + usual_lr(untrained) + ")";
  return true;
}

// The range to raise optim.lr into, for what this run trains and how: an adapter was told
// "AdamW usually trains a model from scratch at 1e-4 to 3e-3" (a LoRA on a random base) and an SGD
// run the ranges of AdamW, whose update does not scale with the gradient.
std::string TrendAdvisor::usual_lr(bool untrained) const {
  if (!opt_.adaptive)
    return "SGD moves by lr times the gradient, and usually trains at 1e-2 to 1e-1";
  const std::string& a = opt_.adapter;
  if (!a.empty() && a != "none") {
    const std::string kind = a == "lora" ? "LoRA" : a == "dora" ? "DoRA" : a == "lokr" ? "LoKr" : a;
    return "AdamW usually trains " + kind +
           " adapters at 1e-4 to 1e-3, as HF PEFT's examples do; their base is frozen";
  }
  return untrained ? "AdamW usually trains a model from scratch at 1e-4 to 3e-3"
                   : "AdamW usually fine-tunes a whole pretrained model at 1e-5 to 2e-4";
}

std::string TrendAdvisor::format_name() const {
  const std::string& p = opt_.precision;
  if (p == "16-mixed" || p == "16-true") return "f16";
  if (p == "bf16-mixed" || p == "bf16-true") return "bf16";
  return "f32";
}

// "16-mixed whose scale never left 1": the scaler is off (scaler.enabled = false).
std::string TrendAdvisor::underflow_fix(const StepResult& r) const {
  const std::string& p = opt_.precision;
  if (p == "16-mixed" && r.loss_scale == 1.0 && r.loss_scale_after == 1.0)
    return "f16 gradients underflow to zero without a loss scaler: set scaler.enabled = true "
           "(16-mixed's GradScaler multiplies the loss by 65536 before backward), or switch "
           "train.precision to bf16-mixed";
  if (p == "16-mixed" && scale_as_set(r))
    return "the loss scale (" + scale_num(r.loss_scale) +
           ", scaler.init_scale, never backed off) is too low for these gradients: raise "
           "scaler.init_scale (PyTorch's default 65536), or switch train.precision to bf16-mixed";
  if (p == "16-mixed")
    return "the loss scale (" + scale_num(r.loss_scale) +
           ") is too low for these gradients: raise scaler.min_scale (or scaler.init_scale), or "
           "switch train.precision to bf16-mixed";
  if (p == "16-true")
    return "f16 gradients underflow without a loss scaler: switch train.precision to 16-mixed "
           "(its GradScaler) or bf16-mixed";
  return "";
}

bool TrendAdvisor::observe_layers(const StepResult& r, const std::vector<BlockGradNorm>& layers,
                                  Finding* f) {
  if (r.found_inf || !std::isfinite(r.grad_norm)) return false;  // a skipped step: no evidence
  std::vector<std::string> vanished;
  std::string alive;
  double alive_norm = 0;
  for (const BlockGradNorm& b : layers) {
    auto it = std::find_if(vanished_run_.begin(), vanished_run_.end(),
                           [&](const auto& e) { return e.first == b.block; });
    if (it == vanished_run_.end()) it = vanished_run_.insert(vanished_run_.end(), {b.block, 0});
    it->second = b.vanished() ? it->second + 1 : 0;
    if (it->second >= opt_.layer_steps)
      vanished.push_back(b.block);
    else if (b.norm > alive_norm)
      alive = b.block, alive_norm = b.norm;
  }
  underflow_ = !vanished.empty() && format_name() == "f16";
  if (vanished.empty()) reported_.clear();
  bool news = false;
  for (const std::string& v : vanished)
    news |= std::find(reported_.begin(), reported_.end(), v) == reported_.end();
  // Every block at once: the global norm is 0 (or below vanish_abs) and the trend's vanishing
  // line says so with the same fix; naming every block would add nothing.
  if (!news || alive.empty()) return false;
  reported_ = vanished;
  const std::string fmt = format_name();
  int64_t zero = 0, count = 0;
  for (const BlockGradNorm& b : layers)
    if (std::find(vanished.begin(), vanished.end(), b.block) != vanished.end())
      zero += b.zero, count += b.count;
  std::string names;
  for (size_t i = 0; i < vanished.size() && i < 8; ++i) names += (i ? ", " : "") + vanished[i];
  if (vanished.size() > 8) names += " (+" + std::to_string(vanished.size() - 8) + " more)";
  f->step = r.step;
  f->trend = "underflow";
  f->layers = vanished;
  f->share = count > 0 ? static_cast<double>(zero) / static_cast<double>(count) : 0;
  f->cause = "the gradients of " + std::to_string(vanished.size()) + " of " +
             std::to_string(layers.size()) + " blocks vanished on the last " +
             std::to_string(opt_.layer_steps) + " steps: " + names +
             " (every element zero or below " + fmt + "'s smallest normal; " + num(100 * f->share) +
             "% of them zeros)" + ", while " + alive + "'s did not (grad norm " + num(alive_norm) +
             ")";
  return true;
}

// Why the blocks of `f` vanished, once this step's trend is known. In a diverged run they died
// of the divergence: weights it blew up saturate softmax, GELU and the normalizations, whose
// gradients are then exactly zero in any format; the divergence's fix is theirs, and the format's
// or a detached layer's would send the user the wrong way.
void TrendAdvisor::explain_vanished(const StepResult& r, Finding& f) const {
  const std::string fmt = format_name();
  if (trend_ == Trend::kExploding) {
    f.cause += ": the run has diverged (since step " + std::to_string(finding_.step) +
               "), and activations saturated by the blown-up weights pass no gradient; not an "
               "underflow";
    f.action = action(Trend::kExploding, r);
    return;
  }
  if (const std::string fix = underflow_fix(r); !fix.empty()) {
    f.cause += ": " + fmt + " underflow";
    f.action = fix;
    return;
  }
  f.cause += ": not an underflow of " + fmt + "'s range (it reaches 1e-38)";
  f.action =
      "check that these layers take part in the loss (frozen, detached, or dead activations)";
}

bool TrendAdvisor::observe_rounding(const StepResult& r, Finding* f) {
  if (!r.stepped || r.update_elements <= 0) return false;
  // A schedule's decayed tail (cosine to 0) makes updates too small to land by design: told to
  // "raise optim.lr" at its last steps, a healthy run was misled.
  if (opt_.peak_lr > 0 && r.lr < 0.1 * opt_.peak_lr) {
    round_run_ = 0;
    return false;
  }
  const double share = static_cast<double>(r.rounded_away) / static_cast<double>(r.update_elements);
  if (share < opt_.round_share) {
    round_run_ = 0;
    round_reported_ = false;
    return false;
  }
  if (++round_run_ < opt_.round_steps || round_reported_ || opt_.stochastic_rounding) return false;
  round_reported_ = true;
  const std::string& p = opt_.precision;
  const std::string weights = p == "bf16-true" ? "bf16" : p == "16-true" ? "f16" : "f32";
  f->step = r.step;
  f->trend = "rounding";
  f->share = share;
  f->cause = num(100 * share) + "% of the weight updates rounded away (step " +
             std::to_string(r.step) + ": " + std::to_string(r.rounded_away) + " of " +
             std::to_string(r.update_elements) + " elements had a non-zero update that left the " +
             "stored " + weights + " value unchanged; " + std::to_string(opt_.round_steps) +
             " steps in a row)";
  if (weights == "bf16")
    f->action =
        "bf16 keeps 8 significant bits, so an update below half a unit in the last place is "
        "lost: switch train.precision to bf16-mixed (f32 master weights keep every update) or set "
        "optim.stochastic_rounding = true (updates land on average)";
  else if (weights == "f16")
    f->action =
        "switch train.precision to bf16-mixed or 16-mixed (f32 master weights keep every update)";
  else
    f->action = "the updates are below f32's resolution for these weights: optim.lr (" + lr_now(r) +
                ") is too small to change them; raise optim.lr";
  return true;
}

bool TrendAdvisor::observe_routing(const StepResult& r, Finding* f) {
  const auto k = static_cast<double>(opt_.experts_per_token);
  if (r.moe_layers == 0 || k <= 0 || opt_.experts <= 0 || !std::isfinite(r.moe_aux_loss) ||
      r.moe_aux_loss <= 0)
    return false;
  const double most = static_cast<double>(opt_.experts) / k;  // every token chose one expert
  const double ratio = r.moe_aux_loss / k, load = r.moe_max_load / most;
  const bool collapsed = ratio >= opt_.routing_ratio || load >= opt_.routing_load;
  if (r.step == 1 && first_aux_ < 0) {
    first_aux_ = r.moe_aux_loss;
    first_collapsed_ = collapsed;
  }
  if (!collapsed) {
    routing_run_ = 0;
    if (ratio < 1.25 && load < 0.5) routing_reported_ = false;  // evened out
    return false;
  }
  if (++routing_run_ < opt_.routing_steps || routing_reported_) return false;
  routing_reported_ = true;
  // The updates did it when step 1 was not collapsed; else the start had it (the model's routers
  // on this data), and a lower learning rate would not help.
  const bool rose = first_aux_ > 0 && !first_collapsed_;
  f->step = r.step;
  f->trend = "routing";
  f->cause = "the routers send most tokens to a few experts on the last " +
             std::to_string(opt_.routing_steps) + " steps: at step " + std::to_string(r.step) +
             " the busiest expert took " + num(r.moe_max_load) + "x its layer's mean (" +
             num(most) + "x: every token's), " + std::to_string(r.moe_unused_experts) +
             " (layer, expert) pairs took no token, and moe/aux_loss is " + num(r.moe_aux_loss) +
             " (" + num(k) + " when even)" +
             (rose ? "; step 1 was spread (moe/aux_loss " + num(first_aux_) +
                         "): the updates concentrated it"
              : first_aux_ > 0 ? "; so from step 1: the model's routers on this data"
                               : std::string());
  const std::string lower = rose ? " or lower optim.lr (" + lr_now(r) + ")" : std::string();
  f->action = opt_.router_aux_loss_coef > 0
                  ? "raise model.router_aux_loss_coef (now " + num(opt_.router_aux_loss_coef) +
                        ") to weigh the load-balancing loss more" + lower
                  : "set model.router_aux_loss_coef = 0.001 (HF's router_aux_loss_coef in "
                    "Mixtral's and Qwen3-MoE's configs; OLMoE's 0.01): the load-balancing loss "
                    "trains the routers toward an even load" +
                        lower;
  return true;
}

std::string TrendAdvisor::trend_line(StepResult& r) {
  const bool nonfinite_event = !std::isfinite(r.loss) || r.nan_steps > nan_steps_;
  nan_steps_ = r.nan_steps;
  updated_ |= r.stepped;

  // Spike test against the window BEFORE this step. A spike is a jump: the previous step was not
  // already halfway up (a steady geometric growth is an explosion, not a series of spikes).
  std::vector<double> prev_norms, prev_losses;
  for (const StepResult& s : window_) {
    if (std::isfinite(s.grad_norm)) prev_norms.push_back(s.grad_norm);
    if (std::isfinite(s.loss)) prev_losses.push_back(s.loss);
  }
  const auto min_steps = static_cast<size_t>(opt_.min_steps);
  auto jumped = [&](const std::vector<double>& prev, double v, double factor) {
    if (prev.size() < min_steps || !std::isfinite(v)) return false;
    const double m = median(prev);
    return m > 0 && v >= factor * m && prev.back() < (1 + (factor - 1) / 2) * m;
  };
  // Against the uniform guess too: a batch that takes a model that had learned something (the
  // window's median well below ln V) above ln V jumped, whatever the ratio (3.26 -> 6.46).
  const double U = opt_.uniform_loss;
  const bool above_uniform = U > 0 && prev_losses.size() >= min_steps && std::isfinite(r.loss) &&
                             r.loss > U && median(prev_losses) < 0.8 * U && prev_losses.back() < U;
  const bool loss_jumped = jumped(prev_losses, r.loss, opt_.loss_spike_factor) || above_uniform;
  // Spikes that left the window go first: a spike exactly `window` steps after the last one is a
  // first sighting again (probed), not a recurrence. It was counted as the second of a pair
  // before the first was dropped, went unprobed, and a clean batch was sent to "if its batch looks
  // wrong, check the data" (a LoRA run at optim.lr 3e-2, spikes at steps 39 and 59).
  while (!spikes_.empty() && r.step - spikes_.front() >= opt_.window) spikes_.pop_front();
  const bool norm_jumped = jumped(prev_norms, r.grad_norm, opt_.spike_factor);
  if (norm_jumped || loss_jumped) {
    last_spike_ = r.step;
    spike_norm_ = norm_jumped;
    spike_loss_ = loss_jumped;
    spikes_.push_back(r.step);
    // A spike's first sighting (of the loss or the grad norm): its batch against the step
    // before's, same weights. A grad-norm spike went unprobed and was sent to "check the data"
    // all the same (optim.lr 0.03 on the clean arithmetic task, step 151).
    if (spikes_.size() == 1 && opt_.batch_loss && !r.example_ids.empty() && !window_.empty() &&
        !window_.back().example_ids.empty())
      probe_ = {r.step, opt_.batch_loss(r.example_ids),
                opt_.batch_loss(window_.back().example_ids)};
  }
  while (!spikes_.empty() && r.step - spikes_.front() >= opt_.window) spikes_.pop_front();

  window_.push_back(r);
  while (static_cast<int64_t>(window_.size()) > opt_.window) window_.pop_front();

  // The best window: median loss of the last 3 applied finite steps, never raised.
  std::vector<double> recent_l, recent_n;
  for (auto it = window_.rbegin(); it != window_.rend() && recent_l.size() < 3; ++it)
    if (it->stepped && std::isfinite(it->loss) && std::isfinite(it->grad_norm)) {
      recent_l.push_back(it->loss);
      recent_n.push_back(it->grad_norm);
    }
  // Not while exploding, nor from losses far above the uniform guess: those are no baseline.
  const bool usable = trend_ != Trend::kExploding &&
                      (U <= 0 || (recent_l.size() == 3 && median(recent_l) <= 1.5 * U));
  if (recent_l.size() == 3 && usable && (best_loss_ == 0 || median(recent_l) < best_loss_)) {
    best_loss_ = median(recent_l);
    best_norm_ = median(recent_n);
  }

  std::string why;
  Trend t = nonfinite_event ? Trend::kExploding : classify(r, why);
  if (nonfinite_event)
    why = std::string("non-finite ") + (std::isfinite(r.loss) ? "gradients" : "loss") +
          " at step " + std::to_string(r.step);
  // The optimizer's flushed moments: the cause and its fix, said once, a divergence already
  // advised or not (it is news: "lower optim.lr" does not fix it).
  if (nonfinite_event && !state_underflow_said_ && opt_.state_underflow) {
    const std::string cause = opt_.state_underflow(), fix = kStateUnderflowFix;
    if (cause.size() > fix.size() + 2 &&
        cause.compare(cause.size() - fix.size(), fix.size(), fix) == 0) {
      state_underflow_said_ = true;
      trend_ = Trend::kExploding;
      zeros_ = false;
      finding_ = Finding{r.step,
                         trend_name(trend_),
                         why + ": " + cause.substr(0, cause.size() - fix.size() - 2),
                         fix,
                         {},
                         {},
                         -1};
      return finding_.trend + ": " + finding_.cause + "; " + finding_.action;
    }
  }
  // An exploding verdict holds until its condition clears: a diverged run that settles on a high
  // plateau is still diverged, never the new baseline of a "stable" run.
  if (trend_ == Trend::kExploding && t != Trend::kExploding && !recovered(r)) return "";
  // Exact zeros are news inside a vanishing trend too: a decay asks for a higher lr, exact zeros
  // for a loss scaler or another precision.
  const bool zeros = t == Trend::kVanishing && r.grad_norm == 0.0 &&
                     why.rfind("the grad norm was exactly 0", 0) == 0;
  if (t == trend_ && (zeros == zeros_ || !zeros)) return "";
  // Back from a learning rate's divergence: "no action needed" told a run at optim.lr 0.3 that
  // had diverged for 16 steps (loss 22) that its rate was fine. The cause is still set.
  // The same after spikes the optimizer made (they recurred on other batches): "no action needed"
  // came 5 steps after the third spike of a run at optim.lr 0.5, which spiked again 2 steps later.
  const Finding before = finding_;
  const Trend was = trend_;
  // (A spike's other actions name the data first, the rate only "if spikes recur".)
  const bool data_first = before.action.rfind("check the data", 0) == 0 ||
                          before.action.rfind("if its batch looks wrong", 0) == 0;
  const bool lr_settled = (was == Trend::kExploding || (was == Trend::kSpiking && !data_first)) &&
                          t == Trend::kStable &&
                          before.action.find("lower optim.lr") != std::string::npos;
  trend_ = t;
  zeros_ = zeros;
  finding_ = Finding{r.step, trend_name(t), why, action(t, r), {}, {}, -1};
  if (lr_settled && was == Trend::kExploding) {
    finding_.cause +=
        "; recovered from the divergence found at step " + std::to_string(before.step);
    finding_.action = "none now; if it diverges again, " + lower_lr_of(r);
  } else if (lr_settled) {
    finding_.cause += "; no spike since step " + std::to_string(last_spike_) +
                      ", which the optimizer made (not its batch)";
    finding_.action = "none now; if spikes recur, " + lower_lr_of(r);
  }
  if (r.step == opt_.inject_step && (t == Trend::kExploding || t == Trend::kSpiking)) {
    const bool nonfinite = !std::isfinite(r.loss) || !std::isfinite(r.grad_norm);
    finding_.cause += "; debug.inject put " + opt_.inject_what + " at this step";
    finding_.action =
        std::string(nonfinite ? (opt_.tracer_on ? "the tracer's log names the module that "
                                                  "produces it; "
                                                : "")
                              : "") +
        "the fault is debug.inject's, not the run's (no learning rate or data to change): set "
        "debug.inject.module = \"\" to train without it";
  }
  if (t == Trend::kSpiking)
    for (const StepResult& s : window_)
      if (s.step == last_spike_) examples_of(s, &finding_.examples);
  return finding_.trend + ": " + finding_.cause + "; " + finding_.action;
}

bool TrendAdvisor::recovered(const StepResult& r) const {
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm) || !r.stepped) return false;
  if (opt_.uniform_loss > 0 && r.loss > opt_.uniform_loss) return false;
  if (best_loss_ > 0 && r.loss > 1.5 * best_loss_) return false;
  // A pretrained start (below ln V) is the level to come back to: 2.7 after starting at 1.25 is
  // not recovered, whatever the best window (contaminated by the steps before the verdict).
  if (start_loss_ > 0 && (opt_.uniform_loss <= 0 || start_loss_ < opt_.uniform_loss) &&
      r.loss > 1.5 * start_loss_)
    return false;
  if (best_norm_ > 0 && r.grad_norm > opt_.explode_ratio * best_norm_) return false;
  // Saturated by blown-up weights, the loss and the grad norm may look calm: still diverged.
  std::string why;
  return !blown_up(why);
}

bool TrendAdvisor::blown_up(std::string& why) const {
  if (!updated_ || !opt_.largest_weight) return false;
  const LargestWeight w = opt_.largest_weight();
  if (!(w.value > kDivergedWeight)) return false;
  why = "diverged: " + why + " while the updates blew " + w.param + " up to |w| = " + num(w.value) +
        " (above " + num(kDivergedWeight) +
        ": no sane update takes a weight there); the activations it saturates pass no gradient: "
        "not a vanishing gradient";
  return true;
}

// "corpus.txt:17, corpus.txt:40 (+3 more)": the batch of step `s`, by file and line.
std::string TrendAdvisor::examples_of(const StepResult& s, std::vector<std::string>* list) const {
  std::string out;
  for (size_t i = 0; i < s.example_ids.size(); ++i) {
    const int64_t id = s.example_ids[i];
    const std::string w =
        opt_.describe_example ? opt_.describe_example(id) : "example " + std::to_string(id);
    if (list) list->push_back(w);
    if (i < 8) out += (out.empty() ? "" : ", ") + w;
  }
  if (s.example_ids.size() > 8) out += " (+" + std::to_string(s.example_ids.size() - 8) + " more)";
  return out;
}

Trend TrendAdvisor::classify(const StepResult& r, std::string& why) const {
  // Loss-scale collapse.
  bool scaler = false;
  int64_t skips = 0;
  for (const StepResult& s : window_) {
    scaler |= s.loss_scale != 1.0 || s.loss_scale_after != 1.0;
    skips += s.found_inf && !s.stepped && s.loss_scale_after < s.loss_scale;
  }
  if (scaler) {
    // A start set above PyTorch's is measured from there: backing off from 1e30 is the setting's
    // (observe_scale), not f16 overflowing at every usable scale.
    double first = window_.front().loss_scale;
    if (opt_.init_scale > kPyTorchInitScale) first = std::min(first, kPyTorchInitScale);
    const double last = r.loss_scale_after;
    // Set below 1 and never backed off: the setting (observe_scale), not a fall.
    if (last < 1.0 && !(opt_.init_scale > 0 && backoffs_ == 0 && last >= opt_.init_scale)) {
      why = "the loss scale fell to " + scale_num(last) + " (below 1)";
      return Trend::kScaleCollapsing;
    }
    if (skips >= opt_.collapse_skips && last > 0 && first / last >= opt_.collapse_ratio) {
      why = "the loss scale fell from " + scale_num(first) + " to " + scale_num(last) + " with " +
            std::to_string(skips) + " skipped steps in the last " + std::to_string(window_.size());
      return Trend::kScaleCollapsing;
    }
  }

  std::vector<double> norms, losses;
  for (const StepResult& s : window_)
    if (std::isfinite(s.grad_norm)) {
      norms.push_back(s.grad_norm);
      losses.push_back(s.loss);
    }
  const size_t n = norms.size();

  // Diverged: the last two applied losses far above the uniform guess, or far above the best
  // window so far. No min_steps: a learning rate that destroys the model shows at once.
  if (n >= 2) {
    const double a = losses[n - 2], b = losses[n - 1], U = opt_.uniform_loss;
    // A model that started above 1.5 ln V (observe_start) is measured against its start: a loss
    // falling from there is training, not a divergence.
    const bool high_start = U > 0 && start_loss_ > 1.5 * U;
    const double bound = high_start ? 1.5 * start_loss_ : 1.5 * U;
    if (U > 0 && a > bound && b > bound) {
      why = "diverged: the loss is " + num(a) + ", " + num(b) + " on the last 2 steps, above " +
            (high_start ? "1.5x the loss before any update (" + num(start_loss_) +
                              ", itself above the uniform guess ln V = " + num(U) + ")"
                        : "the uniform guess ln V = " + num(U) + " (a model that knows nothing)") +
            (best_loss_ > 0 ? "; best window so far " + num(best_loss_) : std::string());
      return Trend::kExploding;
    }
    if (best_loss_ > 0 && a > 3 * best_loss_ + 1 && b > 3 * best_loss_ + 1) {
      why = "diverged: the loss is " + num(a) + ", " + num(b) +
            " on the last 2 steps, over 3x "
            "the best window so far (" +
            num(best_loss_) + ")";
      return Trend::kExploding;
    }
    // The loss before any update is a baseline from step 2 on: a pretrained model (model.path)
    // starts far below ln V, and a learning rate that wrecks it in one update (a LoRA at optim.lr
    // 1: 1.25 -> 7.44, 8.12) stayed under 1.5 ln V with no best window yet, and the run said
    // nothing. Step 1's batch, measured again under the weights now, tells the weights from a
    // hard batch: a first batch easier than the rest is no baseline to diverge from, but the
    // same batch half as bad again and 0.5 worse (1.25 -> 4.4) is the weights'.
    const double s0 = start_loss_;
    if (updated_ && s0 > 0 && a > 3 * s0 + 1 && b > 3 * s0 + 1) {
      double again = NAN;
      // Measured once a window: a first batch easier than all the rest would cost a forward at
      // every step.
      if (trend_ != Trend::kExploding && opt_.batch_loss && !start_ids_.empty()) {
        if (start_probe_.first < 0 || r.step - start_probe_.first >= opt_.window)
          start_probe_ = {r.step, opt_.batch_loss(start_ids_)};
        again = start_probe_.second;
      }
      if (!(again <= 1.5 * s0 + 0.5)) {  // NaN (not measured, or wrecked to NaN): diverged
        why = "diverged: the loss is " + num(a) + ", " + num(b) +
              " on the last 2 steps, over 3x the loss before any update (" + num(s0) + ")" +
              (std::isfinite(again) ? "; step 1's batch now has a loss of " + num(again) +
                                          " under the weights the updates made: not harder data"
                                    : std::string());
        return Trend::kExploding;
      }
    }
  }

  // Exactly-zero (or vanishingly small) gradients: no need to wait for min_steps.
  const auto zs = static_cast<size_t>(opt_.zero_steps);
  if (zs > 0 && n >= zs) {
    bool tiny = true;
    int64_t zeros = 0;
    for (size_t i = n - zs; i < n; ++i) {
      tiny &= norms[i] <= opt_.vanish_abs;
      zeros += norms[i] == 0.0;
    }
    // A loss at 0 has no gradient left to give: a task learned perfectly, not a broken backward.
    // Not in f16, whose gradients of a small loss do underflow (examples/f16-no-scaler): there
    // the zeros are the format's, and the scaler's fix stands.
    double recent_loss = 0;
    for (size_t i = n - zs; i < n; ++i) recent_loss += losses[i] / static_cast<double>(zs);
    if (tiny && recent_loss < 0.01 && format_name() != "f16") {
      why = "converged: the loss is " + num(recent_loss) + " and the grad norm " +
            num(norms[n - 1]) + " on the last " + std::to_string(zs) + " steps";
      return Trend::kStable;
    }
    if (tiny) {
      why = zeros == static_cast<int64_t>(zs)
                ? "the grad norm was exactly 0 on the last " + std::to_string(zs) + " steps"
                : "the grad norm stayed below " + num(opt_.vanish_abs) + " on the last " +
                      std::to_string(zs) + " steps";
      return blown_up(why) ? Trend::kExploding : Trend::kVanishing;
    }
  }

  if (n >= static_cast<size_t>(opt_.min_steps)) {
    const size_t h = n / 2;
    const std::vector<double> old_n(norms.begin(), norms.begin() + h),
        new_n(norms.begin() + (n - h), norms.end());
    const std::vector<double> old_l(losses.begin(), losses.begin() + h),
        new_l(losses.begin() + (n - h), losses.end());
    const double mo = median(old_n), mn = median(new_n);
    if (mo > 0 && mn >= opt_.explode_ratio * mo &&
        (mean(new_l) >= mean(old_l) || mn >= 10 * opt_.explode_ratio * mo)) {
      why = "the grad norm grew " + num(mn / mo) + "x over the last " + std::to_string(n) +
            " steps (median " + num(mo) + " -> " + num(mn) + ", loss " + num(mean(old_l)) + " -> " +
            num(mean(new_l)) + ")";
      return Trend::kExploding;
    }
    // A cross-entropy's gradient shrinks as its loss does: a run that has learned its task (the
    // loss near 0, or a tenth of what it was) is converging, not losing its gradients. It was
    // told to raise optim.lr.
    const double lo = mean(old_l), ln = mean(new_l);
    const bool converging = ln < 0.01 || (lo > 0 && ln <= 0.1 * lo);
    if (mo > 0 && mn <= opt_.vanish_ratio * mo && converging) {
      why = "converging: the loss fell " + num(lo) + " -> " + num(ln) + " over the last " +
            std::to_string(n) + " steps and the grad norm with it (median " + num(mo) + " -> " +
            num(mn) + ")";
      return Trend::kStable;
    }
    if (mo > 0 && mn <= opt_.vanish_ratio * mo) {
      why = "the grad norm fell " + num(mo / std::max(mn, 1e-300)) + "x over the last " +
            std::to_string(n) + " steps (median " + num(mo) + " -> " + num(mn) + ")";
      return blown_up(why) ? Trend::kExploding : Trend::kVanishing;
    }
  }

  if (last_spike_ >= 0 && r.step - last_spike_ < opt_.spike_hold) {
    const StepResult* s = nullptr;
    for (const StepResult& w : window_)
      if (w.step == last_spike_) s = &w;
    const std::string norm = num(s ? s->grad_norm : 0.0), loss = num(s ? s->loss : 0.0);
    const std::string med_norm = num(median(norms)), med_loss = num(median(losses));
    const std::string step = "step " + std::to_string(last_spike_);
    // Only what jumped is called "far above"; the other is given beside it.
    if (spike_norm_ && spike_loss_)
      why = step + " jumped (grad norm " + norm + ", loss " + loss +
            ") far above the recent median (grad norm " + med_norm + ", loss " + med_loss + ")";
    else if (spike_norm_)
      why = step + "'s grad norm jumped to " + norm + ", far above the recent median " + med_norm +
            " (its loss " + loss + ", median " + med_loss + ")";
    else
      why = step + "'s loss jumped to " + loss + ", far above the recent median " + med_loss +
            " (its grad norm " + norm + ", median " + med_norm + ")";
    if (spike_loss_ && s && opt_.uniform_loss > 0 && s->loss > opt_.uniform_loss)
      why += ", above the uniform guess ln V = " + num(opt_.uniform_loss);
    if (spikes_.size() >= 2) {
      why += "; spikes recur (steps";
      for (int64_t k : spikes_) why += " " + std::to_string(k);
      why += ") on different batches: the optimizer, not the data";
    } else if (s && !s->example_ids.empty()) {
      if (const int v = probe_verdict(last_spike_); v != 0)
        why += "; under the same weights its batch's loss is " + num(probe_.spike) +
               " and the step before's batch's " + num(probe_.before) +
               (v > 0 ? ": the batch is the harder, the data"
                : probe_.spike > probe_.before
                    // 1.18x harder was called "no harder": it is not hard enough to be the cause.
                    ? ": its batch is only " + num(probe_.spike / probe_.before) +
                          "x harder (under " + num(opt_.spike_batch_ratio) +
                          "x), too little to make the spike: the update before moved the weights "
                          "(the optimizer, not the data)"
                    : std::string(": its batch is no harder, the update before moved the "
                                  "weights (the optimizer, not the data)"));
      why += "; its batch: " + examples_of(*s, nullptr);
    }
    return Trend::kSpiking;
  }

  why = "grad norm " + num(r.grad_norm) + ", loss " + num(r.loss);
  return Trend::kStable;
}

// optim.lr's own value, and the step's rate beside it where the schedule has moved it: "now 0.1,
// 0.012 at this step of the schedule". The advice named the step's rate as optim.lr's ("lower
// optim.lr (now 0.012, try 0.0012)" to a run at optim.lr 0.1 in its cosine tail: a peak 83x lower,
// not 10x).
std::string TrendAdvisor::lr_now(const StepResult& r) const {
  const double key = opt_.peak_lr > 0 ? opt_.peak_lr : r.lr;
  return "now " + num(key) +
         (num(r.lr) == num(key) ? std::string()
                                : ", " + num(r.lr) + " at this step of the schedule");
}

// The value to try: a tenth of optim.lr, unless AdamW would still move each weight by more than
// a tenth of the weights' RMS at it (a hundredth for a model that starts well below ln V, a
// pretrained one, or where the start is unknown); then the power of ten below that. optim.lr 10
// on the built-in task (RMS 0.0174) was told "try 1", still 57x the RMS, which wrecks the model
// as surely as 10 did. SGD's step scales with the gradient: a tenth is all that is known.
std::string TrendAdvisor::lower_lr_of(const StepResult& r) const {
  const double key = opt_.peak_lr > 0 ? opt_.peak_lr : r.lr;
  const std::string now = lr_now(r);
  double next = key / 10;
  std::string why;
  if (opt_.adaptive && opt_.weight_rms > 0) {
    const bool untrained =
        start_observed_ && opt_.uniform_loss > 0 && start_loss_ >= 0.8 * opt_.uniform_loss;
    const double share = untrained ? 0.1 : 0.01;
    if (const double cap = share * opt_.weight_rms; next > cap) {
      next = std::pow(10.0, std::floor(std::log10(cap)));
      why = ", below " + num(share) + "x the weights' RMS " + num(opt_.weight_rms);
    }
  }
  return "lower optim.lr (" + now + (now.find(',') == std::string::npos ? ", try " : "; try ") +
         num(next) + why + ")";
}

// Warmup helps where the full learning rate from the first update is what spiked: no warmup yet
// and a spike in the first tenth of the run, or a spike during the warmup or as long again after
// it (the ramp is too steep). "add warmup (sched.warmup_steps)" was said at step 151 of 160 and to
// runs that warm up already. "" where a warmup cannot help; the key alone where the schedule is
// unknown.
std::string TrendAdvisor::warmup_fix(int64_t step) const {
  const int64_t w = opt_.warmup_steps, t = opt_.total_steps;
  if (w < 0) return "add warmup (sched.warmup_steps)";
  if (w > 0)
    return step <= 2 * w ? "lengthen the warmup (sched.warmup_steps, now " + std::to_string(w) +
                               " steps: step " + std::to_string(step) + " came " +
                               (step <= w ? "during it" : "soon after it") + ")"
                         : "";
  if (t <= 0) return "add warmup (sched.warmup_steps)";
  const int64_t early = std::max<int64_t>(1, (t + 9) / 10);
  if (step > early) return "";
  return "add warmup (sched.warmup_steps = " + std::to_string(early) + ", a tenth of the run's " +
         std::to_string(t) + " steps; none now)";
}

int TrendAdvisor::probe_verdict(int64_t step) const {
  if (probe_.step != step || !std::isfinite(probe_.spike) || !std::isfinite(probe_.before) ||
      probe_.before <= 0)
    return 0;
  return probe_.spike >= opt_.spike_batch_ratio * probe_.before ? 1 : -1;
}

// Spikes the optimizer makes: a smaller step, a clipping threshold, a warmup.
std::string TrendAdvisor::optimizer_spike_fix(const StepResult& r) const {
  // Clipping that already cut the spike contains it: "lower train.max_grad_norm (now 1: it clipped
  // this step)" told the user to do more of what was done (a norm of 2.77 cut to 1 at optim.lr
  // 0.03); the cause left is the step size. It said "set train.max_grad_norm" to a run clipping
  // already before that.
  const std::string warmup = warmup_fix(last_spike_ >= 0 ? last_spike_ : r.step);
  if (const std::string held = clip_contained(); !held.empty())
    return held + ": " + lower_lr_of(r) +
           (warmup.empty()
                ? std::string()
                : ", and " + warmup + (opt_.warmup_steps < 0 ? " if spikes come early" : ""));
  // A spike the loss scaler skipped (its f16 gradients overflowed) applied no update: no clipping
  // threshold was reached or missed ("lower train.max_grad_norm (now 1, above the spike's grad
  // norm)" was said of a grad norm of nan).
  for (const StepResult& w : window_)
    if (w.step == last_spike_ && w.found_inf && !w.stepped && w.loss_scale_after < w.loss_scale)
      return lower_lr_of(r) + (warmup.empty() ? "" : " and " + warmup) +
             "; the scaler skipped the spike's step (its "
             "gradients overflowed f16 at loss scale " +
             scale_num(w.loss_scale) + "), so no update came of it";
  const double clip = opt_.max_grad_norm;
  const std::string clipping =
      clip > 0    ? "lower train.max_grad_norm (now " + num(clip) + ", above the spike's grad norm)"
      : clip == 0 ? "set train.max_grad_norm = 1.0 (now 0: no clipping)"
                  : "set train.max_grad_norm (this step was " +
                        std::string(r.clipped ? "clipped)" : "not clipped)");
  return lower_lr_of(r) + " or " + clipping + (warmup.empty() ? "" : ", and " + warmup);
}

// "train.max_grad_norm = 1 already clipped it (grad norm 2.77 cut to 1) ...": the last spike's
// step was clipped; "" where it was not, or clipping is off or unknown.
std::string TrendAdvisor::clip_contained() const {
  const double clip = opt_.max_grad_norm;
  const StepResult* s = nullptr;
  for (const StepResult& w : window_)
    if (w.step == last_spike_) s = &w;
  if (!(clip > 0) || !s || !s->clipped || !std::isfinite(s->grad_norm)) return "";
  return "train.max_grad_norm = " + num(clip) + " already clipped it (grad norm " +
         num(s->grad_norm) + " cut to " + num(clip) +
         "), which contains the spike, and a lower threshold would not remove its cause";
}

std::string TrendAdvisor::action(Trend t, const StepResult& r) const {
  // Where lower precision is the suspect, the policy to try instead.
  const std::string& p = opt_.precision;
  std::string switch_to;
  if (const std::string wider = wider_precisions(p); wider == "32-true")
    switch_to = "try train.precision = \"32-true\"";
  else if (!wider.empty())
    switch_to = "switch train.precision to " + wider;
  const std::string lower_lr = lower_lr_of(r);
  switch (t) {
    case Trend::kScaleCollapsing:
      return std::string(
                 "f16 overflows at any usable scale: switch train.precision to "
                 "bf16-mixed or 32-true") +
             (updated_ ? " (or lower optim.lr)" : "");
    case Trend::kExploding: {
      // A scale still above PyTorch's start because scaler.init_scale began far above it: the
      // scale is what overflows (the advice said "switch train.precision to bf16-mixed" where the
      // "loss scale" finding had said "lower scaler.init_scale").
      if (p == "16-mixed" && opt_.init_scale > kPyTorchInitScale &&
          r.loss_scale > kPyTorchInitScale)
        return "lower scaler.init_scale (now " + scale_num(opt_.init_scale) +
               "; PyTorch's default 65536): the loss scale (" + scale_num(r.loss_scale) +
               ") still multiplies the gradients past f16's max 65504; or switch train.precision "
               "to bf16-mixed (no scaler needed)";
      // AdamW moves every weight by about lr at each update: at 10x the weights' RMS or more the
      // model is wrecked in any format, and a wider one only keeps the wreck finite (16-mixed at
      // optim.lr 10, NaN at step 2, was offered "or switch train.precision to bf16-mixed", where
      // the loss reaches 2e3). The learning rate alone is named, with why.
      if (const double key = opt_.peak_lr > 0 ? opt_.peak_lr : r.lr;
          updated_ && opt_.adaptive && opt_.weight_rms > 0 && key >= 10 * opt_.weight_rms &&
          !switch_to.empty())
        // No warmup: it only delays the learning rate that wrecks the model.
        return lower_lr + ": AdamW moves each weight by about lr, " + num(key / opt_.weight_rms) +
               "x the RMS of the weights (" + num(opt_.weight_rms) +
               "), at every update, and no train.precision survives that (a wider one only keeps "
               "the wrecked model finite)";
      if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm))
        return (opt_.tracer_on
                    ? "the tracer's log (" +
                          (opt_.tracer_log.empty() ? std::string("debug/") : opt_.tracer_log) +
                          ") names the module that produces it"
                    : std::string("find the module that produces it with "
                                  "debug.underflow_overflow.enabled = true (or keel "
                                  "replay on the capture)")) +
               (updated_ ? ", then " + lower_lr + (switch_to.empty() ? "" : " or " + switch_to)
                         : (switch_to.empty() ? std::string()
                                              : ", then " + switch_to +
                                                    " (no update was applied "
                                                    "yet: not the learning rate)"));
      // "keep train.max_grad_norm > 0" was said to a run with it at 0.
      // At 10x the weights' RMS AdamW wrecks the model at the peak: a warmup only delays it.
      const double key = opt_.peak_lr > 0 ? opt_.peak_lr : r.lr;
      const std::string warmup = opt_.adaptive && opt_.weight_rms > 0 && key >= 10 * opt_.weight_rms
                                     ? ""
                                     : warmup_fix(r.step);
      return lower_lr + (warmup.empty() ? "" : ", " + warmup) + " and " +
             (opt_.max_grad_norm == 0 ? "set train.max_grad_norm = 1.0 (now 0: no clipping)"
                                      : "keep train.max_grad_norm > 0") +
             (switch_to.empty() ? "" : "; if it persists, " + switch_to);
    }
    case Trend::kVanishing: {
      const bool zero = !window_.empty() && window_.back().grad_norm == 0.0;
      // Blocks whose f16 gradients vanished (observe_layers): the decay is their underflow, and a
      // higher learning rate would not bring them back.
      if (underflow_ && !underflow_fix(r).empty()) return underflow_fix(r);
      if (zero && (p == "16-true" || p == "bf16-true"))
        return "gradients underflow to zero without a loss scaler: switch train.precision to "
               "16-mixed (its GradScaler), bf16-mixed or 32-true";
      // 16-mixed whose scale never left 1: the scaler is off (scaler.enabled = false), and the
      // f16 activation gradients flush to zero below 6e-8 on their way back.
      const bool no_scaler = std::all_of(window_.begin(), window_.end(), [](const StepResult& s) {
        return s.loss_scale == 1.0 && s.loss_scale_after == 1.0;
      });
      if (zero && p == "16-mixed" && no_scaler)
        return "f16 gradients underflow to zero without a loss scaler: set scaler.enabled = true "
               "(16-mixed's GradScaler multiplies the loss by 65536 before backward), or switch "
               "train.precision to bf16-mixed";
      if (zero)
        return "nothing reaches the parameters: check that not every label is ignored (-100), "
               "that the parameters are trainable, and in f16/bf16 switch to a -mixed policy or "
               "32-true";
      if (opt_.num_params > 0 && opt_.num_params < 10'000'000)
        return "raise optim.lr (" + lr_now(r) +
               "): tiny models train well at 1e-3 to 1e-2; check model.init_std";
      return "raise optim.lr (" + lr_now(r) +
             ") or check the initialization (model.init_std) and the schedule";
    }
    case Trend::kSpiking:
      if (spikes_.size() >= 2 || probe_verdict(last_spike_) < 0) return optimizer_spike_fix(r);
      if (probe_verdict(last_spike_) > 0)
        return "check the data around step " + std::to_string(last_spike_) +
               " (a bad, garbage or mislabeled batch: a data spike does not recur when other "
               "batches follow; if spikes recur, " +
               (clip_contained().empty() ? opt_.max_grad_norm > 0
                                               ? "lower optim.lr or train.max_grad_norm (now " +
                                                     num(opt_.max_grad_norm) + ")"
                                               : "lower optim.lr or set train.max_grad_norm = 1.0"
                                         : "lower optim.lr: " + clip_contained()) +
               ")";
      // Not probed (the tracer or the injector is on): neither cause is known.
      return "if its batch looks wrong, check the data around step " + std::to_string(last_spike_) +
             "; if spikes recur, it is the optimizer: " + optimizer_spike_fix(r);
    case Trend::kStable:
      return "no action needed";
  }
  return "";
}

}  // namespace keel::monitor
