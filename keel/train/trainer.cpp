#include "keel/train/trainer.h"

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/backend/cuda_api.h"
#include "keel/backend/monitor.h"
#include "keel/io/checkpoint.h"
#include "keel/io/hf_model.h"
#include "keel/io/trained_model.h"
#include "keel/models/resize.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/nn/layers.h"
#include "keel/numerics/tensor_stats.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/elementwise.h"
#include "keel/ops/shape.h"
#include "keel/optim/adamw.h"
#include "keel/optim/clip.h"
#include "keel/optim/sgd.h"
#include "keel/tensor/host_memory.h"
#include "keel/tensor/random.h"

namespace keel {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string utc_stamp() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::gmtime(&t));
  return buf;
}

models::ModelSpec spec_from(const ModelConfig& m, int64_t vocab, int64_t seq_len, DType dt) {
  models::ModelSpec s;
  s.family = m.family;
  s.n_layer = m.n_layer;
  s.n_embd = m.n_embd;
  s.n_head = m.n_head;
  s.n_kv_head = m.n_kv_head;
  s.intermediate_size = m.intermediate_size;
  s.vocab_size = m.vocab_size > 0 ? m.vocab_size : vocab;
  s.max_seq_len = std::max(m.max_seq_len, seq_len);
  s.tie_embeddings = m.family == "gpt2" ? true : m.tie_embeddings;
  s.rope_theta = m.rope_theta;
  s.norm_eps = m.norm_eps;
  s.init_std = m.init_std;
  s.dropout = m.dropout;
  s.attention = ops::attention_backend_from_name(m.attention);
  s.param_dtype = dt;
  return s;
}

// Element by element (only on a non-finite step): a sum of squares would also flag finite values
// beyond ~1.8e19, whose squares overflow.
// The micro-batch's tensors on `dev` (the batch itself on the cpu).
data::Batch to_device(const data::Batch& b, Device dev) {
  if (dev.is_cpu()) return b;
  data::Batch d = b;
  d.input_ids = b.input_ids.to(dev);
  d.labels = b.labels.to(dev);
  if (b.attention_mask.defined()) d.attention_mask = b.attention_mask.to(dev);
  return d;
}

bool all_finite(const Tensor& t) {
  return monitor_kernels(t.device()).stats(t.data(), t.dtype(), t.numel(), t.dtype()).all_finite();
}

// The id that fills padded positions (they carry no label and attention masks them out): the
// tokenizer's own pad when it names no real token; else, as data.pad says, a dedicated new id one
// past the tokenizer's vocabulary ("add": the model's embeddings grow to hold it, see
// build_model) or its eos (HF's pad = eos), as GPT-2's and Llama-3.1's tokenizers have no pad.
int64_t pad_fill_id(const data::Tokenizer& tok, const std::string& mode) {
  if (tok.pad_id() >= 0 && !data::pad_collides(tok, tok.pad_id())) return tok.pad_id();
  if (mode == "add") return tok.vocab_size();
  if (tok.eos_id() >= 0) return tok.eos_id();
  throw Error(
      "the tokenizer (data.tokenizer) has neither a pad nor an eos token to fill padded "
      "positions with; set data.pad = \"add\" or name one in the tokenizer_config.json beside "
      "tokenizer.json",
      Error::kUsage);
}

nn::AdapterOptions adapter_options(const Config& c) {
  nn::AdapterOptions o;
  o.kind = c.model.adapter.kind;
  o.r = c.model.adapter.r;
  o.alpha = c.model.adapter.alpha;
  o.dropout = c.model.adapter.dropout;
  o.target_modules = c.model.adapter.target_modules;
  o.seed = c.run.seed;
  return o;
}

// The model of a run: from an HF directory (model.path) or from the sizes, parameters in
// `param_dtype`; embeddings grown to hold a dedicated pad id; then the adapters, with the frozen
// base stored in model.base_dtype.
std::unique_ptr<models::CausalLM> build_model(const Config& cfg, const data::Tokenizer& tok,
                                              int64_t pad_id, DType param_dtype,
                                              const std::function<void(const std::string&)>& say) {
  std::unique_ptr<models::CausalLM> m;
  if (!cfg.model.path.empty()) {
    io::HfConfig hf = io::read_hf_config(cfg.model.path);
    hf.spec.param_dtype = param_dtype;
    hf.spec.attention = ops::attention_backend_from_name(cfg.model.attention);
    hf.spec.dropout = cfg.model.dropout;
    m = models::make_causal_lm(hf.spec, cfg.run.seed);
    io::load_hf_weights(*m, cfg.model.path);
    if (hf.spec.family == "gpt2" && cfg.data.seq_len > hf.spec.max_seq_len)
      throw Error("data.seq_len = " + std::to_string(cfg.data.seq_len) + " exceeds " +
                      cfg.model.path + "/config.json's n_positions = " +
                      std::to_string(hf.spec.max_seq_len) + "; lower data.seq_len",
                  Error::kUsage);
  } else {
    m = models::make_causal_lm(
        spec_from(cfg.model, tok.vocab_size(), cfg.data.seq_len, param_dtype), cfg.run.seed);
  }
  const int64_t V = m->spec().vocab_size;
  if (tok.vocab_size() > V)
    throw Error("the tokenizer (" + cfg.data.tokenizer + ") has " +
                    std::to_string(tok.vocab_size()) + " ids but the model's vocabulary has " +
                    std::to_string(V) + " rows; use the model's own tokenizer" +
                    (cfg.model.path.empty() ? " or raise model.vocab_size" : ""),
                Error::kUsage);
  if (pad_id >= V) {
    models::resize_token_embeddings(*m, pad_id + 1);
    say("data.pad = \"add\": the tokenizer has no usable pad token; padding uses the new id " +
        std::to_string(pad_id) + " (embeddings resized from " + std::to_string(V) + " to " +
        std::to_string(pad_id + 1) + " rows, the new row the mean of the others)");
  }
  if (cfg.model.adapter.kind != "none") {
    nn::apply_adapters(*m, adapter_options(cfg));
    if (cfg.model.base_dtype == "bf16") {
      nn::cast_frozen_parameters(*m, DType::BF16);
      // The f32 base's blocks are free now and no training step asks for those sizes again:
      // unmap them instead of keeping them cached (the run trains ~160 MB lower for 102M params).
      host_memory::empty_cache();
    }
  }
  return m;
}

}  // namespace

Trainer::Trainer(const Config& cfg, TrainerHooks hooks, std::shared_ptr<Collective> collective)
    : cfg_(cfg),
      hooks_(std::move(hooks)),
      coll_(collective ? std::move(collective) : std::make_shared<SingleCollective>()) {
  if (cfg_.run.threads > 0) omp_set_num_threads(cfg_.run.threads);
  Device device = device_from_string(cfg_.run.device);
  if (device.is_cuda() && !cuda::status().usable) {
    // One line, then the CPU: a config written for a GPU machine still runs anywhere.
    message("keel: run.device = " + cfg_.run.device + " but no usable CUDA device (" +
            cuda::status().reason + "); training on the CPU");
    device = Device::cpu();
  }
  device_ = device;
  policy_ = resolve_precision(cfg_.train.precision, device, cfg_.train.allow_cpu_bf16);
  out_dir_ = cfg_.run.out_dir.empty() ? "out/" + utc_stamp() : cfg_.run.out_dir;

  // Data.
  tokenizer_ = data::load_tokenizer(cfg_.data.tokenizer);
  if (cfg_.data.task == "arith") {
    data::ArithOptions ao;
    ao.num_train = cfg_.data.num_examples;
    ao.num_eval = cfg_.data.eval_examples;
    ao.digits = cfg_.data.digits;
    ao.seed = cfg_.run.seed;
    ao.reverse_answer = cfg_.data.arith_reverse;
    const auto* byte_tok = dynamic_cast<const data::ByteTokenizer*>(tokenizer_.get());
    if (!byte_tok)
      throw Error(
          "data.task = \"arith\" spells numbers byte by byte: it needs data.tokenizer = "
          "\"byte\", not \"" +
              cfg_.data.tokenizer + "\"",
          Error::kUsage);
    data::ArithTask task = data::make_arith_task(*byte_tok, ao);
    train_set_ = std::move(task.train);
    eval_set_ = std::move(task.eval);
    eval_prompts_ = std::move(task.eval_prompts);
    eval_answers_ = std::move(task.eval_answers);
    stop_token_ = task.stop_token;
    max_answer_tokens_ = task.max_answer_tokens;
  } else if (cfg_.data.task == "text") {
    train_set_ =
        data::load_text_dataset(cfg_.data.path, *tokenizer_, cfg_.data.seq_len, cfg_.data.pack);
  } else if (cfg_.data.task == "jsonl") {
    train_set_ = data::load_jsonl_dataset(cfg_.data.path, *tokenizer_, cfg_.data.seq_len);
  } else {
    throw Error("data.task = \"" + cfg_.data.task + "\": use arith, text or jsonl", Error::kUsage);
  }
  loader_ = std::make_unique<data::DataLoader>(
      *train_set_, cfg_.train.batch_size, cfg_.data.seq_len,
      pad_fill_id(*tokenizer_, cfg_.data.pad), cfg_.data.shuffle, cfg_.run.seed);
  // A step's global window: grad_accum micro-batches per rank (rank_micro_batches).
  const int64_t global_window = cfg_.train.grad_accum * coll_->world_size();
  steps_per_epoch_ = (loader_->batches_per_epoch() + global_window - 1) / global_window;
  total_steps_ =
      cfg_.train.max_steps > 0 ? cfg_.train.max_steps : steps_per_epoch_ * cfg_.train.epochs;

  // Model: parameters in the policy's dtype (f32 masters in the mixed policies), then padding and
  // adapters (only they train: the frozen base is excluded here).
  model_ = build_model(cfg_, *tokenizer_, pad_fill_id(*tokenizer_, cfg_.data.pad),
                       policy_.param_dtype, [this](const std::string& m) { message(m); });
  if (device_.is_cuda()) nn::move_to_device(*model_, device_);
  trainable_ = model_->named_parameters(/*trainable_only=*/true);

  // Optimizer, schedule, scaler.
  auto groups = optim::make_param_groups(trainable_, cfg_.optim.weight_decay);
  if (cfg_.optim.name == "adamw") {
    optim::AdamWOptions o;
    o.beta1 = cfg_.optim.beta1;
    o.beta2 = cfg_.optim.beta2;
    o.eps = cfg_.optim.eps;
    optimizer_ = std::make_unique<optim::AdamW>(std::move(groups), o);
  } else if (cfg_.optim.name == "sgd") {
    optim::SGDOptions o;
    o.momentum = cfg_.optim.momentum;
    optimizer_ = std::make_unique<optim::SGD>(std::move(groups), o);
  } else {
    throw Error("optim.name = \"" + cfg_.optim.name + "\": use adamw or sgd", Error::kUsage);
  }
  schedule_ =
      optim::make_lr_schedule(cfg_.sched.name, cfg_.optim.lr, total_steps_, cfg_.sched.warmup_steps,
                              cfg_.sched.warmup_ratio, cfg_.sched.min_lr_ratio);
  if (policy_.scaler && cfg_.scaler.enabled) {
    GradScalerOptions so2;
    so2.init_scale = cfg_.scaler.init_scale;
    so2.growth_factor = cfg_.scaler.growth_factor;
    so2.backoff_factor = cfg_.scaler.backoff_factor;
    so2.growth_interval = cfg_.scaler.growth_interval;
    if (cfg_.scaler.min_scale > 0) so2.min_scale = cfg_.scaler.min_scale;
    if (cfg_.scaler.max_scale > 0) so2.max_scale = cfg_.scaler.max_scale;
    so2.hysteresis = cfg_.scaler.hysteresis;
    scaler_ = std::make_unique<GradScaler>(so2);
  }
  if (cfg_.run.resume) {
    const std::string last = out_dir_ + "/checkpoints/last";
    if (fs::exists(last)) {
      load_checkpoint(last);
      message("resumed from " + last + " at step " + std::to_string(step_));
    } else {
      message("run.resume = true but " + last + " does not exist: starting from scratch");
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
  const int64_t count = std::min(cfg_.train.grad_accum * W, loader_->batches_per_epoch() - first);
  if (global_count) *global_count = count;
  std::vector<data::Batch> w;
  for (int64_t i : rank_micro_batches(first, count, coll_->rank(), W))
    w.push_back(loader_->batch(epoch, i));
  return w;
}

void Trainer::check_ranks(int64_t step) {
  std::vector<Tensor> params, opt;
  for (auto& [name, p] : model_->named_parameters()) params.push_back(p);
  for (auto& [name, t] : optimizer_->state()) opt.push_back(t);
  check_rank_consistency(
      *coll_, step,
      {{"step", static_cast<double>(step_)},
       {"lr_schedule_step", static_cast<double>(sched_step_)},
       {"lr", schedule_.lr(sched_step_)},
       {"loss_scale", scaler_ ? scaler_->get_scale() : 1.0},
       {"scaler_growth_tracker", scaler_ ? static_cast<double>(scaler_->growth_tracker()) : 0.0},
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

StepResult Trainer::train_step(const std::vector<data::Batch>& window, int64_t epoch) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const int W = coll_->world_size();
  if (W > 1 && cfg_.dist.check_every > 0 &&
      (!ranks_checked_ || (step_ + 1) % cfg_.dist.check_every == 0)) {
    check_ranks(step_ + 1);  // before the step: every rank must enter it in the same state
    ranks_checked_ = true;
  }
  StepResult r;
  r.step = ++step_;
  r.epoch = epoch;
  r.micro_batches = static_cast<int64_t>(window.size());
  r.loss_scale = scaler_ ? scaler_->get_scale() : 1.0;
  r.lr = schedule_.lr(sched_step_);
  if (hooks_.on_step_begin) hooks_.on_step_begin(r.step);

  // 1. Zero grads; the step's dropout seeds derive from (run seed, step).
  optimizer_->zero_grad();
  const uint64_t seed = step_seed(r.step);
  int64_t tokens = 0;
  for (auto& b : window) tokens += b.n_targets;
  if (W > 1) {  // the loss weights divide by the GLOBAL window's tokens (exact in a double)
    double t = static_cast<double>(tokens);
    coll_->all_reduce_sum(&t, 1);
    tokens = static_cast<int64_t>(t);
  }
  r.tokens = tokens;

  // 2. Forward and backward per micro-batch.
  model_->train(true);
  double loss_sum = forward_backward(window, seed, r.loss_scale, tokens, coll_->rank(), W);
  // 3. Distributed: every rank checks its own loss and gradients BEFORE the all-reduce (so the
  // rank that produced a non-finite value knows it and writes the capture), then one all-gather
  // of [loss, saw non-finite, which parameters hold a gradient]: every rank sums the losses in
  // rank order (same bits everywhere), gives a zero gradient to any parameter another rank has
  // one for (a rank without data in a remainder window), and so joins the bucketed sum of the
  // same tensors.
  std::vector<int> saw_nonfinite;  // ranks whose own loss or gradients were non-finite
  if (W > 1) {
    const size_t n = 2 + trainable_.size();
    std::vector<double> mine(n), all(n * static_cast<size_t>(W));
    std::vector<Tensor> local;
    for (auto& [name, p] : trainable_)
      if (p.grad().defined()) local.push_back(p.grad());
    mine[0] = loss_sum;
    mine[1] = std::isfinite(loss_sum) && std::isfinite(optim::global_grad_norm(local)) ? 0 : 1;
    for (size_t i = 0; i < trainable_.size(); ++i)
      mine[2 + i] = trainable_[i].second.grad().defined();
    coll_->all_gather(mine.data(), n, all.data());
    loss_sum = 0;
    for (int q = 0; q < W; ++q) {
      const double* o = &all[static_cast<size_t>(q) * n];
      loss_sum += o[0];
      if (o[1] != 0) saw_nonfinite.push_back(q);
      for (size_t i = 0; i < trainable_.size(); ++i) {
        Tensor& p = trainable_[i].second;
        if (o[2 + i] != 0 && !p.grad().defined())
          p.set_grad(Tensor::zeros(p.shape(), p.dtype(), p.device()));
      }
    }
  }
  r.loss = tokens > 0 ? loss_sum / static_cast<double>(tokens) : 0.0;
  const bool loss_finite = std::isfinite(r.loss);

  std::vector<Tensor> grads;
  for (auto& [name, p] : trainable_)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (W > 1) coll_->all_reduce_grads(grads);

  // 4-5. Unscale (found_inf), then the global norm fused with the finite check.
  bool found_inf = false;
  if (scaler_ && grad_norm_check_) {
    found_inf = scaler_->unscale(grads, &r.grad_norm);  // one pass (one readback on a GPU)
  } else {
    if (scaler_) found_inf = scaler_->unscale(grads);
    r.grad_norm = grad_norm_check_ ? optim::global_grad_norm(grads) : 0.0;
  }
  if (!std::isfinite(r.grad_norm) || !loss_finite) found_inf = true;
  if (W > 1) {  // MAX over ranks: every rank takes the same branch below
    double f = found_inf ? 1 : 0;
    coll_->all_reduce_max(&f, 1);
    found_inf = f != 0;
  }
  r.found_inf = found_inf;
  if (hooks_.on_grads) hooks_.on_grads(r);

  if (found_inf) {
    // 6. A scaler handles an overflow of a finite loss: skip, back off, keep the LR clock.
    bool handled = false;
    if (scaler_ && loss_finite) {
      auto u = scaler_->update(true);
      r.loss_scale_after = u.scale_after;
      handled = !u.at_min_scale;  // at min_scale backing off no longer helps
      ++skipped_steps_;
    }
    if (!handled) {
      ++nan_steps_;
      NonfiniteEvent ev;
      ev.step = r.step;
      ev.epoch = epoch;
      ev.loss = r.loss;
      ev.loss_finite = loss_finite;
      ev.grad_norm = r.grad_norm;
      ev.window = &window;
      ev.step_seed = seed;
      ev.loss_scale = r.loss_scale;
      for (auto& [name, p] : trainable_)
        if (p.grad().defined() && !all_finite(p.grad())) ev.nonfinite_params.push_back(name);
      const std::string& mode = cfg_.train.on_nonfinite;
      if (mode == "capture" || mode == "abort") {
        // One message: the step, what went non-finite, the first such parameter, and where the
        // capture is with the command that replays it.
        std::string path, why_none;
        if (mode == "abort") {
          why_none = "on_nonfinite = abort";
        } else if (!cfg_.debug.nan_capture) {
          why_none = "[debug] nan_capture = false";
        } else if (!hooks_.on_capture) {
          why_none = "no capture handler is attached";
        } else if (W > 1 && !captures_here(saw_nonfinite)) {
          // The rank(s) that saw it write the capture (rank 0 when none did: the sum overflowed).
          std::string who;
          for (int q : saw_nonfinite)
            who += (who.empty() ? "rank " : ", rank ") + std::to_string(q);
          why_none = "on this rank; " + who + " saw the non-finite value and wrote it under " +
                     out_dir_ + "/debug/nan_capture/";
        } else {
          try {
            path = hooks_.on_capture(ev);
          } catch (const std::exception& e) {
            why_none = std::string("writing it failed: ") + e.what();
          }
        }
        std::string what = loss_finite ? std::string("non-finite gradients")
                                       : "non-finite loss (" + std::to_string(r.loss) + ")";
        if (loss_finite && ev.nonfinite_params.empty())
          what = "non-finite gradient norm (" + std::to_string(r.grad_norm) +
                 ": its f32 sum of squares overflowed; every gradient element is finite but some "
                 "exceed ~1.8e19)";
        if (!ev.nonfinite_params.empty())
          what += std::string(loss_finite ? "" : " and gradients") + " in " +
                  std::to_string(ev.nonfinite_params.size()) + " of " +
                  std::to_string(trainable_.size()) +
                  " parameters (first: " + ev.nonfinite_params.front() + ")";
        stop_message_ = "step " + std::to_string(r.step) + ": " + what;
        if (!path.empty())
          stop_message_ += "; capture written to " + path + "; replay with: keel replay " + path;
        else
          stop_message_ += "; no capture written (" + why_none + ")";
      }
    }
    r.stepped = false;
    if (!scaler_ || !loss_finite) r.loss_scale_after = r.loss_scale;
  } else {
    // 7. Clip after unscale (the coefficient goes to the optimizer, which AdamW fuses into its one
    // pass over each parameter), update, advance the schedule, let the scaler grow.
    float clip = 1.f;
    if (cfg_.train.max_grad_norm > 0)
      clip = optim::clip_coefficient(cfg_.train.max_grad_norm, r.grad_norm);
    r.clipped = clip != 1.f;
    optimizer_->step(r.lr, clip);
    ++sched_step_;
    r.loss_scale_after = scaler_ ? scaler_->update(false).scale_after : 1.0;
    r.stepped = true;
    epoch_loss_sum_ += loss_sum;
    epoch_tokens_ += tokens;
    ++epoch_updates_;
  }
  r.skipped_steps = skipped_steps_;
  r.nan_steps = nan_steps_;
  r.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  r.tokens_per_s = r.seconds > 0 ? tokens / r.seconds : 0;
  if (hooks_.on_step) hooks_.on_step(r);
  return r;
}

double Trainer::forward_backward(const std::vector<data::Batch>& window, uint64_t step_seed,
                                 double loss_scale, int64_t window_tokens, int64_t mb_first,
                                 int64_t mb_stride) {
  // Each micro-batch's loss is weighted by its share of the window's target tokens, so the
  // window's loss is the token mean whatever the window size (a remainder window included).
  int64_t tokens = 0;
  for (auto& b : window) tokens += b.n_targets;
  if (window_tokens >= 0) tokens = window_tokens;  // data-parallel: the global window's
  double loss_sum = 0;
  amp::AutocastGuard autocast(policy_.autocast, policy_.compute_dtype);
  for (size_t i = 0; i < window.size() && tokens > 0; ++i) {
    const data::Batch b = to_device(window[i], device_);
    if (b.n_targets == 0) continue;
    nn::Dropout::set_step_seed(
        mix_seed(step_seed, static_cast<uint64_t>(mb_first + static_cast<int64_t>(i) * mb_stride)));
    Tensor mb_loss;  // f32 scalar
    {
      Tensor logits = model_->forward(b.input_ids, b.attention_mask);  // [B, T, V]
      const int64_t V = logits.size(-1);
      Tensor flat = amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, V}));
      mb_loss = ops::cross_entropy(flat, ops::reshape(b.labels, {-1}), -100, ops::Reduction::kSum);
    }  // the loss's graph holds the only handle to the logits: their buffer takes the gradient
    loss_sum += mb_loss.item();
    backward(ops::scale(mb_loss, static_cast<float>(loss_scale / static_cast<double>(tokens))));
  }
  return loss_sum;
}

uint64_t Trainer::step_seed(int64_t step) const {
  return mix_seed(cfg_.run.seed, static_cast<uint64_t>(step));
}

EvalResult Trainer::evaluate() {
  EvalResult e;
  e.step = step_;
  if (!eval_set_ || eval_set_->size() == 0) return e;
  NoGradGuard no_grad;
  model_->train(false);
  amp::AutocastGuard autocast(policy_.autocast, policy_.compute_dtype);
  data::DataLoader eval_loader(*eval_set_, cfg_.train.batch_size, cfg_.data.seq_len,
                               pad_fill_id(*tokenizer_, cfg_.data.pad), false, cfg_.run.seed);
  double loss_sum = 0;
  for (int64_t i = 0; i < eval_loader.batches_per_epoch(); ++i) {
    data::Batch b = to_device(eval_loader.batch(0, i), device_);
    if (b.n_targets == 0) continue;
    Tensor logits = model_->forward(b.input_ids, b.attention_mask);
    const int64_t V = logits.size(-1);
    Tensor flat = amp::autocast(amp::AmpOp::kCrossEntropy, ops::reshape(logits, {-1, V}));
    loss_sum +=
        ops::cross_entropy(flat, ops::reshape(b.labels, {-1}), -100, ops::Reduction::kSum).item();
    e.tokens += b.n_targets;
  }
  e.loss = e.tokens ? loss_sum / e.tokens : 0;
  // Exact match by greedy decoding (the built-in task).
  if (!eval_prompts_.empty()) {
    int64_t correct = 0;
    const int64_t n = static_cast<int64_t>(eval_prompts_.size());
    for (int64_t i = 0; i < n; ++i) {
      std::vector<int32_t> ids = tokenizer_->encode(eval_prompts_[i]);
      std::vector<int32_t> answer;
      for (int64_t t = 0; t < max_answer_tokens_; ++t) {
        if (static_cast<int64_t>(ids.size()) >= model_->spec().max_seq_len) break;
        std::vector<int64_t> v(ids.begin(), ids.end());
        Tensor in = Tensor::from_ints(v, {1, static_cast<int64_t>(v.size())});
        Tensor logits = model_->forward(in.to(device_), Tensor());
        const int64_t V = logits.size(-1);
        const auto row = logits.slice_rows(0, 1)
                             .view({-1, V})
                             .slice_rows(in.size(1) - 1, in.size(1))
                             .to_floats();
        int32_t best = 0;
        for (int64_t j = 1; j < V; ++j)
          if (row[j] > row[best]) best = static_cast<int32_t>(j);
        if (best == stop_token_) break;
        answer.push_back(best);
        ids.push_back(best);
      }
      correct += tokenizer_->decode(answer) == eval_answers_[i];
    }
    e.examples = n;
    e.accuracy = static_cast<double>(correct) / static_cast<double>(n);
  }
  model_->train(true);
  if (hooks_.on_eval) hooks_.on_eval(e);
  return e;
}

int Trainer::fit() {
  fs::create_directories(out_dir_);
  const int64_t nb = loader_->batches_per_epoch();
  // Data-parallel: rank 0 alone evaluates and writes checkpoints (the ranks hold the same state).
  const bool rank0 = coll_->rank() == 0;
  auto checkpoint = [&] {
    if (rank0) save_checkpoint(out_dir_ + "/checkpoints/last");
  };
  while (step_ < total_steps_) {
    if (next_batch_ >= nb) {  // end of an epoch
      if (epoch_updates_ == 0)
        throw Error("every step produced non-finite gradients in epoch " + std::to_string(epoch_) +
                    " (no update was applied); run `keel doctor` on this config, or lower the "
                    "learning rate / switch precision to bf16-mixed or 32-true");
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
    if (rank0 && cfg_.train.eval_every > 0 && step_ % cfg_.train.eval_every == 0) evaluate();
    if (rank0 && cfg_.log.checkpoint_every > 0 && step_ % cfg_.log.checkpoint_every == 0) {
      checkpoint();
      save_checkpoint(out_dir_ + "/checkpoints/step-" + std::to_string(step_));
    }
  }
  if (epoch_updates_ == 0 && next_batch_ >= nb)
    throw Error("every step produced non-finite gradients in epoch " + std::to_string(epoch_) +
                " (no update was applied); lower the learning rate or switch precision to "
                "bf16-mixed or 32-true");
  if (coll_->world_size() > 1) {
    if (cfg_.dist.check_every > 0) check_ranks(step_);  // the final state is the same everywhere
    if (!rank0 && cfg_.dist.rank_weights)
      save_checkpoint(out_dir_ + "/debug/rank" + std::to_string(coll_->rank()) + "/checkpoint");
  }
  if (!rank0) return 0;
  evaluate();
  checkpoint();
  if (cfg_.model.adapter.kind != "none") {
    // The PEFT adapter directory, loadable by PEFT on the base model.path.
    io::save_peft_adapter(*model_, adapter_options(cfg_), out_dir_ + "/adapter", cfg_.model.path);
    message("adapter (PEFT " + cfg_.model.adapter.kind + ") written to " + out_dir_ + "/adapter");
  }
  return 0;
}

void Trainer::save_checkpoint(const std::string& dir) {
  json st;
  st["step"] = step_;
  st["sched_step"] = sched_step_;
  st["epoch"] = epoch_;
  st["next_batch"] = next_batch_;
  st["skipped_steps"] = skipped_steps_;
  st["nan_steps"] = nan_steps_;
  st["epoch_loss_sum"] = epoch_loss_sum_;
  st["epoch_tokens"] = epoch_tokens_;
  st["epoch_updates"] = epoch_updates_;
  st["seed"] = cfg_.run.seed;
  st["precision"] = policy_.name();
  st["world_size"] = coll_->world_size();  // next_batch counts global micro-batches
  if (scaler_) st["scaler"] = scaler_->state_dict();
  std::optional<nn::AdapterOptions> adapter;
  if (cfg_.model.adapter.kind != "none") adapter = adapter_options(cfg_);
  io::save_checkpoint(dir, model_->named_parameters(), optimizer_->state(), st,
                      [&](const std::string& tmp) {  // the checkpoint is a model.path too
                        io::write_checkpoint_model_files(*model_, adapter, cfg_.data.tokenizer,
                                                         cfg_.model.path, tmp);
                      });
}

void Trainer::load_checkpoint(const std::string& dir) {
  io::Checkpoint ck = io::load_checkpoint(dir);
  for (auto& [name, p] : model_->named_parameters()) {
    const Tensor* t = nullptr;
    for (auto& [n, v] : ck.model)
      if (n == name) t = &v;
    if (!t) throw Error(dir + "/model.safetensors: tensor '" + name + "' is missing");
    if (t->shape() != p.shape() || t->dtype() != p.dtype())
      throw Error(dir + "/model.safetensors: tensor '" + name + "' is " + shape_str(t->shape()) +
                  " " + dtype_name(t->dtype()) + ", the model expects " + shape_str(p.shape()) +
                  " " + dtype_name(p.dtype()) + " (was it written by another config?)");
    Tensor dst = p;
    dst.copy_from(*t);
    dst.bump_version();
  }
  optimizer_->load_state(ck.optimizer);
  const json& st = ck.trainer_state;
  step_ = st.at("step");
  sched_step_ = st.at("sched_step");
  epoch_ = st.at("epoch");
  next_batch_ = st.at("next_batch");
  skipped_steps_ = st.at("skipped_steps");
  nan_steps_ = st.at("nan_steps");
  epoch_loss_sum_ = st.at("epoch_loss_sum");
  epoch_tokens_ = st.at("epoch_tokens");
  epoch_updates_ = st.at("epoch_updates");
  if (st.value("world_size", 1) != coll_->world_size())
    message(dir + " was written by a run of " + std::to_string(st.value("world_size", 1)) +
            " rank(s), this one has " + std::to_string(coll_->world_size()) +
            ": it continues from the same global micro-batch, but steps now group " +
            std::to_string(cfg_.train.grad_accum * coll_->world_size()) +
            " micro-batches, so the loss sequence differs from the original run's");
  if (scaler_ && st.contains("scaler"))
    scaler_->load_state_dict(st["scaler"].get<std::map<std::string, double>>());
}

}  // namespace keel
