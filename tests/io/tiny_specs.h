// The tiny GPT-2 and Llama specs the io tests write and load (one definition: the test files of a
// folder share a unity translation unit).
#pragma once
#include "keel/models/causal_lm.h"

namespace keel::io::test_specs {

inline models::ModelSpec llama_spec(bool tied) {
  models::ModelSpec s;
  s.family = "llama";
  s.n_layer = 2;
  s.n_embd = 32;
  s.n_head = 4;
  s.n_kv_head = 2;
  s.intermediate_size = 48;
  s.vocab_size = 40;
  s.max_seq_len = 16;
  s.tie_embeddings = tied;
  return s;
}

inline models::ModelSpec gpt2_spec() {
  models::ModelSpec s;
  s.family = "gpt2";
  s.n_layer = 2;
  s.n_embd = 32;
  s.n_head = 4;
  s.vocab_size = 40;
  s.max_seq_len = 16;
  return s;
}

}  // namespace keel::io::test_specs
