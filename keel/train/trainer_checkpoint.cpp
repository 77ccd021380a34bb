// Trainer's checkpoints (DESIGN §6): the model, optimizer state and the loop position in
// trainer.json, written atomically by io/checkpoint. An adapter run whose frozen base came from an
// HF directory (model.path) saves only the tensors it trains plus a reference to that directory
// (io/base_reference.h): 16 GB less per save for an 8B base. A resume rebuilds the base from
// model.path as the run did (build_run), after checking the reference's fingerprint.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "keel/amp/precision.h"
#include "keel/io/base_reference.h"
#include "keel/io/checkpoint.h"
#include "keel/io/hf_config.h"
#include "keel/io/json_fields.h"
#include "keel/io/safetensors.h"
#include "keel/io/trained_model.h"
#include "keel/io/weight_check.h"
#include "keel/nn/adapters/adapter.h"
#include "keel/numerics/text.h"
#include "keel/train/checkpoint_contents.h"
#include "keel/train/trainer.h"

namespace keel {

using json = nlohmann::json;

namespace {

// The keys a checkpoint fixes, with their values: resuming with another value would continue a
// different run (another data order, batch, precision or model) under the old one's name.
json fixed_by_checkpoint(const Config& c) {
  json out = json::object();
  for (auto& [key, value] : config_values(c)) {
    const bool fixed = key == "run.seed" || key == "train.precision" || key == "train.batch_size" ||
                       key == "train.grad_accum" || key == "optim.name" ||
                       (key.rfind("model.", 0) == 0 && key != "model.attention" &&
                        key != "model.allow_nonfinite_weights") ||
                       (key.rfind("data.", 0) == 0 && key != "data.eval_examples");
    if (fixed) out[key] = value;
  }
  return out;
}

std::string text_of(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

// The other keys that shape the run's numbers, with their values: a resume may change them, and
// says which it changed (an edited optim.lr resumed without a word, and the run differed from an
// uninterrupted one from there on). Not the run's bookkeeping (resume, out_dir), its logging,
// instrumentation and rank checks, nor its length (the schedule's note says what that changes).
json changeable_settings(const Config& c) {
  const json fixed = fixed_by_checkpoint(c);
  json out = json::object();
  for (auto& [key, value] : config_values(c)) {
    const bool skip = fixed.contains(key) || key.rfind("log.", 0) == 0 ||
                      key.rfind("debug.", 0) == 0 || key.rfind("dist.", 0) == 0 ||
                      key == "run.out_dir" || key == "run.resume" || key == "run.resume_force" ||
                      key == "run.overwrite" || key == "train.max_steps" || key == "train.epochs" ||
                      key == "train.eval_every";
    if (!skip) out[key] = value;
  }
  return out;
}

// Keys whose value decides which tensors the model and the optimizer hold: a checkpoint of other
// values cannot load, not even under run.resume_force. (It failed on the first tensor it lacked,
// or as "the checkpoint is damaged" for another optimizer or a dropped adapter.)
constexpr const char* kTensorSetKeys[] = {
    "optim.name",           "model.adapter.kind", "model.adapter.r", "model.adapter.target_modules",
    "model.family",         "model.n_layer",      "model.n_embd",    "model.intermediate_size",
    "model.tie_embeddings", "model.head_dim"};

void refuse_other_tensor_sets(const Config& c, const json& st, const std::string& dir) {
  if (!st.is_object() || !st.contains("config") || !st["config"].is_object()) return;
  const json& saved = st["config"];
  const json now = fixed_by_checkpoint(c);
  std::string diff;
  // An adapter's rank and targets mean nothing while neither run has an adapter.
  const bool adapters = saved.value("model.adapter.kind", json()) != json("\"none\"") ||
                        now.value("model.adapter.kind", json()) != json("\"none\"");
  for (const char* key : kTensorSetKeys)
    if (saved.contains(key) && now.contains(key) && saved[key] != now[key] &&
        (adapters || std::string(key).rfind("model.adapter.", 0) != 0 ||
         std::string(key) == "model.adapter.kind"))
      diff += "\n  " + std::string(key) + ": " + text_of(saved[key]) + " in the checkpoint, " +
              text_of(now[key]) + " now";
  if (diff.empty()) return;
  throw Error(dir +
                  "/trainer.json: run.resume_force = true, but this resume changes which tensors "
                  "the model or the optimizer holds:" +
                  diff +
                  "\nthe checkpoint's model.safetensors and optimizer.safetensors hold those of "
                  "its own run, so it cannot continue under these values; restore them to resume, "
                  "or start a new run from its weights (model.path = \"" +
                  dir + "\", without run.resume)",
              Error::kUsage);
}

// The checkpoint's tensor for the model's parameter `p` (null: rebuilt from the referenced base),
// refused unless it has the parameter's shape and dtype. Reads no tensor data: keel doctor asks
// it of every parameter before a resume would read one.
const Tensor* checkpoint_tensor(const io::Checkpoint& ck, const json& ref, models::CausalLM& model,
                                const std::string& name, const Tensor& p, const std::string& policy,
                                const std::string& dir) {
  const Tensor* t = nullptr;
  for (auto& [n, v] : ck.model)
    if (n == name) t = &v;
  if (!t && from_referenced_base(ref, model, p)) return nullptr;  // the frozen base
  if (!t) throw Error(dir + "/model.safetensors: tensor '" + name + "' is missing");
  // A precision whose parameters have another dtype (32-true <-> 16-true, bf16-true): the
  // optimizer's state and the masters do not carry over, not even with run.resume_force.
  if (t->shape() == p.shape() && t->dtype() != p.dtype())
    throw Error(dir + "/model.safetensors holds '" + name + "' in " + dtype_name(t->dtype()) +
                    ", and train.precision = \"" + policy + "\" keeps it in " +
                    dtype_name(p.dtype()) +
                    ": a resume cannot change the parameters' dtype, even with "
                    "run.resume_force; resume under the checkpoint's train.precision, or start "
                    "a new run from its weights (model.path = \"" +
                    ck.dir + "\")",
                Error::kUsage);
  if (t->shape() != p.shape() || t->dtype() != p.dtype())
    throw Error(dir + "/model.safetensors: tensor '" + name + "' is " + shape_str(t->shape()) +
                " " + dtype_name(t->dtype()) + ", the model expects " + shape_str(p.shape()) + " " +
                dtype_name(p.dtype()) + " (was it written by another config?)");
  return t;
}

// A resume that changes what the checkpoint fixes continues another run: refused, naming each
// difference (run.resume_force lets it through). A key the checkpoint does not record is a
// difference too (a trainer.json without its "config", or with one of another type, let every
// change through), unless it holds its default: a key newer than the keel that wrote the
// checkpoint (model.attention_dropout) ran as its default does.
void refuse_changed_fixed_keys(const Config& cfg, const json& st, const std::string& tj) {
  std::string diff;
  const json fixed = fixed_by_checkpoint(cfg), defaults = fixed_by_checkpoint(Config{});
  const json* saved = st.contains("config") && st["config"].is_object() ? &st["config"] : nullptr;
  for (auto& [key, now] : fixed.items())
    if (saved && !saved->contains(key) && defaults.contains(key) && defaults[key] == now)
      continue;
    else if (!saved || !saved->contains(key))
      diff += "\n  " + key +
              ": unrecorded in the checkpoint (damaged, or written by an older "
              "keel), " +
              text_of(now) + " now";
    else if ((*saved)[key] != now)
      diff += "\n  " + key + ": " + text_of((*saved)[key]) + " in the checkpoint, " + text_of(now) +
              " now";
  if (!diff.empty())
    throw Error(tj + ": this resume changes what the checkpoint fixes:" + diff +
                    "\nrestore these values to continue the interrupted run, or set "
                    "run.resume_force = true to continue from the checkpoint anyway",
                Error::kUsage);
}

// The saved batch position counts batches of the file trained on: another file under the same
// name (regenerated, appended to, cut) would continue with other batches, or past its end.
void refuse_changed_data(const Config& cfg, const RunData& data, const json& st,
                         const std::string& tj) {
  std::string diff;
  const json none = json::object();
  const json& files =
      st.contains("data_files") && st["data_files"].is_object() ? st["data_files"] : none;
  for (const auto& [key, now] : data.files) {
    if (!now.known()) continue;
    const json& then = files.contains(key) ? files[key] : none;  // unrecorded: refused too
    FileFingerprint was;
    if (then.is_object() && then.contains("bytes") && then["bytes"].is_number_integer() &&
        then.contains("fnv1a64") && then["fnv1a64"].is_string())
      was = {then["bytes"].get<int64_t>(), then["fnv1a64"].get<std::string>()};
    if (!(was == now))
      diff += "\n  " + key + " = " + (key == "data.path" ? cfg.data.path : cfg.data.eval_path) +
              ": " + (was.known() ? was.text() : "unrecorded") + " in the checkpoint, " +
              now.text() + " now";
  }
  if (!diff.empty())
    throw Error(tj + ": the data changed since this checkpoint was written:" + diff +
                    "\nrestore the file to continue the interrupted run, or set "
                    "run.resume_force = true to continue on the new data (from the same batch "
                    "position, in another order)",
                Error::kUsage);
}

}  // namespace

std::string resume_checkpoint_dir(const std::string& out_dir) {
  const std::string last = out_dir + "/checkpoints/last";
  // A `last` that is there but incomplete (a file removed or lost) is loaded too, so that its
  // error names the missing file: it was taken as absent, the run started from scratch ("does
  // not exist") and its first save replaced the checkpoint's remaining files.
  std::error_code ec;
  if (io::checkpoint_exists(last) ||
      std::filesystem::exists(std::filesystem::symlink_status(last, ec)))
    return last;
  // The step-N checkpoints beside a lost `last` were replaced one by one by the run that
  // started from scratch: refused, naming the newest, which holds the same state `last` did.
  std::string newest;
  int64_t newest_step = -1;
  for (std::filesystem::directory_iterator it(out_dir + "/checkpoints", ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.rfind("step-", 0) != 0 || n.size() == 5 || n.size() > 23 ||
        n.find_first_not_of("0123456789", 5) != std::string::npos ||
        !io::checkpoint_exists(it->path().string()))
      continue;
    if (const int64_t step = std::stoll(n.substr(5)); step > newest_step)
      newest_step = step, newest = it->path().string();
  }
  if (!newest.empty())
    throw Error("run.resume = true but " + last + " does not exist, while " + newest +
                    " does: copy it to " + last + " to resume from step " +
                    std::to_string(newest_step) +
                    ", or remove the checkpoints to start from scratch (the run would "
                    "replace them one by one)",
                Error::kUsage);
  return "";
}

std::string resume_from_scratch_message(const std::string& out_dir) {
  return "run.resume = true but " + out_dir +
         "/checkpoints/last does not exist: starting from "
         "scratch";
}

std::string nothing_left_to_train_message(int64_t step, int64_t total) {
  return "nothing left to train: the checkpoint is at step " + std::to_string(step) +
         (step == total ? ", the run's last (" + count_of(total, "step") + ")"
                        : ", past the run's " + count_of(total, "step")) +
         "; raise train.max_steps (or train.epochs) to train further";
}

namespace {
// A step-numbered debug key at or before the step a resume continues from never acts there: the
// tracer's abort_after_batch_num = 2 on a run resumed at step 6 stopped at once, "after batch 2",
// without training a step, and trace_batch_nums = [1] or debug.inject.step = 1 did nothing without
// a word. The stop is refused (the run would do nothing but say so); the others are notes.
std::vector<std::string> debug_steps_before_resume(const Config& cfg, int64_t step) {
  std::vector<std::string> notes;
  if (step <= 0) return notes;
  const std::string from = "the step this run resumes from (" + std::to_string(step) + ")";
  const UnderflowOverflowConfig& uo = cfg.debug.underflow_overflow;
  if (uo.enabled && uo.abort_after_batch_num >= 1 && uo.abort_after_batch_num <= step)
    throw Error("debug.underflow_overflow.abort_after_batch_num = " +
                    std::to_string(uo.abort_after_batch_num) + " is not past " + from +
                    ": the tracer would stop before training a step; set it above " +
                    std::to_string(step) + " (or to -1)",
                Error::kUsage);
  if (uo.enabled) {
    std::string early;
    for (int64_t b : uo.trace_batch_nums)
      if (b <= step) early += (early.empty() ? "" : ", ") + std::to_string(b);
    if (!early.empty())
      notes.push_back("debug.underflow_overflow.trace_batch_nums holds " + early +
                      ", at or before " + from +
                      ": those batches were trained before the checkpoint and are not traced; "
                      "list steps above " +
                      std::to_string(step));
  }
  const InjectConfig& inj = cfg.debug.inject;
  if (!inj.module.empty() && inj.step >= 1 && inj.step <= step)
    notes.push_back("debug.inject.step = " + std::to_string(inj.step) + " is at or before " + from +
                    ": nothing is injected; set it above " + std::to_string(step));
  return notes;
}
}  // namespace

std::vector<std::string> check_resume(const Run& run, const Config& cfg) {
  const std::string dir = resume_checkpoint_dir(cfg.run.out_dir);
  if (dir.empty()) return {resume_from_scratch_message(cfg.run.out_dir)};
  const io::Checkpoint ck = io::load_checkpoint(dir);  // maps the files; names a missing one
  const json ref = io::checkpoint_base_reference(ck.dir);
  check_saved_base(ref, ck.dir, cfg,
                   "point model.path at the base model the run was trained on (set "
                   "run.resume_force = true if its path changed)");
  if (cfg.run.resume_force) refuse_other_tensor_sets(cfg, ck.trainer_state, ck.dir);
  const json& st = ck.trainer_state;
  const std::string tj = ck.dir + "/trainer.json";
  // The keys first, as Trainer::load_checkpoint does: a changed key is named, not the tensor it
  // reshapes.
  if (!cfg.run.resume_force && st.is_object()) refuse_changed_fixed_keys(cfg, st, tj);
  for (auto& [name, p] : run.model->named_parameters())
    checkpoint_tensor(ck, ref, *run.model, name, p, run.policy.name(), dir);
  if (!st.is_object())
    throw Error(tj + ": expected a JSON object; " + io::kDamagedCheckpointResumeFix);
  constexpr int64_t kCount = int64_t{1} << 53;
  const int64_t step = io::json_int(st, "step", tj, 0, kCount, io::kDamagedCheckpointResumeFix);
  if (!cfg.run.resume_force) refuse_changed_data(cfg, run.data, st, tj);
  if (step > 0 && step >= run.total_steps)
    return {nothing_left_to_train_message(step, run.total_steps)};
  return debug_steps_before_resume(cfg, step);
}

bool base_by_reference(const Config& c) {
  return c.model.adapter.kind != "none" && !c.model.path.empty() &&
         !io::is_keel_checkpoint(c.model.path);
}

io::NamedTensors saved_parameters(models::CausalLM& model, const Config& c) {
  io::NamedTensors all = model.named_parameters();
  if (!base_by_reference(c)) return all;
  models::ModelSpec base_spec = io::read_hf_config(c.model.path).spec;
  base_spec.param_dtype = model.spec().param_dtype;
  const auto base = models::make_causal_lm_for_loading(base_spec);  // names and shapes only
  std::map<std::string, Shape> in_base;
  for (auto& [name, p] : base->named_parameters()) in_base[name] = p.shape();
  io::NamedTensors out;
  for (auto& [name, p] : all) {
    auto it = in_base.find(name);
    if (p.requires_grad() || nn::is_adapter_parameter(model, p) || it == in_base.end() ||
        it->second != p.shape())
      out.emplace_back(name, p);
  }
  return out;
}

json saved_base_reference(models::CausalLM& model, const Config& c) {
  if (!base_by_reference(c)) return nullptr;
  return io::base_reference(c.model.path, dtype_name(io::stored_base_dtype(model)));
}

void check_saved_base(const json& ref, const std::string& dir, const Config& c,
                      const std::string& fix, const std::string& what) {
  if (ref.is_null()) return;
  if (c.model.path.empty())
    throw Error(what + " " + dir + " references its frozen base " +
                    ref.value("path", std::string("?")) +
                    " (it holds only the trained tensors of an adapter run), but model.path is "
                    "empty; " +
                    fix,
                Error::kUsage);
  io::check_base_reference(ref, dir, c.model.path, fix, what);
}

bool from_referenced_base(const json& ref, models::CausalLM& model, const Tensor& p) {
  return !ref.is_null() && !p.requires_grad() && !nn::is_adapter_parameter(model, p);
}

void Trainer::save_checkpoint(const std::string& dir) {
  // Such weights would not load (io/weight_check.h) and would replace the last good checkpoint.
  const std::vector<std::string> bad = nonfinite_parameters(/*trainable_only=*/true);
  if (bad.empty()) return write_checkpoint(dir);
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool kept = fs::exists(dir, ec);
  const std::string aside =
      (fs::path(dir).parent_path() / ("nonfinite-step-" + std::to_string(step_))).string();
  write_checkpoint(aside);
  const std::string wider = wider_precisions(run_.policy.name());
  throw Error(
      "step " + std::to_string(step_) + ": the weights hold NaN or inf in " +
      count_of(static_cast<long long>(bad.size()), "parameter") + " (first: " + bad.front() +
      "), so " + dir +
      (kept ? " was not replaced (the good one there is kept)" : " was not written") +
      "; they are in " + aside +
      " (model.allow_nonfinite_weights or --allow-nonfinite-weights load it). An applied update "
      "made them so: lower "
      "optim.lr" +
      (wider.empty() ? std::string() : " or switch train.precision to " + wider) +
      ", and leave train.on_nonfinite = capture to stop at the first such step");
}

void Trainer::write_checkpoint(const std::string& dir) {
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
  st["epoch_steps"] = epoch_steps_;
  st["epoch_unhandled"] = epoch_unhandled_;
  // The scaler skips in a row before this step: scaler.max_consecutive_skips counts across the
  // checkpoint (a resume after 2 of 4 allowed skips stopped 2 steps later than the straight run).
  st["skip_scales"] = skip_scales_;
  st["skip_scale_after"] = skip_scale_after_;
  st["seed"] = run_.cfg.run.seed;
  st["precision"] = run_.policy.name();
  st["world_size"] = coll_->world_size();            // next_batch counts global micro-batches
  st["schedule_steps"] = run_.schedule.total_steps;  // what the LR schedule was laid over
  st["config"] = fixed_by_checkpoint(run_.cfg);      // checked on resume
  st["settings"] = changeable_settings(run_.cfg);    // a resume says which it changed
  json files = json::object();                       // so are the data files' contents
  for (const auto& [key, f] : run_.data.files)
    if (f.known()) files[key] = {{"bytes", f.bytes}, {"fnv1a64", f.fnv1a64}};
  st["data_files"] = files;
  if (run_.scaler) st["scaler"] = run_.scaler->state_dict();
  if (hooks_.advisor_state)
    if (json a = hooks_.advisor_state(); !a.is_null()) st["advisor"] = std::move(a);
  std::optional<nn::AdapterOptions> adapter;
  if (run_.cfg.model.adapter.kind != "none") adapter = run_.cfg.model.adapter;
  const json& base = run_.base_ref;
  io::save_checkpoint(dir, saved_parameters(*run_.model, run_.cfg), run_.optimizer->state(), st,
                      [&](const std::string& tmp) {  // the checkpoint is a model.path too
                        io::write_checkpoint_model_files(*run_.model, adapter,
                                                         run_.cfg.data.tokenizer,
                                                         run_.cfg.model.path, tmp, base);
                      });
}

void Trainer::load_checkpoint(const std::string& dir) {
  io::Checkpoint ck = io::load_checkpoint(dir);
  // A checkpoint that references its base: the run rebuilt the base from model.path (build_run);
  // it must be the directory the checkpoint was trained on.
  const json ref = io::checkpoint_base_reference(ck.dir);
  check_saved_base(ref, ck.dir, run_.cfg,
                   "point model.path at the base model the run was trained on (set "
                   "run.resume_force = true if its path changed)");
  if (run_.cfg.run.resume_force) refuse_other_tensor_sets(run_.cfg, ck.trainer_state, ck.dir);
  // The keys the checkpoint fixes, before its tensors are read: another optim.name was refused
  // as "SGD state: unexpected entry ...; the checkpoint is damaged", a wider model.n_embd by a
  // tensor's shape, when the cause is the key (and doctor named it).
  if (!run_.cfg.run.resume_force && ck.trainer_state.is_object())
    refuse_changed_fixed_keys(run_.cfg, ck.trainer_state, ck.dir + "/trainer.json");
  const io::WeightCheck finite{run_.cfg.model.allow_nonfinite_weights,
                               [&](const std::string& m) { message(m); }};
  // CPU tensors are read straight from the files into their memory (io::read_safetensors_into:
  // one read per parameter, one per flat buffer of the optimizer's state) and checked there;
  // others are copied from the mapping that io::load_checkpoint made.
  const std::string model_file = ck.dir + "/model.safetensors";
  io::NamedTensors read_in;  // parameters to read from model_file
  std::vector<Tensor> restored;
  for (auto& [name, p] : run_.model->named_parameters()) {
    const Tensor* t = checkpoint_tensor(ck, ref, *run_.model, name, p, run_.policy.name(), dir);
    if (!t) continue;  // the frozen base, rebuilt from model.path
    if (p.device().is_cpu()) {
      read_in.emplace_back(name, p);
      continue;
    }
    io::check_weights_finite(finite, *t, name, model_file);
    Tensor dst = p;
    dst.copy_from(*t);
    restored.push_back(dst);
  }
  io::read_safetensors_into(model_file, read_in);
  for (auto& [name, p] : read_in) {
    io::check_weights_finite(finite, p, name, model_file);
    restored.push_back(p);
  }
  for (Tensor& p : restored) p.bump_version();
  const std::string opt_file = ck.dir + "/optimizer.safetensors";
  const io::NamedTensors live = run_.optimizer->state();
  const bool on_cpu = std::all_of(live.begin(), live.end(),
                                  [](const auto& e) { return e.second.device().is_cpu(); });
  if (on_cpu && io::holds_exactly(ck.optimizer, live)) {  // ck.optimizer: the file's tensors
    io::read_safetensors_into(opt_file, live);
    ck.optimizer = live;  // the state's own memory: load_state takes the counts, copies nothing
  }
  for (auto& [name, t] : ck.optimizer)  // moments that overflowed poison every later update
    io::check_weights_finite(finite, t, name, opt_file);
  const std::string fix = io::kDamagedCheckpointResumeFix;
  // The optimizer and the scaler check their state; the file it came from is named here.
  try {
    run_.optimizer->load_state(ck.optimizer);
  } catch (const Error& e) {
    throw Error(opt_file + ": " + e.what() + "; " + fix);
  }
  const json& st = ck.trainer_state;
  // trainer.json is input: every field is checked, naming the file and the key.
  const std::string tj = ck.dir + "/trainer.json";
  if (!st.is_object()) throw Error(tj + ": expected a JSON object; " + fix);
  constexpr int64_t kCount = int64_t{1} << 53;  // counts stay exact in JSON's doubles
  step_ = io::json_int(st, "step", tj, 0, kCount, fix);
  sched_step_ = io::json_int(st, "sched_step", tj, 0, step_, fix);
  epoch_ = io::json_int(st, "epoch", tj, 0, kCount, fix);
  // At most one epoch's batches (== the count: the epoch's end is pending); a position past it
  // continued in another epoch without a word. A resume on changed data (resume_force) may find
  // fewer batches: the epoch then ends at once.
  next_batch_ =
      io::json_int(st, "next_batch", tj, 0,
                   run_.cfg.run.resume_force ? kCount : run_.loader->batches_per_epoch(), fix);
  skipped_steps_ = io::json_int(st, "skipped_steps", tj, 0, step_, fix);
  nan_steps_ = io::json_int(st, "nan_steps", tj, 0, step_, fix);
  epoch_loss_sum_ = io::json_number(st, "epoch_loss_sum", tj, fix);
  epoch_tokens_ = io::json_int(st, "epoch_tokens", tj, 0, kCount, fix);
  epoch_updates_ = io::json_int(st, "epoch_updates", tj, 0, step_, fix);
  // Absent from checkpoints written before they were saved: counted from the resume then.
  epoch_steps_ =
      st.contains("epoch_steps") ? io::json_int(st, "epoch_steps", tj, 0, step_, fix) : 0;
  epoch_unhandled_ =
      st.contains("epoch_unhandled") ? io::json_int(st, "epoch_unhandled", tj, 0, step_, fix) : 0;
  skip_scales_.clear();
  skip_scale_after_ = 0;
  if (st.contains("skip_scales")) {
    const auto scales = io::json_field<std::vector<double>>(st, "skip_scales", tj, fix);
    if (static_cast<int64_t>(scales.size()) > skipped_steps_ + nan_steps_)
      throw Error(tj + ": \"skip_scales\" holds " + std::to_string(scales.size()) +
                  " scales, more than its skipped_steps + nan_steps = " +
                  std::to_string(skipped_steps_ + nan_steps_) + "; " + fix);
    skip_scales_ = scales;
    skip_scale_after_ = io::json_number(st, "skip_scale_after", tj, fix);
  }
  // Read by the caller's advisor (TrainerHooks::advisor_state), which checks it.
  resumed_advisor_state_ = st.contains("advisor") ? st["advisor"] : json();
  resumed_trainer_json_ = tj;
  const int64_t world =
      st.contains("world_size") ? io::json_int(st, "world_size", tj, 1, 1 << 20, fix) : 1;
  if (!run_.cfg.run.resume_force) {
    refuse_changed_fixed_keys(run_.cfg, st, tj);
    refuse_changed_data(run_.cfg, run_.data, st, tj);
  }
  if (st.contains("settings") && st["settings"].is_object()) {
    std::string diff;
    const json& then = st["settings"];
    const json settings = changeable_settings(run_.cfg);
    for (auto& [key, now] : settings.items())
      if (then.contains(key) && then[key] != now)
        diff += "\n  " + key + ": " + text_of(then[key]) + " in the checkpoint, " + text_of(now) +
                " now";
    if (!diff.empty())
      message("this resume changes settings of the checkpoint's run (allowed; from step " +
              std::to_string(step_ + 1) + " on the run differs from an uninterrupted one):" + diff);
  }
  if (step_ < run_.total_steps)
    for (const std::string& note : debug_steps_before_resume(run_.cfg, step_)) message(note);
  if (world != coll_->world_size())
    message(dir + " was written by a run of " + count_of(world, "rank") + ", this one has " +
            std::to_string(coll_->world_size()) +
            ": it continues from the same global micro-batch, but steps now group " +
            std::to_string(run_.cfg.train.grad_accum * coll_->world_size()) +
            " micro-batches, so the loss sequence differs from the original run's");
  // A resume with another train.max_steps (or epochs) lays the schedule over the new total: the
  // learning rate jumped without a word (a 4-step run that ended at 0.000439 resumed for 8 steps
  // at 0.0015), as HF's Trainer does when its max_steps changes.
  if (st.contains("schedule_steps") && run_.schedule.kind != optim::ScheduleKind::kConstant) {
    const int64_t then = io::json_int(st, "schedule_steps", tj, 0, kCount, fix);
    if (then > 0 && then != run_.schedule.total_steps) {
      const SchedConfig& sc = run_.cfg.sched;  // the same schedule over the old total
      const optim::LrSchedule old = optim::make_lr_schedule(
          sc.name, run_.cfg.optim.lr, then, sc.warmup_steps, sc.warmup_ratio, sc.min_lr_ratio);
      char now_lr[32], old_lr[32];
      std::snprintf(now_lr, sizeof now_lr, "%.3g", run_.schedule.lr(sched_step_));
      std::snprintf(old_lr, sizeof old_lr, "%.3g", old.lr(std::min(sched_step_, then)));
      message("the learning-rate schedule (sched.name = " + run_.cfg.sched.name +
              ") was laid over " + count_of(then, "step") + " in the checkpoint's run and is " +
              "over " + std::to_string(run_.schedule.total_steps) +
              " now (train.max_steps or train.epochs changed): step " + std::to_string(step_ + 1) +
              " runs at lr " + now_lr + " where the old schedule had " + old_lr);
    }
  }
  // A 16-mixed checkpoint without a scaler's state (its run had scaler.enabled = false, or the
  // file lost it) started the scaler afresh without a word; one with a state under a run whose
  // scaler is now off dropped the scale silently.
  if (run_.scaler && !st.contains("scaler"))
    message(tj + " holds no loss-scaler state (its run had scaler.enabled = false, or the file " +
            "lost it): the scaler starts afresh at scaler.init_scale = " +
            json(run_.cfg.scaler.init_scale).dump() +
            " and backs off again on the first overflowing steps");
  if (!run_.scaler && st.contains("scaler") && st["scaler"].is_object() &&
      st["scaler"].contains("scale"))
    message(tj + " holds a loss scale of " + st["scaler"]["scale"].dump() +
            " that this run drops: " +
            (run_.cfg.train.precision == "16-mixed"
                 ? std::string("scaler.enabled = false now, so f16 gradients below 2^-24 flush "
                               "to zero unscaled")
                 : "train.precision = " + run_.cfg.train.precision + " uses no loss scaler"));
  if (run_.scaler && st.contains("scaler")) {
    if (!st["scaler"].is_object()) throw Error(tj + ": \"scaler\" must be an object; " + fix);
    std::map<std::string, double> scaler;
    for (auto& [k, v] : st["scaler"].items())
      scaler[k] = io::json_number(st["scaler"], k.c_str(), tj + ": scaler", fix);
    try {
      run_.scaler->load_state_dict(scaler);
    } catch (const Error& e) {
      throw Error(tj + ": \"scaler\": " + e.what() + "; " + fix);
    }
  }
}

}  // namespace keel
