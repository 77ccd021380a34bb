// Trainer::evaluate: the held-out loss (token mean, as training weighs it) and, for the built-in
// task, exact match of greedily decoded answers.
#include "keel/amp/autocast.h"
#include "keel/autograd/node.h"
#include "keel/models/generate.h"
#include "keel/train/eval_loss.h"
#include "keel/train/trainer.h"

namespace keel {

EvalResult Trainer::evaluate() {
  EvalResult e;
  e.step = step_;
  if (!run_.data.eval || run_.data.eval->size() == 0) return e;
  const LossTotal loss =
      dataset_loss(*run_.model, *run_.data.eval, run_.cfg.train.batch_size, run_.cfg.data.seq_len,
                   run_.data.pad_id, run_.policy, run_.device);
  e.loss = loss.loss();
  e.tokens = loss.tokens;
  NoGradGuard no_grad;
  amp::AutocastGuard autocast(run_.policy.autocast, run_.policy.compute_dtype);
  // Exact match by greedy decoding (the built-in task), through the generation loop and its
  // key/value cache: each answer token costs one position's forward, not the whole sequence's.
  if (!run_.data.eval_prompts.empty()) {
    models::GenerateOptions greedy;  // temperature 0: argmax, the lowest id wins a tie
    greedy.max_new_tokens = run_.data.max_answer_tokens;
    greedy.eos_ids = {run_.data.stop_token};
    int64_t correct = 0;
    const int64_t n = static_cast<int64_t>(run_.data.eval_prompts.size());
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<int32_t> prompt = run_.data.tokenizer->encode(run_.data.eval_prompts[i]);
      // A prompt that fills the context has no answer (and counts as wrong).
      if (prompt.empty() || static_cast<int64_t>(prompt.size()) >= run_.model->spec().max_seq_len)
        continue;
      const models::GenerateResult answer = models::generate(*run_.model, prompt, greedy);
      correct += run_.data.tokenizer->decode(answer.tokens) == run_.data.eval_answers[i];
    }
    e.examples = n;
    e.accuracy = static_cast<double>(correct) / static_cast<double>(n);
  }
  run_.model->train(true);
  if (hooks_.on_eval) hooks_.on_eval(e);
  return e;
}

}  // namespace keel
