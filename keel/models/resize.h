// Resizing a model's vocabulary, for a tokenizer that gained tokens (a dedicated pad token).
#pragma once
#include <cstdint>
#include <string>

#include "keel/models/causal_lm.h"

namespace keel::models {

// Gives the token embedding (GPT-2 wte, Llama embed_tokens) and an untied lm_head `new_vocab`
// rows, like HF's resize_token_embeddings: existing rows are kept, added rows are the mean of the
// existing rows (HF's mean_resizing draws them from N(mean, covariance); keel takes the mean
// itself, deterministic and the distribution's expected value), so an added token starts as an
// "average" token and the logits of existing tokens are unchanged. Shrinking drops the last rows.
// The parameters keep their handles (the shared TensorImpl is rewritten) and their dtype; grads
// are cleared and versions bumped; spec().vocab_size follows. Call it before building an optimizer.
// Errors: new_vocab < 1.
void resize_token_embeddings(CausalLM& model, int64_t new_vocab);

// Whether parameter `name` is one resize_token_embeddings grows: the token embedding (GPT-2 wte,
// Llama embed_tokens) or lm_head.
bool is_vocabulary_parameter(const std::string& name);

}  // namespace keel::models
