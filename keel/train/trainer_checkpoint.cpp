// Trainer's checkpoints (DESIGN §6): the model, optimizer state and the loop position in
// trainer.json, written atomically by io/checkpoint.
#include <map>
#include <nlohmann/json.hpp>

#include "keel/io/checkpoint.h"
#include "keel/train/trainer.h"

namespace keel {

using json = nlohmann::json;

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
  st["world_size"] = coll_->world_size();  // next_batch counts global micro-batches
  if (run_.scaler) st["scaler"] = run_.scaler->state_dict();
  io::save_checkpoint(dir, run_.model->named_parameters(), run_.optimizer->state(), st);
}

void Trainer::load_checkpoint(const std::string& dir) {
  io::Checkpoint ck = io::load_checkpoint(dir);
  for (auto& [name, p] : run_.model->named_parameters()) {
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
  run_.optimizer->load_state(ck.optimizer);
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
            std::to_string(run_.cfg.train.grad_accum * coll_->world_size()) +
            " micro-batches, so the loss sequence differs from the original run's");
  if (run_.scaler && st.contains("scaler"))
    run_.scaler->load_state_dict(st["scaler"].get<std::map<std::string, double>>());
}

}  // namespace keel
