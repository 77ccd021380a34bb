// Trainer::evaluate: the held-out loss (token mean, as training weighs it) and, for the built-in
// task, exact match of greedily decoded answers.
#include <filesystem>

#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/ops/cross_entropy.h"
#include "keel/ops/shape.h"
#include "keel/train/trainer.h"

namespace keel {

EvalResult Trainer::evaluate() {
  EvalResult e;
  e.step = step_;
  if (!run_.data.eval || run_.data.eval->size() == 0) return e;
  NoGradGuard no_grad;
  run_.model->train(false);
  amp::AutocastGuard autocast(run_.policy.autocast, run_.policy.compute_dtype);
  data::DataLoader eval_loader(*run_.data.eval, run_.cfg.train.batch_size, run_.cfg.data.seq_len,
                               run_.data.pad_id, false, run_.cfg.run.seed);
  double loss_sum = 0;
  for (int64_t i = 0; i < eval_loader.batches_per_epoch(); ++i) {
    data::Batch b = eval_loader.batch(0, i).to(run_.device);
    if (b.n_targets == 0) continue;
    loss_sum += batch_loss_sum(*run_.model, b).item();
    e.tokens += b.n_targets;
  }
  e.loss = e.tokens ? loss_sum / e.tokens : 0;
  // Exact match by greedy decoding (the built-in task).
  if (!run_.data.eval_prompts.empty()) {
    int64_t correct = 0;
    const int64_t n = static_cast<int64_t>(run_.data.eval_prompts.size());
    for (int64_t i = 0; i < n; ++i) {
      std::vector<int32_t> ids = run_.data.tokenizer->encode(run_.data.eval_prompts[i]);
      std::vector<int32_t> answer;
      for (int64_t t = 0; t < run_.data.max_answer_tokens; ++t) {
        if (static_cast<int64_t>(ids.size()) >= run_.model->spec().max_seq_len) break;
        std::vector<int64_t> v(ids.begin(), ids.end());
        Tensor in = Tensor::from_ints(v, {1, static_cast<int64_t>(v.size())});
        Tensor logits = run_.model->forward(in.to(run_.device), Tensor());
        const int64_t V = logits.size(-1);
        const auto row = logits.slice_rows(0, 1)
                             .view({-1, V})
                             .slice_rows(in.size(1) - 1, in.size(1))
                             .to_floats();
        int32_t best = 0;
        for (int64_t j = 1; j < V; ++j)
          if (row[j] > row[best]) best = static_cast<int32_t>(j);
        if (best == run_.data.stop_token) break;
        answer.push_back(best);
        ids.push_back(best);
      }
      correct += run_.data.tokenizer->decode(answer) == run_.data.eval_answers[i];
    }
    e.examples = n;
    e.accuracy = static_cast<double>(correct) / static_cast<double>(n);
  }
  run_.model->train(true);
  if (hooks_.on_eval) hooks_.on_eval(e);
  return e;
}

}  // namespace keel
