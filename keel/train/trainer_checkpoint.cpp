// Trainer's checkpoints (DESIGN §6): the model, optimizer state and the loop position in
// trainer.json, written atomically by io/checkpoint.
#include <map>
#include <nlohmann/json.hpp>

#include "keel/io/checkpoint.h"
#include "keel/io/json_fields.h"
#include "keel/io/trained_model.h"
#include "keel/io/weight_check.h"
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

}  // namespace

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
  st["seed"] = run_.cfg.run.seed;
  st["precision"] = run_.policy.name();
  st["world_size"] = coll_->world_size();        // next_batch counts global micro-batches
  st["config"] = fixed_by_checkpoint(run_.cfg);  // checked on resume
  if (run_.scaler) st["scaler"] = run_.scaler->state_dict();
  std::optional<nn::AdapterOptions> adapter;
  if (run_.cfg.model.adapter.kind != "none") adapter = run_.cfg.model.adapter;
  io::save_checkpoint(dir, run_.model->named_parameters(), run_.optimizer->state(), st,
                      [&](const std::string& tmp) {  // the checkpoint is a model.path too
                        io::write_checkpoint_model_files(*run_.model, adapter,
                                                         run_.cfg.data.tokenizer,
                                                         run_.cfg.model.path, tmp);
                      });
}

void Trainer::load_checkpoint(const std::string& dir) {
  io::Checkpoint ck = io::load_checkpoint(dir);
  const io::WeightCheck finite{run_.cfg.model.allow_nonfinite_weights,
                               [&](const std::string& m) { message(m); }};
  for (auto& [name, p] : run_.model->named_parameters()) {
    const Tensor* t = nullptr;
    for (auto& [n, v] : ck.model)
      if (n == name) t = &v;
    if (!t) throw Error(dir + "/model.safetensors: tensor '" + name + "' is missing");
    if (t->shape() != p.shape() || t->dtype() != p.dtype())
      throw Error(dir + "/model.safetensors: tensor '" + name + "' is " + shape_str(t->shape()) +
                  " " + dtype_name(t->dtype()) + ", the model expects " + shape_str(p.shape()) +
                  " " + dtype_name(p.dtype()) + " (was it written by another config?)");
    io::check_weights_finite(finite, *t, name, ck.dir + "/model.safetensors");
    Tensor dst = p;
    dst.copy_from(*t);
    dst.bump_version();
  }
  for (auto& [name, t] : ck.optimizer)  // moments that overflowed poison every later update
    io::check_weights_finite(finite, t, name, ck.dir + "/optimizer.safetensors");
  run_.optimizer->load_state(ck.optimizer);
  const json& st = ck.trainer_state;
  // trainer.json is input: every field is checked, naming the file and the key.
  const std::string tj = ck.dir + "/trainer.json";
  const std::string fix =
      "the checkpoint is damaged: resume from another one (checkpoints/step-N) or start without "
      "run.resume";
  if (!st.is_object()) throw Error(tj + ": expected a JSON object; " + fix);
  constexpr int64_t kCount = int64_t{1} << 53;  // counts stay exact in JSON's doubles
  step_ = io::json_int(st, "step", tj, 0, kCount, fix);
  sched_step_ = io::json_int(st, "sched_step", tj, 0, step_, fix);
  epoch_ = io::json_int(st, "epoch", tj, 0, kCount, fix);
  next_batch_ = io::json_int(st, "next_batch", tj, 0, kCount, fix);
  skipped_steps_ = io::json_int(st, "skipped_steps", tj, 0, step_, fix);
  nan_steps_ = io::json_int(st, "nan_steps", tj, 0, step_, fix);
  epoch_loss_sum_ = io::json_number(st, "epoch_loss_sum", tj, fix);
  epoch_tokens_ = io::json_int(st, "epoch_tokens", tj, 0, kCount, fix);
  epoch_updates_ = io::json_int(st, "epoch_updates", tj, 0, step_, fix);
  const int64_t world =
      st.contains("world_size") ? io::json_int(st, "world_size", tj, 1, 1 << 20, fix) : 1;
  // A resume that changes what the checkpoint fixes continues another run: refused, naming each
  // difference, unless run.resume_force.
  if (st.contains("config") && st["config"].is_object() && !run_.cfg.run.resume_force) {
    std::string diff;
    const json fixed = fixed_by_checkpoint(run_.cfg);
    for (auto& [key, now] : fixed.items())
      if (st["config"].contains(key) && st["config"][key] != now)
        diff += "\n  " + key + ": " + text_of(st["config"][key]) + " in the checkpoint, " +
                text_of(now) + " now";
    if (!diff.empty())
      throw Error(tj + ": this resume changes what the checkpoint fixes:" + diff +
                      "\nrestore these values to continue the interrupted run, or set "
                      "run.resume_force = true to continue from the checkpoint anyway",
                  Error::kUsage);
  }
  if (world != coll_->world_size())
    message(dir + " was written by a run of " + std::to_string(world) + " rank(s), this one has " +
            std::to_string(coll_->world_size()) +
            ": it continues from the same global micro-batch, but steps now group " +
            std::to_string(run_.cfg.train.grad_accum * coll_->world_size()) +
            " micro-batches, so the loss sequence differs from the original run's");
  if (run_.scaler && st.contains("scaler")) {
    if (!st["scaler"].is_object()) throw Error(tj + ": \"scaler\" must be an object; " + fix);
    std::map<std::string, double> scaler;
    for (auto& [k, v] : st["scaler"].items())
      scaler[k] = io::json_number(st["scaler"], k.c_str(), tj + ": scaler", fix);
    run_.scaler->load_state_dict(scaler);
  }
}

}  // namespace keel
